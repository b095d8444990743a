"""Logit-lens figures, drawn from the tables of :mod:`depthscope.analyses.lens.logit` only.

* :func:`plot_lens_metrics` -- every per-site metric against depth (attention and MLP sites
  distinguished; logit and tuned lens distinguished when the table holds both), with the 95%
  interval of each site's mean as a band when the table has ``<metric>_lo``/``_hi`` columns.
* :func:`plot_top1_heatmap` -- position x site grid of the lens's top-1 token, shaded by its
  probability, for one prompt (a ``logit_lens_tokens`` table).
* :func:`plot_rank_trajectory` -- the rank of each next token through depth, one line per
  position of that prompt.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from depthscope.analyses import style
from depthscope.analyses.style import SUBLAYER_MARKERS, SUBLAYER_ORDER, SUBLAYER_PALETTE

__all__ = ["plot_lens_metrics", "plot_top1_heatmap", "plot_rank_trajectory", "show_token", "interval_band"]

METRIC_PANELS = [
    ("kl_to_final", "KL(final ‖ lens) [nats]", "symlog"),
    ("cross_entropy", "next-token cross-entropy [nats]", "linear"),
    ("entropy", "lens entropy [nats]", "linear"),
    ("top1_agreement", "top-1 agreement with final", "linear"),
    ("top1_accuracy", "top-1 accuracy (next token)", "linear"),
    ("target_log_rank", "mean log$_{10}$(1 + rank of next token)", "linear"),
]
#: line style, colour and filled markers of each lens's curves (``_OTHER_LENS`` for other kinds)
_LENS_STYLE = {"logit": ("-", "#8c8c8c", True), "tuned": ("--", "#222222", False)}
_OTHER_LENS = ("-.", "#555555", True)
BAND_ALPHA = 0.25


def interval_band(ax, d: pd.DataFrame, col: str, color, *, alpha: float = BAND_ALPHA, positive: bool = False) -> bool:
    """Fill the 95% interval ``<col>_lo``..``<col>_hi`` of ``d`` (sorted by depth) behind its curve;
    ``positive``: leave out intervals reaching 0 (a log axis cannot show them). Returns whether
    anything was drawn."""
    lo, hi = f"{col}_lo", f"{col}_hi"
    if lo not in d.columns or hi not in d.columns:
        return False
    a, b = d[lo].to_numpy(float), d[hi].to_numpy(float)
    ok = np.isfinite(a) & np.isfinite(b) & ((a > 0) if positive else True)
    if not ok.any():
        return False
    ax.fill_between(d["depth"].to_numpy(float), a, b, where=ok, color=color, alpha=alpha, lw=0, zorder=0.5)
    return True


def show_token(tok, width: int = 12, *, space: str = "mark") -> str:
    """A token string made visible: escaped newlines/tabs, '∅' for an empty string, '␣' for a
    whitespace-only token, and a leading space shown as '␣' (``space="mark"``), dropped
    (``"strip"``, for dense grids) or kept inside quotes (``"quote"``); clipped to ``width``."""
    if tok is None or (isinstance(tok, float) and math.isnan(tok)):
        return ""
    s = str(tok)
    if s == "":
        return "∅"
    s = s.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if s.strip(" ") == "":
        s = "␣" * len(s)
    elif space == "mark" and s.startswith(" "):
        s = "␣" + s[1:]
    elif space == "strip":
        s = s[1:] if s.startswith(" ") else s
    if len(s) > width:
        s = s[: width - 1] + "…"
    return f"'{s}'" if space == "quote" else s


def _n_layers(df: pd.DataFrame) -> int:
    return int(df["layer"].max()) + 1 if len(df) else 0


def plot_lens_metrics(df: pd.DataFrame, path, *, title: str | None = None) -> None:
    """Six panels of per-site means against depth from a ``logit_lens`` table (or several
    concatenated, told apart by their ``lens`` column: the plain and the tuned lens), each mean
    with its 95% interval (clustered by document) as a band when the table has one."""
    lenses = list(dict.fromkeys(df["lens"])) if "lens" in df.columns else ["logit"]
    panels = [p for p in METRIC_PANELS if p[0] in df.columns]
    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    n_layers = _n_layers(df)
    banded = False
    for ax, panel in zip(axes.flat, panels):
        banded |= _metric_panel(ax, df, lenses, panel, n_layers)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = _metrics_legend(df, lenses, banded)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, -0.02))
    if title is None:
        n = int(df["n_positions"].iloc[0]) if "n_positions" in df.columns else None
        title = "Logit lens at every sublayer" + (f" (means over {n:,} positions)" if n else "")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    style.savefig(fig, path)


def _metric_panel(ax, df: pd.DataFrame, lenses: list, panel: tuple, n_layers: int) -> bool:
    """One metric's panel: per lens its band, its line through all sites and markers per
    sublayer (hollow for the tuned lens); returns whether a band was drawn."""
    col, ylabel, scale = panel
    banded = False
    for lens in lenses:
        d = df[df["lens"] == lens] if "lens" in df.columns else df
        d = d.sort_values("depth")
        ls, color, filled = _LENS_STYLE.get(lens, _OTHER_LENS)
        banded |= interval_band(ax, d, col, color)
        ax.plot(d["depth"], d[col], ls=ls, color=color, lw=1.1, zorder=1)
        _sublayer_markers(ax, d, col, filled)
    ax.set_ylabel(ylabel)
    style.depth_axis(ax, n_layers)
    ax.set_xlabel("depth (blocks)")
    if scale == "symlog":
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=0)
    if col in ("top1_agreement", "top1_accuracy"):
        ax.set_ylim(-0.03, 1.03)
    return banded


def _sublayer_markers(ax, d: pd.DataFrame, col: str, filled: bool) -> None:
    """Markers of ``col`` at every site of ``d``, shaped and coloured by sublayer."""
    for sub in SUBLAYER_ORDER:
        part = d[d["sublayer"] == sub]
        if len(part):
            c = SUBLAYER_PALETTE[sub]
            ax.scatter(
                part["depth"],
                part[col],
                s=20,
                marker=SUBLAYER_MARKERS[sub],
                zorder=2,
                color=c if filled else "white",
                edgecolors=c,
                linewidths=1.0,
            )


def _metrics_legend(df: pd.DataFrame, lenses: list, banded: bool) -> list:
    """The figure's one legend: sublayer markers, the lenses' line styles when there are
    several, and the band when one was drawn."""
    handles = [
        Line2D([], [], ls="", marker=SUBLAYER_MARKERS[s], color=SUBLAYER_PALETTE[s], label=lab)
        for s, lab in (("embed", "embedding"), ("attn", "after attention"), ("mlp", "after MLP"))
    ]
    if len(lenses) > 1:
        for lens in lenses:
            ls, color, filled = _LENS_STYLE.get(lens, _OTHER_LENS)
            handles.append(
                Line2D(
                    [],
                    [],
                    ls=ls,
                    color=color,
                    marker="o",
                    markerfacecolor=color if filled else "white",
                    markeredgecolor=color,
                    label=f"{lens} lens",
                )
            )
    if banded:
        handles.append(Patch(color="#8c8c8c", alpha=BAND_ALPHA, lw=0, label=band_label(df)))
    return handles


def band_label(df: pd.DataFrame) -> str:
    """What the bands are: 95% intervals over documents (or the windows of a single document)."""
    docs = int(df["n_docs"].iloc[0]) if "n_docs" in df.columns and len(df) else 0
    if docs == 1 and "n_windows" in df.columns:
        return f"95% interval ({int(df['n_windows'].iloc[0])} windows as clusters)"
    return f"95% interval ({docs} documents as clusters)" if docs else "95% interval"


def _one_window(tokens_df: pd.DataFrame, doc: int | None, window: int | None) -> pd.DataFrame:
    """The rows of one window (default: the first document's first window)."""
    d = tokens_df
    if doc is None:
        doc = int(d["doc"].iloc[0])
    if window is None:
        window = int(d[d["doc"] == doc]["window"].iloc[0])
    d = d[(d["doc"] == doc) & (d["window"] == window)]
    if d.empty:
        raise ValueError(f"no rows for doc {doc}, window {window}")
    return d


def plot_top1_heatmap(
    tokens_df: pd.DataFrame,
    path,
    *,
    doc: int | None = None,
    window: int | None = None,
    max_positions: int = 24,
    title: str | None = None,
) -> None:
    """Position x site grid of the lens's top-1 token, shaded by its probability, for one
    window of a ``logit_lens_tokens`` table. Columns are input positions (the token read at
    that position; the prediction is for the next one), rows are sites, deepest at the top."""
    d = _one_window(tokens_df, doc, window)
    positions = sorted(d["position"].unique())[:max_positions]
    d = d[d["position"].isin(positions)]
    sites = sorted(d["site"].unique(), reverse=True)  # deepest first = top row
    labels = d.drop_duplicates("site").set_index("site")["label"]
    prob = d.pivot(index="site", columns="position", values="top1_prob").loc[sites, positions]
    text = d.pivot(index="site", columns="position", values="top1_token").loc[sites, positions]
    inputs = d.drop_duplicates("position").set_index("position")
    n_rows, n_cols = len(sites), len(positions)
    cell_w, cell_h = 0.78, 0.2
    fig, ax = plt.subplots(figsize=(1.6 + cell_w * n_cols + 1.0, 0.9 + cell_h * n_rows + 0.9))
    im = ax.imshow(prob.to_numpy(dtype=float), aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fs = 6.5 if n_rows > 30 else 8
    vals = prob.to_numpy(dtype=float)
    for i in range(n_rows):
        for j in range(n_cols):
            ax.text(
                j,
                i,
                show_token(text.iat[i, j], 9, space="strip"),
                ha="center",
                va="center",
                fontsize=fs,
                color="white" if vals[i, j] > 0.6 else "black",
            )
    ax.set_xticks(range(n_cols))
    ax.set_xticklabels(
        [show_token(inputs.loc[p, "token"], 12, space="strip") for p in positions], rotation=45, ha="right"
    )
    ax.set_xlabel("input token (the lens predicts the token after it)")
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels([labels[s] for s in sites], fontsize=6.5 if n_rows > 30 else 9)
    ax.set_ylabel("site (deepest at top)")
    ax.grid(False)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_label("top-1 probability")
    lens = d["lens"].iloc[0] if "lens" in d.columns else "logit"
    ax.set_title(title or f"{lens.capitalize()} lens: top-1 token at each site and position")
    style.savefig(fig, path)


def plot_rank_trajectory(
    tokens_df: pd.DataFrame,
    path,
    *,
    doc: int | None = None,
    window: int | None = None,
    max_positions: int = 16,
    title: str | None = None,
) -> None:
    """Rank of each position's target (its next token; the model's own prediction at the last
    position) through depth, one line per position; rank 0 = the lens's top-1."""
    d = _one_window(tokens_df, doc, window)
    positions = sorted(d["position"].unique())[:max_positions]
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    cmap = plt.get_cmap("viridis")
    n_layers = _n_layers(d)
    own = False
    for k, pos in enumerate(positions):
        part = d[d["position"] == pos].sort_values("depth")
        row = part.iloc[0]
        is_own = row.get("target_kind", "next") == "model_top1"
        own |= bool(is_own)
        lab = (
            f"{pos}: {show_token(row['token'], space='quote')} {'⇒' if is_own else '→'} "
            f"{show_token(row['target_token'], space='quote')}"
        )
        color = cmap(k / max(1, len(positions) - 1))
        ax.plot(part["depth"], part["target_rank"] + 1, color=color, lw=1.4, label=lab, marker="o", ms=2.5)
    ax.set_yscale("log")
    top = max(10.0, float(d["target_rank"].max()) + 1)
    ticks = [10**i for i in range(0, int(math.ceil(math.log10(top))) + 1)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:,}" if t < 1000 else f"{t // 1000:,}k" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(top * 1.5, 0.8)  # rank 1 (the lens's top-1) at the top
    ax.set_ylabel("rank of the token (1 = the lens top-1)")
    style.depth_axis(ax, n_layers)
    legend_title = "position: input → next token" + ("\n(⇒ the model's own prediction)" if own else "")
    ax.legend(
        title=legend_title, fontsize=7.5, title_fontsize=8, frameon=False, loc="center left", bbox_to_anchor=(1.01, 0.5)
    )
    lens = d["lens"].iloc[0] if "lens" in d.columns else "logit"
    ax.set_title(title or f"{lens.capitalize()} lens: rank of each next token through depth")
    style.savefig(fig, path)
