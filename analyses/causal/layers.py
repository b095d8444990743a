"""How much each block matters, and whether its place in the order does: the model with one block
skipped (its output = its input) and with two neighbouring blocks swapped (Lad et al. 2024, "The
remarkable robustness of LLMs: stages of inference?": block ``l + 1`` runs, then block ``l``),
scored by next-token cross-entropy on a text and by top-1 agreement with the unmodified model.

=================================  ==========================================================
:func:`layer_interventions`        the table: one row per (layer, intervention) with
                                   ``cross_entropy``, ``top1_agreement``, ``ce_increase``,
                                   ``n_predictions`` (+ ``layer, sublayer, depth``)
:func:`interventions`              the (intervention, layer, block order) triples a model has
:func:`next_token_scores`          per-batch sums: cross-entropy, agreement with a reference
                                   argmax, predicted positions
=================================  ==========================================================

Rows: ``none`` (the unmodified model; ``layer`` -1), ``skip`` for every block, ``swap`` for every
block with a next one. ``cross_entropy`` is the mean over every predicted position of the text
(position ``t`` predicts token ``t + 1`` of the same line; each line is tokenized as the model's
tokenizer does by default, BOS included where it adds one), i.e. the token-weighted mean over
lines; ``top1_agreement`` the fraction of those positions whose argmax equals the unmodified
model's. ``depth`` is the depth (:mod:`depthscope.hooks.sites`) of the first residual site the
intervention changes: ``l + 1``, block ``l``'s output, for both. Lines are batched with right
padding (the attention mask hides the padding; padded positions are never scored) and lines
longer than ``window`` tokens (default min(context, 512)) are split into windows, each a fresh
context. Memory: one forward's logits, about ``batch_size * longest line * vocabulary * 12``
bytes. The blocks are rearranged by
:func:`depthscope.hooks.block_order.block_order`, and every forward is ``model.run``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.next_token import next_token_nll
from depthscope.analyses.text import token_batches
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.block_order import block_order, skip, swap

INTERVENTIONS = ("none", "skip", "swap")
COLUMNS = ["layer", "sublayer", "depth", "intervention", "cross_entropy", "top1_agreement", "ce_increase"]


def interventions(n_layers: int) -> list[tuple[str, int, list | None]]:
    """``(intervention, layer, order)`` for ``none`` (order None), ``skip`` of every block and
    ``swap`` of every block with a next one."""
    out: list[tuple[str, int, list | None]] = [("none", -1, None)]
    out += [("skip", layer, skip(n_layers, layer)) for layer in range(n_layers)]
    out += [("swap", layer, swap(n_layers, layer)) for layer in range(n_layers - 1)]
    return out


def next_token_scores(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, reference=None) -> tuple:
    """``(sum of cross-entropies, agreements, predictions, argmax)`` over the positions ``t`` whose
    next token ``t + 1`` is real (``mask`` True at both). ``reference``: the argmax ``[batch, pos - 1]``
    to agree with (None: the agreement is counted against this argmax itself). Float32 reductions."""
    ce, scored = next_token_nll(logits, ids, mask)
    top = logits[:, :-1].argmax(-1)
    ref = top if reference is None else reference
    agree = (top == ref) & scored
    return float(ce.double().sum()), int(agree.sum()), int(scored.sum()), top


def layer_interventions(
    model,
    texts: Sequence[str] | str,
    *,
    batch_size: int = 8,
    window: int | None = None,
    layers: Sequence[int] | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Skip and swap every block (``layers``: only these) of ``model`` (a decoder HookedModel) and
    score each on ``texts`` (one document per string); see the module docstring for the table."""
    if not model.is_decoder or not model.unembed.decodes_stream:
        raise InputError(f"layer interventions score next-token predictions: {model.name} is not a decoder LM")
    plan = interventions(model.n_layers)
    if layers is not None:
        keep = {int(x) for x in layers}
        bad = sorted(keep - set(range(model.n_layers)))
        if bad:
            raise InputError(f"layers {bad} out of range 0..{model.n_layers - 1}")
        plan = [p for p in plan if p[0] == "none" or p[1] in keep]
    batches = list(token_batches(model, texts, batch_size=batch_size, window=window))
    if not any(bool((b.mask[:, 1:] & b.mask[:, :-1]).any()) for b in batches):
        raise InputError("the text has no token with a next token to predict (every line is one token)")
    sums = np.zeros((len(plan), 3))  # cross-entropy, agreements, predictions
    with progress_bar(len(batches) * len(plan), desc="layer interventions", unit="fwd", enabled=progress) as bar:
        for b in batches:
            ref = None
            for k, (_, _, order) in enumerate(plan):
                ce, agree, n, top = _score(model, b, order, ref)
                ref = top if ref is None else ref
                sums[k] += (ce, agree, n)
                bar.update(1)
    return _table(plan, sums, model.n_layers)


def _score(model, batch, order, reference) -> tuple:
    """One forward of ``batch`` with the blocks in ``order`` (None: unmodified), scored."""
    ids, mask = batch.ids.to(model.device), batch.mask.to(model.device)
    if order is None:
        logits = model.run(ids, mask=mask).logits
    else:
        with block_order(model, order):
            logits = model.run(ids, mask=mask).logits
    return next_token_scores(logits, ids, mask, reference)


def _table(plan, sums: np.ndarray, n_layers: int) -> pd.DataFrame:
    """The tidy table of :func:`layer_interventions` from the plan and its summed scores."""
    n = np.maximum(sums[:, 2], 1)
    ce = sums[:, 0] / n
    df = pd.DataFrame(
        {
            "layer": [p[1] for p in plan],
            "sublayer": ["model" if p[0] == "none" else "block" for p in plan],
            "depth": [np.nan if p[0] == "none" else p[1] + 1.0 for p in plan],
            "intervention": [p[0] for p in plan],
            "cross_entropy": ce,
            "top1_agreement": sums[:, 1] / n,
            "ce_increase": ce - ce[0],
            "n_predictions": sums[:, 2].astype(np.int64),
        }
    )
    df.attrs["n_layers"] = n_layers
    return df
