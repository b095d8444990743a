"""Figures of path patching results, drawn from the tables of :mod:`depthscope.analyses.circuits.patching.paths` only.

| function | figure |
|---|---|
| ``plot_path_patching`` | layer x head heatmap of each head sender's fraction recovered, one panel per receiver set |

It takes a table of :func:`~depthscope.analyses.circuits.patching.paths.path_patching` (means over pairs)
or :func:`~depthscope.analyses.circuits.patching.paths.path_patch_pairs` (then averaged over pairs here,
per-pair fractions' mean) and a path, draws one figure in the shared style and returns the path.
Colours are diverging and centred at 0 (red: the path restores the clean behaviour, blue: it
pushes the other way), as in :mod:`depthscope.analyses.circuits.patching.plots`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from depthscope.analyses.circuits.patching.plots import _title, head_panels
from depthscope.analyses.style import need_columns, savefig
from depthscope.common.errors import InputError

__all__ = ["plot_path_patching"]


def _head_grids(df: pd.DataFrame, value: str, what: str) -> list[tuple[str, pd.DataFrame]]:
    """(receiver spec, layer x head grid of ``value``) per receiver set, from the head senders' rows."""
    d = df[df["head"].notna() & (df["kind"] == "heads")]
    if not len(d):
        raise InputError(f"{what}: no head senders in the table (path patch with senders 'heads' or '<l>.heads')")
    out = []
    for receiver in dict.fromkeys(d["receiver"]):
        rows = d[d["receiver"] == receiver]
        grid = rows.pivot_table(index="layer", columns="head", values=value, aggfunc="mean").sort_index()
        out.append((str(receiver), grid))
    return out


def plot_path_patching(df: pd.DataFrame, path, *, value: str = "fraction_recovered") -> Path:
    """Layer x head heatmap of the head senders' ``value``, one panel per receiver set (titled with
    the receivers; with frozen MLPs the title says so)."""
    what = "plot_path_patching"
    need_columns(df, ["layer", "head", "kind", "receiver", value], what)
    grids = _head_grids(df, value, what)
    fig = head_panels(
        [g for _, g in grids], [f"receivers: {r}" for r, _ in grids], value, ("sender head", "sender layer")
    )
    frozen = " (MLPs frozen)" if df.attrs.get("freeze_mlps") else ""
    positions = df.attrs.get("positions")
    where = f", sender at {positions} position{'s' if positions == 'all' else ''}" if positions else ""
    fig.suptitle(_title(df, f"Path patching per head{frozen}{where}"), fontsize=9)
    savefig(fig, path)
    return Path(path)
