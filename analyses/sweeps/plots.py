"""Figures across checkpoints, drawn from a sweep's combined tables."""

from __future__ import annotations

import pandas as pd

from depthscope.analyses import style
from depthscope.analyses.style import plt, savefig, sns


def _order(df: pd.DataFrame) -> list[str]:
    first = df.drop_duplicates("checkpoint")[["checkpoint", "step"]]
    first = first.assign(_s=pd.to_numeric(first["step"], errors="coerce"))
    return first.sort_values(["_s", "checkpoint"], na_position="last")["checkpoint"].tolist()


def plot_checkpoint_heatmap(df: pd.DataFrame, metric: str, path, *, title: str | None = None, cmap: str = "viridis"):
    """A checkpoint x depth heatmap of ``metric`` (one cell per site; rows ordered by step)."""
    if metric not in df.columns:
        raise KeyError(f"no column {metric!r} in the sweep table; columns: {list(df.columns)}")
    d = df
    if "task" in d.columns and d["task"].nunique() > 1:
        raise ValueError("several tasks in the table: filter one task first")
    order = _order(d)
    piv = d.pivot_table(index="checkpoint", columns="depth", values=metric, aggfunc="mean").reindex(order)
    steps = d.drop_duplicates("checkpoint").set_index("checkpoint")["step"].reindex(order)
    ylabels = [f"{c} (step {int(s)})" if pd.notna(s) and str(int(s)) not in c else c for c, s in zip(order, steps)]
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.18 * piv.shape[1]), 1.2 + 0.45 * len(order)))
    im = ax.imshow(piv.to_numpy(dtype=float), aspect="auto", cmap=cmap, interpolation="nearest")
    depths = list(piv.columns)
    step = max(1, len(depths) // 12)
    ax.set_xticks(range(0, len(depths), step))
    ax.set_xticklabels([f"{x:g}" for x in depths[::step]])
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(ylabels)
    ax.set_xlabel(style.DEPTH_LABEL)
    ax.set_ylabel("checkpoint")
    ax.grid(False)
    fig.colorbar(im, ax=ax, label=metric)
    ax.set_title(title or f"{metric} across checkpoints")
    savefig(fig, path)
    return path


def plot_metric_over_training(df: pd.DataFrame, metric: str, path, *, hue: str = "task", title: str | None = None):
    """A per-checkpoint summary (e.g. ``expected_layer_delta`` per task) against training step."""
    d = df.copy()
    d["step"] = pd.to_numeric(d["step"], errors="coerce")
    if d["step"].isna().all():
        d["step"] = d["checkpoint"].map({c: i for i, c in enumerate(_order(df))})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    sns.lineplot(data=d, x="step", y=metric, hue=hue if hue in d.columns else None, marker="o", ax=ax)
    ax.set_xlabel("training step")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title or f"{metric.replace('_', ' ')} across training")
    savefig(fig, path)
    return path


def plot_final_site_over_training(df: pd.DataFrame, metric: str, path):
    """``metric`` at every sublayer, one line per checkpoint (colour = step)."""
    order = _order(df)
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, ck in enumerate(order):
        part = df[df["checkpoint"] == ck].sort_values("depth")
        ax.plot(part["depth"], part[metric], color=cmap(i / max(1, len(order) - 1)), label=ck, lw=1.5)
    ax.set_xlabel(style.DEPTH_LABEL)
    ax.set_ylabel(metric.replace("_", " "))
    ax.legend(fontsize=7, ncol=2, frameon=False)
    savefig(fig, path)
    return path


__all__ = ["plot_checkpoint_heatmap", "plot_metric_over_training", "plot_final_site_over_training"]
