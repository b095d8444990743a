"""Figures of circuits as graphs, drawn from the tables of :mod:`~depthscope.analyses.circuits.edges.eap`
and :mod:`~depthscope.analyses.circuits.edges.faithfulness` only.

======================  ============================================================================
function                figure
======================  ============================================================================
plot_faithfulness       f(k) against the circuit size k (percent of edges), one line per method,
                        with the random circuits' mean (dashed) and their spread (band, min to max)
plot_circuit            a circuit drawn as a graph: the input at the top, the layers downwards, the
                        logits at the bottom; heads and MLPs as nodes, edges as arcs whose width is
                        the edge's |score| and whose colour is its sign
======================  ============================================================================

Each takes a table and a path, draws one figure in the shared style and returns the path.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch

from depthscope.analyses.circuits.edges.faithfulness import areas
from depthscope.analyses.style import need_columns, savefig, setup
from depthscope.common.errors import InputError

__all__ = ["plot_faithfulness", "plot_circuit", "node_positions", "circuit_rows"]

#: colours of an edge's sign: a negative score (corrupting the edge lowers the metric) and a positive one
SIGN_COLOURS = {"lowers": "#1f5fa8", "raises": "#c0392b"}
#: line style of an edge by what it enters
KIND_STYLES = {"q": "-", "k": "--", "v": ":", "mlp_in": "-", "logits": "-"}
THRESHOLD = 0.8


def plot_faithfulness(curve: pd.DataFrame, path, *, threshold: float = THRESHOLD) -> Path:
    """f(k) of a :func:`~depthscope.analyses.circuits.edges.faithfulness.faithfulness` table (several
    methods: a ``method`` column), the sizes equally spaced and labelled in percent; the random
    circuits' mean dashed and their min-max band shaded; CPR and CMD in the legend; the signed
    ranking's curve dotted (``f_signed``, when there); the title names the split (``attrs["split"]``)."""
    what = "plot_faithfulness"
    need_columns(curve, ["k", "fraction", "f", "f_random", "f_random_min", "f_random_max"], what)
    setup()
    methods = list(dict.fromkeys(curve["method"])) if "method" in curve.columns else [curve.attrs.get("method")]
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    ks = sorted(set(curve["k"]))
    x_of = {k: i for i, k in enumerate(ks)}
    palette = plt.get_cmap("tab10")
    for i, method in enumerate(methods):
        d = curve if "method" not in curve.columns else curve[curve["method"] == method]
        d = d.sort_values("k")
        cpr, cmd = areas(d["fraction"], d["f"])
        label = f"{method or 'top edges'} (CPR {cpr:.2f}, CMD {cmd:.2f})"
        ax.plot([x_of[k] for k in d["k"]], d["f"], marker="o", color=palette(i), label=label, zorder=3)
        if "f_signed" in d.columns:  # MIB's CPR ranking: the top edges by signed score
            cpr_s = areas(d["fraction"], d["f_signed"])[0]
            xs = [x_of[k] for k in d["k"]]
            ax.plot(xs, d["f_signed"], marker=".", ls=":", color=palette(i), label=f"signed ranking (CPR {cpr_s:.2f})")
    r = (curve if "method" not in curve.columns else curve[curve["method"] == methods[0]]).sort_values("k")
    if r["f_random"].notna().any():
        xs = [x_of[k] for k in r["k"]]
        cpr, cmd = areas(r["fraction"], r["f_random"])
        n = int(r["n_random"].iloc[0]) if "n_random" in r.columns else 0
        ax.fill_between(xs, r["f_random_min"], r["f_random_max"], color="#999999", alpha=0.25, lw=0, zorder=1)
        ax.plot(
            xs,
            r["f_random"],
            ls="--",
            color="#666666",
            label=f"random circuits, {n} draws (CPR {cpr:.2f}, CMD {cmd:.2f})",
        )
    ax.axhline(1, color="#333333", lw=0.8)
    ax.axhline(0, color="#333333", lw=0.8)
    ax.axhline(threshold, color="#2e8b57", lw=0.8, ls=":", label=f"f = {threshold:g}")
    ax.set_xticks(range(len(ks)), [f"{k:g}" for k in ks])
    ax.set_xlabel("circuit size k (% of the graph's edges, top by |score|)")
    ax.set_ylabel("faithfulness f(k)")
    ablation = curve["ablation"].iloc[0] if "ablation" in curve.columns else curve.attrs.get("ablation", "")
    bits = [f"Faithfulness of the top-k circuits ({ablation} ablation)"]
    if curve.attrs.get("model"):
        bits.append(str(curve.attrs["model"]))
    if curve.attrs.get("split"):  # in-sample or held out, and how many pairs judge
        n = f", {int(curve['n_pairs'].iloc[0])} pairs" if "n_pairs" in curve.columns else ""
        bits.append(("IN-SAMPLE: " if curve.attrs.get("in_sample") else "") + str(curve.attrs["split"]) + n)
    ax.set_title("\n".join(bits), fontsize=9)
    ax.legend(fontsize=7, loc="best")
    savefig(fig, path)
    return Path(path)


def circuit_rows(edges: pd.DataFrame, n_edges: int | None = None) -> pd.DataFrame:
    """The rows a circuit figure draws: those with ``in_circuit`` True when the table has that
    column, else the ``n_edges`` (default 100) with the largest ``|score|``."""
    if "in_circuit" in edges.columns:
        return edges[edges["in_circuit"].astype(bool)]
    n = 100 if n_edges is None else int(n_edges)
    return edges.reindex(edges["score"].abs().sort_values(ascending=False, kind="stable").index[:n])


def node_positions(n_layers: int, n_heads: int) -> dict[str, tuple[float, float]]:
    """(x, y) of every node of the drawn graph: ``embed`` on top (y = 0), layer l's heads at
    x = 0 .. H-1 and its MLP at x = H + 0.5 on row l + 1, ``logits`` below the last layer."""
    pos = {"embed": ((n_heads - 1) / 2, 0.0), "logits": ((n_heads - 1) / 2, n_layers + 1.0)}
    for layer in range(n_layers):
        for h in range(n_heads):
            pos[f"{layer}.heads.{h}"] = (float(h), layer + 1.0)
        pos[f"{layer}.mlp_out"] = (n_heads + 0.5, layer + 1.0)
    return pos


def receiver_node(receiver: str) -> str:
    """The node a receiver belongs to: ``3.q.5`` -> ``3.heads.5``, ``3.mlp_in`` -> ``3.mlp_out``."""
    if receiver == "logits":
        return receiver
    parts = receiver.split(".")
    return f"{parts[0]}.heads.{parts[2]}" if len(parts) == 3 else f"{parts[0]}.mlp_out"


def _shape(edges: pd.DataFrame) -> tuple[int, int]:
    n_layers = edges.attrs.get("n_layers")
    n_heads = edges.attrs.get("n_heads")
    if n_layers is None:
        n_layers = int(edges["receiver_layer"].max()) if "receiver_layer" in edges.columns else None
    if n_heads is None and "head" in edges.columns:
        n_heads = int(pd.concat([edges["head"], edges.get("receiver_head", edges["head"])]).max()) + 1
    if not n_layers or not n_heads:
        raise InputError("plot_circuit: the table gives no number of layers and heads (attrs n_layers, n_heads)")
    return int(n_layers), int(n_heads)


def _node_label(name: str) -> str:
    if name in ("embed", "logits"):
        return name
    parts = name.split(".")
    return f"{parts[0]}.{parts[2]}" if parts[1] == "heads" else f"m{parts[0]}"


def plot_circuit(edges: pd.DataFrame, path, *, n_edges: int | None = None, title: str | None = None) -> Path:
    """A circuit as a graph (module docstring): the rows of :func:`circuit_rows` of an
    :func:`~depthscope.analyses.circuits.edges.eap.edge_attribution` table. Arcs are solid into a
    query or an MLP, dashed into a key, dotted into a value; blue when corrupting the edge lowers
    the metric (negative score), red when it raises it."""
    need_columns(edges, ["sender", "receiver", "score"], "plot_circuit")
    n_layers, n_heads = _shape(edges)
    rows = circuit_rows(edges, n_edges)
    pos = node_positions(n_layers, n_heads)
    setup()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * n_heads + 2.5), max(6.0, 0.32 * n_layers + 2.0)))
    xs, ys = zip(*pos.values())
    ax.scatter(xs, ys, s=6, color="#cccccc", zorder=1)
    used = set(rows["sender"]) | {receiver_node(r) for r in rows["receiver"]}
    top = float(rows["score"].abs().max()) if len(rows) else 1.0
    for s, r, score in zip(rows["sender"], rows["receiver"], rows["score"]):
        kind = "logits" if r == "logits" else r.split(".")[1]
        a, b = pos[s], pos[receiver_node(r)]
        colour = SIGN_COLOURS["lowers" if score < 0 else "raises"]
        width = 0.4 + 3.0 * abs(score) / (top or 1.0)
        arc = FancyArrowPatch(a, b, connectionstyle="arc3,rad=0.18", arrowstyle="-", lw=width, color=colour)
        arc.set_linestyle(KIND_STYLES.get(kind, "-"))
        arc.set_alpha(0.75)
        ax.add_patch(arc)
    for name in sorted(used & set(pos)):
        x, y = pos[name]
        ax.scatter([x], [y], s=60, color="#222222", zorder=3)
        ax.annotate(_node_label(name), (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6, zorder=4)
    ax.set_xlim(-1, n_heads + 1.5)
    ax.set_ylim(n_layers + 1.7, -0.7)
    ax.set_yticks(range(n_layers + 2), ["embed", *[str(i) for i in range(n_layers)], "logits"], fontsize=6)
    ax.set_xticks([*range(n_heads), n_heads + 0.5], [*[str(h) for h in range(n_heads)], "MLP"], fontsize=6)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.grid(False)
    handles = [Line2D([], [], color=c, lw=2, label=f"corrupting it {w} the metric") for w, c in SIGN_COLOURS.items()]
    handles += [
        Line2D([], [], color="#555555", ls=KIND_STYLES[k], label=f"into {n}")
        for k, n in (("q", "a query or an MLP"), ("k", "a key"), ("v", "a value"))
    ]
    ax.legend(handles=handles, fontsize=6, loc="lower right")
    model = edges.attrs.get("model")
    head = title or f"Circuit of {len(rows)} edges (width: |score|)"
    ax.set_title(
        "\n".join(x for x in (head, f"{edges.attrs.get('method', '')} {model or ''}".strip()) if x), fontsize=9
    )
    savefig(fig, path)
    return Path(path)
