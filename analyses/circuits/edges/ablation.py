"""What an edge outside a circuit carries under mean or zero ablation, shared by the scores and
the evaluation so that both use the same differences.

=====================  =========================================================================
offers                 what
=====================  =========================================================================
SenderMeans            each sender's mean write over a set of clean prompts: per position for
                       each prompt length, and over positions 1 .. for other lengths
sender_means           the SenderMeans of a dataset of pairs (their clean prompts)
ablated_writes         the senders' ablated writes ``[1, P, S, d]`` for prompts of ``P`` tokens
ABLATIONS              ``counterfactual``, ``mean``, ``zero``
ablation_kind          an ``ablation`` argument read: its kind and its means (a
                       :class:`SenderMeans` passed as ``ablation`` is mean ablation with them)
ablation_start         the first position an ablation changes (``mean``: 1, ``zero``: 0)
position_embeddings    the learned position embeddings ``[P, d]`` that ``embed`` holds besides
                       the token embedding (GPT-2), or None (rotary models)
=====================  =========================================================================

Conventions (EAP-IG's ``intervention='mean-positional'`` and ``'zero'``, with two choices of
depthscope's, both stated here and in the docs):

- **The mean comes from other prompts than the ones judged**: ``sender_means`` of the pairs that
  score the edges (the command's train split) or of a file of its own (``--mean-pairs``). For a
  prompt of ``P`` tokens, a sender's ablated write at position ``p`` is its mean at ``p`` over the
  mean set's prompts of ``P`` tokens (the prompts align position by position); when the mean set
  has no prompt of that length, its mean over positions ``1 ..`` of every prompt (each prompt's
  positions averaged, then the prompts).
- **Position 0 is never mean-ablated**: it keeps its clean value in the scores and in the runs (as
  :mod:`depthscope.analyses.jobs.sae` keeps its BOS). Position 0 (a BOS token, or the first word)
  is the attention sink; a mean over positions put there is far off what it ever holds. Zero
  ablation zeroes every position, position 0 too, as EAP-IG does.
- **``embed`` is the token embedding alone.** With learned position embeddings (GPT-2) the input
  of block 0 is token plus position embedding; EAP-IG's input node (``hook_embed``) is the token
  embedding, the position embedding staying in every receiver's input. So here: zero ablation of
  ``embed`` removes the token embedding and leaves the position's own embedding, and the mean of
  ``embed`` is the mean token embedding plus the position's own. Under counterfactual ablation the
  position parts cancel (both prompts have the same positions), so nothing changes there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthscope.analyses.circuits.edges.runs import graph_batches, sender_points, stack_senders
from depthscope.common.errors import InputError

__all__ = [
    "ABLATIONS",
    "ablation_kind",
    "SenderMeans",
    "sender_means",
    "ablated_writes",
    "ablation_start",
    "position_embeddings",
]


ABLATIONS = ("counterfactual", "mean", "zero")


def ablation_kind(ablation) -> tuple[str, SenderMeans | None]:
    """(kind, means) of an ``ablation`` argument: one of :data:`ABLATIONS`, or a
    :class:`SenderMeans` (mean ablation with those means; ``"mean"`` alone leaves the means to the caller)."""
    if isinstance(ablation, SenderMeans):
        return "mean", ablation
    if ablation not in ABLATIONS:
        raise InputError(f"ablation must be one of {', '.join(ABLATIONS)} or SenderMeans, got {ablation!r}")
    return ablation, None


def position_embeddings(model, n: int) -> torch.Tensor | None:
    """The learned position embeddings ``[n, d]`` (float32) of positions ``0 .. n-1`` that the
    model adds to the token embeddings before block 0 (GPT-2's ``wpe``), or None where it has none."""
    hf = model.hf_model
    base = getattr(hf, "base_model", hf)
    wpe = getattr(base, "wpe", None)
    if not isinstance(wpe, torch.nn.Embedding):
        return None
    return wpe.weight[:n].detach().float()


@dataclass(frozen=True)
class SenderMeans:
    """Each sender's mean write over ``n_prompts`` clean prompts (the token part of ``embed``):
    ``by_length`` maps a prompt length ``P`` to the per-position means ``[P, S, d]`` over the
    prompts of that length, ``flat`` ``[S, d]`` is the mean over positions ``1 ..`` (None when no
    prompt has two tokens); ``source`` names the prompts."""

    by_length: dict[int, torch.Tensor]
    flat: torch.Tensor | None
    n_prompts: int
    source: str

    def positional(self, n: int) -> bool:
        """Whether prompts of ``n`` tokens get per-position means (the mean set has prompts of ``n`` tokens)."""
        return n in self.by_length


def sender_means(model, pairs, *, source: str = "the given pairs", batch_tokens: int = 512) -> SenderMeans:
    """The :class:`SenderMeans` of the clean prompts of ``pairs`` (what
    :func:`~depthscope.analyses.circuits.pairs.as_pairs` accepts)."""
    from depthscope.analyses.circuits.edges.graph import circuit_graph

    graph = circuit_graph(model)
    tps, batches = graph_batches(model, pairs, None, batch_tokens, "mean ablation")
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    flat, n_flat = None, 0
    with torch.no_grad():
        for b in batches:
            run = model.run(b.clean, cache=sender_points(graph.n_layers))
            writes = stack_senders(run.__getitem__, graph.n_layers)  # [B, P, S, d]
            pos = position_embeddings(model, writes.shape[1])
            if pos is not None:
                writes[:, :, 0] -= pos.to(writes.device)
            P = writes.shape[1]
            sums[P] = writes.sum(0) + sums.get(P, 0)
            counts[P] = counts.get(P, 0) + writes.shape[0]
            if P > 1:
                s = writes[:, 1:].mean(1).sum(0)
                flat, n_flat = (s if flat is None else flat + s), n_flat + writes.shape[0]
    by_length = {P: sums[P] / counts[P] for P in sums}
    return SenderMeans(by_length, None if flat is None else flat / n_flat, len(tps), source)


def ablation_start(ablation: str) -> int:
    """The first position whose senders an ablation changes: 1 under ``mean`` (position 0 keeps
    its clean value), 0 under ``zero``."""
    return 1 if ablation == "mean" else 0


def ablated_writes(model, n_senders: int, n: int, means: SenderMeans | None, device) -> torch.Tensor:
    """The senders' ablated writes ``[1, n, S, d]`` for prompts of ``n`` tokens: ``means`` (per
    position when the mean set has prompts of ``n`` tokens, else the mean over positions ``1 ..``)
    or zero (``means`` None); the ``embed`` slot carries the position embeddings of the model's
    learned positions besides (module docstring). Position 0 under mean ablation is never read."""
    d = model.d_model
    if means is None:
        out = torch.zeros(1, n, n_senders, d, device=device)
    elif means.positional(n):
        out = means.by_length[n][None].to(device).clone()
    else:
        if means.flat is None:
            raise InputError(
                f"mean ablation of {n}-token prompts needs a mean over positions 1 .., and every prompt of "
                f"{means.source} has one token: give longer prompts for the mean"
            )
        out = means.flat[None, None].to(device).expand(1, n, -1, -1).clone()
    pos = position_embeddings(model, n)
    if pos is not None:
        out[0, :, 0] += pos.to(device)
    return out
