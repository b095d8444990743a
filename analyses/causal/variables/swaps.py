"""How interchange interventions run: the site vectors of base and source computed once, the base
forwards from the intervened position on, batched.

An intervention at a residual site and position ``p`` of the base changes nothing before ``p``
(attention is causal). The key/value cache of the base's positions ``0..p-1`` is therefore
computed once per batch of examples (examples sharing the base's length and ``p``) and every
intervened forward runs the positions ``p..`` only; the site's vectors of base and source at the
position are read once per example (one forward of each prompt for every site at once). Every
forward goes through depthscope's hook engine (the edit is a hook at the site).

==========================  ====================================================================
:class:`Batch`              examples sharing the base's token length and intervened position
:func:`make_batches`        the batches of one named position
:func:`site_vectors`        the base's and source's vectors ``[sites, examples, d]`` at one
                            named position
:class:`Runner`             the batches of one position with their key/value prefixes;
                            :meth:`Runner.logits`: last-position logits of a batch with an
                            intervention (:mod:`depthscope.hooks.interventions`) on the base's
                            vectors ``[batch, d]`` at one site
:func:`frozen`              the model's parameters out of autograd for a ``with`` block (only
                            an intervention's own parameters are trained)
:func:`candidate_scores`    ``(argmax over the candidates == label, logit of the label minus the
                            mean logit of the other candidates, argmax over the whole vocabulary
                            == the label's token)`` per example
==========================  ====================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from depthscope.analyses.causal.variables.counterfactuals import TokenExample
from depthscope.hooks.interventions import Intervention
from depthscope.hooks.late_start import Budget, KVPrefix, tail_logits
from depthscope.hooks.sites import site_labels

__all__ = ["Batch", "make_batches", "site_vectors", "Runner", "frozen", "candidate_scores"]


@dataclass
class Batch:
    """Examples ``rows`` (indices into the tokenized list) whose bases share a token length and
    the intervened position ``start``: ``ids`` ``[batch, pos]`` on the model's device, candidate
    ids ``[batch, candidates]`` and the label's index ``[batch]``."""

    rows: list[int]
    ids: torch.Tensor
    start: int
    candidates: torch.Tensor
    label: torch.Tensor


def make_batches(model, examples: Sequence[TokenExample], position: str, batch_size: int) -> list[Batch]:
    """The batches of one named position (at most ``batch_size`` examples each), in the order of
    the examples' first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault((len(e.base_ids), e.positions[position][0], len(e.candidates)), []).append(i)
    out = []
    for (_, start, _), rows in groups.items():
        for k in range(0, len(rows), batch_size):
            chunk = rows[k : k + batch_size]
            dev = model.device
            ids = torch.stack([examples[i].base_ids for i in chunk]).to(dev)
            cands = torch.tensor([examples[i].candidates for i in chunk], device=dev)
            label = torch.tensor([examples[i].label for i in chunk], device=dev)
            out.append(Batch(chunk, ids, start, cands, label))
    return out


def site_vectors(model, examples: Sequence[TokenExample], sites: Sequence[int], position: str, batch_size: int):
    """``(base, source)``: the vectors ``[sites, examples, d]`` (float32, on the model's device) of
    every example's base and source at the named position, one forward per prompt batch."""
    labels = [site_labels(model.n_layers)[s] for s in sites]
    out = {}
    for side in (0, 1):
        vec = torch.empty(len(sites), len(examples), model.d_model, device=model.device)
        by_len: dict[int, list[int]] = {}
        for i, e in enumerate(examples):
            by_len.setdefault(len(e.source_ids if side else e.base_ids), []).append(i)
        for rows in by_len.values():
            for k in range(0, len(rows), batch_size):
                chunk = rows[k : k + batch_size]
                ids = torch.stack([examples[i].source_ids if side else examples[i].base_ids for i in chunk])
                run = model.run(ids.to(model.device), cache=labels)
                at = torch.tensor([examples[i].positions[position][side] for i in chunk], device=model.device)
                arange = torch.arange(len(chunk), device=model.device)
                for j, label in enumerate(labels):
                    vec[j, chunk] = run[label][arange, at].float()
        out[side] = vec
    return out[0], out[1]


@contextlib.contextmanager
def frozen(model) -> Iterator[None]:
    """The model's parameters with ``requires_grad`` off for a ``with`` block, restored on exit:
    a backward then reaches only the intervention's parameters (no weight gradient is formed)."""
    params = list(model.hf_model.parameters())
    before = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, rg in zip(params, before):
            p.requires_grad_(rg)


class Runner:
    """The batches of one named position and their key/value prefixes (the base's positions before
    the intervened one, :class:`~depthscope.hooks.late_start.KVPrefix`), computed once and kept
    (up to :data:`~depthscope.hooks.late_start.PREFIX_BYTES` in all; past it each is recomputed
    when used)."""

    def __init__(self, model, batches: list[Batch]):
        self.model, self.batches = model, batches
        self.labels = site_labels(model.n_layers)
        self.prefixes: dict[int, KVPrefix | None] = {}
        self.budget = Budget()

    def _prefix(self, i: int) -> KVPrefix | None:
        """Batch ``i``'s key/value prefix of positions ``0..start-1`` (None: nothing to reuse)."""
        if i in self.prefixes:
            return self.prefixes[i]
        b = self.batches[i]
        prefix = KVPrefix.build(self.model, b.ids, b.start)
        if prefix is not None and self.budget.open and self.budget.take(prefix.nbytes):
            self.prefixes[i] = prefix
        return prefix

    def logits(self, i: int, site: int, intervention: Intervention, source=None) -> torch.Tensor:
        """Last-position logits ``[batch, vocab]`` (float32) of batch ``i`` with the base's vectors
        ``[batch, d]`` (as float32) at ``site`` and the batch's position replaced by
        ``intervention(vectors, source)`` (:mod:`depthscope.hooks.interventions`; ``source``: the
        batch's source vectors ``[batch, d]``, or None); a graph is kept when grad mode is on."""
        b = self.batches[i]
        prefix = self._prefix(i)
        rel = b.start - (prefix.start if prefix is not None else 0)

        def hook(t: torch.Tensor, ctx) -> torch.Tensor:
            new = t.clone()
            new[:, rel] = intervention(t[:, rel].float(), source).to(t.dtype)
            return new

        logits = tail_logits(self.model, b.ids, {self.labels[site]: hook}, prefix, last_only=True)
        return logits[:, -1].float()


def candidate_scores(logits: torch.Tensor, batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per example of ``batch``: whether the argmax over its candidates is the label, the label's
    logit minus the mean logit of the other candidates, and whether the model's output token (the
    argmax over the whole vocabulary) is the label's token."""
    c = logits.gather(1, batch.candidates)  # [batch, candidates]
    hit = c.argmax(1) == batch.label
    lab = c.gather(1, batch.label[:, None])[:, 0]
    others = (c.sum(1) - lab) / (c.shape[1] - 1)
    token = logits.argmax(1) == batch.candidates.gather(1, batch.label[:, None])[:, 0]
    return hit.cpu().numpy(), (lab - others).detach().cpu().numpy(), token.cpu().numpy()
