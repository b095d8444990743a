"""How much each block matters, and whether its place in the order does: the model with one block
skipped (its output = its input) and with two neighbouring blocks swapped (Lad et al. 2024, "The
remarkable robustness of LLMs: stages of inference?": block ``l + 1`` runs, then block ``l``),
scored by next-token cross-entropy on a text and by top-1 agreement with the unmodified model.

=================================  ==========================================================
:func:`layer_interventions`        the table: one row per (layer, intervention) with the
                                   shared site columns, ``intervention``, ``cross_entropy``,
                                   ``top1_agreement``, ``ce_increase``, ``n_predictions``
:func:`interventions`              the (intervention, layer, block order) triples a model has
:func:`next_token_scores`          per-batch sums: cross-entropy, agreement with a reference
                                   argmax, predicted positions
=================================  ==========================================================

Rows: ``none`` (the unmodified model; ``site`` -1, ``label`` and ``sublayer`` "model",
``layer`` -1, ``depth`` NaN), ``skip`` for every block, ``swap`` for every block with a next
one. The site columns of an intervention at block ``l`` are those of the first residual site
both models have that it changes: block ``l``'s output, the site ``l.mlp`` (depth ``l + 1``).
The text is read as every free-text analysis reads it
(:func:`~depthscope.analyses.text.text_rows` under a
:class:`~depthscope.analyses.text_settings.TextWindows`: the BOS token prepended to every window
when the tokenizer adds none, documents longer than the window split into windows, each a fresh
context; at most ``max_tokens`` predicted tokens), so the unmodified row's ``cross_entropy`` is
the clean loss of the causal test (:func:`~depthscope.analyses.causal.erasure.loss.doc_nll`) and of
:func:`~depthscope.analyses.features.evaluate.evaluate_sae` on the same text.
``cross_entropy`` is the mean over every predicted token (position ``t`` predicts token ``t + 1``
of the same window), i.e. the token-weighted mean over documents; ``top1_agreement`` the fraction
of those positions whose argmax equals the unmodified model's. Windows are batched with right
padding (the attention mask hides the padding; padded positions are never scored). Memory: one
forward's logits, about ``batch_size * window * vocabulary * 12`` bytes, and the batch's clean
streams (below). The blocks are rearranged by :func:`depthscope.hooks.block_order.block_order`,
and every forward is ``model.run``.

Cost. An intervention at block ``l`` changes nothing before it, so the unmodified forward of each
batch keeps the stream entering every block, and the intervened forwards start at block ``l``
from it (:func:`~depthscope.hooks.block_start.from_block`): about half the blocks on average,
with the same numbers as the full forwards. Past the late-start byte budget
(:data:`~depthscope.hooks.late_start.PREFIX_BYTES`, the streams of one batch) every forward runs
all blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.next_token import next_token_nll
from depthscope.analyses.text import pad_id, text_rows, with_window
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.block_order import block_order, skip, swap
from depthscope.hooks.late_start import Budget, from_block
from depthscope.hooks.sites import SITE_COLUMNS, site_frame, site_labels

INTERVENTIONS = ("none", "skip", "swap")
COLUMNS = [*SITE_COLUMNS, "intervention", "cross_entropy", "top1_agreement", "ce_increase", "n_predictions"]


def interventions(n_layers: int) -> list[tuple[str, int, list | None]]:
    """``(intervention, layer, order)`` for ``none`` (order None), ``skip`` of every block and
    ``swap`` of every block with a next one."""
    out: list[tuple[str, int, list | None]] = [("none", -1, None)]
    out += [("skip", layer, skip(n_layers, layer)) for layer in range(n_layers)]
    out += [("swap", layer, swap(n_layers, layer)) for layer in range(n_layers - 1)]
    return out


def next_token_scores(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, reference=None, first: torch.Tensor | None = None
) -> tuple:
    """``(sum of cross-entropies, agreements, predictions, argmax)`` over the positions ``t`` whose
    next token ``t + 1`` is real (``mask`` True at both) and counted (``first``: each row's first
    counted position, :func:`~depthscope.analyses.next_token.next_token_nll`). ``reference``: the
    argmax ``[batch, pos - 1]`` to agree with (None: the agreement is counted against this argmax
    itself). Float32 reductions."""
    ce, scored = next_token_nll(logits, ids, mask, first)
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
    text: TextWindows | None = None,
) -> pd.DataFrame:
    """Skip and swap every block (``layers``: only these) of ``model`` (a decoder HookedModel) and
    score each on ``texts`` (one document per string) read under ``text`` (None: the defaults;
    ``window`` sets its window); see the module docstring for the table. ``df.attrs`` holds
    ``n_layers``, ``n_docs`` and ``n_windows``."""
    if not model.is_decoder or not model.unembed.decodes_stream:
        raise InputError(f"layer interventions score next-token predictions: {model.name} is not a decoder LM")
    plan = interventions(model.n_layers)
    if layers is not None:
        keep = {int(x) for x in layers}
        bad = sorted(keep - set(range(model.n_layers)))
        if bad:
            raise InputError(f"layers {bad} out of range 0..{model.n_layers - 1}")
        plan = [p for p in plan if p[0] == "none" or p[1] in keep]
    text = with_window(text or TextWindows(), window)
    try:
        rows = text_rows(model, texts, text, skip=1)
    except InputError as e:
        if "no token to predict" not in str(e):
            raise
        raise InputError("the text has no token with a next token to predict (every line is one token)") from None
    batches = list(rows.batches(batch_size, pad_id(model)))
    sums = np.zeros((len(plan), 3))  # cross-entropy, agreements, predictions
    with progress_bar(len(batches) * len(plan), desc="layer interventions", unit="fwd", enabled=progress) as bar:
        for b in batches:
            *scores, ref, streams = _clean(model, b, [p[1] for p in plan[1:]])
            sums[0] += scores
            bar.update(1)
            for k, (_, layer, order) in enumerate(plan[1:], 1):
                sums[k] += _score(model, b, order, ref, layer, streams.get(layer))[:3]
                bar.update(1)
    df = _table(plan, sums, model.n_layers)
    df.attrs.update(n_docs=int(len(set(rows.doc.tolist()))), n_windows=rows.n_rows)
    return df


def _clean(model, batch, layers: Sequence[int]) -> tuple:
    """The unmodified forward of ``batch``: its scores (:func:`next_token_scores`) and the streams
    entering the blocks ``layers`` (``{layer: [batch, pos, d]}``; none for block 0, and none at all
    when they would exceed :data:`~depthscope.hooks.late_start.PREFIX_BYTES`)."""
    ids, mask = batch.ids.to(model.device), batch.mask.to(model.device)
    want = sorted({layer for layer in layers if layer > 0})
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    if not Budget().take(len(want) * ids.numel() * model.d_model * itemsize):
        want = []
    labels = site_labels(model.n_layers)  # site 2l: the stream entering block l
    run = model.run(ids, mask=mask, cache=[labels[2 * layer] for layer in want])
    streams = {layer: run[labels[2 * layer]] for layer in want}
    return (*next_token_scores(run.logits, ids, mask, None, batch.first_tensor()), streams)


def _score(model, batch, order, reference, layer: int = 0, stream: torch.Tensor | None = None) -> tuple:
    """One forward of ``batch`` with the blocks in ``order``, scored; with ``stream`` (the clean
    stream entering block ``layer``, the first position ``order`` changes) it starts at ``layer``
    (:func:`~depthscope.hooks.block_start.from_block`: the blocks before are not run again)."""
    ids, mask = batch.ids.to(model.device), batch.mask.to(model.device)
    start = layer if stream is not None else 0
    with block_order(model, order), from_block(model, start, stream):
        logits = model.run(ids, mask=mask).logits
    return next_token_scores(logits, ids, mask, reference, batch.first_tensor())


def _table(plan, sums: np.ndarray, n_layers: int) -> pd.DataFrame:
    """The tidy table of :func:`layer_interventions` from the plan and its summed scores."""
    n = np.maximum(sums[:, 2], 1)
    ce = sums[:, 0] / n
    sites = site_frame([2 * p[1] + 2 for p in plan[1:]], n_layers)  # plan[0] is "none": the model itself
    model = {"site": [-1], "label": ["model"], "layer": [-1], "sublayer": ["model"], "depth": [np.nan]}
    df = pd.concat([pd.DataFrame(model), sites], ignore_index=True)
    df = df.assign(
        intervention=[p[0] for p in plan],
        cross_entropy=ce,
        top1_agreement=sums[:, 1] / n,
        ce_increase=ce - ce[0],
        n_predictions=sums[:, 2].astype(np.int64),
    )
    df.attrs["n_layers"] = n_layers
    return df
