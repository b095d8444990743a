"""Exact circuit evaluation: the clean run with every edge outside the circuit ablated.

=====================  =========================================================================
offers                 what
=====================  =========================================================================
evaluate_circuit       one row per pair: the metric of the clean prompt run through the circuit
CircuitEvaluator       a dataset prepared once (batches, ablated values) for many circuits:
                       ``metrics(in_circuit)`` per pair, ``clean()``, ``corrupted()``
ABLATIONS              ``counterfactual``, ``mean``, ``zero``
=====================  =========================================================================

A circuit is a set of edges of the graph (:mod:`depthscope.analyses.circuits.edges.graph`). Each pair's
clean prompt runs with every receiver fed its own input: the residual stream it reads, in which
each sender whose edge into it is *not* in the circuit is replaced by its ablated value,

    x_v = stream_v + sum over ablated edges u -> v of (a_u(ablated) - a_u(this run))

(the EAP-IG code's ``evaluate_graph``). ``a_u(this run)`` is the sender's write as it is computed in
this very run, itself fed by the circuit, so an edge in the circuit carries the clean value of a
sender computed through the circuit. The ablated value is the sender's write in the pair's
corrupted run (``counterfactual``), its mean over the clean prompts of another set of pairs
(``mean``: a :class:`~depthscope.analyses.circuits.edges.ablation.SenderMeans` passed as
``ablation``, per position where the prompts align, position 0 kept clean; ``"mean"`` alone takes
the evaluated pairs' own mean), or zero (:mod:`~depthscope.analyses.circuits.edges.ablation`:
the conventions, and ``embed`` as the token embedding alone on GPT-2).
With every edge the run *is* the clean run (no hook changes anything); with none under
counterfactual ablation every receiver reads the corrupted stream, so the run computes the
corrupted run's metric (to float rounding).

How. Hooks at the senders (``embed``, ``l.heads``, ``l.mlp_out``) note each write's difference
from its ablated value; hooks at the receivers recompute what each receiver makes of its own
input: the queries, keys and values of the heads that have an ablated input edge (the model's own
norm and projection weights, :func:`~depthscope.analyses.circuits.edges.runs.project`), the MLP's
normed input (``l.mlp_in``) and the final stream. With grouped key/value heads, the query heads of
one group may need different keys or values; the batch then runs ``n_heads / n_kv_heads`` copies
of each prompt, copy ``r`` carrying the keys and values of each group's ``r``-th query head, and
each head's output ``l.z`` is taken from its own copy (all copies equal again after every layer).
Memory per token of a batch: the senders' writes, ``senders x d_model`` floats (twice with the
counterfactual values kept between circuits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.circuits import memory
from depthscope.analyses.circuits.edges.ablation import (
    ABLATIONS,
    ablated_writes,
    ablation_kind,
    ablation_start,
    sender_means,
)
from depthscope.analyses.circuits.edges.graph import CircuitGraph, circuit_graph, edge_matrix, prune_circuit
from depthscope.analyses.circuits.edges.runs import (
    GraphBatch,
    first_difference,
    graph_batches,
    layer_parts,
    project,
    sender_points,
    stack_senders,
)
from depthscope.analyses.circuits.prompts import describe_metrics
from depthscope.common.errors import InputError
from depthscope.hooks.model_checks import require_decoder

__all__ = ["evaluate_circuit", "CircuitEvaluator", "ABLATIONS", "BATCH_TOKENS"]

BATCH_TOKENS = 512
#: ablated values kept between circuits up to this many bytes (else the corrupted runs are redone)
KEEP_BYTES = 1 << 30


@dataclass(frozen=True)
class _Sum:
    """How one group of receivers (a layer's changed q, k or v heads, an MLP input, the logits)
    gets its update: ``sign * sum_k m[k, r] delta[..., idx[k], :]``, plus the running sum of every
    upstream sender's difference when ``from_all`` (then ``m`` holds the *kept* edges, subtracted:
    the cheaper side when most upstream edges are cut)."""

    cols: list[int]  # the receivers' offsets in their group (heads, or [0])
    idx: torch.Tensor  # sender indices
    m: torch.Tensor  # [len(idx), len(cols)] float
    from_all: bool


def _sum(cut: np.ndarray, kept: np.ndarray, n: int, device) -> _Sum | None:
    """The :class:`_Sum` of receivers whose columns are ``cut``/``kept`` ``[S, cols]`` (the first
    ``n`` senders upstream); None when no edge into them is cut."""
    changed = np.nonzero(cut.any(axis=0))[0]
    if not len(changed):
        return None
    c, k = cut[:n, changed], kept[:n, changed]
    use_kept = k.any(axis=1).sum() < c.any(axis=1).sum()
    m = k if use_kept else c
    idx = np.nonzero(m.any(axis=1))[0]
    return _Sum(
        changed.tolist(),
        torch.as_tensor(idx, dtype=torch.long, device=device),
        torch.as_tensor(m[idx], dtype=torch.float32, device=device),
        bool(use_kept),
    )


@dataclass(frozen=True)
class _Plan:
    """What one circuit changes, worked out once on the host: per receiver group (``(layer,
    part)`` for q, k, v; ``(layer, "mlp")``; ``"logits"``) its :class:`_Sum`, which layers need
    per-copy keys or values (``split``) and the copies a run needs."""

    sums: dict
    split: list[bool]
    copies: int


def _plan(graph: CircuitGraph, kept: np.ndarray, device) -> _Plan:
    cut, kept = graph.mask & ~kept, graph.mask & kept
    sums, split = {}, []
    rep = graph.n_heads // (graph.n_kv_heads or graph.n_heads)
    H = graph.n_heads
    for layer in range(graph.n_layers):
        base, need = layer * graph.per_layer, False
        for i, part in enumerate("qkv"):
            cols = slice(base + i * H, base + (i + 1) * H)
            sums[(layer, part)] = _sum(cut[:, cols], kept[:, cols], graph.upstream(base), device)
            if part != "q" and rep > 1:  # a group's query heads reading different inputs
                grouped = cut[:, cols].T.reshape(-1, rep, cut.shape[0])
                need |= not bool((grouped == grouped[:, :1]).all())
        split.append(need)
        col = slice(base + 3 * H, base + 3 * H + 1)
        sums[(layer, "mlp")] = _sum(cut[:, col], kept[:, col], graph.upstream(base + 3 * H), device)
    sums["logits"] = _sum(cut[:, -1:], kept[:, -1:], len(graph.senders), device)
    return _Plan(sums, split, rep if any(split) else 1)


class _Patch:
    """The hooks of one patched run of a batch of ``rows`` pairs in ``plan.copies`` copies:
    ``ablated`` the senders' ablated writes ``[B, P', S, d]`` (or ``[1, 1, S, d]``) at the
    positions ``start:`` (before them every sender's difference is zero)."""

    def __init__(self, ev: CircuitEvaluator, plan: _Plan, ablated: torch.Tensor, rows: int, start: int):
        self.ev, self.g, self.plan, self.rows, self.start = ev, ev.graph, plan, rows, start
        self.copies = plan.copies
        self.ablated = ablated
        self.delta = None  # [B, P', S, d]: ablated - this run's write, filled as the senders write
        self.running = None  # [B, P', d]: the sum of the differences noted so far
        self.before_attn: dict[int, torch.Tensor] = {}  # running at a layer's q (parallel MLPs read it)
        self.resid: dict[str, torch.Tensor] = {}

    def _update(self, key) -> tuple[list[int], torch.Tensor] | None:
        """(receivers changed, their updates ``[B, P', n, d]``) of one receiver group, or None."""
        plan = self.plan.sums.get(key)
        if plan is None:
            return None
        part = torch.matmul(plan.m.T, self.delta.index_select(2, plan.idx)) if len(plan.idx) else 0
        if not plan.from_all:
            return plan.cols, part
        total = self.before_attn[key[0]] if key != "logits" and key[1] == "mlp" and self.g.parallel else self.running
        return plan.cols, total.unsqueeze(2) - part

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        """A per-pair tensor ``[B, ...]`` repeated to every copy ``[copies * B, ...]``."""
        return t.repeat(self.copies, *([1] * (t.dim() - 1))) if self.copies > 1 else t

    def _note(self, start: int, writes: torch.Tensor) -> None:
        """The differences of the senders ``start ...`` from their writes ``[B, P, n, d]``."""
        writes = writes[:, self.start :].float()
        if self.delta is None:
            B, P, _, d = writes.shape
            self.delta = torch.zeros(B, P, len(self.g.senders), d, dtype=torch.float32, device=writes.device)
            self.running = torch.zeros(B, P, d, dtype=torch.float32, device=writes.device)
        n = writes.shape[2]
        diff = self.ablated[:, :, start : start + n] - writes
        self.delta[:, :, start : start + n] = diff
        self.running += diff.sum(2)

    # -- senders and the stream
    def embed(self, t, ctx):
        self._note(0, t[: self.rows].unsqueeze(2))
        self.resid["pre0"] = t
        return None

    def keep(self, key: str):
        def fn(t, ctx):
            self.resid[key] = t
            return None

        return fn

    def mlp_out(self, layer: int):
        def fn(t, ctx):
            self._note(self.g.attn_start(layer) + self.g.n_heads, t[: self.rows].unsqueeze(2))
            return None

        return fn

    def z(self, layer: int):
        """``l.z``: in a split layer each head's output from the copy that carried its keys and
        values (all copies equal again); then the heads' writes noted (from the first copy)."""
        parts = self.ev.parts[layer]

        def fn(t, ctx):
            new = None
            if self.plan.split[layer]:
                view = t.view(self.copies, self.rows, *t.shape[1:])
                heads = torch.arange(t.shape[2], device=t.device)
                own = view[heads % self.copies, :, :, heads]  # [H, B, P, d_head]
                new = self._expand(own.permute(1, 2, 0, 3))
            z = (t if new is None else new)[: self.rows]
            self._note(self.g.attn_start(layer), parts.head_writes(z))
            return new

        return fn

    # -- receivers
    def qkv(self, layer: int, part: str):
        parts = self.ev.parts[layer]

        def fn(t, ctx):
            if part == "q":
                self.before_attn[layer] = self.running.clone()
            todo = self._update((layer, part))
            if todo is None:
                return None
            heads, upd = todo
            x = self.resid[f"pre{layer}"][: self.rows, self.start :]
            b = None if parts.b[part] is None else parts.b[part][heads]
            values = project(parts.ln1, x.unsqueeze(2) + upd.to(x.dtype), parts.w[part][heads], b)
            return self._write(t, part, heads, values, layer)

        return fn

    def _write(self, t, part: str, heads: list[int], values: torch.Tensor, layer: int) -> torch.Tensor:
        """``t`` (this layer's q, k or v, ``[copies * B, P, heads_part, d_head]``) with the heads
        that changed replaced: a query head directly; a key/value head of a group by the value of
        the group's head that each copy carries (its first head when the group needs no split)."""
        values, at = values.to(t.dtype), self.start
        new = t.clone()
        if part == "q" or t.shape[2] == self.g.n_heads:
            for i, h in enumerate(heads):
                new[:, at:, h] = self._expand(values[:, :, i])
            return new
        rep = self.g.n_heads // t.shape[2]
        view = new.view(self.copies, self.rows, *t.shape[1:])
        for i, h in enumerate(heads):
            g, r = divmod(h, rep)
            if self.plan.split[layer]:
                view[r, :, at:, g] = values[:, :, i]
            elif r == 0:  # no split: the group's heads all read the same input
                view[:, :, at:, g] = values[:, :, i]
        return new

    def mlp_in(self, layer: int):
        parts = self.ev.parts[layer]

        def fn(t, ctx):
            todo = self._update((layer, "mlp"))
            if todo is None:
                return None
            base = self.resid[f"pre{layer}" if self.g.parallel else f"mid{layer}"][: self.rows, self.start :]
            new = t.clone()
            new[:, self.start :] = self._expand(parts.ln2(base + todo[1][:, :, 0].to(base.dtype)).to(t.dtype))
            return new

        return fn

    def last(self, t, ctx):
        todo = self._update("logits")
        if todo is None:
            return None
        new = t.clone()
        new[:, self.start :] += self._expand(todo[1][:, :, 0].to(t.dtype))
        return new

    def hooks(self) -> dict:
        g, out = self.g, {"embed": self.embed}
        for layer in range(g.n_layers):
            for part in "qkv":
                out[f"{layer}.{part}"] = self.qkv(layer, part)
            out[f"{layer}.z"] = self.z(layer)
            out[f"{layer}.attn"] = self.keep(f"mid{layer}")
            out[f"{layer}.mlp_in"] = self.mlp_in(layer)
            out[f"{layer}.mlp_out"] = self.mlp_out(layer)
            out[f"{layer}.mlp"] = [self.keep(f"pre{layer + 1}")] + ([self.last] if layer == g.n_layers - 1 else [])
        return out


def _check_memory(model, batches: list[GraphBatch]) -> None:
    """Before any forward: the largest batch's evaluation
    (:func:`~depthscope.analyses.circuits.memory.evaluate_bytes`) fits in the memory free."""
    if not batches:
        return
    rows, n = max((b.clean.shape for b in batches), key=lambda shape: shape[0] * shape[1])
    knobs = ["shorter pairs"]
    if rows > 1:
        knobs.insert(0, f"a smaller --batch-tokens (batch_tokens=; a batch holds {rows} pairs)")
    what = f"circuit evaluation of {rows} pair{'s' if rows > 1 else ''} of {n:,} tokens"
    memory.check_room(memory.evaluate_bytes(model, rows, n), model.device, what, knobs)


class CircuitEvaluator:
    """A dataset of pairs prepared for evaluating many circuits of one model: batches of one
    token length, the ablated values (kept between circuits when they fit ``KEEP_BYTES``), the
    clean and corrupted metrics. ``metrics(in_circuit)`` evaluates one circuit (a bool
    ``[senders, receivers]`` matrix, or what :func:`~depthscope.analyses.circuits.edges.graph.edge_matrix`
    reads) and returns each pair's metric."""

    def __init__(self, model, pairs, ablation="counterfactual", *, metric=None, batch_tokens: int = BATCH_TOKENS):
        require_decoder(model, "circuit evaluation")
        self.model = model
        self.ablation, self.means = ablation_kind(ablation)
        self.graph: CircuitGraph = circuit_graph(model)
        self.tps, self.batches = graph_batches(model, pairs, metric, batch_tokens, "circuit evaluation")
        _check_memory(model, self.batches)
        self.parts = [layer_parts(model, layer) for layer in range(self.graph.n_layers)]
        self.what = describe_metrics(self.tps)
        self._clean = self._corrupted = None
        self._kept: dict[int, torch.Tensor] = {}
        if self.ablation == "mean" and self.means is None:  # the API's default: the evaluated prompts' own mean
            self.means = sender_means(model, pairs, source="the evaluated pairs", batch_tokens=batch_tokens)

    @property
    def n_pairs(self) -> int:
        return len(self.tps)

    def _run_metrics(self, which: str) -> np.ndarray:
        out = np.zeros(self.n_pairs)
        with torch.no_grad():
            for b in self.batches:
                out[b.index] = b.metric(self.model.run(getattr(b, which)).logits).float().cpu().numpy()
        return out

    def clean(self) -> np.ndarray:
        """Each pair's metric on its clean prompt (the full circuit)."""
        if self._clean is None:
            self._clean = self._run_metrics("clean")
        return self._clean

    def corrupted(self) -> np.ndarray:
        """Each pair's metric on its corrupted prompt."""
        if self._corrupted is None:
            self._corrupted = self._run_metrics("corrupted")
        return self._corrupted

    def _ablated(self, i: int, b: GraphBatch) -> torch.Tensor:
        """The senders' ablated writes of batch ``i`` (kept between circuits while they fit)."""
        if i in self._kept:
            return self._kept[i]
        if self.ablation != "counterfactual":
            out = ablated_writes(self.model, len(self.graph.senders), b.clean.shape[1], self.means, b.clean.device)
        else:
            with torch.no_grad():
                run = self.model.run(b.corrupted, cache=sender_points(self.graph.n_layers))
            out = stack_senders(run.__getitem__, self.graph.n_layers).float()
        if sum(t.numel() * 4 for t in self._kept.values()) + out.numel() * 4 <= KEEP_BYTES:
            self._kept[i] = out
        return out

    def metrics(self, in_circuit) -> np.ndarray:
        """Each pair's metric with the circuit ``in_circuit`` (see the class docstring)."""
        kept = (
            in_circuit
            if isinstance(in_circuit, np.ndarray) and in_circuit.dtype == bool
            else edge_matrix(self.graph, in_circuit)
        )
        if kept.shape != self.graph.mask.shape:
            raise InputError(f"a circuit matrix must have shape {self.graph.mask.shape}, got {kept.shape}")
        if not (self.graph.mask & ~kept).any():
            return self.clean().copy()
        out = np.zeros(self.n_pairs)
        plan = _plan(self.graph, kept, self.model.device)
        for i, b in enumerate(self.batches):
            rows = b.clean.shape[0]
            start = self._start(b)
            if start >= b.clean.shape[1]:  # the same prompts: ablated and clean writes are the same
                out[b.index] = self.clean()[b.index]
                continue
            patch = _Patch(self, plan, self._ablated(i, b)[:, start:], rows, start)
            with torch.no_grad():
                logits = self.model.run(b.clean.repeat(plan.copies, 1), hooks=patch.hooks()).logits[:rows]
            out[b.index] = b.metric(logits).float().cpu().numpy()
        return out

    def _start(self, b: GraphBatch) -> int:
        """The first position at which an ablated write can differ from this run's: under
        counterfactual ablation the first at which a pair's prompts differ (a causal model computes
        the same before it in both runs, in every circuit); under mean ablation 1 (position 0 keeps
        its clean value), under zero ablation 0."""
        if self.ablation != "counterfactual":
            return ablation_start(self.ablation)
        first = first_difference(b)
        return b.clean.shape[1] if first is None else first


def evaluate_circuit(
    model,
    pairs,
    edges,
    ablation="counterfactual",
    *,
    prune: bool = True,
    metric=None,
    batch_tokens: int = BATCH_TOKENS,
) -> pd.DataFrame:
    """Each pair's metric on its clean prompt run through the circuit ``edges`` (module docstring).

    ``edges``: a table with ``sender`` and ``receiver`` columns (rows of
    :func:`~depthscope.analyses.circuits.edges.eap.edge_attribution`, e.g. its top rows, or the
    ``edges`` table ``depthscope circuit`` writes) or a list of ``(sender, receiver)``. A table with
    an ``in_circuit`` column is the circuit of its rows marked True (the job's own ``edges.parquet``
    evaluates its drawn circuit); a table without one is taken whole. ``prune`` (default) prunes the
    circuit as the faithfulness curve does
    (:func:`~depthscope.analyses.circuits.edges.graph.prune_circuit`). Every other edge carries its
    sender's ablated value (``ablation``: ``counterfactual``, the pair's corrupted run; a
    :class:`~depthscope.analyses.circuits.edges.ablation.SenderMeans` of other pairs, or ``mean``
    for the evaluated pairs' own mean; ``zero``). ``pairs`` and ``metric`` as in
    :func:`~depthscope.analyses.circuits.edges.eap.edge_attribution`.

    Returns one row per pair: ``pair``, ``metric``, ``clean_metric`` and ``corrupted_metric`` (the
    plain runs), ``n_edges`` (the edges evaluated, after pruning), ``n_edges_given`` (before) and
    ``ablation``."""
    ev = CircuitEvaluator(model, pairs, ablation, metric=metric, batch_tokens=batch_tokens)
    if isinstance(edges, pd.DataFrame) and "in_circuit" in edges.columns:
        on = edges["in_circuit"]
        if on.isna().any() or not all(isinstance(x, (bool, np.bool_)) for x in on):
            raise InputError("an edge table's in_circuit column must be True or False on every row")
        edges = edges[on.to_numpy(dtype=bool)]
    given = edge_matrix(ev.graph, edges)
    kept = prune_circuit(ev.graph, given) if prune else given
    values = ev.metrics(kept)
    n, n_given = int(kept.sum()), int(given.sum())
    df = pd.DataFrame(
        {
            "pair": np.arange(ev.n_pairs),
            "metric": values,
            "clean_metric": ev.clean(),
            "corrupted_metric": ev.corrupted(),
            "n_edges": n,
            "n_edges_given": n_given,
            "ablation": ev.ablation,
        }
    )
    df.attrs.update(model=str(model.name), metric=ev.what, ablation=ev.ablation, n_edges=n, n_edges_given=n_given)
    df.attrs["pruned"] = bool(prune)
    return df
