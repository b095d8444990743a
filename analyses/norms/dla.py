"""Direct logit attribution: a decoder's logit split into the embedding's and every sublayer's direct part."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.norms.streaming import Inputs, check_has_blocks
from depthscope.common.errors import InputError, UnsupportedArchitecture
from depthscope.hooks.sites import site_frame

if TYPE_CHECKING:  # annotations only
    from depthscope.hooks.model import ResidualStream


def _per_example(model, tokens, n: int, what: str) -> list[int] | None:
    """Token ids of ``tokens`` (one for all ``n`` examples, or one per example); None for None."""
    if tokens is None:
        return None
    if isinstance(tokens, (str, int, np.integer)) or (isinstance(tokens, torch.Tensor) and tokens.numel() == 1):
        return [model.token_id(tokens, what)] * n
    tokens = list(tokens)
    if len(tokens) != n:
        raise InputError(f"{len(tokens)} {what} tokens for {n} examples; give one, or one per example")
    return [model.token_id(t, what) for t in tokens]


def direct_logit_attribution(
    model,
    inputs: Inputs,
    target_tokens=None,
    contrast_tokens=None,
    *,
    position: int = -1,
    batch_size: int = 8,
    check: bool = True,
    mask: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Direct logit attribution of every sublayer (and the embedding) to a target logit.

    ``inputs``: prompts (strings; each one example, not split into windows) or a LongTensor
    ``[n, pos]`` of token ids. ``target_tokens`` (and optional ``contrast_tokens``): one token
    (single-token string such as ``" Paris"`` or an id) for all examples or one per example;
    with a contrast the attributed quantity is ``logit[target] - logit[contrast]``.
    ``position``: the token whose next-token logit is explained, counted among real tokens
    (default -1, the last); ``mask`` marks the real tokens of padded (right-padded) id rows.

    The final stream is ``h = embed + sum_s u_s``; the final norm with its scale frozen at
    ``h`` is linear, so ``logit = sum_c w . centre(c) / sigma(h) + const`` with
    ``w = gain * W_U[:, target]`` (minus the contrast column), ``centre`` the identity for
    RMSNorm and mean-centring for LayerNorm, and ``const = W_U[:, t] . bias_norm + b_U[t]``.
    A ``logit_scale`` multiplies everything; soft-capped logits are refused (not linear). The
    frozen norm is :meth:`depthscope.hooks.unembed.Unembed.frozen`.

    Returns one row per ``(example, site)`` plus one ``const`` row per example (``site=-1``,
    ``label="const"``, ``layer=-1``, ``sublayer="const"``, ``depth`` NaN), columns ``example,
    text, position, token, target, target_id, contrast, contrast_id`` + site columns +
    ``contribution`` (this part), ``logit`` (the model's own logit or logit difference). With
    ``check`` the sum of the parts must equal ``logit`` (relative 1e-4 of the scale of the
    parts; a few rounding units of the model's dtype in bfloat16/float16), else a RuntimeError
    names the example.
    """
    _check_decoder(model)
    examples = _examples(inputs)
    request = _Request(
        texts=examples.texts,
        targets=_per_example(model, target_tokens, examples.n, "target"),
        contrasts=_per_example(model, contrast_tokens, examples.n, "contrast"),
        position=position,
        check=check,
    )
    sf = site_frame(range(model.n_sites), model.n_layers)
    rows = []
    for start, rs in examples.forwards(model, mask, batch_size):
        rows += [_example_rows(model, sf, rs, j, start + j, request) for j in range(rs.input_ids.shape[0])]
    df = pd.concat(rows, ignore_index=True)
    first = ["example", "text", "position", "token", "target", "target_id", "contrast", "contrast_id"]
    df = df[first + list(sf.columns) + ["contribution", "logit"]]
    df.attrs.update({"model": str(model.name), "what": "logit difference" if request.contrasts else "logit"})
    return df


def _check_decoder(model) -> None:
    """Refuse models whose logits are not ``unembed(final_norm(stream))`` with a linear
    unembedding (before any forward): the attribution would not sum to the logit."""
    check_has_blocks(model)
    if not model.unembed.decodes_stream:
        raise UnsupportedArchitecture(
            f"{model.name}: direct logit attribution needs a decoder whose logits are "
            f"unembed(final_norm(stream)); {model.arch.family} ({model.arch.layout}) is not"
        )
    model.unembed.frozen(torch.zeros(model.d_model))  # refuses soft-capped logits


@dataclass(frozen=True)
class _Examples:
    """DLA inputs as examples: token-id rows (``ids``) or prompts (``texts``), ``n`` of them."""

    ids: torch.Tensor | None
    texts: list[str] | None
    n: int

    def forwards(self, model, mask: torch.Tensor | None, batch_size: int) -> Iterator[tuple[int, ResidualStream]]:
        """``(first example, stream)`` per batch of ``batch_size`` examples, all sites captured."""
        for start in range(0, self.n, batch_size):
            stop = min(self.n, start + batch_size)
            if self.texts is None:
                m = None if mask is None else mask.reshape(self.ids.shape)[start:stop]
                yield start, model.residual_stream(self.ids[start:stop], mask=m)
            else:
                yield start, model.residual_stream(self.texts[start:stop])


def _examples(inputs) -> _Examples:
    """The examples of DLA inputs (one string, prompts, or token ids ``[n, pos]`` / ``[pos]``)."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, torch.Tensor):
        ids_all = inputs if inputs.dim() == 2 else inputs[None]
        if ids_all.numel() == 0:
            raise InputError("empty input: no tokens")
        return _Examples(ids_all, None, ids_all.shape[0])
    texts = list(inputs)
    if not texts or any((not isinstance(t, str)) or t == "" for t in texts):
        raise InputError("empty input: give non-empty prompts")
    return _Examples(None, texts, len(texts))


@dataclass(frozen=True)
class _Request:
    """What to attribute for every example: its prompt (None for token ids), the target and
    contrast token ids per example (None: the model's own top-1 / no contrast), the position
    whose next-token logit is explained, and whether the parts must sum to the logit."""

    texts: list[str] | None
    targets: list[int] | None
    contrasts: list[int] | None
    position: int
    check: bool


def _example_rows(model, sf: pd.DataFrame, rs: ResidualStream, j: int, ex: int, request: _Request) -> pd.DataFrame:
    """The rows of example ``ex`` (row ``j`` of the batch ``rs``): one per site and the constant."""
    L = int(rs.mask[j].sum())
    p = request.position if request.position >= 0 else L + request.position
    if not 0 <= p < L:
        raise InputError(f"position {request.position} outside example {ex}'s {L} tokens")
    t = request.targets[ex] if request.targets is not None else int(rs.logits[j, p].argmax())
    c = request.contrasts[ex] if request.contrasts is not None else None
    lg = rs.logits[j, p].double()
    logit = float(lg[t] - (lg[c] if c is not None else 0.0))
    contrib, const = _attribute(model, rs.resid[:, j, p], t, c, logit if request.check else None, ex)
    tok = model.tokenizer
    info = {
        "example": ex,
        "text": request.texts[ex] if request.texts is not None else None,
        "position": p,
        "token": tok.decode([int(rs.input_ids[j, p])]) if tok is not None else None,
        "target": tok.decode([t]) if tok is not None else str(t),
        "target_id": t,
        "contrast": (tok.decode([c]) if tok is not None else str(c)) if c is not None else None,
        "contrast_id": c if c is not None else -1,
        "logit": logit,
    }
    f = _parts_frame(sf, contrib.cpu().numpy(), const)
    for k, v in info.items():
        f[k] = v
    return f


def _parts_frame(sf: pd.DataFrame, contrib: np.ndarray, const: float) -> pd.DataFrame:
    """The site columns with each site's ``contribution``, then the constant's row (``site=-1``,
    ``label="const"``, ``layer=-1``, ``sublayer="const"``, ``depth`` NaN)."""
    f = sf.copy()
    f["contribution"] = contrib
    const_row = pd.DataFrame(
        {
            "site": [-1],
            "label": ["const"],
            "layer": [-1],
            "sublayer": ["const"],
            "depth": [float("nan")],
            "contribution": [const],
        }
    )
    return pd.concat([f, const_row], ignore_index=True)


def _attribute(model, h: torch.Tensor, t: int, c: int | None, logit: float | None, ex: int):
    """Parts of ``logit[t] (- logit[c])`` for one token's streams ``h`` [S, D] (after every site):
    the embedding and every write through the final norm frozen at ``h[-1]``, and the constant.
    With ``logit`` (the model's own), the parts must sum to it: to 1e-4 of the parts' scale, or
    to a few rounding units of the model's dtype when it computes in half precision (bfloat16's
    unit is 2^-8: its own logit is that far from the exact sum of the parts)."""
    tol = max(1e-4, 4 * torch.finfo(h.dtype).eps) if h.is_floating_point() else 1e-4
    h = h.double()
    comps = torch.cat([h[:1], h[1:] - h[:-1]], 0)  # embed, then every write
    frozen = model.unembed.frozen(h[-1])
    contrib = frozen.contributions(comps, t, c)
    const = frozen.constant(t, c)
    if logit is not None:
        total = float(contrib.sum()) + const
        size = max(float(contrib.abs().sum()) + abs(const), abs(logit), 1e-6)
        if abs(total - logit) > tol * size:
            raise RuntimeError(
                f"direct logit attribution does not reproduce the model's logit for example {ex} "
                f"(parts sum to {total:.6g}, model says {logit:.6g}): the final norm or the "
                f"unembedding of {model.name} is not the plain RMSNorm/LayerNorm -> linear form"
            )
    return contrib, const
