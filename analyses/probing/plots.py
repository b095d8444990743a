"""Figures of the probing suite, drawn from its tables only.

``plot_overview(summary, path)``
    the all-tasks panel: E_Delta with its 95% interval and E_s per task on one shared depth
    axis (the report's first figure).
``plot_probe_curves(by_site, path)``
    one row per task: test accuracy with 95% binomial error bars, control-task accuracy
    (dashed) and the majority-class baseline (dotted) on a full 0-1 axis, and selectivity in
    points; sites coloured by sublayer; one legend for the figure. With a ``probe`` column
    holding several kinds (``probe="both"``), each kind is its own curve in the same panels
    (linear: filled markers on a grey line, MLP: hollow markers on a purple line). The
    structural probes' tasks (``structural``, ``depth``) show their main score (UUAS, root
    accuracy) and Spearman correlation per site, each beside its baseline (dotted).
    ``by_site`` is ``ProbeResults.by_site`` (columns task, site, label, layer, sublayer, depth,
    accuracy, control_accuracy, selectivity).
``plot_tenney(summary, mixing, path)``
    Tenney et al. (2019)'s figure: per task (stacked in pipeline order, one shared y scale) the
    cumulative-scoring gains Delta per depth as bars (coloured by sublayer), the scalar-mix weights as a line, and
    the expected layers E_Delta (solid) and E_s (dashed) marked. ``summary`` is
    ``ProbeResults.summary`` (task, expected_layer_delta, expected_layer_mix), ``mixing`` is
    ``ProbeResults.mixing`` (task, site, sublayer, depth, delta, mix_weight).

All return the path written. Where a table's ``probe`` column holds several kinds, the overview
and the Tenney figure give each (task, probe) its own row, labelled ``task (mlp)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.transforms import ScaledTranslation

from depthscope.analyses.style import SUBLAYER_MARKERS, SUBLAYER_ORDER, SUBLAYER_PALETTE, depth_axis, plt, savefig
from depthscope.probes.corpora.tasks import pipeline_rank

#: how each probe kind is drawn on the per-site figure: line colour, marker fill
PROBE_STYLE = {"linear": ("#999999", None), "mlp": ("#9467bd", "white")}


def _task_order(tasks) -> list:
    return sorted(pd.unique(pd.Series(list(tasks))), key=lambda t: (pipeline_rank(str(t)), str(t)))


def _probe_order(df: pd.DataFrame) -> list:
    """The probe kinds of ``df`` (linear first), ``[None]`` when it has no ``probe`` column."""
    if df is None or "probe" not in df or not len(df):
        return [None]
    kinds = [str(k) for k in pd.unique(df["probe"])]
    return sorted(kinds, key=lambda k: (k != "linear", k))


def _by_task_and_probe(df: pd.DataFrame) -> list:
    """``[(label, rows)]``: the rows of each task (pipeline order) and, when ``df`` holds several
    probe kinds, of each kind (labelled ``task (kind)`` but for linear)."""
    probes = _probe_order(df)
    out = []
    for task in _task_order(df["task"]):
        for kind in probes:
            rows = df[(df["task"] == task) & ((df["probe"] == kind) if kind is not None else True)]
            if len(rows):
                label = task if len(probes) == 1 or kind == "linear" else f"{task} ({kind})"
                out.append((label, rows))
    return out


def _n_layers(df: pd.DataFrame) -> int:
    return int(np.ceil(df["depth"].max())) if len(df) else 0


def _binomial_se(p, n):
    return np.sqrt(np.clip(p * (1 - p), 0, None) / np.maximum(n, 1))


def plot_overview(summary: pd.DataFrame, path) -> Path:
    """All tasks on one shared depth axis: E_Delta with its 95% interval (filled circle; hollow
    when the total gain is too small for E_Delta to mean a depth) and E_s (diamond), one row
    per task in pipeline order, values written at the right edge so labels never collide."""
    if summary is not None and "kind" in summary:
        summary = summary[summary["kind"] != "tree"]  # the structural probes have no expected layer
    rows = _by_task_and_probe(summary) if summary is not None and len(summary) else []
    tasks = [label for label, _ in rows]
    L = int(summary["n_layers"].max()) if len(tasks) and "n_layers" in summary else 0
    fig, ax = plt.subplots(figsize=(8, 0.55 * max(1, len(tasks)) + 1.4))
    for i, (_, part) in enumerate(rows):
        r = part.iloc[0]
        y = len(tasks) - 1 - i
        e, lo, hi = (
            float(r.get(c, np.nan))
            for c in ("expected_layer_delta", "expected_layer_delta_lo", "expected_layer_delta_hi")
        )
        es = float(r.get("expected_layer_mix", np.nan))
        ok = bool(r.get("expected_layer_delta_meaningful", True))
        if np.isfinite(lo) and np.isfinite(hi):
            ax.plot([lo, hi], [y, y], color="#6a3d9a", lw=2.2, solid_capstyle="butt", zorder=2)
        if np.isfinite(e):
            ax.plot([e], [y], "o", ms=8, color="#6a3d9a", mfc="#6a3d9a" if ok else "white", mew=1.8, zorder=3)
        if np.isfinite(es):
            ax.plot([es], [y], "D", ms=6, color="#2ca02c", mfc="none", mew=1.6, zorder=3)
        text = f"$E_\\Delta$ {e:.2f} [{lo:.1f}, {hi:.1f}]   $E_s$ {es:.2f}" + ("" if ok else "  (gain too small)")
        ax.text(1.01, y, text, transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=8.5)
    ax.set_yticks(range(len(tasks)))
    ax.set_yticklabels(list(reversed(tasks)))
    ax.set_ylim(-0.6, len(tasks) - 0.4)
    depth_axis(ax, L)
    handles = [
        plt.Line2D([], [], color="#6a3d9a", marker="o", ms=7, lw=2.2),
        plt.Line2D([], [], color="#6a3d9a", marker="o", ms=7, mfc="white", lw=0),
        plt.Line2D([], [], color="#2ca02c", marker="D", ms=6, mfc="none", lw=0),
    ]
    # below the tick labels and the axis label, a fixed distance (in inches) under the axes
    # whatever their height (a single task makes them short)
    below = ax.transAxes + ScaledTranslation(0, -0.5, fig.dpi_scale_trans)
    ax.legend(
        handles,
        [
            "$E_\\Delta$ (cumulative scoring) and 95% interval",
            "$E_\\Delta$ where the gain is too small",
            "$E_s$ (scalar mix)",
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0),
        bbox_transform=below,
        ncol=3,
        frameon=False,
        fontsize=8,
    )
    ax.set_title("Which depth encodes which property: expected layer per task", fontsize=10)
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)


def plot_probe_curves(by_site: pd.DataFrame, path) -> Path:
    """Per task: test accuracy with binomial error bars, control-task accuracy (dashed) and
    the majority-class baseline (dotted) against depth (full 0-1 range), and selectivity in
    points; one legend for the figure."""
    tasks = _task_order(by_site["task"])
    n = max(1, len(tasks))
    fig, axes = plt.subplots(n, 2, figsize=(11, 2.8 * n + 0.6), squeeze=False, sharex=True)
    L = _n_layers(by_site)
    probes = _probe_order(by_site)
    for row, task in zip(axes, tasks):
        for kind in probes:
            d = by_site[(by_site["task"] == task) & ((by_site["probe"] == kind) if kind is not None else True)]
            d = d.sort_values("depth")
            if not len(d):
                continue
            if task in TREE_SCORES:
                _tree_panels(row, d, task)
            else:
                _accuracy_panel(row[0], d, task, kind)
                _selectivity_panel(row[1], d, task, kind)
    for ax in axes[-1]:
        depth_axis(ax, L)
    if tasks and tasks[0] not in TREE_SCORES:  # a structural task titles its own panels
        axes[0, 0].set_title("test accuracy (bars: 95% binomial interval)", fontsize=10)
        axes[0, 1].set_title("selectivity = accuracy - control accuracy", fontsize=10)
    handles = [plt.Line2D([], [], color=SUBLAYER_PALETTE[s], marker=SUBLAYER_MARKERS[s], lw=0) for s in SUBLAYER_ORDER]
    handles += [plt.Line2D([], [], color="#7f7f7f", ls="--"), plt.Line2D([], [], color="black", ls=":")]
    labels = [f"{s} site" for s in SUBLAYER_ORDER] + ["control task", "majority class / baseline"]
    if len(probes) > 1:
        for kind in probes:
            color, fill = PROBE_STYLE.get(kind, ("#1f77b4", None))
            handles.append(plt.Line2D([], [], color=color, marker="o", mfc=fill or color, lw=1))
            labels.append(f"{kind} probe")
    fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=5 if len(probes) == 1 else 4,
        frameon=False,
        fontsize=9,
        bbox_to_anchor=(0.5, 0),
    )
    band = 0.35 if len(probes) == 1 else 0.55  # inches for the legend's rows
    fig.tight_layout(rect=(0, band / fig.get_figheight(), 1, 1))
    savefig(fig, path)
    return Path(path)


#: the structural probes' per-site scores: the main score's column and axis label
TREE_SCORES = {"structural": ("uuas", "UUAS"), "depth": ("root_accuracy", "root accuracy")}


def _tree_panels(row, d: pd.DataFrame, task: str) -> None:
    """A structural-probe task's two panels: its main score (UUAS or root accuracy) and its
    Spearman correlation per site, markers by sublayer, each baseline dotted."""
    col, name = TREE_SCORES.get(task, ("uuas", "UUAS"))
    base = "linear chain" if task == "structural" else "depth = position"
    row[0].set_title(f"{name} of the structural probe (dotted: {base} baseline)", fontsize=10)
    row[1].set_title(
        f"Spearman correlation with the gold {'distances' if task == 'structural' else 'depths'}", fontsize=10
    )
    for ax, (key, ylabel) in zip(row, [(col, name), ("spearman", "Spearman")]):
        if key not in d or not d[key].notna().any():
            continue
        ax.plot(d["depth"], d[key], color="#999999", lw=1, zorder=1)
        for sub in SUBLAYER_ORDER:
            part = d[d["sublayer"] == sub]
            if len(part):
                ax.scatter(part["depth"], part[key], s=18, marker=SUBLAYER_MARKERS[sub], color=SUBLAYER_PALETTE[sub])
        if f"baseline_{key}" in d and d[f"baseline_{key}"].notna().any():
            ax.axhline(float(d[f"baseline_{key}"].iloc[0]), ls=":", color="black", lw=1.0)
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"{task}\n{ylabel}")


def _accuracy_panel(ax, d: pd.DataFrame, task: str, kind: str | None = None) -> None:
    """One task's test accuracy per site (95% binomial bars, markers by sublayer), with the
    control-task accuracy and the majority-class baseline when the table has them; ``kind``
    (the probe) picks the line colour and marker fill (:data:`PROBE_STYLE`)."""
    color, fill = PROBE_STYLE.get(kind, ("#999999", None))
    ax.plot(d["depth"], d["accuracy"], color=color, lw=1, zorder=1)
    for sub in SUBLAYER_ORDER:
        part = d[d["sublayer"] == sub]
        if len(part):
            err = _binomial_se(part["accuracy"].to_numpy(), part["n_test"].to_numpy() if "n_test" in part else 1)
            ax.errorbar(
                part["depth"],
                part["accuracy"],
                yerr=1.96 * err,
                fmt=SUBLAYER_MARKERS[sub],
                ms=4,
                color=SUBLAYER_PALETTE[sub],
                mfc=fill or SUBLAYER_PALETTE[sub],
                elinewidth=0.8,
                capsize=0,
                zorder=2,
            )
    if "control_accuracy" in d and d["control_accuracy"].notna().any():
        ax.plot(
            d["depth"], d["control_accuracy"], ls="--", color="#7f7f7f" if kind in (None, "linear") else color, lw=1.2
        )
    if "majority_accuracy" in d and d["majority_accuracy"].notna().any():
        ax.axhline(float(d["majority_accuracy"].iloc[0]), ls=":", color="black", lw=1.0)
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"{task}\naccuracy")


def _selectivity_panel(ax, d: pd.DataFrame, task: str, kind: str | None = None) -> None:
    """One task's selectivity (accuracy - control accuracy, in points) per site, when known
    (``kind``: the probe, as in :func:`_accuracy_panel`)."""
    color, fill = PROBE_STYLE.get(kind, ("#999999", None))
    if "selectivity" in d and d["selectivity"].notna().any():
        ax.plot(d["depth"], 100 * d["selectivity"], color=color, lw=1, zorder=1)
        for sub in SUBLAYER_ORDER:
            part = d[d["sublayer"] == sub]
            if len(part):
                ax.scatter(
                    part["depth"],
                    100 * part["selectivity"],
                    s=18,
                    marker=SUBLAYER_MARKERS[sub],
                    edgecolors=SUBLAYER_PALETTE[sub],
                    facecolors=fill or SUBLAYER_PALETTE[sub],
                    zorder=2,
                )
        ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel(f"{task}\nselectivity (points)")


def plot_tenney(summary: pd.DataFrame, mixing: pd.DataFrame, path) -> Path:
    """Tenney-style summary: Delta bars per depth, mixing weights, E_Delta and E_s."""
    if mixing is None or not len(mixing):
        return _no_mixing_figure(path)
    rows = _by_task_and_probe(mixing)
    n = max(1, len(rows))
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.9 * n + 1.1), sharex=True, sharey=True, squeeze=False)
    L = _n_layers(mixing)
    summ = dict(_by_task_and_probe(summary)) if summary is not None and len(summary) else {}
    for ax, (label, dm) in zip(axes[:, 0], rows):
        dm = dm.sort_values("depth")
        _delta_bars(ax, dm, label)
        _mix_weight_line(ax, dm)
        if label in summ:
            _expected_layer_marks(ax, summ[label].iloc[0], L)
    depth_axis(axes[-1, 0], L)
    _tenney_header(fig)
    savefig(fig, path)
    return Path(path)


def _no_mixing_figure(path) -> Path:
    """A one-line figure saying the run has no cumulative scoring (so no Tenney figure)."""
    fig, ax = plt.subplots(figsize=(6, 1.5))
    ax.axis("off")
    ax.text(0.5, 0.5, "no cumulative scoring in this run (run_probes(..., cumulative=True))", ha="center", va="center")
    savefig(fig, path)
    return Path(path)


def _delta_bars(ax, dm: pd.DataFrame, task: str) -> None:
    """One task's cumulative-scoring gains Delta per depth as bars coloured by sublayer."""
    d = dm[dm["site"] != dm["site"].min()]  # Delta(0) is the embedding's own score, not a gain
    colors = [SUBLAYER_PALETTE.get(s, "#555555") for s in d["sublayer"]]
    ax.bar(d["depth"], d["delta"], width=0.42, color=colors, alpha=0.9, zorder=2)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_ylabel(f"{task}\n$\\Delta$ soft acc.", fontsize=9)


def _mix_weight_line(ax, dm: pd.DataFrame) -> None:
    """One task's scalar-mix weights per depth on a twin axis of their own."""
    ax2 = ax.twinx()
    ax2.plot(dm["depth"], dm["mix_weight"], color="#2ca02c", lw=1.2, marker=".", ms=3, zorder=3)
    ax2.set_ylim(0, max(0.05, float(dm["mix_weight"].max()) * 1.15))
    ax2.set_ylabel("mix weight s", fontsize=8, color="#2ca02c")
    ax2.tick_params(axis="y", labelsize=7, colors="#2ca02c")
    ax2.grid(False)


#: the expected layers marked on the Tenney figure: column, label, colour, line style, width, label height
_EXPECTED_MARKS = [
    ("expected_layer_delta", "$E_\\Delta$", "#9467bd", "-", 2.0, 1.0),
    ("expected_layer_mix", "$E_s$", "#2ca02c", "--", 1.5, 0.97),
]


def _expected_layer_marks(ax, r: pd.Series, L: int) -> None:
    """One task's E_Delta (with its 95% interval as a band) and E_s as labelled vertical lines;
    values off the depth axis are drawn at its edge and said to be off scale."""
    if {"expected_layer_delta_lo", "expected_layer_delta_hi"} <= set(r.index):
        lo, hi = float(r["expected_layer_delta_lo"]), float(r["expected_layer_delta_hi"])
        if np.isfinite(lo) and np.isfinite(hi):  # bootstrap interval of E_Delta over test examples
            ax.axvspan(max(lo, -0.4), min(hi, L + 0.4), color="#9467bd", alpha=0.12, lw=0, zorder=0)
    for col, name, color, ls, lw, ypos in _EXPECTED_MARKS:
        e = float(r[col]) if col in r.index else float("nan")
        if not np.isfinite(e):
            continue
        shown = min(max(e, -0.4), L + 0.4)
        off = " (off scale)" if shown != e else ""
        ax.axvline(shown, color=color, lw=lw, ls=ls, zorder=4)
        # E_Delta's label on the side away from E_s, so the two never overlap
        other = float(r["expected_layer_mix" if col == "expected_layer_delta" else "expected_layer_delta"])
        right = shown >= other if np.isfinite(other) else shown < 0.8 * L
        ax.text(
            shown,
            ypos,
            f" {name} = {e:.2f}{off} ",
            transform=ax.get_xaxis_transform(),
            va="top",
            ha="left" if right else "right",
            fontsize=8,
            color=color,
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.7, pad=0.5),
        )


def _tenney_header(fig) -> None:
    """The Tenney figure's title, then its two-row legend, in a band of fixed height (inches)
    above the panels."""
    handles = [plt.Rectangle((0, 0), 1, 1, color=SUBLAYER_PALETTE[s]) for s in SUBLAYER_ORDER if s != "embed"]
    labels = [f"$\\Delta$ at {s} sites" for s in SUBLAYER_ORDER if s != "embed"]
    handles += [
        plt.Line2D([], [], color="#2ca02c", marker=".", lw=1.2),
        plt.Line2D([], [], color="#9467bd", lw=2),
        plt.Line2D([], [], color="#2ca02c", lw=1.5, ls="--"),
    ]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#9467bd", alpha=0.12))
    labels += ["scalar mix weight $s$", "$E_\\Delta$ (cumulative)", "$E_s$ (scalar mix)", "$E_\\Delta$ 95% interval"]
    height = fig.get_figheight()
    title_h, legend_h = 0.24, 0.2  # (tight_layout adds its own padding below)
    fig.suptitle("Which depth encodes which property (Tenney et al. 2019 style)", y=1 - 0.04 / height, fontsize=11)
    fig.legend(
        handles,
        labels,
        loc="upper center",
        ncol=4,
        frameon=False,
        fontsize=8,
        bbox_to_anchor=(0.5, 1 - title_h / height),
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - (title_h + legend_h) / height))
