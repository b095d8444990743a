"""Which attention heads carry an edge of an attribution graph: one edge's direct effect split
into the same-position residual path and each head's OV path (patterns frozen), a question
circuit-tracer's users ask and its graphs do not answer.

==========================  ==================================================================
offers                      what
==========================  ==================================================================
:func:`edge_by_head`        one edge (target, source) -> a tidy table: the residual path and
                            one row per (layer, head), summing to the edge
``EDGE_HEAD_COLUMNS``       its columns
==========================  ==================================================================

In the frozen replacement model an edge ``s -> t`` is linear in ``s``'s write: two frozen
forwards, one with every source zeroed and one with ``s``'s write added, differ only by what
``s`` causes. The target reads the stream at its position through its frozen norm (``ln2`` of
its layer for a feature, the final norm for a logit), and the stream there is the sum of the
writes before that read: ``s``'s own write when it is at the same position (the **residual**
path), and each head's write (``l.heads``; through the frozen post-attention norm in sandwich
families). So the edge is the residual term plus one term per head whose layer comes before the
target's read -- each head's term the whole of what reaches the target through that head as
its *last* attention hop (a path through two heads is credited to the later one). The terms sum
to the edge exactly; ``tests/test_attribution.py`` checks them against the backward passes'
adjacency entry.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.circuits.features.graph import AttributionGraph
from depthscope.analyses.circuits.features.replacement import ReplacementModel, Sources
from depthscope.common.errors import InputError
from depthscope.hooks.sites import SITE_COLUMNS, site_frame

EDGE_HEAD_COLUMNS = ["target", "source", "path", *SITE_COLUMNS, "head", "contribution", "fraction"]


def _source_write(rm: ReplacementModel, graph: AttributionGraph, source: int) -> tuple[str, int, int, torch.Tensor]:
    """``(kind, layer, position, write [d])`` of a source node; layer -1 for a token."""
    kinds = graph.kind_slices()
    if kinds["feature"].start <= source < kinds["feature"].stop:
        layer, pos, f = (int(x) for x in graph.features[source])
        act = rm.activation(layer, pos, f)
        return "feature", layer, pos, act * rm.decoder_rows(layer, torch.tensor([f], device=act.device))[0]
    if kinds["error"].start <= source < kinds["error"].stop:
        layer, pos = divmod(source - kinds["error"].start, graph.n_pos)
        return "error", layer, pos, rm.errors[layer, pos]
    if kinds["token"].start <= source < kinds["token"].stop:
        pos = source - kinds["token"].start
        return "token", -1, pos, rm.embed[pos]
    raise InputError(f"node {source} is not a source (a feature, error or token node) of this graph")


def _target_read(rm: ReplacementModel, graph: AttributionGraph, target: int) -> tuple[int, int, torch.Tensor]:
    """``(layer, position, u)``: where a target reads the stream and the direction ``u`` with
    ``target input = u . stream + constant``; layer ``L`` for a logit."""
    from depthscope.analyses.circuits.features.attribute import _logit_reads

    kinds = graph.kind_slices()
    L, n = rm.n_layers, rm.n_pos
    if kinds["feature"].start <= target < kinds["feature"].stop:
        layer, pos, f = (int(x) for x in graph.features[target])
        w = rm.transcoders[layer].W_enc[:, f]
        norm = rm.ln2[layer]
        return layer, pos, w if norm is None else norm.pullback(w, pos)
    if kinds["logit"].start <= target < kinds["logit"].stop:
        token = graph.logit_tokens[target - kinds["logit"].start]
        read = _logit_reads(rm, torch.tensor([token], device=rm.ids.device))[0]
        return L, n - 1, rm.final_norm.pullback(read, n - 1)
    raise InputError(f"node {target} is not a target (a feature or logit node) of this graph")


def edge_by_head(rm: ReplacementModel, graph: AttributionGraph, target: int, source: int) -> pd.DataFrame:
    """The edge ``adjacency[target, source]`` (node indices of ``graph``, built from ``rm``) split
    into the residual path and each (layer, head)'s path; see the module doc. Rows: ``path``
    "residual" (at the source's site, ``head`` -1) then "head" rows in layer and head order;
    ``fraction``: the share of the edge (NaN for a zero edge)."""
    kind, s_layer, s_pos, write = _source_write(rm, graph, source)
    t_layer, t_pos, u = _target_read(rm, graph, target)
    L, arch = rm.n_layers, rm.model.arch
    seq = arch.layout == "sequential"
    zero = rm.bias_sources(1)
    embed = torch.cat([zero.embed, zero.embed])
    mlp_out = [torch.cat([m, m]) for m in zero.mlp_out]
    if kind == "token":
        embed[1, s_pos] += write
    else:
        mlp_out[s_layer][1, s_pos] += write
    with torch.no_grad():
        out = rm.run(Sources(embed, mlp_out), heads=True)
    # heads whose write the target reads: sequential blocks read ln2 after their own attention
    last = L - 1 if t_layer == L else (t_layer if seq else t_layer - 1)
    parts, sites, heads = [], [], []
    reaches = s_pos == t_pos and (kind == "token" or t_layer == L or s_layer < t_layer)
    parts.append(float(write @ u) if reaches else 0.0)
    sites.append(0 if kind == "token" else 2 * s_layer + 2)
    heads.append(-1)
    with torch.no_grad():
        for m in range(last + 1):
            delta = out.heads[m][1, t_pos] - out.heads[m][0, t_pos]  # [heads, d]
            if rm.post_attn[m] is not None:  # the post-attention norm, frozen, is linear per head
                norm = rm.post_attn[m]
                delta = norm.gain * norm.centre(delta) / norm.sigma[t_pos]
            parts += (delta @ u).double().cpu().tolist()
            sites += [2 * m + 1] * delta.shape[0]
            heads += list(range(delta.shape[0]))
    df = site_frame(sites, L)
    df.insert(0, "path", ["residual"] + ["head"] * (len(parts) - 1))
    df.insert(0, "source", source)
    df.insert(0, "target", target)
    df["head"] = heads
    df["contribution"] = parts
    total = float(np.sum(parts))
    df["fraction"] = df["contribution"] / total if total != 0 else np.nan
    df.attrs.update({"edge": total, "model": str(rm.model.name)})
    return df[EDGE_HEAD_COLUMNS]
