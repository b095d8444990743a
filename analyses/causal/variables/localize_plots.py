"""The figures of ``depthscope localize``, drawn from its tables only.

``plot_iia(table, path)``
    IIA against depth, one line per named position (its 95% band shaded), the random subspace's
    IIA dashed in the same colour (DAS), and the IIA with no intervention dotted (the floor).
    ``table``: the localize table (columns depth, position, iia, iia_low, iia_high, iia_random,
    iia_unchanged, method, dim). Returns the path.
``plot_three_curves(table, probes, path)``
    One property three ways, side by side against depth: decodable (the probe's test accuracy,
    ``probes``: the causal table's ``accuracy`` and ``majority``), needed (the causal table's
    ``used`` with its band) and computed with (IIA per position, as in :func:`plot_iia`).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from depthscope.analyses.style import depth_axis, plt, savefig

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _n_layers(table: pd.DataFrame) -> int | None:
    return int(table["layer"].max()) + 1 if "layer" in table and table["layer"].notna().any() else None


def _iia(ax, table: pd.DataFrame) -> None:
    for k, (pos, d) in enumerate(table.groupby("position", sort=False)):
        d = d.sort_values("depth")
        c = PALETTE[k % len(PALETTE)]
        if d["iia_low"].notna().any():
            ax.fill_between(d["depth"], d["iia_low"], d["iia_high"], color=c, alpha=0.15, lw=0)
        ax.plot(d["depth"], d["iia"], color=c, marker="o", ms=3, lw=1.5, label=f"{pos}")
        if d["iia_random"].notna().any():
            ax.plot(d["depth"], d["iia_random"], color=c, ls="--", lw=1, label=f"{pos}: random subspace")
        ax.plot(d["depth"], d["iia_unchanged"], color=c, ls=":", lw=1, label=f"{pos}: no intervention")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("IIA")
    ax.legend(fontsize=8, frameon=False)


def _what(table: pd.DataFrame) -> str:
    method = str(table["method"].iloc[0])
    dims = sorted(set(int(x) for x in table["dim"]))
    return f"{method}, dim {dims[0]}" if len(dims) == 1 else method


def plot_iia(table: pd.DataFrame, path) -> Path:
    """See the module docstring."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    _iia(ax, table)
    depth_axis(ax, _n_layers(table))
    var = table["variable"].dropna()
    name = f" of '{var.iloc[0]}'" if len(var) else ""
    ax.set_title(f"interchange intervention accuracy{name} ({_what(table)}; 95% band)", fontsize=10)
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)


def plot_three_curves(table: pd.DataFrame, probes: pd.DataFrame, path) -> Path:
    """See the module docstring."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharex=True)
    p = probes.sort_values("depth")
    task = str(p["task"].iloc[0]) if "task" in p and len(p) else "probe"
    axes[0].plot(p["depth"], p["accuracy"], color="#333333", marker="o", ms=3, lw=1.5)
    axes[0].axhline(float(p["majority"].iloc[0]), color="black", ls=":", lw=1)
    axes[0].set_ylim(0, 1.02)
    axes[0].set_ylabel("probe accuracy")
    axes[0].set_title(f"decodable: linear probe of {task} (dotted: majority)", fontsize=10)
    if p["used_lo"].notna().any():
        axes[1].fill_between(p["depth"], p["used_lo"], p["used_hi"], color="#9467bd", alpha=0.2, lw=0)
    axes[1].plot(p["depth"], p["used"], color="#9467bd", marker="o", ms=3, lw=1.5)
    axes[1].axhline(0, color="black", ls=":", lw=1)
    axes[1].set_ylabel("used (fraction of loss)")
    axes[1].set_title(f"needed: LEACE erasure of {task} (95% band)", fontsize=10)
    _iia(axes[2], table)
    axes[2].set_title(f"computed with: IIA ({_what(table)}; 95% band)", fontsize=10)
    n_layers = _n_layers(table) or _n_layers(p)
    for ax in axes:
        depth_axis(ax, n_layers)
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)
