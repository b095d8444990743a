"""Figures of contribution norms, drawn from the tables of :mod:`depthscope.analyses.norms` only.

Every function takes a DataFrame and a path, draws one figure in the shared style and returns
the path. ``df`` is a :func:`~depthscope.analyses.norms.contribution_norms` table (one row per
``(site, positions)``), ``pos_df`` a :func:`~depthscope.analyses.norms.norms_by_position` table,
``dla_df`` a :func:`~depthscope.analyses.norms.direct_logit_attribution` table.

Curves of per-site means (stream norm, update norms, relative update, cosine, attention share)
carry the 95% interval of each mean as a band or error bar when the table has the
``<metric>_lo``/``<metric>_hi`` columns (documents as clusters,
:mod:`depthscope.analyses.intervals`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.patches import Patch

from depthscope.analyses.lens.plots import BAND_ALPHA, band_label, interval_band
from depthscope.analyses.norms.growth import fit_growth_rate
from depthscope.analyses.style import (
    SUBLAYER_ORDER,
    SUBLAYER_PALETTE,
    depth_axis,
    lineplot_by_sublayer,
    need_columns,
    plt,
    savefig,
    sns,
)
from depthscope.common.errors import InputError

__all__ = [
    "plot_stream_growth",
    "plot_update_norms",
    "plot_relative_update",
    "plot_position_heatmap",
    "plot_dla",
    "plot_head_writes",
]

FIRST_STYLE = dict(color="#333333", lw=1.2, ls="--", marker=".", ms=4)
REST_BAND = "#999999"  # the colour of lineplot_by_sublayer's line
FIRST_BAND_ALPHA = 0.12


def _bands(ax, rest, first, col: str, *, positive: bool = False) -> bool:
    """The 95% intervals of ``col`` behind the rest-positions curve and the first-position one."""
    drawn = interval_band(ax, rest.sort_values("depth"), col, REST_BAND, positive=positive)
    if len(first):
        f = first.sort_values("depth")
        drawn |= interval_band(ax, f, col, FIRST_STYLE["color"], alpha=FIRST_BAND_ALPHA, positive=positive)
    return drawn


def _band_handle(ax, df, ncol: int = 1) -> None:
    """Add the band to ``ax``'s legend (after the curves' own entries)."""
    handles, labels = ax.get_legend_handles_labels()
    patch = Patch(color=REST_BAND, alpha=BAND_ALPHA, lw=0)
    ax.legend(handles + [patch], labels + [band_label(df)], frameon=False, fontsize=8, ncol=ncol)


def _split(df: pd.DataFrame):
    if "positions" not in df.columns:
        return df, df.iloc[0:0]
    return df[df["positions"] == "rest"], df[(df["positions"] == "first") & (df["n_tokens"] > 0)]


def _n_layers(df: pd.DataFrame) -> int:
    return int(df["layer"].max()) + 1


def _title(ax_or_fig, df, text: str) -> None:
    name = df.attrs.get("model") if hasattr(df, "attrs") else None
    full = f"{text} — {name}" if name else text
    if hasattr(ax_or_fig, "suptitle"):
        ax_or_fig.suptitle(full)
    else:
        ax_or_fig.set_title(full)


def plot_stream_growth(df: pd.DataFrame, path, *, fit: bool = True) -> Path:
    """Mean stream norm against depth on a log axis, with the fitted growth rate per block.

    Real tokens at positions >= 1 as markers coloured by sublayer; the first position (the
    attention sink) as a dashed line; the fit ``log ||h|| = a + b * depth`` over block
    outputs as a dotted line labelled with ``exp(b)`` per block; 95% intervals as bands.
    """
    need_columns(df, ["depth", "sublayer", "stream_norm", "layer"], "plot_stream_growth")
    rest, first = _split(df)
    L = _n_layers(df)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    banded = _bands(ax, rest, first, "stream_norm", positive=True)
    lineplot_by_sublayer(ax, rest, "stream_norm", ylabel="mean ||h|| (log scale)", n_layers=L)
    if len(first):
        f = first.sort_values("depth")
        ax.plot(f["depth"], f["stream_norm"], label="first position (sink)", zorder=1, **FIRST_STYLE)
    if fit:
        g = fit_growth_rate(df)
        if np.isfinite(g["rate"]):
            x = np.linspace(1, L, 50)
            ax.plot(
                x,
                g["intercept"] * g["rate"] ** x,
                color="#2ca02c",
                ls=":",
                lw=2,
                label=f"fit: x{g['rate']:.3f} per block (R² {g['r2']:.2f})",
            )
    ax.set_yscale("log")
    ax.legend(frameon=False, fontsize=8)
    if banded:
        _band_handle(ax, df)
    _title(ax, df, "Residual stream norm by depth")
    savefig(fig, path)
    return Path(path)


def plot_update_norms(df: pd.DataFrame, path) -> Path:
    """Attention vs MLP update norms side by side per layer (95% intervals as error bars), and
    the attention share per layer (its interval as a band)."""
    need_columns(df, ["layer", "sublayer", "update_norm", "attn_share"], "plot_update_norms")
    rest, _ = _split(df)
    d = rest[rest["sublayer"].isin(["attn", "mlp"])]
    if not len(d):
        raise InputError("plot_update_norms: no attention/MLP rows")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    layers = sorted(d["layer"].unique())
    where = {layer: i for i, layer in enumerate(layers)}
    has_ci = {"update_norm_lo", "update_norm_hi"} <= set(d.columns)
    for sub, off in (("attn", -0.2), ("mlp", 0.2)):
        part = d[d["sublayer"] == sub].sort_values("layer")
        x = part["layer"].map(where).to_numpy(float) + off
        y = part["update_norm"].to_numpy(float)
        ax1.bar(x, y, width=0.4, color=SUBLAYER_PALETTE[sub], label=sub)
        if has_ci:
            err = np.stack([y - part["update_norm_lo"].to_numpy(float), part["update_norm_hi"].to_numpy(float) - y])
            ok = np.isfinite(err).all(0)
            ax1.errorbar(x[ok], y[ok], yerr=err[:, ok], fmt="none", ecolor="#222222", elinewidth=0.8, capsize=1.5)
    ax1.set_yscale("log")
    ax1.set_ylabel("mean ||u|| (log scale)")
    ax1.set_xlabel("")
    ax1.legend(title="sublayer write" + (" (bars: 95% interval)" if has_ci else ""), frameon=False)
    share = d[d["sublayer"] == "attn"].sort_values("layer")
    interval_band(ax2, share.assign(depth=np.arange(len(share), dtype=float)), "attn_share", SUBLAYER_PALETTE["attn"])
    ax2.plot(range(len(share)), share["attn_share"], color=SUBLAYER_PALETTE["attn"], marker="o", ms=4)
    mean = float(share["attn_share"].mean())
    ax2.axhline(0.5, color="#999999", lw=0.8)
    ax2.axhline(mean, color=SUBLAYER_PALETTE["attn"], lw=0.8, ls="--", label=f"mean {mean:.2f}")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("attn share\n||u_attn|| / (||u_attn|| + ||u_mlp||)", fontsize=8)
    ax2.set_xlabel("layer")
    ax2.legend(frameon=False, fontsize=8, loc="upper right")
    step = max(1, len(share) // 15)
    ax2.set_xticks(range(0, len(share), step))
    ax2.set_xticklabels([str(int(v)) for v in share["layer"].to_numpy()[::step]])
    _title(fig, df, "Sublayer writes per layer (positions >= 1)")
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)


def plot_relative_update(df: pd.DataFrame, path) -> Path:
    """Relative update ||u|| / ||h_prev|| (log) and cos(u, h_prev) against depth; the sink dashed;
    95% intervals as bands."""
    need_columns(df, ["depth", "sublayer", "relative_update", "cos_update_stream"], "plot_relative_update")
    rest, first = _split(df)
    rest = rest[rest["sublayer"] != "embed"]
    first = first[first["sublayer"] != "embed"]
    L = _n_layers(df)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    banded = _bands(ax1, rest, first, "relative_update", positive=True)
    banded |= _bands(ax2, rest, first, "cos_update_stream")
    lineplot_by_sublayer(ax1, rest, "relative_update", ylabel="||u|| / ||h_prev|| (log)", n_layers=L)
    lineplot_by_sublayer(ax2, rest, "cos_update_stream", ylabel="cos(u, h_prev)", n_layers=L)
    if len(first):
        f = first.sort_values("depth")
        ax1.plot(f["depth"], f["relative_update"], label="first position", zorder=1, **FIRST_STYLE)
        ax2.plot(f["depth"], f["cos_update_stream"], label="first position", zorder=1, **FIRST_STYLE)
    ax1.set_yscale("log")
    ax1.axhline(1, color="#999999", lw=0.8)
    ax2.axhline(0, color="#999999", lw=0.8)
    ax2.set_ylim(-1, 1)
    for ax in (ax1, ax2):
        ax.legend(frameon=False, fontsize=8, ncol=4)
    if banded:
        _band_handle(ax1, df, ncol=5)
    ax1.set_xlabel("")
    _title(fig, df, "How much each sublayer writes, and in which direction")
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)


def plot_position_heatmap(
    pos_df: pd.DataFrame, path, *, sequence: int | None = None, value: str = "stream_norm"
) -> Path:
    """Position x site heatmap of stream norms (log colour) for one sequence of a per-position table.

    Rows are token positions (labelled with the tokens), columns are sites in forward order;
    the sink position and massive activations stand out. The site holding the sequence's
    largest ``|h|`` is outlined and named in the title.
    """
    need_columns(pos_df, ["sequence", "position", "site", "label", value], "plot_position_heatmap")
    seq = int(pos_df["sequence"].min()) if sequence is None else sequence
    d = pos_df[pos_df["sequence"] == seq]
    if not len(d):
        raise InputError(f"plot_position_heatmap: no sequence {seq} in the table")
    grid = d.pivot(index="position", columns="site", values=value).sort_index()
    labels = d.drop_duplicates("site").set_index("site")["label"]
    if "token" in d.columns:
        toks = d.drop_duplicates("position").set_index("position")["token"]
        ylabels = [f"{p} {toks.get(p, '')!r}" for p in grid.index]
    else:
        ylabels = [str(p) for p in grid.index]
    n_pos, n_site = grid.shape
    fig, ax = plt.subplots(figsize=(min(18, 3 + 0.2 * n_site), min(14, 1.5 + 0.32 * n_pos)))
    vals = grid.to_numpy(float)
    pos_vals = vals[np.isfinite(vals) & (vals > 0)]
    norm = LogNorm(vmin=pos_vals.min(), vmax=pos_vals.max()) if len(pos_vals) else None
    sns.heatmap(
        np.where(vals > 0, vals, np.nan),
        ax=ax,
        cmap="magma",
        norm=norm,
        cbar_kws={"label": f"{value} (log)"},
        xticklabels=[labels[s] for s in grid.columns],
        yticklabels=ylabels,
    )
    ax.set_xlabel("site")
    ax.set_ylabel("position / token")
    ax.tick_params(axis="x", labelsize=6, rotation=90)
    ax.tick_params(axis="y", labelsize=8, rotation=0)
    note = ""
    if "max_abs" in d.columns:
        top = d.loc[d["max_abs"].idxmax()]
        col = list(grid.columns).index(top["site"])
        row = list(grid.index).index(top["position"])
        ax.add_patch(plt.Rectangle((col, row), 1, 1, fill=False, ec="#00e5ff", lw=1.5))
        dim = f", dim {int(top['max_abs_dim'])}" if "max_abs_dim" in d.columns else ""
        note = f"\nlargest |h| = {top['max_abs']:.0f} at {top['label']}, position {int(top['position'])}{dim}"
    _title(ax, pos_df, f"Stream norm by position and site{note}")
    savefig(fig, path)
    return Path(path)


def plot_dla(dla_df: pd.DataFrame, path, *, example: int | None = None, top: int = 6) -> Path:
    """Direct logit attribution bars for one example: every site's contribution by depth.

    Bars at each site's depth coloured by sublayer, the constant term apart on the left, the
    ``top`` largest contributions (by magnitude) labelled; the title gives the prompt, target
    and the model's logit (the sum of all bars).
    """
    need_columns(dla_df, ["example", "site", "label", "depth", "sublayer", "contribution", "logit"], "plot_dla")
    ex = int(dla_df["example"].min()) if example is None else example
    d = dla_df[dla_df["example"] == ex]
    if not len(d):
        raise InputError(f"plot_dla: no example {ex} in the table")
    parts = d[d["site"] >= 0].sort_values("depth")
    const = d[d["site"] < 0]["contribution"].sum()
    L = int(parts["layer"].max()) + 1
    fig, ax = plt.subplots(figsize=(10, 4.8))
    colors = [SUBLAYER_PALETTE.get(s, "#555555") for s in parts["sublayer"]]
    ax.bar(parts["depth"], parts["contribution"], width=0.42, color=colors)
    ax.bar([-1.2], [const], width=0.6, color="#bbbbbb")
    ax.text(-1.2, 0, "const", rotation=90, ha="center", va="bottom" if const < 0 else "top", fontsize=7)
    ax.axhline(0, color="#666666", lw=0.8)
    big = parts.reindex(parts["contribution"].abs().sort_values(ascending=False).index)[:top]
    for _, r in big.iterrows():
        ax.annotate(
            r["label"],
            (r["depth"], r["contribution"]),
            textcoords="offset points",
            xytext=(0, 4 if r["contribution"] >= 0 else -10),
            ha="center",
            fontsize=7,
        )
    handles = [plt.Rectangle((0, 0), 1, 1, color=SUBLAYER_PALETTE[s]) for s in SUBLAYER_ORDER]
    ax.legend(handles, SUBLAYER_ORDER, frameon=False, fontsize=8)
    depth_axis(ax, L)
    ax.set_xlim(-2, L + 0.5)
    what = "logit"
    row = d.iloc[0]
    target = row.get("target")
    if isinstance(row.get("contrast"), str):
        what = f"logit[{target!r}] - logit[{row['contrast']!r}]"
    else:
        what = f"logit[{target!r}]"
    ax.set_ylabel(f"direct contribution to {what}")
    text = row.get("text")
    prompt = f"{text!r} -> " if isinstance(text, str) else ""
    ax.set_title(f"Direct logit attribution: {prompt}{what} = {row['logit']:.2f} (sum of bars)", fontsize=10)
    savefig(fig, path)
    return Path(path)


def plot_head_writes(heads_df: pd.DataFrame, path, *, value: str = "write_norm") -> Path:
    """Layer x head heatmap of per-head write norms (positions >= 1), from
    :func:`~depthscope.analyses.norms.heads.head_write_norms`; the right strip shows each layer's
    ``heads_coherence`` (||sum of heads|| / sum of head norms)."""
    need_columns(heads_df, ["layer", "head", value], "plot_head_writes")
    d = heads_df[heads_df["positions"] == "rest"] if "positions" in heads_df.columns else heads_df
    grid = d.pivot(index="layer", columns="head", values=value).sort_index()
    has_coh = "heads_coherence" in d.columns
    fig, axes = plt.subplots(
        1,
        2 if has_coh else 1,
        figsize=(2.5 + 0.45 * grid.shape[1] + (1.2 if has_coh else 0), 1.5 + 0.22 * grid.shape[0]),
        gridspec_kw={"width_ratios": [grid.shape[1], 1.2]} if has_coh else None,
        squeeze=False,
    )
    ax = axes[0, 0]
    vals = grid.to_numpy(float)
    ok = vals[np.isfinite(vals) & (vals > 0)]
    norm = LogNorm(vmin=ok.min(), vmax=ok.max()) if len(ok) else None
    sns.heatmap(
        np.where(vals > 0, vals, np.nan),
        ax=ax,
        cmap="viridis",
        norm=norm,
        cbar_kws={"label": f"mean {value} (log)"},
        xticklabels=list(grid.columns),
        yticklabels=list(grid.index),
    )
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(axis="y", labelsize=7, rotation=0)
    if has_coh:
        coh = d.groupby("layer")["heads_coherence"].first().reindex(grid.index)
        ax2 = axes[0, 1]
        ax2.barh(np.arange(len(coh)) + 0.5, coh.to_numpy(float), color=SUBLAYER_PALETTE["attn"])
        ax2.set_ylim(len(coh), 0)
        ax2.set_xlim(0, 1)
        ax2.set_yticks([])
        ax2.set_xlabel("coherence", fontsize=8)
    _title(fig, heads_df, "Per-head attention writes ||W_O^h z_h||")
    savefig(fig, path)
    return Path(path)
