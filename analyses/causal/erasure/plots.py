"""The figure of the causal erasure tests, drawn from their table only.

``plot_causal(table, path)``
    one row per task, depth on a shared x axis: left, what is encoded (linear-probe test accuracy
    per site, markers by sublayer; the accuracy after LEACE erasure, dashed; the majority-class
    baseline, dotted); right, what is used (``used``: the extra next-token loss of erasing the
    concept beyond a random erasure of the same rank, as a fraction of the clean loss, with its
    95% bootstrap band; 0 dotted). ``table`` is :attr:`CausalResult.table` (columns task, depth,
    sublayer, accuracy, accuracy_erased, majority, used, used_lo, used_hi). Returns the path.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from depthscope.analyses.style import SUBLAYER_MARKERS, SUBLAYER_ORDER, SUBLAYER_PALETTE, depth_axis, plt, savefig


def _by_sublayer(ax, d: pd.DataFrame, y: str) -> None:
    """``y`` against depth: a grey line through every site, markers coloured by sublayer."""
    ax.plot(d["depth"], d[y], color="#999999", lw=1, zorder=1)
    for sub in SUBLAYER_ORDER:
        part = d[d["sublayer"] == sub]
        if len(part):
            ax.scatter(
                part["depth"], part[y], s=20, marker=SUBLAYER_MARKERS[sub], color=SUBLAYER_PALETTE[sub], zorder=2
            )


def _encoded(ax, d: pd.DataFrame, task: str) -> None:
    _by_sublayer(ax, d, "accuracy")
    ax.plot(d["depth"], d["accuracy_erased"], color="#7f7f7f", ls="--", lw=1.2)
    ax.axhline(float(d["majority"].iloc[0]), color="black", ls=":", lw=1)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel(f"{task}\nprobe accuracy")


def _used(ax, d: pd.DataFrame, task: str) -> None:
    if d["used_lo"].notna().any():
        ax.fill_between(d["depth"], d["used_lo"], d["used_hi"], color="#9467bd", alpha=0.2, lw=0)
    _by_sublayer(ax, d, "used")
    ax.axhline(0, color="black", ls=":", lw=1)
    ax.set_ylabel(f"{task}\nused (fraction of loss)")


def plot_causal(table: pd.DataFrame, path) -> Path:
    """See the module docstring."""
    tasks = list(dict.fromkeys(table["task"]))
    n = max(1, len(tasks))
    fig, axes = plt.subplots(n, 2, figsize=(11, 2.8 * n + 0.6), squeeze=False, sharex=True)
    n_layers = int(table["layer"].max()) + 1 if "layer" in table and table["layer"].notna().any() else None
    for row, task in zip(axes, tasks):
        d = table[table["task"] == task].sort_values("depth")
        _encoded(row[0], d, task)
        _used(row[1], d, task)
    for ax in axes[-1]:
        depth_axis(ax, n_layers)
    axes[0, 0].set_title("encoded: linear probe accuracy, before and after LEACE", fontsize=10)
    axes[0, 1].set_title("used: loss of erasing it beyond a random erasure (95% band)", fontsize=10)
    handles = [plt.Line2D([], [], color=SUBLAYER_PALETTE[s], marker=SUBLAYER_MARKERS[s], lw=0) for s in SUBLAYER_ORDER]
    handles += [plt.Line2D([], [], color="#7f7f7f", ls="--"), plt.Line2D([], [], color="black", ls=":")]
    labels = [f"{s} site" for s in SUBLAYER_ORDER] + ["after erasure", "majority class / 0"]
    fig.legend(handles, labels, loc="lower center", ncol=5, frameon=False, fontsize=9, bbox_to_anchor=(0.5, 0))
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    savefig(fig, path)
    return Path(path)
