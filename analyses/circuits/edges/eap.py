"""Edge attribution patching: every edge of the graph scored at once (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024).

=====================  =========================================================================
offers                 what
=====================  =========================================================================
edge_attribution       one row per real edge: ``sender``, ``receiver``, ``score`` (mean over
                       pairs), ``n_pairs``; per-pair rows on request
EdgeScores             the scores as numbers: the graph, ``[pairs, edges]`` per-pair scores, each
                       pair's clean and corrupted metric (what faithfulness and stability use)
score_edges            the EdgeScores of a dataset
METHODS                ``eap``, ``eap-ig``
=====================  =========================================================================

The convention is MIB's counterfactual one. For a pair with metric ``m`` (by default
``logit[target] - logit[foil]`` at the last position):

    score(u -> v) = sum over positions of (a_u(corrupted) - a_u(clean)) . dm/dx_v

with ``a_u`` the sender's write (:mod:`depthscope.analyses.circuits.edges.graph`) and ``x_v`` the
receiver's input (the residual stream it reads, before its norm), the gradient taken on the clean
run: a first-order estimate of ``m`` with that one edge carrying the corrupted value, minus
``m(clean)``. **EAP-IG** (inputs) replaces the clean gradient by its mean over ``steps`` runs whose
input embeddings lie on the line from the corrupted to the clean ones,
``e(corrupted) + (k / steps) (e(clean) - e(corrupted))`` for ``k = 0 .. steps - 1`` (the EAP-IG
code's points). Scores are means over pairs.

**Under mean or zero ablation** (``ablation``) the difference scored is the one the evaluation
puts in, ``a_u(ablated) - a_u(clean)`` with ``a_u(ablated)`` the sender's mean write over other
prompts or zero, as EAP-IG's ``intervention='mean-positional'|'zero'`` does for EAP
(:mod:`~depthscope.analyses.circuits.edges.ablation`: the mean's prompts, per position, position 0
kept clean under mean ablation; ``embed`` is the token embedding alone, so on GPT-2 the position
embedding is never ablated). EAP-IG's own code allows only counterfactual inputs for EAP-IG
(inputs); here its path runs from the ablated input embeddings to the clean ones instead.

How. The scores of a batch are one ``[senders, receivers]`` matrix per pair, masked to the real
edges (as the EAP-IG code keeps them): per layer one batched product of the senders' activation
differences ``[B, senders, P * d]`` with the receivers' input gradients ``[B, P * d, receivers]``.
A receiver's input gradient is its projection's gradient pulled back through its own weights and
the model's own norm module: ``dm/dx_{q,h} = J_LN1(x)^T W_Q^h^T dm/dq_h`` (all query heads' in one
product, the norm's Jacobian by autograd on the norm applied to one copy of ``x`` per receiver),
``dm/dx_mlp`` through ``LN2``, and the logits' receiver is the gradient of the final stream. With
grouped key/value heads a query head's key and value inputs are receivers of their own (MIB's
count): their gradients come from the attention's backward with the output gradient of only one
head of each group at a time (``n_heads / n_kv_heads`` small backward passes per layer).

Cost per batch: EAP is two forwards (corrupted without gradient, clean with it) and one backward;
EAP-IG is two forwards without gradient and ``steps`` forwards and backwards. Memory per token of
a batch: the senders' differences and the receivers' gradients, ``(senders + receivers) x
d_model`` floats (SmolLM2-135M: 2.6 MB a token), so ``batch_tokens`` bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.circuits import memory
from depthscope.analyses.circuits.edges.ablation import ablated_writes, ablation_kind, ablation_start, sender_means
from depthscope.analyses.circuits.edges.graph import CircuitGraph, circuit_graph
from depthscope.analyses.circuits.edges.runs import (
    GraphBatch,
    LayerParts,
    first_difference,
    graph_batches,
    layer_parts,
    stack_senders,
)
from depthscope.analyses.circuits.prompts import describe_metrics
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.common.settings import check_number
from depthscope.hooks.model_checks import require_decoder

__all__ = ["edge_attribution", "score_edges", "EdgeScores", "METHODS", "MAX_STEPS"]

METHODS = ("eap", "eap-ig")
MAX_STEPS = 1000
#: tokens per batch by default: the differences and gradients take (senders + receivers) x d_model floats a token
BATCH_TOKENS = 256


@dataclass(frozen=True)
class EdgeScores:
    """The scores of a dataset: ``per_pair`` ``[pairs, edges]`` (edges in ``graph.edge_index``
    order), each pair's ``clean`` and ``corrupted`` metric, the method, steps and metric, the
    ablation whose differences they score and (mean ablation) the prompts the mean came from."""

    graph: CircuitGraph
    per_pair: np.ndarray
    clean: np.ndarray
    corrupted: np.ndarray
    method: str
    steps: int
    metric: str
    ablation: str = "counterfactual"
    mean_source: str | None = None

    @property
    def mean(self) -> np.ndarray:
        """The mean score of each edge over pairs."""
        return self.per_pair.mean(axis=0)

    def matrix(self, values: np.ndarray | None = None) -> np.ndarray:
        """``values`` per edge (default: the means) as a ``[senders, receivers]`` matrix (0 off the edges)."""
        out = np.zeros(self.graph.mask.shape, dtype=np.float64)
        s, r = self.graph.edge_index
        out[s, r] = self.mean if values is None else values
        return out


# ----------------------------------------------------------------------------- gradients
class _Grab:
    """A hook that hands a tensor back as a clone and keeps the clone: the model goes on with the
    clone, so autograd can differentiate with respect to it (a cached view is no tensor the model uses)."""

    def __init__(self):
        self.kept: dict[str, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor, ctx) -> torch.Tensor:
        c = t.clone()
        self.kept[str(ctx)] = c
        return c


def _hooks(n_layers: int, grouped: bool, grab: _Grab, embed: torch.Tensor | None) -> dict:
    """Clones of the keys and values of grouped-query layers (to split their gradients per query
    head), and the input embeddings replaced by ``embed`` (a leaf that requires grad)."""
    hooks = {f"{layer}.{p}": grab for layer in range(n_layers) for p in "kv"} if grouped else {}
    if embed is not None:
        hooks["embed"] = lambda t, ctx: embed.detach().to(t.dtype).requires_grad_(True)
    return hooks


def _split_groups(run, grab: _Grab, layer: int, n_rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dm/dk and dm/dv per *query* head ``[B, P, heads, d_head]`` of a grouped-query layer: the
    attention's backward from its output ``l.z`` with the gradient of one head per group at a time."""
    k, v = grab.kept[f"{layer}.k"], grab.kept[f"{layer}.v"]
    z, grad_z = run[f"{layer}.z"], run.grad(f"{layer}.z")
    heads = grad_z.shape[2]
    out_k = torch.empty(*k.shape[:2], heads, k.shape[-1], dtype=k.dtype, device=k.device)
    out_v = torch.empty_like(out_k)
    for r in range(n_rep):
        keep = torch.zeros(heads, dtype=grad_z.dtype, device=grad_z.device)
        keep[r::n_rep] = 1
        gk, gv = torch.autograd.grad(z, [k, v], grad_z * keep[:, None], retain_graph=True)
        out_k[:, :, r::n_rep], out_v[:, :, r::n_rep] = gk, gv
    return out_k, out_v


def _pull_back(norm, x: torch.Tensor, cot: torch.Tensor) -> torch.Tensor:
    """``J_norm(x)^T cot[:, :, r]`` for every receiver ``r``: ``x`` ``[B, P, d]``, ``cot``
    ``[B, P, R, d]`` -> ``[B, P, R, d]``, by autograd through the model's own norm module (one
    vector-Jacobian product mapped over the receivers)."""
    x = x.detach()
    with torch.enable_grad():
        _, vjp = torch.func.vjp(norm, x)
        try:
            return torch.func.vmap(vjp, in_dims=2, out_dims=2)(cot.to(x.dtype))[0]
        except RuntimeError:  # a norm module vmap cannot map: one copy of x per receiver instead
            xs = x[:, :, None, :].expand(cot.shape).clone().requires_grad_(True)
            return torch.autograd.grad(norm(xs), xs, cot.to(xs.dtype))[0]


def _layer_grads(parts: LayerParts, g_qkv, g_mlp, resid_pre, mlp_base) -> torch.Tensor:
    """One layer's receiver input gradients ``[B, P, 3H + 1, d]`` from the gradients at its
    projections (``g_qkv`` ``[B, P, 3H, d_head]``: every query head's q, then k, then v) and at its
    MLP's normed input."""
    cot = torch.einsum("bphe,hed->bphd", g_qkv, parts.w_qkv.to(g_qkv.dtype))
    attn = _pull_back(parts.ln1, resid_pre, cot)
    mlp = _pull_back(parts.ln2, mlp_base, g_mlp[:, :, None, :])
    return torch.cat([attn, mlp], dim=2).float()


def _receiver_grads(model, graph: CircuitGraph, parts, batch: GraphBatch, start: int, embed=None):
    """The metric's gradient at every receiver's input on the clean ids (input embeddings
    replaced by ``embed`` when given), at positions ``start:``: per layer ``[B, P', 3H + 1, d]``
    and the logits' ``[B, P', d]``; also the senders' writes ``[B, P', S, d]`` and the metric ``[B]``."""
    L = graph.n_layers
    n_rep = graph.n_heads // (graph.n_kv_heads or graph.n_heads)
    grab = _Grab()
    inner = ("q", "k", "v", "z", "attn", "mlp_in", "mlp_out", "mlp")
    names = ["embed"] + [f"{layer}.{k}" for layer in range(L) for k in inner]
    run = model.run(batch.clean, hooks=_hooks(L, n_rep > 1, grab, embed), cache=names, grad=True)
    values = batch.metric(run.logits)
    values.sum().backward(retain_graph=n_rep > 1)
    out = []
    for layer in range(L):
        if n_rep > 1:
            g = [run.grad(f"{layer}.q"), *_split_groups(run, grab, layer, n_rep)]
        else:
            g = [run.grad(f"{layer}.{p}") for p in "qkv"]
        resid_pre = run["embed"] if layer == 0 else run[f"{layer - 1}.mlp"]
        mlp_base = resid_pre if graph.parallel else run[f"{layer}.attn"]
        g_qkv = torch.cat([x[:, start:] for x in g], dim=2)
        g_mlp = run.grad(f"{layer}.mlp_in")[:, start:]
        out.append(_layer_grads(parts[layer], g_qkv, g_mlp, resid_pre[:, start:], mlp_base[:, start:]))
    with torch.no_grad():
        senders = _senders(run, parts, L, start)
    return out, run.grad(f"{L - 1}.mlp")[:, start:].float(), senders, values.detach().float()


def _senders(run, parts, n_layers: int, start: int) -> torch.Tensor:
    """The senders' writes ``[B, P', S, d]`` at positions ``start:`` of a run that cached
    ``embed``, ``l.z`` and ``l.mlp_out`` (each head's write computed there only)."""
    return stack_senders(
        lambda n: run[n][:, start:].detach(),
        n_layers,
        lambda layer: parts[layer].head_writes(run[f"{layer}.z"][:, start:].detach()),
    )


#: what a run caches for the senders' writes (heads' writes computed from l.z where needed)
def _sender_cache(n_layers: int) -> list[str]:
    return ["embed"] + [f"{layer}.{k}" for layer in range(n_layers) for k in ("z", "mlp_out")]


# ----------------------------------------------------------------------------- one batch
def _contract(graph: CircuitGraph, delta: torch.Tensor, layer_grads: list, logits_grad: torch.Tensor) -> np.ndarray:
    """Per-pair scores ``[B, edges]``: ``sum_p delta[b, p, s] . grad[b, p, r]`` for every real edge."""
    B, P, S, d = delta.shape
    diff = delta.permute(0, 2, 1, 3).reshape(B, S, P * d)
    full = torch.zeros(B, S, len(graph.receivers), dtype=torch.float32, device=delta.device)
    for layer, g in enumerate(layer_grads):  # g [B, P, 3H + 1, d]
        n = graph.upstream(layer * graph.per_layer + 3 * graph.n_heads)  # the senders reaching its MLP: all it needs
        grad = g.permute(0, 2, 1, 3).reshape(B, g.shape[2], P * d)
        full[:, :n, graph.layer_receivers(layer)] = torch.bmm(diff[:, :n], grad.transpose(1, 2))
    full[:, :, -1] = torch.bmm(diff, logits_grad.reshape(B, P * d, 1))[:, :, 0]
    s, r = graph.edge_index
    return full[:, torch.as_tensor(s, device=full.device), torch.as_tensor(r, device=full.device)].cpu().numpy()


def _batch_scores(model, graph, parts, batch: GraphBatch, method: str, steps: int, abl, tick=lambda n: None):
    """(per-pair scores ``[B, edges]``, clean metrics, corrupted metrics) of one batch under the
    ablation ``abl`` (kind, means); ``tick(1)`` after each backward pass (EAP: one; EAP-IG: ``steps``)."""
    L = graph.n_layers
    kind, means = abl
    P = batch.clean.shape[1]
    start = first_difference(batch) if kind == "counterfactual" else ablation_start(kind)
    with torch.no_grad():
        corr = model.run(batch.corrupted, cache=_sender_cache(L))
        corrupted_values = batch.metric(corr.logits).float()
    if start is None or start >= P:  # no sender's value differs anywhere: no edge changes anything
        with torch.no_grad():
            clean_values = batch.metric(model.run(batch.clean).logits).float()
        zeros = np.zeros((len(batch.pairs), graph.n_edges), dtype=np.float32)
        tick(1 if method == "eap" else steps)
        return zeros, clean_values.cpu().numpy(), corrupted_values.cpu().numpy()
    with torch.no_grad():
        if kind == "counterfactual":
            a_abl = _senders(corr, parts, L, start)
        else:  # the values the evaluation puts in: the means (position 0 kept clean) or zero
            a_abl = ablated_writes(model, len(graph.senders), P, means, batch.clean.device)[:, start:]
    if method == "eap":
        grads, logits_grad, a_clean, clean_values = _receiver_grads(model, graph, parts, batch, start)
        tick(1)
    else:
        with torch.no_grad():
            clean = model.run(batch.clean, cache=_sender_cache(L))
            clean_values = batch.metric(clean.logits).float()
            a_clean = _senders(clean, parts, L, start)
        e_clean = clean["embed"]
        if kind == "counterfactual":
            e_abl = corr["embed"]
        else:  # the path starts at the ablated input embeddings
            e_abl = e_clean.clone()
            e_abl[:, start:] = a_abl[:, :, 0].to(e_clean.dtype)
        grads, logits_grad = None, None
        for k in range(steps):
            point = e_abl + (k / steps) * (e_clean - e_abl)
            g, gl, _, _ = _receiver_grads(model, graph, parts, batch, start, point)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            logits_grad = gl if logits_grad is None else logits_grad + gl
            tick(1)
        grads, logits_grad = [g / steps for g in grads], logits_grad / steps
    scores = _contract(graph, a_abl - a_clean, grads, logits_grad)
    return scores, clean_values.cpu().numpy(), corrupted_values.cpu().numpy()


# ----------------------------------------------------------------------------- public API
def score_edges(
    model,
    pairs,
    method: str = "eap",
    steps: int = 5,
    *,
    ablation="counterfactual",
    metric=None,
    batch_tokens: int = BATCH_TOKENS,
):
    """The :class:`EdgeScores` of a dataset of pairs (arguments as :func:`edge_attribution`)."""
    require_decoder(model, "edge attribution")
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    check_number("steps", steps, maximum=MAX_STEPS)
    kind, means = ablation_kind(ablation)
    graph = circuit_graph(model)
    tps, batches = graph_batches(model, pairs, metric, batch_tokens, "edge attribution")
    if kind == "mean" and means is None:  # "mean" alone: the scored pairs' own mean
        means = sender_means(model, pairs, source="the scored pairs", batch_tokens=batch_tokens)
    _check_memory(model, batches, method)
    parts = [layer_parts(model, layer) for layer in range(graph.n_layers)]
    n = len(tps)
    per_pair = np.zeros((n, graph.n_edges), dtype=np.float32)
    clean, corrupted = np.zeros(n), np.zeros(n)
    # the bar counts backward passes (EAP-IG: one per step), so a long pair's bar moves within it
    passes = int(steps) if method == "eap-ig" else 1
    with progress_bar(len(batches) * passes, desc=f"edge attribution ({method}, {n} pairs)", unit="pass") as bar:
        for batch in batches:
            scores, c, k = _batch_scores(model, graph, parts, batch, method, int(steps), (kind, means), bar.update)
            idx = batch.index
            per_pair[idx], clean[idx], corrupted[idx] = scores, c, k
    return EdgeScores(
        graph,
        per_pair,
        clean,
        corrupted,
        method,
        int(steps) if method == "eap-ig" else 0,
        describe_metrics(tps),
        kind,
        None if means is None else means.source,
    )


def _check_memory(model, batches: list[GraphBatch], method: str) -> None:
    """Before any forward: the batch that needs the most memory
    (:func:`~depthscope.analyses.circuits.memory.eap_bytes`) fits in the memory free, else a
    :class:`~depthscope.analyses.circuits.memory.WorkTooLarge` naming it and what helps."""
    sized = []
    for b in batches:
        rows, n = b.clean.shape
        start = first_difference(b)
        terms = memory.eap_bytes(model, rows, n, 0 if start is None else n - start, method=method)
        sized.append((sum(terms.values()), rows, n, terms))
    if not sized:
        return
    _, rows, n, terms = max(sized, key=lambda x: x[0])
    knobs = ["shorter pairs (memory grows with the tokens from the first one where clean and corrupted differ)"]
    if rows > 1:
        knobs.insert(0, f"a smaller --batch-tokens (batch_tokens=; this batch holds {rows} pairs)")
    what = f"edge attribution ({method}) of {rows} pair{'s' if rows > 1 else ''} of {n:,} tokens"
    memory.check_room(terms, model.device, what, knobs)


def edge_attribution(
    model,
    pairs,
    method: str = "eap",
    steps: int = 5,
    *,
    ablation="counterfactual",
    metric=None,
    per_pair: bool = False,
    batch_tokens: int = BATCH_TOKENS,
) -> pd.DataFrame:
    """Every edge of the model's graph (:func:`~depthscope.analyses.circuits.edges.graph.circuit_graph`)
    scored over a dataset of prompt pairs by EAP or EAP-IG (module docstring).

    ``pairs``: what :func:`~depthscope.analyses.circuits.pairs.as_pairs` accepts (PromptPairs, dicts,
    a ``.jsonl`` path); each pair's clean and corrupted prompts must have the same number of tokens
    (a pair that does not is refused, named); each pair's ``target`` and ``foil`` make its metric,
    ``metric`` serves pairs without a target. ``steps``: EAP-IG's interpolation points.
    ``ablation``: what the scored differences replace the clean writes by (module docstring):
    ``counterfactual`` (the corrupted prompt's writes), a
    :class:`~depthscope.analyses.circuits.edges.ablation.SenderMeans` of other pairs (mean
    ablation; ``"mean"`` takes the scored pairs' own), or ``zero``; score with the ablation the
    circuit will be evaluated under.
    ``batch_tokens`` bounds the tokens of one batch (memory: module docstring).

    Returns one row per real edge, sender by sender in forward order: ``sender``, ``receiver``,
    ``score`` (mean over pairs: the estimated change of the metric when that edge alone carries
    its ablated value, so an edge that supports the target scores negative, the opposite of MIB's
    sign; the ``embed`` sender is the token embedding, the position embedding of GPT-2 never
    ablated), ``n_pairs``, the sender's site columns (the residual site it
    writes to) and ``head``, and ``receiver_layer``, ``receiver_kind``, ``receiver_head``; with
    ``per_pair`` one row per pair and edge (a ``pair`` column; ``score`` that pair's). ``attrs``:
    model, method, steps, metric, ablation, mean_source, n_pairs, n_edges, clean_metric and
    corrupted_metric (means)."""
    es = score_edges(model, pairs, method, steps, ablation=ablation, metric=metric, batch_tokens=batch_tokens)
    return edge_frame(es, model.name, per_pair=per_pair)


def edge_frame(es: EdgeScores, model_name: str, *, per_pair: bool = False) -> pd.DataFrame:
    """The table of :func:`edge_attribution` from its :class:`EdgeScores`."""
    edges = es.graph.edge_table()
    n = es.per_pair.shape[0]
    if per_pair:
        df = pd.concat([edges] * n, ignore_index=True)
        df.insert(0, "pair", np.repeat(np.arange(n), len(edges)))
        df.insert(3, "score", es.per_pair.reshape(-1).astype(np.float64))
    else:
        df = edges
        df.insert(2, "score", es.mean.astype(np.float64))
    df.insert(df.columns.get_loc("score") + 1, "n_pairs", n)
    df.attrs.update(
        model=str(model_name),
        method=es.method,
        steps=es.steps,
        metric=es.metric,
        ablation=es.ablation,
        mean_source=es.mean_source,
        n_pairs=n,
        n_edges=es.graph.n_edges,
        n_layers=es.graph.n_layers,
        n_heads=es.graph.n_heads,
        clean_metric=float(es.clean.mean()),
        corrupted_metric=float(es.corrupted.mean()),
    )
    return df
