"""Tidy tables on disk: every analysis writes Parquet and CSV, atomically."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from depthscope.common.files import atomic_write
from depthscope.hooks.sites import SITE_COLUMNS

SHARED_COLUMNS = SITE_COLUMNS  # site, label, layer, sublayer, depth (+ checkpoint, step in sweeps)


def write_table(df: pd.DataFrame, out_dir, name: str, *, csv: bool = True, parquet: bool = True) -> list[Path]:
    """Write ``df`` as ``out_dir/name.parquet`` and ``.csv`` (each atomically); returns the paths."""
    out_dir = Path(out_dir)
    paths = []
    if parquet:
        p = out_dir / f"{name}.parquet"
        atomic_write(p, lambda t: df.to_parquet(t, index=False))
        paths.append(p)
    if csv:
        p = out_dir / f"{name}.csv"
        atomic_write(p, lambda t: df.to_csv(t, index=False))
        paths.append(p)
    return paths


def read_table(path) -> pd.DataFrame:
    path = Path(path)
    if path.suffix == ".parquet":
        return pd.read_parquet(path)
    return pd.read_csv(path)


def site_first(df: pd.DataFrame, extra_first: tuple[str, ...] = ()) -> pd.DataFrame:
    """Order columns: extras (e.g. checkpoint, step, task), the shared site columns, then the rest."""
    first = [c for c in (*extra_first, *SITE_COLUMNS) if c in df.columns]
    return df[first + [c for c in df.columns if c not in first]]
