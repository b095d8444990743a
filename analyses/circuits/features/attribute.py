"""The attribution graph's edges: direct effects in the frozen replacement model, read by batched
backward passes with injected vectors (circuit-tracer's ``attribute``, reimplemented).

==============================  ==============================================================
offers                          what
==============================  ==============================================================
:func:`attribution_graph`       model, transcoders, prompt -> :class:`AttributionGraph`
:func:`attribution_graph_of`    the same from a :class:`ReplacementModel` and an
                                :class:`AttributionConfig`
:class:`AttributionConfig`      ``max_feature_nodes``, ``desired_logit_prob``, ``max_n_logits``,
                                ``batch_size``, ``update_interval``
:func:`salient_logits`          the target tokens: top logits until their probability reaches
                                ``desired_logit_prob``, at most ``max_n_logits``
==============================  ==============================================================

**Targets.** A feature's input is its pre-activation (``W_enc[:, f]`` applied to the MLP input,
``ln2`` frozen, plus ``b_enc``); a logit target's input is the logit minus the mean logit over
the vocabulary at the last position (as circuit-tracer: softmax ignores the mean, so a source
that raises every logit alike gets no credit), before any soft-capping (which is not linear).

**Edges.** ``adjacency[t, s]`` is the direct effect of source ``s`` on target ``t`` in the frozen
model: the gradient of ``t``'s input at ``s``'s write, dotted with that write (``activation *
W_dec[f]`` at ``l.mlp_out`` for a feature, the error vector for an error node, block 0's input
for a token). One forward of the frozen model (batch 1) keeps the graph; each backward injects
``batch_size`` targets' read vectors as one batch of gradients (``torch.autograd.grad(...,
is_grads_batched=True)``: an encoder column at ``l.mlp_in``, a demeaned unembedding column at
the final norm's output) and reads every row's gradient at ``embed`` and every ``l.mlp_out``.
Because MLPs are replaced by their (fixed) writes, a path never goes through another MLP: edges
are the direct effects through the residual stream and the attention heads (OV, patterns
frozen).

**Order.** The logit rows first, then features in order of their influence on the logits, as
circuit-tracer: the influence of every feature over the rows computed so far (row-normalised
``|adjacency|``, all path lengths, weighted by the logit probabilities) is recomputed every
``update_interval`` batches and the most influential features not yet visited come next, until
``max_feature_nodes`` rows (None: every active feature, in node order).

**Columns, completeness.** The columns hold every active feature (the graph's feature nodes are
all active features; those never visited are sources only, ``inputs``/``bias`` NaN), so for every
target ``inputs[t] == adjacency[t].sum() + bias[t]`` holds exactly: ``inputs`` from the clean
forward of the model itself, ``bias`` from one more frozen forward with every source zeroed (the
model's biases, the transcoders' ``b_dec`` and ``b_enc``, LayerNorm biases). The adjacency is a
``scipy.sparse`` CSR matrix of the computed rows' nonzero entries (an edge against the flow of
the model -- a later layer or position into an earlier one -- is an exact zero and not stored).

**Memory.** A row holds an edge from every active feature upstream of its target: about 12
bytes per edge while the rows are computed (values, column, the normalised copy the ranking
reads). The prompt's own state is kept small and exact: patterns as their causal triangle
(:mod:`~depthscope.analyses.circuits.features.patterns`, unpacked one layer at a time, in the
backward passes too), activations and pre-activations sparse, the last position's logits only,
feature writes rebuilt per pass in position chunks of ``CHUNK_BYTES`` when they do not fit
``WRITES_BYTES``, and nothing of the model's own (discarded) attention kept for the backward.
On the default model with random TopK transcoders (4,096 latents, k 64): 1,024 tokens with 64
feature rows (batch 8), 9.7 million edges, 4.1-4.2 GiB peak RSS with the model (7.2 GiB
before these; the same adjacency to the bit), about 1.1 of it the model and transcoders; the
rest is mostly one pass's 31 leaf gradients (0.6 GB), the packed patterns (0.5 GB) and freed
heap the allocator keeps. Edges grow with rows x upstream features, so a 1,024-token prompt
with 2,048 rows does not fit 4 GB this way; ``columns="visited"`` makes the graph small but folds only at the end.
Bounding the edges too needs the ranking on truncated rows and the kept rows recomputed on the
visited columns (not done).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp
import torch

from depthscope.analyses.circuits.features.graph import AttributionGraph
from depthscope.analyses.circuits.features.replacement import ReplacementModel, replacement_model
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar

#: the most bytes of feature writes laid out once and kept for every backward pass
WRITES_BYTES = 256 * 2**20

#: the most bytes of feature writes rebuilt at once when they are not kept
CHUNK_BYTES = 32 * 2**20

#: which features are nodes: every active one, or only those whose rows were computed (the
#: others' writes folded into their error nodes)
COLUMNS = ("all", "visited")


@dataclass(frozen=True)
class AttributionConfig:
    """How a graph is built: ``max_feature_nodes`` feature rows (None: all active features),
    logit targets up to ``desired_logit_prob`` cumulative probability and at most
    ``max_n_logits``, ``batch_size`` targets per backward pass,
    influence recomputed every ``update_interval`` batches. ``columns``: "all" (every active
    feature is a node; those never visited are sources only) or "visited" (only the visited
    features are nodes, circuit-tracer's node set; each other feature's edges are added to its
    error node's, which then stands for the error plus the features left out, so completeness
    still holds exactly)."""

    max_feature_nodes: int | None = None
    desired_logit_prob: float = 0.95
    max_n_logits: int = 10
    batch_size: int = 64
    update_interval: int = 4
    columns: str = "all"
    progress: bool = True

    def __post_init__(self):
        if self.max_feature_nodes is not None and self.max_feature_nodes < 0:
            raise InputError(f"max_feature_nodes must be >= 0, got {self.max_feature_nodes}")
        if not 0 < self.desired_logit_prob <= 1:
            raise InputError(f"desired_logit_prob must be in (0, 1], got {self.desired_logit_prob}")
        if self.columns not in COLUMNS:
            raise InputError(f"columns must be one of {COLUMNS}, got {self.columns!r}")
        for name in ("max_n_logits", "batch_size", "update_interval"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")


def attribution_graph(
    model,
    transcoders,
    prompt,
    *,
    targets=None,
    max_feature_nodes: int | None = None,
    desired_logit_prob: float = 0.95,
    max_n_logits: int = 10,
    batch_size: int = 64,
) -> AttributionGraph:
    """The attribution graph of ``prompt`` (a string or token ids) in ``model`` with
    ``transcoders`` (``{layer: SAE}`` reading ``l.mlp_in``, writing ``l.mlp_out``; missing layers
    have error nodes only). ``targets``: token ids or one-token strings to explain (default: the
    salient logits). See the module doc."""
    cfg = AttributionConfig(max_feature_nodes, desired_logit_prob, max_n_logits, batch_size)
    return attribution_graph_of(replacement_model(model, transcoders, prompt), cfg, targets=targets)


def salient_logits(probs: torch.Tensor, desired_logit_prob: float, max_n_logits: int) -> torch.Tensor:
    """The top tokens of ``probs`` ``[vocab]`` until their cumulative probability reaches
    ``desired_logit_prob``, at most ``max_n_logits`` (at least one)."""
    top_p, top = torch.topk(probs, min(max_n_logits, probs.shape[-1]))
    n = int(torch.searchsorted(torch.cumsum(top_p, 0), torch.tensor(desired_logit_prob, dtype=top_p.dtype))) + 1
    return top[: min(n, len(top))]


# ----------------------------------------------------------------------------- the pieces
@dataclass
class _Features:
    """The active features: node order (layer, position, feature), activations, each layer's
    slice, and each one's write (activation * decoder row) laid out per position for one batched
    product with the gradients (:meth:`padded`: ``[pos, most per position, d]``; ``slot[l]`` each
    feature's place there). The layouts are kept when they fit ``WRITES_BYTES`` (the default
    model, 16 tokens, k 64: 71 MB), else rebuilt from the decoder at every backward pass."""

    index: np.ndarray  # [n, 3]
    values: torch.Tensor  # [n]
    spans: dict[int, tuple[int, int]]
    positions: dict[int, torch.Tensor]  # layer -> [n_l]
    slot: dict[int, torch.Tensor]  # layer -> [n_l]
    width: dict[int, int]  # layer -> most features at one position
    rm: ReplacementModel | None = None
    kept: dict[int, torch.Tensor] | None = None

    @classmethod
    def of(cls, rm: ReplacementModel) -> _Features:
        rows, vals, start = [], [], 0
        feats = cls(np.zeros((0, 3), dtype=np.int64), torch.zeros(0), {}, {}, {}, {}, rm)
        for layer, acts in enumerate(rm.acts):
            if acts is None:
                continue
            nz = acts.indices().T  # coalesced: row-major, by position, then feature
            rows.append(torch.cat([torch.full_like(nz[:, :1], layer), nz], 1).cpu())
            vals.append(acts.values())
            feats.spans[layer] = (start, start + len(nz))
            pos = nz[:, 0]
            counts = torch.bincount(pos, minlength=rm.n_pos)
            first = torch.cumsum(counts, 0) - counts  # each position's first feature
            feats.positions[layer] = pos
            feats.slot[layer] = torch.arange(len(nz), device=pos.device) - first[pos]
            feats.width[layer] = int(counts.max()) if len(nz) else 0
            start += len(nz)
        if rows:
            feats.index = torch.cat(rows).numpy().astype(np.int64)
            feats.values = torch.cat(vals)
        size = sum(rm.n_pos * w * rm.embed.shape[-1] * rm.embed.element_size() for w in feats.width.values())
        if size <= WRITES_BYTES:
            feats.kept = {layer: feats.padded(layer) for layer in feats.spans}
        return feats

    def padded(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Layer ``layer``'s writes at positions ``lo:hi`` ``[hi - lo, width, d]`` (zeros past
        each position's features)."""
        hi = self.rm.n_pos if hi is None else hi
        if self.kept is not None and layer in self.kept:
            return self.kept[layer][lo:hi]
        rm, (a, b) = self.rm, self.spans[layer]
        pos = self.positions[layer]
        # the features at lo:hi: a contiguous run (row-major order)
        a, b = a + int(torch.searchsorted(pos, lo)), a + int(torch.searchsorted(pos, hi))
        off = a - self.spans[layer][0]
        f = torch.as_tensor(self.index[a:b, 2], device=rm.embed.device)
        out = torch.zeros(hi - lo, self.width[layer], rm.embed.shape[-1], dtype=rm.embed.dtype, device=rm.embed.device)
        at = (pos[off : off + b - a] - lo, self.slot[layer][off : off + b - a])
        out[at] = self.values[a:b, None] * rm.decoder_rows(layer, f)
        return out

    def position_chunks(self, layer: int) -> list[tuple[int, int]]:
        """Position ranges whose rebuilt writes take at most ``CHUNK_BYTES`` (one range when kept)."""
        n = self.rm.n_pos
        if self.kept is not None:
            return [(0, n)]
        per_pos = max(1, self.width[layer] * self.rm.embed.shape[-1] * self.rm.embed.element_size())
        step = max(1, CHUNK_BYTES // per_pos)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def __len__(self) -> int:
        return len(self.index)


class _Rows:
    """Target rows from backward passes through one kept forward of the frozen model (batch 1):
    each backward is batched over its targets (``is_grads_batched``: one vectorised backward with
    a batch of injected vectors, as many rows as targets, the forward never copied)."""

    def __init__(self, rm: ReplacementModel, feats: _Features):
        self.rm, self.feats = rm, feats
        L, n = rm.n_layers, rm.n_pos
        self.n_cols = len(feats) + L * n + n
        src = rm.clean_sources(1)
        self.leaves = [src.embed.requires_grad_(True)] + [m.requires_grad_(True) for m in src.mlp_out]
        with torch.enable_grad():
            self.out = rm.run(src)
        self.backwards = 0

    def compute(self, reads: list[tuple[int, int, torch.Tensor]]) -> np.ndarray:
        """Rows ``[len(reads), n_cols]`` for targets given as ``(layer, position, read vector)``:
        ``layer`` L for a logit (read at the final norm's output), else the feature's layer (read
        at that layer's transcoder input)."""
        L = self.rm.n_layers
        outs = {}
        for b, (layer, pos, vec) in enumerate(reads):
            if layer not in outs:
                outs[layer] = torch.zeros(len(reads), *self.out.final.shape, dtype=vec.dtype, device=vec.device)
            outs[layer][b, 0, pos] = vec
        tensors = [self.out.final if layer == L else self.out.mlp_in[layer] for layer in outs]
        grads = torch.autograd.grad(
            tensors, self.leaves, list(outs.values()), retain_graph=True, allow_unused=True, is_grads_batched=True
        )
        self.backwards += 1
        grads = [None if g is None else g[:, 0] for g in grads]
        return self._contract(grads, len(reads)).cpu().numpy()

    def _contract(self, grads, batch: int) -> torch.Tensor:
        """Each source's write dotted with its gradient: ``[batch, n_cols]``."""
        rm, feats, L, n = self.rm, self.feats, self.rm.n_layers, self.rm.n_pos
        # float32 rows for half-precision models (numpy has no bfloat16; sums of many edges)
        dt = torch.float64 if rm.embed.dtype == torch.float64 else torch.float32
        rows = torch.zeros(batch, self.n_cols, dtype=dt, device=rm.embed.device)
        grads = [None if g is None else g.to(dt) for g in grads]
        g_embed, g_mlp = grads[0], grads[1:]
        base = len(feats)
        for layer in range(L):
            g = g_mlp[layer]
            if g is None:
                continue
            if layer in feats.spans:
                a, b = feats.spans[layer]
                pos, slot = feats.positions[layer], feats.slot[layer]
                for lo, hi in feats.position_chunks(layer):
                    padded = feats.padded(layer, lo, hi).to(dt)
                    per_pos = torch.bmm(g[:, lo:hi].transpose(0, 1), padded.transpose(1, 2))  # [pos, batch, k_max]
                    i, j = int(torch.searchsorted(pos, lo)), int(torch.searchsorted(pos, hi))
                    rows[:, a + i : a + j] = per_pos[pos[i:j] - lo, :, slot[i:j]].T
            rows[:, base + layer * n : base + (layer + 1) * n] = torch.einsum("bpd,pd->bp", g, rm.errors[layer].to(dt))
        if g_embed is not None:
            rows[:, base + L * n :] = torch.einsum("bpd,pd->bp", g_embed, rm.embed.to(dt))
        return rows


class _Stored:
    """The rows computed so far: CSR blocks (float32 values -- float64 for a float64 model --,
    int32 columns) with their target nodes, and each block's row-normalised ``|values|`` sharing
    its column indices (what the influence ranking multiplies by; no stacked copy is made)."""

    def __init__(self, n_nodes: int, dtype=np.float32):
        self.n_nodes, self.dtype = n_nodes, dtype
        self.blocks: list[sp.csr_matrix] = []
        self.normed: list[sp.csr_matrix] = []
        self.nodes: list[np.ndarray] = []

    def add(self, nodes: np.ndarray, dense: np.ndarray) -> None:
        block = sp.csr_matrix(dense.astype(self.dtype, copy=False))
        block.resize(block.shape[0], self.n_nodes)  # the logit columns: always empty
        sums = np.add.reduceat(np.abs(block.data), block.indptr[:-1]) if block.nnz else np.zeros(0)
        sums = np.where(np.diff(block.indptr) > 0, sums if len(sums) else 0, 1.0)
        scale = np.repeat(1 / np.maximum(sums, 1e-8), np.diff(block.indptr)).astype(np.float32)
        normed = sp.csr_matrix(
            ((np.abs(block.data) * scale).astype(np.float32), block.indices, block.indptr), shape=block.shape
        )
        self.blocks.append(block)
        self.normed.append(normed)
        self.nodes.append(np.asarray(nodes))

    def influence(self, logit_p: np.ndarray) -> np.ndarray:
        """Each node's influence on the logits through the rows so far: the logit probabilities
        pushed back through the row-normalised ``|adjacency|`` over all path lengths (the logit
        rows come first), until the paths left carry less than 1e-9 of what was found."""
        row_nodes = np.concatenate(self.nodes)
        row_of = np.full(self.n_nodes, -1)
        row_of[row_nodes] = np.arange(len(row_nodes))
        has = row_of >= 0
        starts = np.cumsum([0] + [b.shape[0] for b in self.normed])
        prod = np.zeros(len(row_nodes))
        prod[: len(logit_p)] = logit_p
        influence = np.zeros(self.n_nodes)
        for _ in range(len(row_nodes) + 1):  # a DAG: no path is longer than the number of rows
            v = sum(m.T @ prod[a:b] for m, a, b in zip(self.normed, starts[:-1], starts[1:]))
            if v.sum() <= 1e-9 * influence.sum():  # what is left cannot change the ranking
                break
            influence += v
            prod = np.zeros(len(row_nodes))
            prod[row_of[has]] = v[has]
        return influence

    def assemble(self) -> sp.csr_matrix:
        """The rows at their targets' node indices, ``[n_nodes, n_nodes]`` CSR; the blocks are
        released on the way (at most two copies of the values at once)."""
        self.normed.clear()
        row_nodes = np.concatenate(self.nodes)
        stacked = sp.vstack(self.blocks, format="csr")
        self.blocks.clear()
        order = np.argsort(row_nodes, kind="stable")
        rows = stacked[order]
        del stacked
        counts = np.zeros(self.n_nodes, dtype=np.int64)
        counts[row_nodes[order]] = np.diff(rows.indptr)
        indptr = np.concatenate([[0], np.cumsum(counts)])
        return sp.csr_matrix((rows.data, rows.indices, indptr), shape=(self.n_nodes, self.n_nodes))


def _logit_targets(rm: ReplacementModel, cfg: AttributionConfig, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Target token ids and their probabilities at the last position."""
    probs = torch.softmax(rm.logits.float(), -1)
    if targets is None:
        ids = salient_logits(probs, cfg.desired_logit_prob, cfg.max_n_logits)
    else:
        targets = [targets] if isinstance(targets, (str, int)) else list(targets)
        if not targets:
            raise InputError("targets: name at least one token (or leave it None for the salient logits)")
        ids = torch.tensor([rm.model.token_id(t, "target") for t in targets], device=probs.device)
    return ids, probs[ids]


def _logit_reads(rm: ReplacementModel, ids: torch.Tensor) -> torch.Tensor:
    """``[n, d]``: the unembedding columns minus their vocabulary mean (times any logit scale)."""
    un = rm.model.unembed
    W = un.W_U.detach()
    reads = W[:, ids].T - W.mean(1)
    return reads * un.logit_scale if un.logit_scale is not None else reads


# ----------------------------------------------------------------------------- the graph
def attribution_graph_of(
    rm: ReplacementModel, config: AttributionConfig | None = None, *, targets=None
) -> AttributionGraph:
    """The attribution graph of a replacement model (see the module doc)."""
    cfg = config or AttributionConfig()
    t0 = time.perf_counter()
    feats = _Features.of(rm)
    L, n, nf = rm.n_layers, rm.n_pos, len(feats)
    logit_ids, logit_p = _logit_targets(rm, cfg, targets)
    n_logits = len(logit_ids)
    n_cols = nf + L * n + n
    n_nodes = n_cols + n_logits
    logit_nodes = np.arange(n_cols, n_nodes)
    rows = _Rows(rm, feats)
    reads = _logit_reads(rm, logit_ids)
    store = _Stored(n_nodes, np.float64 if rm.embed.dtype == torch.float64 else np.float32)
    B = cfg.batch_size
    for i in range(0, n_logits, B):
        store.add(logit_nodes[i : i + B], rows.compute([(L, n - 1, reads[j]) for j in range(i, min(i + B, n_logits))]))
    visited = _visit_features(rm, feats, rows, store, cfg, logit_p.detach().double().cpu().numpy())
    n_backward = rows.backwards
    del rows  # the kept forward's graph
    adjacency = store.assemble()
    inputs, bias = _inputs_and_bias(rm, feats, visited, logit_ids, n_cols)
    index, acts = feats.index, feats.values.detach().float().cpu().numpy()
    if cfg.columns == "visited":
        adjacency, keep = _fold_unvisited(adjacency, feats.index, visited, L, n)
        inputs, bias, index, acts = inputs[keep], bias[keep], index[visited], acts[visited]
    settings = {
        **{k: v for k, v in asdict(cfg).items() if k != "progress"},
        "n_active_features": nf,
        "n_feature_rows": int(visited.sum()),
        "n_backward_passes": n_backward,
        "seconds": round(time.perf_counter() - t0, 3),
        "transcoders": {str(layer): repr(sae) for layer, sae in rm.transcoders.items()},
        "token_node": "block 0's input at the position (token + learned position embedding in GPT-2)",
        "logit_target": "logit minus the vocabulary's mean logit, last position, before soft-capping",
    }
    tok = rm.model.tokenizer
    ids = rm.ids[0].tolist()
    return AttributionGraph(
        prompt=tok.decode(ids) if tok is not None else "",
        tokens=ids,
        token_strings=[tok.decode([i]) for i in ids] if tok is not None else [str(i) for i in ids],
        n_layers=L,
        features=index,
        activations=acts,
        logit_tokens=logit_ids.tolist(),
        logit_strings=[tok.decode([i]) for i in logit_ids.tolist()] if tok is not None else [],
        logit_probabilities=logit_p.detach().float().cpu().numpy(),
        adjacency=adjacency,
        inputs=inputs,
        bias=bias,
        model_name=str(rm.model.name),
        settings=settings,
    )


def _visit_features(rm, feats: _Features, rows: _Rows, store: _Stored, cfg: AttributionConfig, logit_p) -> np.ndarray:
    """Feature rows in order of influence (every feature, in node order, when all are asked
    for), ``batch_size`` per backward; which features were visited."""
    nf, B = len(feats), cfg.batch_size
    limit = nf if cfg.max_feature_nodes is None else min(cfg.max_feature_nodes, nf)
    visited = np.zeros(nf, dtype=bool)
    with progress_bar(limit, desc="attribution: feature rows", unit="row", enabled=cfg.progress) as bar:
        while visited.sum() < limit:
            if limit == nf:
                pending = np.arange(nf)
            else:
                influence = store.influence(logit_p)[:nf]
                rank = np.argsort(-influence, kind="stable")
                pending = rank[~visited[rank]][: min(cfg.update_interval * B, limit - int(visited.sum()))]
            for i in range(0, len(pending), B):
                chunk = pending[i : i + B]
                store.add(chunk, rows.compute([_feature_read(rm, feats, j) for j in chunk]))
                visited[chunk] = True
                bar.update(len(chunk))
    return visited


def _feature_read(rm: ReplacementModel, feats: _Features, j: int) -> tuple[int, int, torch.Tensor]:
    layer, pos, f = (int(x) for x in feats.index[j])
    return layer, pos, rm.transcoders[layer].W_enc[:, f]


def _fold_unvisited(A: sp.csr_matrix, index: np.ndarray, visited: np.ndarray, L: int, n: int):
    """``columns="visited"``: the nodes without the unvisited features, each one's column added
    to its error node's (layer, position). Returns the new adjacency and the old indices kept."""
    nf, n_nodes = len(visited), A.shape[0]
    keep = np.concatenate([np.flatnonzero(visited), np.arange(nf, n_nodes)])
    new_of = np.full(n_nodes, -1)
    new_of[keep] = np.arange(len(keep))
    n_kept = int(visited.sum())
    gone = np.flatnonzero(~visited)
    new_of[gone] = n_kept + index[gone, 0] * n + index[gone, 1]  # its error node, in the new order
    M = sp.csr_matrix((np.ones(n_nodes, dtype=A.dtype), (np.arange(n_nodes), new_of)), shape=(n_nodes, len(keep)))
    return (A[keep] @ M).tocsr(), keep


def _inputs_and_bias(rm, feats: _Features, visited: np.ndarray, logit_ids: torch.Tensor, n_cols: int):
    """Each target's input (from the clean forward of the model itself) and its bias (the
    frozen model with every source zeroed: one more forward); NaN for sources only."""
    n_nodes = n_cols + len(logit_ids)
    inputs = np.full(n_nodes, np.nan)
    bias = np.full(n_nodes, np.nan)
    with torch.no_grad():
        zero = rm.run(rm.bias_sources(1))
        for layer, (a, b) in feats.spans.items():
            sel = np.flatnonzero(visited[a:b]) + a
            if not len(sel):
                continue
            pos = torch.as_tensor(feats.index[sel, 1], device=rm.ids.device)
            f = torch.as_tensor(feats.index[sel, 2], device=rm.ids.device)
            at = torch.as_tensor(sel - a, device=rm.ids.device)  # rm.pre's entries are the span's, in order
            inputs[sel] = rm.pre[layer].values()[at].double().cpu().numpy()
            pre0 = rm.transcoders[layer].pre_activations(zero.mlp_in[layer][0])
            bias[sel] = pre0[pos, f].double().cpu().numpy()
        clean = rm.pre_logits.double()
        inputs[n_cols:] = (clean[logit_ids] - clean.mean()).cpu().numpy()
        z = rm.logits_of(zero.final[0, -1]).double()
        bias[n_cols:] = (z[logit_ids] - z.mean()).cpu().numpy()
    return inputs, bias
