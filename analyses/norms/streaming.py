"""Streaming texts through the model for the norms analyses: bounded batches, every site, one finiteness check."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from depthscope.analyses.text import TokenBatch, token_batches, with_window
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError, NonFiniteActivationError, UnsupportedArchitecture

Inputs = torch.Tensor | Sequence[str] | str


def stream_batch(model, batch: TokenBatch, hooks):
    """All sites for one batch. The finiteness check is ours (on the per-token norms of real
    tokens, see :func:`check_norms_finite`), which saves residual_stream a full pass."""
    return model.residual_stream(batch.ids, mask=batch.mask, return_logits=False, hooks=hooks, check_finite=False)


def stream_batches(model, batches: Iterable[TokenBatch], hooks, *, progress: bool = False) -> Iterable[tuple]:
    """``(batch, stream_batch(...))`` of every batch, in order; on a streamed model as layer-major
    passes (:func:`~depthscope.hooks.stream_pass.layer_major`: the weights read once per pass, every
    site of each batch held until its pass ends); hooks at the attention function's points: batch
    by batch."""
    from depthscope.hooks.engine import normalise_hooks
    from depthscope.hooks.stream_pass import attention_free, layer_major

    per_token = 4 * model.n_sites * model.d_model
    safe = attention_free(normalise_hooks(hooks, model.n_layers))
    run = lambda b: (b, stream_batch(model, b, hooks))  # noqa: E731
    held = lambda b: b.ids.numel() * per_token  # noqa: E731
    return layer_major(model, batches, run, held=held, enabled=safe, progress=progress)


def check_norms_finite(model, stream_norm: torch.Tensor, mask: torch.Tensor) -> None:
    """NaN/inf anywhere in a real token's stream makes its norm non-finite: refuse, naming the site."""
    bad = ~torch.isfinite(stream_norm) & mask.to(stream_norm.device)[None]
    if bool(bad.any()):
        per_site = bad.flatten(1).any(1)
        s = int(per_site.nonzero()[0, 0])
        rows = bad[s].any(-1).nonzero().flatten().tolist()
        raise NonFiniteActivationError(
            f"NaN/inf in the residual stream first at site {model.labels[s]} (batch rows {rows}); "
            f"contribution norms are undefined there"
        )


def _limited(batches: Iterable[TokenBatch], max_tokens: int | None) -> Iterable[TokenBatch]:
    """Stop after ``max_tokens`` real tokens (the last sequence is cut to a prefix)."""
    if max_tokens is None:
        yield from batches
        return
    if max_tokens <= 0:
        raise InputError(f"max_tokens must be positive, got {max_tokens}")
    left = max_tokens
    for b in batches:
        if left <= 0:
            return
        n = b.mask.sum(1)
        if int(n.sum()) <= left:
            left -= int(n.sum())
            yield b
            continue
        mask = b.mask.clone()
        keep_rows = 0
        for i in range(mask.shape[0]):
            k = min(int(n[i]), left)
            mask[i, k:] = False
            left -= k
            if k > 0:
                keep_rows = i + 1
        width = int(mask[:keep_rows].sum(1).max())
        yield TokenBatch(
            b.ids[:keep_rows, :width], mask[:keep_rows, :width], b.doc_index[:keep_rows], b.window_index[:keep_rows]
        )
        return


def norm_batches(model, inputs, batch_size, window, max_tokens, mask=None, text: TextWindows | None = None):
    """The batches of ``inputs``: documents read under ``text`` (its window and cap, or
    ``window`` and ``max_tokens`` given here; the cap counts the positions read, cut inside a
    document), or, without ``text``, as the tokenizer tokenizes them (prompts); token ids as they
    are, stopping after ``max_tokens`` real tokens."""
    if batch_size <= 0:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    if max_tokens is not None and max_tokens <= 0:
        raise InputError(f"max_tokens must be positive, got {max_tokens}")
    if text is not None and not isinstance(inputs, torch.Tensor):
        text = with_window(text, window, max_tokens)
        return token_batches(model, inputs, batch_size=batch_size, text=text, skip=0)
    if text is not None:
        window, max_tokens = window or text.window, max_tokens or text.max_tokens
    return _limited(token_batches(model, inputs, batch_size=batch_size, window=window, mask=mask), max_tokens)


def window_keywords(kw: dict) -> tuple[int | None, int | None]:
    """``(window, max_tokens)`` of an analysis' keyword shorthand; any other keyword is a TypeError."""
    unknown = sorted(set(kw) - {"window", "max_tokens"})
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}")
    return kw.get("window"), kw.get("max_tokens")


def text_settings(inputs, text: TextWindows | None) -> TextWindows | None:
    """How a dataset-level norms analysis reads ``inputs``: documents under ``text`` (None: the
    defaults every free-text analysis shares); token ids as they are (None)."""
    return None if isinstance(inputs, torch.Tensor) else (text or TextWindows())


def norm_sample(resid: torch.Tensor, mask: torch.Tensor, n: int = 64) -> torch.Tensor:
    """Up to ``n`` real tokens' streams at every site, [S, n, D], to verify the norms against."""
    b, p = mask.nonzero(as_tuple=True)
    return resid[:, b[:n], p[:n]]


def check_has_blocks(model) -> None:
    if model.n_layers < 1:
        raise UnsupportedArchitecture("a model without blocks has no sublayer writes")


def table_attrs(model, reader) -> dict:
    return {
        "model": str(model.name),
        "layout": model.arch.layout,
        "notes": "; ".join(reader.notes) if reader is not None else "",
    }
