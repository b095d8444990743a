"""The cache job: the activations of every token of a text written to an activation cache.

==========================  =====================================================================
:func:`cache_job`           the hook points of ``CacheConfig.points`` of every token of the
                            documents into a folder (:func:`~depthscope.hooks.activation_cache.
                            write_activations`, resuming an unfinished one); returns the store
                            and a summary
:func:`summary_table`       the console table of its summary (``depthscope cache`` prints it)
==========================  =====================================================================

Its settings are :class:`~depthscope.analyses.jobs.configs.CacheConfig`; the store's layout is in
``docs/cache.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from depthscope.analyses.jobs.configs import CacheConfig
from depthscope.analyses.text import text_rows
from depthscope.hooks.activation_cache import Activations, CacheSettings, write_activations


def _disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cache_job(
    model, docs: Sequence[str], config: CacheConfig, out, overwrite: bool = False
) -> tuple[Activations, dict]:
    """``config.points`` of every token of ``docs`` read under ``config.text`` (each window one
    document of the store; the manifest's ``meta`` gives the text document and window of each)
    written to the activation cache ``out`` (``overwrite``: replace a cache of another run there);
    returns the store and its summary (documents, windows, tokens, points, chunks, bytes on disk)."""
    rows = text_rows(model, list(docs), config.text, skip=0)
    settings = CacheSettings(chunk_tokens=config.chunk_tokens, progress=config.progress, overwrite=overwrite)
    meta = {"text_document": rows.doc.tolist(), "text_window": rows.window.tolist(), "bos": config.text.bos}
    acts = write_activations(model, rows.rows, config.points, out, settings=settings, first=rows.first, meta=meta)
    summary = {
        "model": str(model.name),
        "folder": str(acts.path),
        "documents": len(set(rows.doc.tolist())),
        "windows": acts.n_documents,
        "tokens": acts.n_tokens,
        "points": len(acts),
        "chunks": len(acts.manifest["chunks"]),
        "bytes": _disk_bytes(acts.path),
    }
    return acts, summary


def summary_table(summary: dict) -> Table:
    """The console table of a cache job's summary."""
    t = Table("quantity", "value", title=f"activation cache of {summary['model']}")
    t.add_row("folder", summary["folder"])
    t.add_row("documents / windows / tokens", f"{summary['documents']} / {summary['windows']} / {summary['tokens']}")
    t.add_row("points / chunks", f"{summary['points']} / {summary['chunks']}")
    t.add_row("size on disk", f"{summary['bytes'] / 2**20:.1f} MiB")
    return t
