"""What edge attribution and circuit evaluation share on the model side: batches of pairs, the
senders' writes as one tensor, and each receiver's path from its input to its projection.

=====================  =========================================================================
offers                 what
=====================  =========================================================================
GraphBatch             pairs of one token length, their ids ``[B, P]`` and their metric
graph_batches          the pairs of a dataset checked (equal clean/corrupted token lengths, as
                       MIB requires) and grouped into batches of one length
first_difference       the first position at which a batch's clean and corrupted ids differ
SENDER_POINTS          the hook points whose values are the senders' writes
sender_points          their names for a model with ``n_layers`` blocks
stack_senders          the senders' writes ``[B, P, senders, d_model]`` from a run's cache
LayerParts             one layer's pre-attention and pre-MLP norms and per-query-head
                       projection weights ``[heads, d_head, d_model]`` (keys and values of
                       grouped heads repeated to every query head of their group)
layer_parts            the LayerParts of one layer
project                ``norm(x) W^T + b`` per head: the queries, keys or values a head computes
                       from its own input
=====================  =========================================================================

A receiver's input is the residual stream it reads *before* its norm (the stream is the sum of
the senders' writes): the queries of head h in layer l are ``LN1(x_q,h) W_Q^h + b_Q^h`` and the
MLP reads ``LN2(x_mlp)`` (``l.mlp_in``). The weights are the model's own, read through
:func:`~depthscope.hooks.arch.read_qkv`, so fused projections (GPT-2, GPT-NeoX) need nothing of
their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from depthscope.analyses.circuits.pairs import as_pairs
from depthscope.analyses.circuits.prompts import TokenPair, tokenize_pairs
from depthscope.common.errors import InputError
from depthscope.common.settings import TOKENS, check_number
from depthscope.hooks.arch import linear_weight, read_qkv

__all__ = [
    "GraphBatch",
    "graph_batches",
    "first_difference",
    "SENDER_POINTS",
    "sender_points",
    "stack_senders",
    "LayerParts",
    "layer_parts",
    "project",
]

SENDER_POINTS = ("heads", "mlp_out")


@dataclass(frozen=True)
class GraphBatch:
    """Pairs of one token length: their TokenPairs, clean and corrupted ids ``[B, P]``."""

    pairs: list[TokenPair]
    clean: torch.Tensor
    corrupted: torch.Tensor

    @property
    def index(self) -> list[int]:
        return [tp.index for tp in self.pairs]

    def metric(self, logits: torch.Tensor) -> torch.Tensor:
        """Each pair's metric of its own row of ``logits`` (the first ``B`` rows) ``[B]``."""
        return torch.cat([tp.metric(logits[i : i + 1]).reshape(1) for i, tp in enumerate(self.pairs)])


def _text(prompt) -> str:
    text = prompt if isinstance(prompt, str) else f"token ids {list(prompt)[:8]}"
    return text if len(text) <= 60 else text[:57] + "..."


def graph_batches(model, pairs, metric, batch_tokens: int, what: str) -> tuple[list[TokenPair], list[GraphBatch]]:
    """The pairs as the model sees them, and batches of at most ``batch_tokens`` tokens (at least
    one pair) of pairs with the same token length. A pair whose clean and corrupted prompts differ
    in token length is refused, naming it: ``what`` (an edge's effect) is defined position by
    position."""
    check_number("batch_tokens", batch_tokens, maximum=TOKENS)
    raw = as_pairs(pairs)
    tps = tokenize_pairs(model, raw, metric)
    by_length: dict[int, list[TokenPair]] = {}
    for tp, p in zip(tps, raw):
        n, m = tp.clean_ids.shape[1], tp.corrupted_ids.shape[1]
        if n != m:
            raise InputError(
                f"pair {tp.index} ({_text(p.clean)!r}): the clean prompt has {n} tokens and the corrupted one {m}; "
                f"{what} needs the prompts of a pair to have the same number of tokens (as MIB requires): "
                f"reword the corrupted prompt or drop the pair"
            )
        by_length.setdefault(n, []).append(tp)
    batches = []
    for n, group in sorted(by_length.items()):
        rows = max(1, int(batch_tokens) // n)
        for i in range(0, len(group), rows):
            chunk = group[i : i + rows]
            clean = torch.cat([tp.clean_ids for tp in chunk])
            corrupted = torch.cat([tp.corrupted_ids for tp in chunk])
            batches.append(GraphBatch(chunk, clean, corrupted))
    return tps, batches


def first_difference(batch: GraphBatch) -> int | None:
    """The first position at which some pair's clean and corrupted ids differ (None: nowhere).
    A causal model computes the same values before it in both runs, so every sender's
    difference is zero there and those positions add nothing to any score."""
    differs = (batch.clean != batch.corrupted).any(dim=0).nonzero()
    return int(differs[0, 0]) if len(differs) else None


def sender_points(n_layers: int) -> list[str]:
    """The hook points holding the senders' writes: ``embed``, then ``l.heads`` and ``l.mlp_out``."""
    return ["embed"] + [f"{layer}.{kind}" for layer in range(n_layers) for kind in SENDER_POINTS]


def stack_senders(cache: Callable[[str], torch.Tensor], n_layers: int, heads=None) -> torch.Tensor:
    """``[B, P, senders, d_model]`` float32: ``embed``, then per layer each head's write and the
    MLP's, read with ``cache(name)`` (``run.__getitem__``), in the graph's sender order. ``heads``
    (``heads(layer) -> [B, P, heads, d_model]``) replaces the reading of ``l.heads``."""
    parts = [cache("embed").unsqueeze(2)]
    for layer in range(n_layers):
        parts += [cache(f"{layer}.heads") if heads is None else heads(layer), cache(f"{layer}.mlp_out").unsqueeze(2)]
    return torch.cat([p.float() for p in parts], dim=2)


@dataclass(frozen=True)
class LayerParts:
    """One layer's norms (``ln1`` before attention, ``ln2`` before the MLP) and per-query-head
    projection weights ``w[part]`` ``[heads, d_head, d_model]`` and biases ``b[part]``
    ``[heads, d_head]`` (None without bias), for ``part`` in q, k, v; ``w_qkv`` the three stacked;
    ``w_o`` the output projection's weights per head."""

    ln1: nn.Module
    ln2: nn.Module
    w: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor | None]
    w_qkv: torch.Tensor  # every query head's query, key and value weights stacked: [3 heads, d_head, d_model]
    w_o: torch.Tensor  # the output projection per head: [d_model, heads, d_head]

    def head_writes(self, z: torch.Tensor) -> torch.Tensor:
        """Each head's write ``[B, P, heads, d_model]`` (its term of the output projection, no bias;
        the hook point ``l.heads``) from its output ``z`` ``[B, P, heads, d_head]`` (``l.z``)."""
        return torch.einsum("bphe,dhe->bphd", z, self.w_o.to(z.dtype))


def layer_parts(model, layer: int) -> LayerParts:
    """The norms and per-query-head projection weights of one layer (detached views of the model's
    own parameters; grouped key/value heads repeated to the query heads that share them)."""
    arch = model.arch
    w, b = {}, {}
    for i, part in enumerate("qkv"):
        proj = getattr(arch, f"{part}_proj")[layer]
        per = read_qkv(arch, i, linear_weight(proj).T)  # [d_model, heads_part, d_head]
        per = per.permute(1, 2, 0)
        bias = getattr(proj, "bias", None)
        bias = read_qkv(arch, i, bias.detach()) if bias is not None else None
        rep = arch.n_heads // per.shape[0]
        if rep > 1:
            per = per.repeat_interleave(rep, dim=0)
            bias = bias.repeat_interleave(rep, dim=0) if bias is not None else None
        w[part], b[part] = per, bias
    o = linear_weight(arch.o_proj[layer])  # [d_model, heads * d_head]
    w_o = o.view(o.shape[0], arch.n_heads, -1)
    return LayerParts(arch.ln1[layer], arch.ln2[layer], w, b, torch.cat([w[p] for p in "qkv"]), w_o)


def project(norm: nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``norm(x[..., h, :]) W_h^T + b_h`` per head: ``x`` ``[B, P, heads, d_model]`` (each head's
    own input), ``w`` ``[heads, d_head, d_model]`` -> ``[B, P, heads, d_head]``."""
    out = torch.einsum("bphd,hed->bphe", norm(x), w.to(x.dtype))
    return out if b is None else out + b.to(out.dtype)
