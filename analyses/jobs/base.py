"""What every job shares: an output folder that records what was written, and the result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported by the analyses themselves: `depthscope --help` stays fast
    import pandas as pd


class Output:
    """An output folder: writes tables (Parquet + CSV) and figures atomically, once each.

    ``out.table(df, "lens_by_site")``, ``out.figure(plot_fn, df, name="lens_metrics")`` and
    ``out.json(summary, "norms_summary")``;
    ``out.written`` lists every file in the order written. Writing one name twice in one run is
    a bug (two writers) and raises. ``Output(None)`` computes without writing (Python users who
    only want the tables).
    """

    def __init__(self, folder: Path | None):
        self.folder = Path(folder) if folder is not None else None
        self.written: list[Path] = []
        self._names: set[str] = set()

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise RuntimeError(f"{name} written twice in one run: each table and figure has one writer")
        self._names.add(name)

    def table(self, df: pd.DataFrame, name: str) -> list[Path]:
        from ..tables import write_table

        self._claim(name)
        if self.folder is None:
            return []
        paths = write_table(df, self.folder, name)
        self.written += paths
        return paths

    def json(self, obj, name: str) -> Path | None:
        """Write ``obj`` as ``<folder>/<name>.json`` (indented, atomically)."""
        import json

        from depthscope.hooks.files import atomic_text

        self._claim(name)
        if self.folder is None:
            return None
        path = atomic_text(self.folder / f"{name}.json", json.dumps(obj, indent=2, default=str))
        self.written.append(path)
        return path

    def figure(self, plot: Callable[..., object], *args, name: str, **kwargs) -> Path | None:
        """Draw ``plot(*args, path, **kwargs)`` into ``<folder>/<name>.png``."""
        self._claim(name)
        if self.folder is None:
            return None
        path = self.folder / f"{name}.png"
        plot(*args, path, **kwargs)
        self.written.append(path)
        return path


@dataclass
class JobResult:
    """Tables by name, a JSON-able summary (the numbers a console table or report sentence
    quotes), and the files written."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
