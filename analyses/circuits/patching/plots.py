"""Figures of patching results, drawn from the tables of :mod:`depthscope.analyses.circuits.patching.activation` only.

| function | figure |
|---|---|
| ``plot_patching_sites`` | hook point x position heatmap of the fraction recovered (rows in forward order) |
| ``plot_patching_heads`` | layer x head heatmap for per-head points (``l.heads`` / ``l.z``), one panel per kind |
| ``plot_attribution_vs_exact`` | attribution estimate against exact patching, one dot per patch |

Each takes a table (one of :func:`~depthscope.analyses.circuits.patching.activation.activation_patching` or
:func:`~depthscope.analyses.circuits.patching.activation.attribution_patching`, or the job's ``patching_by_site`` /
``patching_by_head``, which hold both methods) and a path, draws
one figure in the shared style and returns the path. Colours are diverging and centred at 0
(red: the patch restores the clean behaviour, blue: it pushes the other way).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from depthscope.analyses.style import need_columns, plt, savefig, sns
from depthscope.common.errors import InputError

__all__ = ["plot_patching_sites", "plot_patching_heads", "plot_attribution_vs_exact"]

_CMAP = "RdBu_r"


def _one_method(df: pd.DataFrame, method: str | None, what: str) -> pd.DataFrame:
    """The rows of one patching method (default: exact activation patching when present)."""
    if "method" not in df.columns:
        return df
    methods = list(dict.fromkeys(df["method"]))
    method = method or ("activation" if "activation" in methods else methods[0])
    d = df[df["method"] == method]
    if not len(d):
        raise InputError(f"{what}: no rows of method {method!r} (the table has {methods})")
    return d


def _limit(vals: np.ndarray) -> float:
    """The colour scale's half-range: the largest finite magnitude, at least 1."""
    ok = np.abs(vals[np.isfinite(vals)])
    return float(max(1.0, ok.max())) if len(ok) else 1.0


def _position_label(r) -> str:
    """A heatmap column label: the position (its index, or its name when pairs of a dataset put it
    at different indices) and its token (clean -> corrupted when they differ; left out when the
    pairs' tokens differ)."""
    name = r.get("position_name", None)
    if pd.isna(r["position"]) and (name is None or name == "all" or pd.isna(name)):
        return "all positions"
    tok, clean = r.get("token", "") or "", r.get("clean_token", "") or ""
    shown = repr(tok) if tok == clean else f"{clean!r}→{tok!r}"
    where = str(name) if pd.isna(r["position"]) else str(int(r["position"]))
    if name is not None and not pd.isna(name) and str(name) not in ("last", "all", where):
        where = f"{name} ({where})"
    return f"{where} {shown}" if tok or clean else where


def _positions(d: pd.DataFrame) -> pd.Series:
    """The key of each row's patched position: its name where the table has one, else its index."""
    if "position_name" in d.columns:
        return d["position_name"].astype(str)
    return d["position"].fillna(-1).astype(int).astype(str)


def _title(df: pd.DataFrame, text: str) -> str:
    """``text`` (with the direction when it is ``noise``), then the clean and corrupted metric
    values and the model, one per line."""
    noising = "direction" in df.columns and len(df) and (df["direction"] == "noise").all()
    bits = [f"{text}, noising (corrupted values into the clean run)" if noising else text]
    metric = df.attrs.get("metric")
    if metric is None and "clean_metric" in df.columns:
        metric = "metric"
    if "clean_metric" in df.columns:
        over = f", means over {int(df['n_pairs'].iloc[0])} pairs" if "n_pairs" in df.columns else ""
        bits.append(
            f"{metric}: clean {df['clean_metric'].iloc[0]:.2f}, corrupted {df['corrupted_metric'].iloc[0]:.2f}{over}"
        )
    if df.attrs.get("model"):
        bits.append(str(df.attrs["model"]))
    return "\n".join(bits)


def plot_patching_sites(
    df: pd.DataFrame, path, *, value: str = "fraction_recovered", method: str | None = None
) -> Path:
    """Hook point x position heatmap: rows are the patched points in forward order (per-head
    points left out), columns the patched positions labelled with their tokens (``clean→corrupted``
    where the prompts differ)."""
    what = "plot_patching_sites"
    need_columns(df, ["site", "point", "head", "position", value], what)
    d = _one_method(df, method, what)
    d = d[d["head"].isna()]
    if not len(d):
        raise InputError(f"{what}: only per-head rows; use plot_patching_heads")
    d = d.assign(_pos=_positions(d))
    rows = list(dict.fromkeys(d.sort_values("site", kind="stable")["point"]))  # forward order
    order = list(dict.fromkeys(d["_pos"]))  # the table's order: forward order of positions
    grid = d.pivot_table(index="point", columns="_pos", values=value, aggfunc="first").reindex(rows)[order]
    cols = d.drop_duplicates("_pos").set_index("_pos")
    xlabels = [_position_label(cols.loc[p]) for p in grid.columns]
    vals = grid.to_numpy(float)
    lim = _limit(vals)
    fig, ax = plt.subplots(figsize=(min(18, 3 + 0.55 * grid.shape[1]), min(16, 1.5 + 0.16 * grid.shape[0])))
    sns.heatmap(
        vals,
        ax=ax,
        cmap=_CMAP,
        vmin=-lim,
        vmax=lim,
        center=0,
        xticklabels=xlabels,
        yticklabels=list(grid.index),
        cbar_kws={"label": value.replace("_", " ")},
    )
    ax.set_xlabel("patched position (token)")
    ax.set_ylabel("patched hook point")
    ax.tick_params(axis="x", labelsize=7, rotation=60)
    ax.tick_params(axis="y", labelsize=6, rotation=0)
    estimate = "method" in d.columns and d["method"].iloc[0] == "attribution"
    ax.set_title(_title(df, "Attribution patching (estimate)" if estimate else "Activation patching"), fontsize=9)
    savefig(fig, path)
    return Path(path)


def plot_patching_heads(
    df: pd.DataFrame,
    path,
    *,
    value: str = "fraction_recovered",
    method: str | None = None,
    position: int | str | None = None,
) -> Path:
    """Layer x head heatmap of per-head patches, one panel per kind (``heads``, ``z``, ``q``...).

    With several patched positions, ``position`` picks one (an index, or a position name of a
    dataset's table; default: the last patched one); rows that patched every position at once are
    used as they are."""
    what = "plot_patching_heads"
    need_columns(df, ["layer", "head", "kind", "position", value], what)
    d, where = _head_rows(_one_method(df, method, what), position, what)
    kinds = list(dict.fromkeys(d["kind"]))
    grids = [
        d[d["kind"] == k].pivot_table(index="layer", columns="head", values=value, aggfunc="first").sort_index()
        for k in kinds
    ]
    titles = [f"{kind} ({where})" for kind in kinds]
    fig = head_panels(grids, titles, value, ("head", "layer"))
    fig.suptitle(_title(df, "Patching per head"), fontsize=9)
    savefig(fig, path)
    return Path(path)


def head_panels(grids: list[pd.DataFrame], titles: list[str], value: str, axes_labels: tuple[str, str]):
    """A figure of layer x head heatmaps side by side, one per grid (rows: layers, columns: heads),
    on one diverging colour scale centred on 0; ``axes_labels`` are (x, y)."""
    lim = _limit(np.concatenate([g.to_numpy(float).ravel() for g in grids]))
    n_layers, n_heads = max(g.shape[0] for g in grids), max(g.shape[1] for g in grids)
    # constrained layout keeps a three-line suptitle clear of the panel titles on short grids
    fig, axes = plt.subplots(
        1,
        len(grids),
        figsize=(max(5.5, len(grids) * (2.5 + 0.45 * n_heads)), 2.4 + 0.22 * n_layers),
        squeeze=False,
        layout="constrained",
    )
    for ax, title, grid in zip(axes[0], titles, grids):
        sns.heatmap(
            grid.to_numpy(float),
            ax=ax,
            cmap=_CMAP,
            vmin=-lim,
            vmax=lim,
            center=0,
            xticklabels=[int(h) for h in grid.columns],
            yticklabels=[int(v) for v in grid.index],
            cbar_kws={"label": value.replace("_", " ")},
        )
        ax.set_xlabel(axes_labels[0])
        ax.set_ylabel(axes_labels[1])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="y", labelsize=7, rotation=0)
    return fig


def _head_rows(d: pd.DataFrame, position, what: str) -> tuple[pd.DataFrame, str]:
    """The per-head rows to draw and where they patched: at ``position`` (default: the last
    patched one) when positions were patched one at a time, else the all-positions rows."""
    d = d[d["head"].notna()]
    if not len(d):
        raise InputError(f"{what}: no per-head rows (patch '<layer>.heads' or '<layer>.z' points)")
    named = "position_name" in d.columns and (isinstance(position, str) or d["position"].isna().all())
    if named and not (d["position_name"] == "all").all():
        names = list(dict.fromkeys(d["position_name"]))
        name = names[-1] if position is None else str(position)
        d = d[d["position_name"] == name]
        if not len(d):
            raise InputError(f"{what}: no per-head rows at position {name!r} (the table has {names})")
        return d, f"position {name}"
    if not d["position"].notna().any():
        return d, "all positions"
    pos = int(d["position"].max()) if position is None else int(position)
    d = d[d["position"] == pos]
    if not len(d):
        raise InputError(f"{what}: no per-head rows at position {pos}")
    return d, f"position {pos}"


def plot_attribution_vs_exact(df: pd.DataFrame, path, *, value: str = "fraction_recovered") -> Path:
    """One dot per patch: the attribution estimate against exact activation patching, the
    diagonal for reference and the Spearman rank correlation in the title."""
    what = "plot_attribution_vs_exact"
    need_columns(df, ["method", "point", "head", "position", value], what)
    keys = ["point", "head", "position_name" if "position_name" in df.columns else "position"]
    a = df[df["method"] == "activation"].set_index(keys)[value]
    b = df[df["method"] == "attribution"].set_index(keys)[value]
    both = pd.concat({"exact": a, "attribution": b}, axis=1, join="inner").dropna()
    if len(both) < 2:
        raise InputError(f"{what}: the table needs activation and attribution rows of the same patches")
    rho = spearmanr(both["exact"], both["attribution"]).statistic
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(both["exact"], both["attribution"], s=14, alpha=0.7, color="#1f77b4")
    lo = float(min(both.min().min(), 0))
    hi = float(max(both.max().max(), 1))
    ax.plot([lo, hi], [lo, hi], color="#999999", lw=0.8, ls="--")
    ax.set_xlabel(f"exact (activation patching): {value.replace('_', ' ')}")
    ax.set_ylabel("attribution patching estimate")
    ax.set_title(_title(df, f"Attribution vs exact patching: Spearman {rho:.3f} over {len(both)} patches"), fontsize=9)
    savefig(fig, path)
    return Path(path)
