"""Figures of the probing suite, drawn from its tables only.

``plot_probe_curves(by_site, path)``
    one row per task: test accuracy (solid) and control-task accuracy (dashed) against depth,
    and selectivity (accuracy - control accuracy) against depth; sites coloured by sublayer.
    ``by_site`` is ``ProbeResults.by_site`` (columns task, site, label, layer, sublayer, depth,
    accuracy, control_accuracy, selectivity).
``plot_tenney(summary, mixing, path)``
    Tenney et al. (2019)'s figure: per task (stacked in pipeline order) the cumulative-scoring
    gains Delta per depth as bars (coloured by sublayer), the scalar-mix weights as a line, and
    the expected layers E_Delta (solid) and E_s (dashed) marked. ``summary`` is
    ``ProbeResults.summary`` (task, expected_layer_delta, expected_layer_mix), ``mixing`` is
    ``ProbeResults.mixing`` (task, site, sublayer, depth, delta, mix_weight).

Both return the path written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from depthscope.probes.tasks import pipeline_rank

from .style import SUBLAYER_ORDER, SUBLAYER_PALETTE, depth_axis, lineplot_by_sublayer, plt, savefig


def _task_order(tasks) -> list:
    return sorted(pd.unique(pd.Series(list(tasks))), key=lambda t: (pipeline_rank(str(t)), str(t)))


def _n_layers(df: pd.DataFrame) -> int:
    return int(np.ceil(df["depth"].max())) if len(df) else 0


def plot_probe_curves(by_site: pd.DataFrame, path) -> Path:
    """Accuracy / control accuracy and selectivity against depth, one row per task."""
    tasks = _task_order(by_site["task"])
    n = max(1, len(tasks))
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.1 * n), squeeze=False)
    L = _n_layers(by_site)
    for row, task in zip(axes, tasks):
        d = by_site[by_site["task"] == task].sort_values("depth")
        ax = row[0]
        lineplot_by_sublayer(ax, d, "accuracy", ylabel="accuracy", n_layers=L)
        if "control_accuracy" in d and d["control_accuracy"].notna().any():
            ax.plot(d["depth"], d["control_accuracy"], ls="--", color="#7f7f7f", lw=1.2, label="control task")
            ax.legend(title="site", frameon=False, fontsize=8)
        ax.set_title(f"{task}: test accuracy (dashed: control task)")
        ax = row[1]
        if "selectivity" in d and d["selectivity"].notna().any():
            lineplot_by_sublayer(ax, d, "selectivity", ylabel="selectivity", n_layers=L)
            ax.axhline(0, color="black", lw=0.6)
        ax.set_title(f"{task}: selectivity (accuracy - control)")
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)


def plot_tenney(summary: pd.DataFrame, mixing: pd.DataFrame, path) -> Path:
    """Tenney-style summary: Delta bars per depth, mixing weights, E_Delta and E_s."""
    if mixing is None or not len(mixing):
        fig, ax = plt.subplots(figsize=(6, 1.5))
        ax.axis("off")
        ax.text(
            0.5, 0.5, "no cumulative scoring in this run (run_probes(..., cumulative=True))", ha="center", va="center"
        )
        savefig(fig, path)
        return Path(path)
    tasks = _task_order(mixing["task"])
    n = max(1, len(tasks))
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.9 * n + 0.8), sharex=True, squeeze=False)
    L = _n_layers(mixing)
    summ = summary.set_index("task") if summary is not None and len(summary) else pd.DataFrame()
    for ax, task in zip(axes[:, 0], tasks):
        d = mixing[mixing["task"] == task].sort_values("depth")
        d = d[d["site"] != d["site"].min()]  # Delta(0) is the embedding's own score, not a gain
        colors = [SUBLAYER_PALETTE.get(s, "#555555") for s in d["sublayer"]]
        ax.bar(d["depth"], d["delta"], width=0.42, color=colors, alpha=0.9, zorder=2)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylabel(f"{task}\nDelta acc", fontsize=9)
        ax2 = ax.twinx()
        dm = mixing[mixing["task"] == task].sort_values("depth")
        ax2.plot(dm["depth"], dm["mix_weight"], color="#2ca02c", lw=1.2, marker=".", ms=3, zorder=3)
        ax2.set_ylim(0, max(0.05, float(dm["mix_weight"].max()) * 1.15))
        ax2.set_ylabel("mix weight s", fontsize=8, color="#2ca02c")
        ax2.tick_params(axis="y", labelsize=7, colors="#2ca02c")
        ax2.grid(False)
        if task in summ.index and {"expected_layer_delta_lo", "expected_layer_delta_hi"} <= set(summ.columns):
            lo, hi = float(summ.loc[task, "expected_layer_delta_lo"]), float(summ.loc[task, "expected_layer_delta_hi"])
            if np.isfinite(lo) and np.isfinite(hi):  # bootstrap interval of E_Delta over test examples
                ax.axvspan(max(lo, -0.4), min(hi, L + 0.4), color="#9467bd", alpha=0.12, lw=0, zorder=0)
        if task in summ.index:
            marks = [
                ("expected_layer_delta", "E_Delta", "#9467bd", "-", 2.0, 1.0),
                ("expected_layer_mix", "E_s", "#2ca02c", "--", 1.5, 0.78),
            ]
            for col, name, color, ls, lw, ypos in marks:
                e = float(summ.loc[task, col]) if col in summ.columns else float("nan")
                if not np.isfinite(e):
                    continue
                shown = min(max(e, -0.4), L + 0.4)
                off = " (off scale)" if shown != e else ""
                ax.axvline(shown, color=color, lw=lw, ls=ls, zorder=4)
                ha = "right" if shown > 0.8 * L else "left"
                ax.text(
                    shown,
                    ypos,
                    f" {name}={e:.2f}{off} ",
                    transform=ax.get_xaxis_transform(),
                    va="top",
                    ha=ha,
                    fontsize=8,
                    color=color,
                )
    depth_axis(axes[-1, 0], L)
    handles = [plt.Rectangle((0, 0), 1, 1, color=SUBLAYER_PALETTE[s]) for s in SUBLAYER_ORDER if s != "embed"]
    labels = [f"Delta at {s} sites" for s in SUBLAYER_ORDER if s != "embed"]
    handles += [
        plt.Line2D([], [], color="#2ca02c", marker=".", lw=1.2),
        plt.Line2D([], [], color="#9467bd", lw=2),
        plt.Line2D([], [], color="#2ca02c", lw=1.5, ls="--"),
    ]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#9467bd", alpha=0.12))
    labels += ["scalar mix weight s", "E_Delta (cumulative)", "E_s (scalar mix)", "E_Delta 95% bootstrap interval"]
    fig.legend(handles, labels, loc="upper center", ncol=6, frameon=False, fontsize=8, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle("Which depth encodes which property (Tenney et al. 2019 style)", y=1.04, fontsize=11)
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)
