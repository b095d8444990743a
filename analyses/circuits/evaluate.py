"""Exact circuit evaluation: the clean run with every edge outside the circuit ablated.

=====================  =========================================================================
offers                 what
=====================  =========================================================================
evaluate_circuit       one row per pair: the metric of the clean prompt run through the circuit
CircuitEvaluator       a dataset prepared once (batches, ablated values) for many circuits:
                       ``metrics(in_circuit)`` per pair, ``clean()``, ``corrupted()``
ABLATIONS              ``counterfactual``, ``mean``, ``zero``
=====================  =========================================================================

A circuit is a set of edges of the graph (:mod:`depthscope.analyses.circuits.graph`). Each pair's
clean prompt runs with every receiver fed its own input: the residual stream it reads, in which
each sender whose edge into it is *not* in the circuit is replaced by its ablated value,

    x_v = stream_v + sum over ablated edges u -> v of (a_u(ablated) - a_u(this run))

(the EAP-IG code's ``evaluate_graph``). ``a_u(this run)`` is the sender's write as it is computed in
this very run, itself fed by the circuit, so an edge in the circuit carries the clean value of a
sender computed through the circuit. The ablated value is the sender's write in the pair's
corrupted run (``counterfactual``), its mean over every token of the pairs' clean prompts
(``mean``, each prompt's positions averaged, then the prompts; as the EAP-IG code), or zero.
With every edge the run *is* the clean run (no hook changes anything); with none under
counterfactual ablation every receiver reads the corrupted stream, so the run computes the
corrupted run's metric (to float rounding).

How. Hooks at the senders (``embed``, ``l.heads``, ``l.mlp_out``) note each write's difference
from its ablated value; hooks at the receivers recompute what each receiver makes of its own
input: the queries, keys and values of the heads that have an ablated input edge (the model's own
norm and projection weights, :func:`~depthscope.analyses.circuits.graph_runs.project`), the MLP's
normed input (``l.mlp_in``) and the final stream. With grouped key/value heads, the query heads of
one group may need different keys or values; the batch then runs ``n_heads / n_kv_heads`` copies
of each prompt, copy ``r`` carrying the keys and values of each group's ``r``-th query head, and
each head's output ``l.z`` is taken from its own copy (all copies equal again after every layer).
Memory per token of a batch: the senders' writes, ``senders x d_model`` floats (twice with the
counterfactual values kept between circuits).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.circuits.graph import CircuitGraph, circuit_graph, edge_matrix
from depthscope.analyses.circuits.graph_runs import (
    GraphBatch,
    graph_batches,
    layer_parts,
    project,
    sender_points,
    stack_senders,
)
from depthscope.analyses.circuits.prompts import describe_metrics
from depthscope.analyses.circuits.runs import require_decoder
from depthscope.common.errors import InputError

__all__ = ["evaluate_circuit", "CircuitEvaluator", "ABLATIONS", "BATCH_TOKENS"]

ABLATIONS = ("counterfactual", "mean", "zero")
BATCH_TOKENS = 512
#: ablated values kept between circuits up to this many bytes (else the corrupted runs are redone)
KEEP_BYTES = 1 << 30


class _Patch:
    """The hooks of one patched run of a batch of ``B`` pairs in ``copies`` copies: ``ablated``
    ``[B, P, S, d]`` (or ``[1, 1, S, d]``), ``cut`` the ablated edges ``[S, R]`` (float)."""

    def __init__(self, ev: CircuitEvaluator, ablated: torch.Tensor, cut: torch.Tensor, rows: int, copies: int):
        self.ev, self.g, self.cut, self.copies, self.rows = ev, ev.graph, cut, copies, rows
        self.ablated = ablated
        self.delta = None  # [B, P, S, d]: ablated - this run's write, filled as the senders write
        self.resid: dict[str, torch.Tensor] = {}
        self.split = [self._needs_split(layer) for layer in range(self.g.n_layers)]

    # -- which heads change
    def _cols(self, layer: int, part: str) -> slice:
        base = layer * self.g.per_layer + "qkv".index(part) * self.g.n_heads
        return slice(base, base + self.g.n_heads)

    def _needs_split(self, layer: int) -> bool:
        """Whether a group's query heads need different keys or values in this layer."""
        if self.copies == 1:
            return False
        for part in "kv":
            cols = self.cut[:, self._cols(layer, part)].T  # [H, S]
            grouped = cols.view(-1, self.copies, cols.shape[1])
            if not bool((grouped == grouped[:, :1]).all()):
                return True
        return False

    def _update(self, cols) -> torch.Tensor:
        """sum over ablated senders of their differences, per receiver in ``cols``: ``[B, P, n, d]``."""
        cut = self.cut[:, cols]
        n = int(cut.nonzero()[:, 0].max()) + 1
        return torch.einsum("bpsd,sr->bprd", self.delta[:, :, :n], cut[:n])

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        """A per-pair tensor ``[B, ...]`` repeated to every copy ``[copies * B, ...]``."""
        return t.repeat(self.copies, *([1] * (t.dim() - 1))) if self.copies > 1 else t

    # -- senders
    def sender(self, start: int):
        def fn(t, ctx):
            w = t[: self.rows]
            if self.delta is None:
                self.delta = torch.zeros(
                    *w.shape[:2], len(self.g.senders), w.shape[-1], dtype=torch.float32, device=w.device
                )
            w = w.float() if w.dim() == 4 else w.float().unsqueeze(2)
            a = self.ablated[:, :, start : start + w.shape[2]]
            self.delta[:, :, start : start + w.shape[2]] = a - w
            if ctx.kind == "embed":
                self.resid["pre0"] = t
            return None

        return fn

    def keep(self, key: str):
        def fn(t, ctx):
            self.resid[key] = t
            return None

        return fn

    # -- receivers
    def qkv(self, layer: int, part: str):
        parts = self.ev.parts[layer]

        def fn(t, ctx):
            cols = self._cols(layer, part)
            heads = self.cut[:, cols].any(0).nonzero()[:, 0]
            if not len(heads):
                return None
            x = self.resid[f"pre{layer}"][: self.rows]
            upd = self._update(cols)[:, :, heads]
            h = heads.tolist()
            new_heads = project(parts.ln1, x.unsqueeze(2) + upd.to(x.dtype), parts.w[part][h], _pick(parts.b[part], h))
            return self._write(t, part, h, new_heads, layer)

        return fn

    def _write(self, t, part: str, heads: list[int], values: torch.Tensor, layer: int) -> torch.Tensor:
        """``t`` (this layer's q, k or v, ``[copies * B, P, heads_part, d_head]``) with the heads
        that changed replaced: a query head directly; a key/value head of a group by the value of
        the group's head that each copy carries (its first head when the group needs no split)."""
        values = values.to(t.dtype)
        new = t.clone()
        if part == "q" or t.shape[2] == self.g.n_heads:
            for i, h in enumerate(heads):
                new[:, :, h] = self._expand(values[:, :, i])
            return new
        rep = self.g.n_heads // t.shape[2]
        view = new.view(self.copies, self.rows, *t.shape[1:])
        for i, h in enumerate(heads):
            g, r = divmod(h, rep)
            if self.split[layer]:
                view[r, :, :, g] = values[:, :, i]
            elif r == 0:  # no split: the group's heads all read the same input
                view[:, :, :, g] = values[:, :, i]
        return new

    def collapse(self, layer: int):
        """``l.z`` of a split layer: each head's output from the copy that carried its keys and values."""

        def fn(t, ctx):
            if not self.split[layer]:
                return None
            view = t.view(self.copies, self.rows, *t.shape[1:])
            heads = torch.arange(t.shape[2], device=t.device)
            own = view[heads % self.copies, :, :, heads]  # [H, B, P, d_head]
            return self._expand(own.permute(1, 2, 0, 3))

        return fn

    def mlp_in(self, layer: int):
        parts = self.ev.parts[layer]
        col = layer * self.g.per_layer + 3 * self.g.n_heads

        def fn(t, ctx):
            if not bool(self.cut[:, col].any()):
                return None
            base = self.resid[f"pre{layer}" if self.g.parallel else f"mid{layer}"][: self.rows]
            new = parts.ln2(base + self._update(slice(col, col + 1))[:, :, 0].to(base.dtype))
            return self._expand(new.to(t.dtype))

        return fn

    def last(self):
        def fn(t, ctx):
            if not bool(self.cut[:, -1].any()):
                return None
            return t + self._expand(self._update(slice(-1, None))[:, :, 0].to(t.dtype))

        return fn

    def hooks(self) -> dict:
        g, out = self.g, {}
        out["embed"] = self.sender(0)
        for layer in range(g.n_layers):
            start = g.attn_start(layer)
            for part in "qkv":
                out[f"{layer}.{part}"] = self.qkv(layer, part)
            if self.split[layer]:
                out[f"{layer}.z"] = self.collapse(layer)
            out[f"{layer}.heads"] = self.sender(start)
            out[f"{layer}.attn"] = self.keep(f"mid{layer}")
            out[f"{layer}.mlp_in"] = self.mlp_in(layer)
            out[f"{layer}.mlp_out"] = self.sender(start + g.n_heads)
            out[f"{layer}.mlp"] = [self.keep(f"pre{layer + 1}")] + ([self.last()] if layer == g.n_layers - 1 else [])
        return out


def _pick(b: torch.Tensor | None, heads: list[int]) -> torch.Tensor | None:
    return None if b is None else b[heads]


class CircuitEvaluator:
    """A dataset of pairs prepared for evaluating many circuits of one model: batches of one
    token length, the ablated values (kept between circuits when they fit ``KEEP_BYTES``), the
    clean and corrupted metrics. ``metrics(in_circuit)`` evaluates one circuit (a bool
    ``[senders, receivers]`` matrix, or what :func:`~depthscope.analyses.circuits.graph.edge_matrix`
    reads) and returns each pair's metric."""

    def __init__(
        self, model, pairs, ablation: str = "counterfactual", *, metric=None, batch_tokens: int = BATCH_TOKENS
    ):
        require_decoder(model, "circuit evaluation")
        if ablation not in ABLATIONS:
            raise InputError(f"ablation must be one of {', '.join(ABLATIONS)}, got {ablation!r}")
        self.model, self.ablation = model, ablation
        self.graph: CircuitGraph = circuit_graph(model)
        self.tps, self.batches = graph_batches(model, pairs, metric, batch_tokens, "circuit evaluation")
        self.parts = [layer_parts(model, layer) for layer in range(self.graph.n_layers)]
        self.what = describe_metrics(self.tps)
        self._clean = self._corrupted = None
        self._kept: dict[int, torch.Tensor] = {}
        self._mean = self._means() if ablation == "mean" else None

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

    def _means(self) -> torch.Tensor:
        """Each sender's mean write ``[1, 1, S, d]`` over the pairs' clean prompts (positions
        averaged within a prompt, then prompts)."""
        total = None
        with torch.no_grad():
            for b in self.batches:
                run = self.model.run(b.clean, cache=sender_points(self.graph.n_layers))
                s = stack_senders(run.__getitem__, self.graph.n_layers).float().mean(1).sum(0)
                total = s if total is None else total + s
        return (total / self.n_pairs)[None, None]

    def _ablated(self, i: int, b: GraphBatch) -> torch.Tensor:
        if self.ablation == "mean":
            return self._mean
        if self.ablation == "zero":
            return torch.zeros(1, 1, len(self.graph.senders), 1, device=b.clean.device)
        if i in self._kept:
            return self._kept[i]
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
        cut_np = self.graph.mask & ~kept
        if not cut_np.any():
            return self.clean().copy()
        out = np.zeros(self.n_pairs)
        device = self.model.device
        cut = torch.as_tensor(cut_np, dtype=torch.float32, device=device)
        n_rep = self.graph.n_heads // (self.graph.n_kv_heads or self.graph.n_heads)
        for i, b in enumerate(self.batches):
            ablated = self._ablated(i, b)
            rows = b.clean.shape[0]
            patch = _Patch(self, ablated, cut, rows, n_rep)
            if not any(patch.split):
                patch = _Patch(self, ablated, cut, rows, 1)
            ids = b.clean.repeat(patch.copies, 1)
            with torch.no_grad():
                logits = self.model.run(ids, hooks=patch.hooks()).logits[:rows]
            out[b.index] = b.metric(logits).float().cpu().numpy()
        return out


def evaluate_circuit(
    model, pairs, edges, ablation: str = "counterfactual", *, metric=None, batch_tokens: int = BATCH_TOKENS
) -> pd.DataFrame:
    """Each pair's metric on its clean prompt run through the circuit ``edges`` (module docstring).

    ``edges``: a table with ``sender`` and ``receiver`` columns (rows of
    :func:`~depthscope.analyses.circuits.eap.edge_attribution`, e.g. its top rows) or a list of
    ``(sender, receiver)``; every other edge carries its sender's ablated value (``ablation``:
    ``counterfactual``, the pair's corrupted run; ``mean``; ``zero``). ``pairs`` and ``metric`` as
    in :func:`~depthscope.analyses.circuits.eap.edge_attribution`.

    Returns one row per pair: ``pair``, ``metric``, ``clean_metric`` and ``corrupted_metric`` (the
    plain runs), ``n_edges`` (edges in the circuit) and ``ablation``."""
    ev = CircuitEvaluator(model, pairs, ablation, metric=metric, batch_tokens=batch_tokens)
    kept = edge_matrix(ev.graph, edges)
    values = ev.metrics(kept)
    df = pd.DataFrame(
        {
            "pair": np.arange(ev.n_pairs),
            "metric": values,
            "clean_metric": ev.clean(),
            "corrupted_metric": ev.corrupted(),
            "n_edges": int(kept.sum()),
            "ablation": ablation,
        }
    )
    df.attrs.update(model=str(model.name), metric=ev.what, ablation=ablation, n_edges=int(kept.sum()))
    return df
