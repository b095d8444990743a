"""The attribution graph as a static figure: the pruned graph's nodes by layer and position.

==========================  ==============================================================
offers                      what
==========================  ==============================================================
:func:`node_layout`         each node's place: x the position (nodes sharing a layer and a
                            position side by side), y the layer (tokens at 0, a feature or
                            error node at layer ``l`` at ``l + 1``, the logits on top)
:func:`pruned_edges`        the pruned graph's edges as a table (source, target, weight)
:func:`plot_attribution_graph`  the figure: features sized by influence, error nodes as grey
                            squares, tokens along the bottom (the prompt), logits on top,
                            the pruned graph's edges drawn lightly, the most influential
                            features labelled with their top tokens
==========================  ==============================================================

The figure reads the graph and its pruning
(:func:`~depthscope.analyses.circuits.features.prune.prune_graph`) through
:func:`~depthscope.analyses.circuits.features.export.node_table`, the same table
``nodes.parquet`` holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
from matplotlib import pyplot as plt
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D

from depthscope.analyses.circuits.features.export import node_table
from depthscope.analyses.circuits.features.prune import PrunedGraph, prune_graph
from depthscope.analyses.style import savefig, setup

__all__ = ["node_layout", "pruned_edges", "plot_attribution_graph", "MAX_FIGURE_EDGES"]

#: colours: a feature, an error node, a token, a logit; an edge's sign
KIND_COLOURS = {"feature": "#d62728", "error": "#999999", "token": "#555555", "logit": "#1f5fa8"}
SIGN_COLOURS = {"positive": "#c0392b", "negative": "#1f5fa8"}
#: the width of a position's column that the nodes sharing it spread over, the most nodes
#: side by side in it, and the height of a layer's row that further rows of a cell stack over
SPREAD = 0.8
PER_ROW = 10
ROW_SPREAD = 0.6
#: the most edges the figure draws (the largest by |weight|)
MAX_FIGURE_EDGES = 400


def node_layout(table: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    """``x``, ``y`` for each row of a node table: y is 0 for tokens, ``layer + 1`` for features
    and error nodes, ``n_layers + 1`` for logits; x is the position. The nodes sharing a layer
    and a position (a cell) are packed in a grid centred on the cell (error node first, then
    features by influence): at most :data:`PER_ROW` side by side across ``SPREAD`` of the
    column, further rows stacked within ``ROW_SPREAD`` of the layer, so a cell never leaves
    its column or its row."""
    y = np.where(
        table["kind"] == "token",
        0.0,
        np.where(table["kind"] == "logit", n_layers + 1.0, table["layer"].astype(float) + 1.0),
    )
    x = table["position"].to_numpy(dtype=float).copy()
    y_out = y.copy()
    rank = np.where(table["kind"] == "error", -np.inf, -table["influence"].to_numpy(dtype=float))
    frame = pd.DataFrame({"y": y, "pos": x, "rank": rank}).reset_index(drop=True)
    step = SPREAD / (PER_ROW - 1)
    for _, idx in frame.groupby(["y", "pos"]).groups.items():
        members = frame.loc[idx].sort_values("rank", kind="stable").index.to_numpy()
        k = len(members)
        cols = min(k, PER_ROW)
        n_rows = -(-k // cols)
        slot = np.arange(k)
        x[members] += (slot % cols - (cols - 1) / 2) * step
        if n_rows > 1:  # the first (most influential) row on top
            y_out[members] += ((n_rows - 1) / 2 - slot // cols) * (ROW_SPREAD / (n_rows - 1))
    return pd.DataFrame({"x": x, "y": y_out}, index=table.index)


def pruned_edges(graph, pruned: PrunedGraph, table: pd.DataFrame) -> pd.DataFrame:
    """The pruned graph's edges between the nodes of the JSON (``in_pruned_graph``): ``source``,
    ``target`` (adjacency indices) and ``weight`` (the raw direct effect), largest |weight|
    first."""
    mask = pruned.edge_mask.tocoo()
    keep = table["in_pruned_graph"].to_numpy()
    on = keep[mask.row] & keep[mask.col]
    rows, cols = mask.row[on], mask.col[on]
    weight = np.asarray(sp.csr_matrix(graph.adjacency)[rows, cols]).ravel().astype(float)
    edges = pd.DataFrame({"source": cols.astype(int), "target": rows.astype(int), "weight": weight})
    return edges.reindex(edges["weight"].abs().sort_values(ascending=False, kind="stable").index).reset_index(drop=True)


def _feature_label(row, tokens: list[str] | None) -> str:
    head = f"L{int(row.layer)}#{int(row.feature)}"
    if not tokens:
        return head
    shown = " ".join(repr(str(t)) for t in tokens[:4])
    return f"{head}  {shown}"


def _draw_edges(ax, edges: pd.DataFrame, xy: pd.DataFrame) -> None:
    """The edges as light lines under the nodes (one collection: thousands draw at once)."""
    if not len(edges):
        return
    a, b = xy.loc[edges["source"]].to_numpy(), xy.loc[edges["target"]].to_numpy()
    weight = edges["weight"].to_numpy(dtype=float)
    colours = np.where(weight > 0, SIGN_COLOURS["positive"], SIGN_COLOURS["negative"])
    widths = 0.4 + 2.2 * np.abs(weight) / (np.abs(weight).max() or 1.0)
    lines = LineCollection(np.stack([a, b], axis=1), colors=colours, linewidths=widths, alpha=0.18, zorder=1)
    ax.add_collection(lines)


def _draw_nodes(ax, shown: pd.DataFrame, xy: pd.DataFrame) -> None:
    """Features and error nodes sized by influence; tokens and logits as diamonds, the most
    probable logit labelled with its token and probability (all of them are listed beside the
    plot by :func:`_side_text`: ten labels in one column's width would overlap)."""
    influence = shown["influence"].to_numpy(dtype=float)
    big = float(influence[shown["kind"].isin(["feature", "error"]).to_numpy()].max(initial=0.0)) or 1.0
    for kind, marker in (("error", "s"), ("feature", "o")):
        part = shown[shown["kind"] == kind]
        size = 6 + 70 * part["influence"].to_numpy(dtype=float) / big
        ax.scatter(xy.loc[part.index, "x"], xy.loc[part.index, "y"], s=size, marker=marker,
                   color=KIND_COLOURS[kind], alpha=0.85, edgecolor="white", lw=0.4, zorder=3)  # fmt: skip
    for kind in ("token", "logit"):
        part = shown[shown["kind"] == kind]
        ax.scatter(
            xy.loc[part.index, "x"], xy.loc[part.index, "y"], s=24, marker="D", color=KIND_COLOURS[kind], zorder=3
        )
    logits = shown[shown["kind"] == "logit"].sort_values("probability", ascending=False)
    for row in logits.head(1).itertuples():
        at = (xy.at[row.Index, "x"], xy.at[row.Index, "y"])
        ax.annotate(f"{_token_text(row.token)} {row.probability:.2f}", at, xytext=(0, 7), textcoords="offset points",
                    ha="center", fontsize=8, weight="bold", color=KIND_COLOURS["logit"])  # fmt: skip


def _token_text(token) -> str:
    return repr(str(token))[1:-1]


def _free_spot(at, size, taken: list, offsets) -> tuple[float, float]:
    """The first offset (points) from ``at`` (points) where a ``size`` box overlaps none of
    ``taken`` (greedy; the last offset when every one is taken); the box is added to ``taken``."""
    w, h = size
    for dx, dy in offsets:
        box = (at[0] + dx - w / 2, at[1] + dy - h / 2, at[0] + dx + w / 2, at[1] + dy + h / 2)
        if not any(box[0] < t[2] and t[0] < box[2] and box[1] < t[3] and t[1] < box[3] for t in taken):
            break
    taken.append(box)
    return dx, dy


#: where a rank label may go from its node (points): rings of eight directions, nearest first
LABEL_OFFSETS = [
    (r * np.cos(a), r * np.sin(a)) for r in (7, 12, 18, 25, 33, 42) for a in np.linspace(np.pi / 4, 2.25 * np.pi, 8)
]


def _label_features(ax, shown: pd.DataFrame, xy: pd.DataFrame, max_labels: int) -> pd.DataFrame:
    """The ``max_labels`` most influential features: a rank number near each node, placed where
    it overlaps no other rank label (with a thin leader line when it had to move away); returns
    the labelled rows, in rank order, for :func:`_side_text`."""
    feats = shown[shown["kind"] == "feature"].sort_values("influence", ascending=False).head(max_labels)
    to_points = ax.transData.transform
    scale = 72.0 / ax.figure.dpi
    taken: list = []
    for k, row in enumerate(feats.itertuples(), start=1):
        at = (xy.at[row.Index, "x"], xy.at[row.Index, "y"])
        centre = to_points(at) * scale
        dx, dy = _free_spot(centre, (4.6 * len(str(k)) + 2, 9), taken, LABEL_OFFSETS)
        leader = {"arrowstyle": "-", "lw": 0.5, "color": "#333"} if np.hypot(dx, dy) > 8 else None
        ax.annotate(str(k), at, xytext=(dx, dy), textcoords="offset points", fontsize=7, weight="bold", zorder=4,
                    ha="center", va="center", arrowprops=leader,
                    bbox={"boxstyle": "round,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.75})  # fmt: skip
    return feats


def _side_text(ax, logits: pd.DataFrame, feats: pd.DataFrame, top_tokens) -> None:
    """Beside the plot: the target logits with their probabilities, then the numbered features
    with their layer, index and top tokens."""
    lines = ["target logits (probability)"]
    lines += [f"  {_token_text(r.token)!r:<14} {r.probability:.3f}" for r in logits.itertuples()]
    if len(feats):
        lines += ["", "most influential features"]
        for k, row in enumerate(feats.itertuples(), start=1):
            lines.append(f"{k:>2}. {_feature_label(row, (top_tokens or {}).get(int(row.Index)))}")
    ax.text(1.01, 0.80, "\n".join(lines), transform=ax.transAxes, va="top", ha="left", fontsize=7, family="monospace")


def _axes(ax, graph) -> None:
    ax.set_xticks(range(graph.n_pos))
    ax.set_xticklabels([repr(t)[1:-1] for t in graph.token_strings], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(graph.n_layers + 2))
    ax.set_yticklabels(["tokens"] + [str(i) for i in range(graph.n_layers)] + ["logits"], fontsize=8)
    ax.set_xlim(-0.7, graph.n_pos - 0.3)
    ax.set_ylim(-0.6, graph.n_layers + 1.8)
    ax.set_ylabel("layer (MLP transcoder)")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Line2D([], [], marker="o", ls="", color=KIND_COLOURS["feature"], label="feature (area: influence)"),
        Line2D([], [], marker="s", ls="", color=KIND_COLOURS["error"], label="error node"),
        Line2D([], [], color=SIGN_COLOURS["positive"], label="edge > 0"),
        Line2D([], [], color=SIGN_COLOURS["negative"], label="edge < 0"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)


def plot_attribution_graph(
    graph,
    path,
    *,
    pruned: PrunedGraph | None = None,
    top_tokens: dict[int, list[str]] | None = None,
    max_labels: int = 12,
    title: str | None = None,
) -> Path:
    """Draw the pruned graph of ``graph`` (an
    :class:`~depthscope.analyses.circuits.features.graph.AttributionGraph`; ``pruned`` by
    default :func:`prune_graph` at 0.8 and 0.98) into ``path``: features (red dots, area by
    influence on the logits) and error nodes (grey squares) at their layer (y) and position (x,
    labelled with the prompt's tokens), the logits on top with their probabilities, the pruned
    graph's edges as light lines (red positive, blue negative, width by |weight|; the
    :data:`MAX_FIGURE_EDGES` largest). The ``max_labels`` most influential features are
    numbered and listed beside the plot as ``L{layer}#{feature}`` with their top tokens from
    ``top_tokens`` (adjacency index -> the tokens the feature's decoder writes to most,
    computed by the caller) when given."""
    pruned = prune_graph(graph) if pruned is None else pruned
    table = node_table(graph, pruned)
    xy = node_layout(table, graph.n_layers)
    shown = table[table["in_pruned_graph"]]
    edges = pruned_edges(graph, pruned, table)
    setup()
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * graph.n_pos + 2.5), max(4.5, 0.3 * (graph.n_layers + 2) + 2.0)))
    _draw_edges(ax, edges.head(MAX_FIGURE_EDGES), xy)
    _draw_nodes(ax, shown, xy)
    _axes(ax, graph)  # the limits first: the rank labels are placed in points
    feats = _label_features(ax, shown, xy, max_labels)
    logits = shown[shown["kind"] == "logit"].sort_values("probability", ascending=False)
    _side_text(ax, logits, feats, top_tokens)
    n_feat = int((shown["kind"] == "feature").sum())
    drawn = (
        f"{len(edges)} edges"
        if len(edges) <= MAX_FIGURE_EDGES
        else f"the {MAX_FIGURE_EDGES} largest of {len(edges)} edges"
    )
    head = f"Attribution graph: {n_feat} of {graph.n_features} features, {drawn}"
    ax.set_title(title or f"{head} (pruned at {pruned.node_threshold:g} / {pruned.edge_threshold:g})", fontsize=10)
    path = Path(path)
    savefig(fig, path)
    return path
