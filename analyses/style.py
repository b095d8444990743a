"""One style for every figure: seaborn, readable labels, attention vs MLP sites distinguished,
depth on the x axis in block units (embed 0, after block l's attention l+0.5, after its MLP l+1)."""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files, never windows
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from depthscope.common.errors import InputError  # noqa: E402
from depthscope.common.files import atomic_write  # noqa: E402

SUBLAYER_PALETTE = {"embed": "#555555", "attn": "#1f77b4", "mlp": "#d62728"}
SUBLAYER_MARKERS = {"embed": "s", "attn": "o", "mlp": "^"}
SUBLAYER_ORDER = ["embed", "attn", "mlp"]
DEPTH_LABEL = "depth (blocks; attn = l + 0.5, mlp = l + 1)"


def need_columns(df, cols, what: str) -> None:
    """Refuse to plot an empty table or one without ``cols`` (:class:`InputError` naming ``what``)."""
    if df is None or len(df) == 0:
        raise InputError(f"{what}: empty table, nothing to plot")
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise InputError(f"{what}: the table lacks columns {missing}")


def setup() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)
    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 150, "savefig.bbox": "tight"})


#: matplotlib settings for an SVG twin of each PNG saved in this context (None: no twin);
#: set by :meth:`depthscope.analyses.jobs.Output.figure` through :func:`svg_twin`
_SVG_TWIN: contextvars.ContextVar = contextvars.ContextVar("svg_twin", default=None)


@contextlib.contextmanager
def svg_twin(rc: dict):
    """Inside this context, :func:`savefig` writes each PNG's ``.svg`` twin from the same
    figure (drawn once), under the matplotlib settings ``rc``."""
    token = _SVG_TWIN.set(rc)
    try:
        yield
    finally:
        _SVG_TWIN.reset(token)


def savefig(fig, path) -> None:
    """Save ``fig`` to ``path`` (format from the suffix) atomically, with its SVG twin inside
    :func:`svg_twin`, and close it."""
    path = Path(path)
    twin = _SVG_TWIN.get()
    try:  # whole or not at all, and a full disk is an OutputError naming the file
        atomic_write(path, lambda t: fig.savefig(t, format=path.suffix.lstrip(".") or "png"))
        if twin is not None and path.suffix == ".png":
            with matplotlib.rc_context(twin):
                atomic_write(path.with_suffix(".svg"), lambda t: fig.savefig(t, format="svg"))
    finally:
        plt.close(fig)


def depth_axis(ax, n_layers: int | None = None) -> None:
    ax.set_xlabel(DEPTH_LABEL)
    if n_layers:
        step = max(1, n_layers // 10)
        ax.set_xticks(range(0, n_layers + 1, step))
        ax.set_xlim(-0.5, n_layers + 0.5)


def lineplot_by_sublayer(ax, df, y: str, *, ylabel: str | None = None, n_layers: int | None = None, hue_extra=None):
    """A metric against depth: a thin line through all sites, markers coloured by sublayer."""
    d = df.sort_values("depth")
    ax.plot(d["depth"], d[y], color="#999999", lw=1, zorder=1)
    for sub in SUBLAYER_ORDER:
        part = d[d["sublayer"] == sub]
        if len(part):
            ax.scatter(
                part["depth"],
                part[y],
                s=22,
                marker=SUBLAYER_MARKERS[sub],
                color=SUBLAYER_PALETTE[sub],
                label=sub,
                zorder=2,
            )
    ax.set_ylabel(ylabel or y)
    depth_axis(ax, n_layers)
    ax.legend(title="site", frameon=False)
    return ax


setup()
