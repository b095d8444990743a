"""The model's next-token loss on held-out text, per document, with write hooks; the ``used`` score.

=====================================  ===========================================================
``held_out(model, texts, window=,      the texts as token rows (:func:`~depthscope.analyses.text.
bos=, max_tokens=, text=)``            text_rows`, counting predicted tokens): the BOS token
                                       prepended as the probes do, documents longer than
                                       ``window`` split into windows each starting with it, at
                                       most ``max_tokens`` predicted tokens (cut inside a
                                       document); ``text``: all of it as one
                                       :class:`~depthscope.analyses.text_settings.TextWindows`
``doc_nll(model, held, hooks,          summed next-token negative log-likelihood (nats) and the
batch_size=)``                         number of predicted tokens per document, one forward
                                       pass per batch through ``model.run(hooks=...)``: a
                                       :class:`DocLoss`
``doc_nlls(model, held, hook_sets)``   :func:`doc_nll` of several hooks as one layer-major pass
                                       (a streamed model reads each block once)
``used_score(clean, erased,            ``(L_erased - mean_c L_control_c) / L_clean``, the losses
controls)``                            token-weighted means over the documents
``used_interval(clean, erased,         its two-level percentile bootstrap interval: documents
controls, n, seed=)``                  (the same draw for every condition) and controls
                                       resampled with replacement; NaN below 10 documents
=====================================  ===========================================================

``used`` is the extra loss that erasing the concept costs beyond erasing a random subspace of the
same rank, as a fraction of the clean loss: 0 when the model loses no more from losing the
concept than from losing as many random directions edited by as much, 0.1 when it loses 10%
of its clean loss more. Documents are the resampling unit, so the interval accounts for the
correlation of a sentence's tokens; the controls are resampled too, so it accounts for how much
the loss of one random erasure differs from another's (with one control it cannot: that spread
is then unmeasured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from depthscope.analyses.intervals import MIN_UNITS, too_few
from depthscope.analyses.next_token import next_token_nll
from depthscope.analyses.text import TextRows, pad_id, text_rows
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.hooks.engine import normalise_hooks
from depthscope.hooks.stream_pass import attention_free, layer_major

#: the most token positions per forward pass (the logits are [rows, positions, vocabulary])
BATCH_TOKENS = 4096

#: the held-out text: token rows whose counted positions are the predicted tokens
#: (:class:`~depthscope.analyses.text.TextRows`; ``n_tokens`` predicted tokens, ``start`` 1 when
#: every row begins with a BOS token that erasure leaves alone)
HeldOut = TextRows


@dataclass(frozen=True)
class DocLoss:
    """Per document: summed next-token NLL in nats (``nll``, float64) and predicted tokens (``tokens``)."""

    nll: np.ndarray
    tokens: np.ndarray

    @property
    def mean(self) -> float:
        """The token-weighted mean loss."""
        return float(self.nll.sum() / max(int(self.tokens.sum()), 1))


def held_out(
    model,
    texts: Sequence[str],
    *,
    window: int | None = None,
    bos: bool = True,
    max_tokens: int | None = None,
    text: TextWindows | None = None,
) -> HeldOut:
    """``texts`` as token rows for :func:`doc_nll` (see the module docstring): under ``text``, or
    the settings ``window``, ``bos`` and ``max_tokens`` (predicted tokens) when it is None."""
    if model.tokenizer is None:
        raise InputError("this model has no tokenizer: the held-out text cannot be read")
    text = text or TextWindows(bos=bos, window=window, max_tokens=max_tokens)
    try:
        return text_rows(model, texts, text, skip=1)
    except InputError as e:
        if "no token to predict" not in str(e):
            raise
        raise InputError("the held-out text has no document of two or more tokens: nothing to predict") from None


@torch.no_grad()
def doc_nll(model, held: HeldOut, hooks: dict | None = None, *, batch_size: int = 16, prefixes=None) -> DocLoss:
    """Per-document next-token loss of ``model`` on ``held`` with ``hooks`` (``{point: fn}``,
    None: the plain forward); see the module docstring. ``prefixes``
    (:class:`~depthscope.analyses.causal.erasure.prefix.Prefixes` of ``held``): its batches, each forward
    starting at its block from the clean stream there (the hooks must be at or after it)."""
    return doc_nlls(model, held, [hooks], batch_size=batch_size, prefixes=prefixes)[0]


@torch.no_grad()
def doc_nlls(model, held: HeldOut, hook_sets: Sequence, *, batch_size: int = 16, prefixes=None) -> list[DocLoss]:
    """:func:`doc_nll` of each hooks of ``hook_sets``, as one layer-major pass
    (:func:`~depthscope.hooks.stream_pass.layer_major`): on a streamed model every forward (each
    hooks on each batch) goes through a block before any goes to the next, so each block is read
    once per pass; the same numbers as one :func:`doc_nll` after the other."""
    if prefixes is None:
        batches = list(held.batches(batch_size, pad_id(model), by_length=True, max_tokens=BATCH_TOKENS))
        start = lambda i: contextlib.nullcontext()  # noqa: E731 - the plain forward
    else:
        batches, start = prefixes.batches, prefixes.start
    items = [(k, i) for k in range(len(hook_sets)) for i in range(len(batches))]

    def run(item: tuple) -> tuple:
        k, i = item
        b = batches[i]
        with start(i):
            logits = model.run(b.ids, mask=b.mask, hooks=hook_sets[k]).logits
        per, valid = next_token_nll(logits, b.ids, b.mask, b.first_tensor())
        return per.sum(1).double().cpu().numpy(), valid.sum(1).cpu().numpy()

    def held_bytes(item: tuple) -> int:  # a forward's waiting stream (its logits are reduced before the next runs)
        return batches[item[1]].ids.numel() * model.d_model * 4

    points = [p for h in hook_sets if h for p in normalise_hooks(h, model.n_layers)]
    sums = [(np.zeros(held.n_docs, dtype=np.float64), np.zeros(held.n_docs, dtype=np.int64)) for _ in hook_sets]
    results = layer_major(model, items, run, held=held_bytes, enabled=attention_free(points))
    for (k, i), (nll, count) in zip(items, results):
        np.add.at(sums[k][0], batches[i].doc_index, nll)
        np.add.at(sums[k][1], batches[i].doc_index, count)
    return [DocLoss(nll, count) for nll, count in sums]


def used_score(clean: DocLoss, erased: DocLoss, controls: Sequence[DocLoss]) -> float:
    """``(L_erased - mean_c L_control_c) / L_clean`` (module docstring)."""
    return (erased.mean - float(np.mean([c.mean for c in controls]))) / clean.mean


def used_interval(
    clean: DocLoss,
    erased: DocLoss,
    controls: Sequence[DocLoss],
    n: int,
    *,
    seed: int = 0,
    level: float = 0.95,
    min_units: int = MIN_UNITS,
) -> tuple[float, float]:
    """The ``level`` two-level percentile bootstrap interval of :func:`used_score`: each of the ``n``
    resamples draws the documents with replacement (the same draw for every condition) and the
    controls with replacement (so the interval widens with the controls' spread), and recomputes
    the score. NaN, NaN for ``n`` 0 or fewer than ``min_units`` documents
    (:data:`~depthscope.analyses.intervals.MIN_UNITS`)."""
    k = len(clean.nll)
    if n <= 0 or too_few(k, min_units):
        return float("nan"), float("nan")
    rng = np.random.default_rng([seed, 3535])
    w = rng.multinomial(k, np.full(k, 1.0 / k), size=n).astype(np.float64)  # [n, docs]
    tok = np.maximum(w @ clean.tokens, 1.0)
    base = w @ clean.nll / tok
    per_control = np.stack([w @ c.nll / tok for c in controls], 1)  # [n, C]
    pick = rng.integers(0, len(controls), size=(n, len(controls)))  # the controls drawn per resample
    gap = w @ erased.nll / tok - np.take_along_axis(per_control, pick, 1).mean(1)
    lo, hi = np.quantile(gap / base, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
