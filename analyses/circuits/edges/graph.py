"""The computational graph of a decoder as MIB and the EAP-IG code draw it: senders, receivers, real edges.

=====================  =========================================================================
offers                 what
=====================  =========================================================================
CircuitGraph           the senders, the receivers and the mask of real edges of one model shape
circuit_graph          the graph of a HookedModel, or of a transformers config (no weights needed)
edge_matrix            an in-circuit matrix ``[senders, receivers]`` from an edge table or a list
                       of ``(sender, receiver)``
prune_circuit          MIB's pruning: drop the edges of nodes with no incoming or no outgoing edge
mib_name, mib_graph    the names and the JSON of EAP-IG's ``Graph`` (``Graph.from_json`` reads it)
=====================  =========================================================================

Senders (what writes into the residual stream), in forward order: ``embed`` (the input of block
0), each head's write ``<l>.heads.<h>`` (its term of the attention output projection, without the
projection's bias, which is the same in every run), each MLP's write ``<l>.mlp_out``. Receivers
(what reads from it): the query, key and value inputs of every query head ``<l>.q.<h>``,
``<l>.k.<h>``, ``<l>.v.<h>`` (with grouped key/value heads each query head's key and value
inputs are receivers of their own, as MIB counts them), each MLP's input ``<l>.mlp_in`` and
``logits`` (the stream the final norm reads). A receiver's *input* is the residual stream it
reads before its norm; the residual stream is the sum of the senders' writes (and constant
biases), so every sender reaches every receiver downstream of it directly: a head of layer l
reaches the receivers of layers > l, the MLP of layer l and the logits; an MLP reaches layers > l
and the logits. In parallel-attention families (GPT-NeoX, GPT-J) the MLP of layer l reads the
same stream as the attention of layer l, so it receives no edge from that layer's heads. With
``L`` layers and ``H`` heads there are ``1 + L (H + 1)`` senders and ``L (3H + 1) + 1``
receivers, in MIB's order; the real edges number 32,491 on a GPT-2-small shape (12 x 12),
179,749 on Qwen2.5-0.5B (24 x 14) and 123,211 on SmolLM2-135M (30 x 9).

Families with a norm after each sublayer (OLMo-2, Gemma-2/3) are refused: the heads' sum goes
through that norm before it reaches the stream, so a single head's write is not a term of the
stream and has no edges of its own. Encoders (BERT) are refused too (no next-token logits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from depthscope.common.errors import InputError, UnsupportedArchitecture

__all__ = [
    "CircuitGraph",
    "circuit_graph",
    "edge_matrix",
    "prune_circuit",
    "mib_name",
    "mib_graph",
    "RECEIVER_KINDS",
]

#: the kinds of receivers of one layer, in MIB's order (then ``logits`` after the last layer)
RECEIVER_KINDS = ("q", "k", "v", "mlp_in")
_SANDWICH = ("olmo2", "olmo3", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class CircuitGraph:
    """The graph of a decoder with ``n_layers`` blocks of ``n_heads`` query heads
    (``n_kv_heads`` key/value heads; None: as many), ``parallel`` attention and MLP or not."""

    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    parallel: bool = False

    def __post_init__(self):
        for name in ("n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"a circuit graph needs {name} >= 1, got {value!r}")
        kv = self.n_kv_heads
        if kv is not None and (not isinstance(kv, int) or kv < 1 or self.n_heads % kv):
            raise InputError(f"n_kv_heads must divide n_heads ({self.n_heads}), got {kv!r}")

    # ------------------------------------------------------------------ nodes
    @property
    def per_layer(self) -> int:
        """Receivers per layer: the q, k and v inputs of every query head, and the MLP's input."""
        return 3 * self.n_heads + 1

    @cached_property
    def senders(self) -> list[str]:
        out = ["embed"]
        for layer in range(self.n_layers):
            out += [f"{layer}.heads.{h}" for h in range(self.n_heads)] + [f"{layer}.mlp_out"]
        return out

    @cached_property
    def receivers(self) -> list[str]:
        out = []
        for layer in range(self.n_layers):
            for part in "qkv":
                out += [f"{layer}.{part}.{h}" for h in range(self.n_heads)]
            out.append(f"{layer}.mlp_in")
        return out + ["logits"]

    @cached_property
    def sender_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.senders)}

    @cached_property
    def receiver_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.receivers)}

    def attn_start(self, layer: int) -> int:
        """Index of layer ``layer``'s first head sender (the senders before it reach its q, k, v)."""
        return 1 + layer * (self.n_heads + 1)

    def upstream(self, receiver: int) -> int:
        """How many senders (the first ones, in forward order) reach receiver ``receiver``."""
        if receiver == len(self.receivers) - 1:
            return len(self.senders)
        layer, slot = divmod(receiver, self.per_layer)
        start = self.attn_start(layer)
        return start + (self.n_heads if slot == 3 * self.n_heads and not self.parallel else 0)

    @cached_property
    def prev(self) -> np.ndarray:
        """Per receiver, the number of senders that reach it (they are the first ones)."""
        return np.array([self.upstream(r) for r in range(len(self.receivers))], dtype=np.int64)

    @cached_property
    def mask(self) -> np.ndarray:
        """``[senders, receivers]`` bool: True where a sender reaches a receiver (a real edge)."""
        return np.arange(len(self.senders))[:, None] < self.prev[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.prev.sum())

    @cached_property
    def edge_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(sender indices, receiver indices) of the real edges, sender by sender in forward order."""
        s, r = np.nonzero(self.mask)
        return s, r

    @cached_property
    def owner(self) -> np.ndarray:
        """Per receiver, the sender index of the node it feeds (-1 for the logits)."""
        out = np.full(len(self.receivers), -1, dtype=np.int64)
        for layer in range(self.n_layers):
            base, start = layer * self.per_layer, self.attn_start(layer)
            for part in range(3):
                out[base + part * self.n_heads : base + (part + 1) * self.n_heads] = start + np.arange(self.n_heads)
            out[base + 3 * self.n_heads] = start + self.n_heads
        return out

    def layer_receivers(self, layer: int) -> slice:
        """The receivers of one layer: q heads, k heads, v heads, the MLP input."""
        return slice(layer * self.per_layer, (layer + 1) * self.per_layer)

    # ------------------------------------------------------------------ tables
    def sender_table(self) -> pd.DataFrame:
        """One row per sender: ``sender``, the site columns of the residual site it writes to
        (``embed``, ``l.attn`` for a head, ``l.mlp`` for an MLP) and ``head`` (missing but for heads)."""
        from depthscope.hooks.sites import site_frame  # lazy: keeps this module light for config checks

        sites, heads = [0], [None]
        for layer in range(self.n_layers):
            sites += [2 * layer + 1] * self.n_heads + [2 * layer + 2]
            heads += list(range(self.n_heads)) + [None]
        df = site_frame(sites, self.n_layers)
        df.insert(0, "sender", self.senders)
        df["head"] = pd.array(heads, dtype="Int64")
        return df

    def receiver_table(self) -> pd.DataFrame:
        """One row per receiver: ``receiver``, ``receiver_layer`` (the logits: ``n_layers``),
        ``receiver_kind`` (q, k, v, mlp_in, logits) and ``receiver_head``."""
        layers, kinds, heads = [], [], []
        for layer in range(self.n_layers):
            for part in "qkv":
                layers += [layer] * self.n_heads
                kinds += [part] * self.n_heads
                heads += list(range(self.n_heads))
            layers.append(layer)
            kinds.append("mlp_in")
            heads.append(None)
        return pd.DataFrame(
            {
                "receiver": self.receivers,
                "receiver_layer": layers + [self.n_layers],
                "receiver_kind": kinds + ["logits"],
                "receiver_head": pd.array(heads + [None], dtype="Int64"),
            }
        )

    def edge_table(self) -> pd.DataFrame:
        """One row per real edge (sender by sender): ``sender``, ``receiver``, the sender's site
        columns and ``head``, and the receiver's columns of :meth:`receiver_table`."""
        s, r = self.edge_index
        senders = self.sender_table().iloc[s].reset_index(drop=True)
        receivers = self.receiver_table().iloc[r].reset_index(drop=True)
        out = pd.concat([senders, receivers], axis=1)
        first = ["sender", "receiver"]
        return out[first + [c for c in out.columns if c not in first]]


def circuit_graph(source) -> CircuitGraph:
    """The graph of a :class:`~depthscope.hooks.HookedModel` or of a transformers config
    (``transformers.AutoConfig``; no weights are read). Refuses families whose heads' writes are
    not terms of the residual stream (a norm after each sublayer) and encoders."""
    arch = getattr(source, "arch", None)
    if arch is not None:
        family, layout = arch.family, arch.layout
        if layout == "post_norm" or not getattr(source, "is_decoder", True):
            raise _refuse(family, "an encoder (no next-token logits to attribute)")
        if arch.sandwich:
            raise _refuse(family, _SANDWICH_WHY)
        if not (arch.n_heads and arch.d_head and arch.qkv) or any(n is None for n in arch.ln1 + arch.ln2):
            raise _refuse(family, "depthscope does not know its heads, query/key/value projections and pre-norms")
        return CircuitGraph(len(arch.blocks), arch.n_heads, arch.n_kv_heads, layout == "parallel")
    return _from_config(source)


_SANDWICH_WHY = (
    "a norm after each sublayer: the heads' summed write goes through it before it reaches the residual "
    "stream, so a single head's write is not a term of the stream and has no edges of its own"
)


def _refuse(family: str, why: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"{family}: circuits as graphs are defined for pre-norm decoders; {family} has {why}"
    )


def _from_config(config) -> CircuitGraph:
    """The graph of a transformers config, read as depthscope's architecture table reads it."""
    from depthscope.hooks.arch import FAMILIES, HEAD_KEYS, KV_HEAD_KEYS  # lazy: hooks import torch

    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise InputError(f"circuit_graph takes a HookedModel or a transformers config, got {type(config).__name__}")
    spec = FAMILIES.get(model_type)
    if model_type in _SANDWICH:
        raise _refuse(model_type, _SANDWICH_WHY)
    if spec is not None and spec.layout == "post_norm":
        raise _refuse(model_type, "an encoder (no next-token logits to attribute)")
    layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer") if hasattr(config, k)), None)
    heads = next((getattr(config, k) for k in HEAD_KEYS if getattr(config, k, None)), None)
    kv = next((getattr(config, k) for k in KV_HEAD_KEYS if getattr(config, k, None)), None)
    if not layers or not heads:
        raise InputError(f"{model_type}: the config gives no number of layers or heads")
    parallel = bool(spec is not None and spec.layout == "parallel" and getattr(config, "use_parallel_residual", True))
    return CircuitGraph(int(layers), int(heads), int(kv) if kv else None, parallel)


# ----------------------------------------------------------------------------- circuits
def edge_matrix(graph: CircuitGraph, edges) -> np.ndarray:
    """The in-circuit matrix ``[senders, receivers]`` (bool) of ``edges``: a table with ``sender``
    and ``receiver`` columns (rows of :func:`~depthscope.analyses.circuits.edges.eap.edge_attribution`),
    or an iterable of ``(sender, receiver)`` names. Unknown names and pairs that are no edge (the
    sender does not come before the receiver) raise :class:`InputError` naming them."""
    if isinstance(edges, pd.DataFrame):
        missing = [c for c in ("sender", "receiver") if c not in edges.columns]
        if missing:
            raise InputError(f"an edge table needs the columns sender and receiver; it has no {missing}")
        items: Iterable = zip(edges["sender"], edges["receiver"])
    elif isinstance(edges, (str, bytes)) or not isinstance(edges, Iterable):
        raise InputError(
            "edges must be a table with sender and receiver columns or (sender, receiver) pairs, "
            f"got {type(edges).__name__}"
        )
    else:
        items = edges
    out = np.zeros(graph.mask.shape, dtype=bool)
    si, ri = graph.sender_index, graph.receiver_index
    for k, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InputError(f"edge {k}: expected a (sender, receiver) pair, got {item!r}")
        s, r = (str(x) for x in item)
        if s not in si:
            raise InputError(f"edge {k}: unknown sender {s!r}; senders are 'embed', '<l>.heads.<h>', '<l>.mlp_out'")
        if r not in ri:
            raise InputError(f"edge {k}: unknown receiver {r!r}; receivers are '<l>.q|k|v.<h>', '<l>.mlp_in', 'logits'")
        if not graph.mask[si[s], ri[r]]:
            raise InputError(f"edge {k}: {s} -> {r} is no edge (the sender does not come before the receiver)")
        out[si[s], ri[r]] = True
    return out


def prune_circuit(graph: CircuitGraph, kept: np.ndarray) -> np.ndarray:
    """MIB's pruning of a circuit (``kept``: bool ``[senders, receivers]``): repeatedly drop the
    nodes with no outgoing edge, or with no incoming edge into any of their inputs (``embed``
    always counts as fed), and every edge from or into a dropped node, until nothing changes.
    Under counterfactual ablation this changes no metric (a node cut off from the input computes
    its corrupted value); under mean or zero ablation it does, as in MIB."""
    kept = kept & graph.mask
    owner = graph.owner
    fed = owner >= 0
    while True:
        has_out = kept.any(axis=1)
        has_in = np.zeros(len(graph.senders), dtype=bool)
        np.logical_or.at(has_in, owner[fed], kept[:, fed].any(axis=0))
        has_in[0] = True
        alive = has_out & has_in
        receiver_alive = np.ones(len(graph.receivers), dtype=bool)
        receiver_alive[fed] = alive[owner[fed]]
        new = kept & alive[:, None] & receiver_alive[None, :]
        if np.array_equal(new, kept):
            return new
        kept = new


# ----------------------------------------------------------------------------- MIB's format
def mib_name(sender: str, receiver: str | None = None) -> str:
    """MIB's name of a sender node (``input``, ``a3.h5``, ``m3``) or, with ``receiver``, of an
    edge (``a3.h5->a4.h1<q>``, ``m3->m4``, ``m11->logits``)."""

    def node(name: str, receiving: bool) -> str:
        if name in ("embed", "logits"):
            return "input" if name == "embed" else "logits"
        parts = name.split(".")
        if parts[1] in ("heads", "q", "k", "v"):
            tail = f"<{parts[1]}>" if receiving else ""
            return f"a{parts[0]}.h{parts[2]}{tail}"
        return f"m{parts[0]}"

    return node(sender, False) if receiver is None else f"{node(sender, False)}->{node(receiver, True)}"


def mib_graph(graph: CircuitGraph, scores: np.ndarray, in_circuit: np.ndarray, d_model: int) -> dict:
    """The graph as the JSON object of EAP-IG's ``Graph.to_json`` (``cfg``, ``nodes`` with
    ``in_graph``, ``edges`` with ``score`` and ``in_graph``), so ``Graph.from_json`` of the EAP-IG
    and MIB code reads a depthscope circuit. ``scores`` and ``in_circuit`` are ``[senders, receivers]``."""
    cfg = {
        "n_layers": graph.n_layers,
        "n_heads": graph.n_heads,
        "parallel_attn_mlp": graph.parallel,
        "d_model": d_model,
    }
    s_idx, r_idx = graph.edge_index
    edges, alive = {}, np.zeros(len(graph.senders), dtype=bool)
    for s, r in zip(s_idx.tolist(), r_idx.tolist()):
        on = bool(in_circuit[s, r])
        edges[mib_name(graph.senders[s], graph.receivers[r])] = {"score": float(scores[s, r]), "in_graph": on}
        alive[s] |= on
    nodes = {mib_name(n): {"in_graph": bool(alive[i])} for i, n in enumerate(graph.senders)}
    nodes["logits"] = {"in_graph": True}
    return {"cfg": cfg, "nodes": nodes, "edges": edges}
