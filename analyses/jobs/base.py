"""What every job shares: an output folder checked and claimed before any compute
(:func:`prepare_output`), that records what was written (:class:`Output`), and the result
(:class:`JobResult`). The model a job runs is :class:`~depthscope.analyses.jobs.configs.ModelSpec`.

This module stays free of pandas and matplotlib at import: the commands claim their output
folder through it before any job module (which imports them) loads."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from depthscope.common.errors import InputError, OutputError
from depthscope.common.files import FolderLock, atomic_text, check_writable, check_writable_dir, json_text

if TYPE_CHECKING:  # pandas is imported by the analyses themselves: `depthscope --help` stays fast
    import pandas as pd


#: the marker of an output folder: which command wrote it, for which model and data
MARKER = ".depthscope.json"
#: commands whose folder is theirs alone (a report, a sweep): other commands do not write into it
EXCLUSIVE = ("run", "sweep")


class OutputClaim:
    """An output folder claimed by :func:`prepare_output`: its lock is held until :meth:`release`,
    which also removes what the claim added when nothing else was written (a run that failed
    leaves no empty folder and no marker behind)."""

    def __init__(self, folder: Path, lock, created: bool, marker_existed: bool):
        self.folder, self.lock, self.created, self.marker_existed = folder, lock, created, marker_existed

    def release(self) -> None:
        if self.lock is None:
            return
        ours = {MARKER, LOCK}
        try:
            empty = not any(p.name not in ours for p in self.folder.iterdir())
            if empty and not self.marker_existed:
                (self.folder / MARKER).unlink(missing_ok=True)
                if self.created:
                    (self.folder / LOCK).unlink(missing_ok=True)
                    self.folder.rmdir()
        except OSError:
            pass  # tidying up is best effort
        self.lock.release()
        self.lock = None


LOCK = ".depthscope.lock"


def load_for_command(model: str | None, device: str, dtype: str, stream: bool | None, why: str | None = None):
    """``load_model(model, device=device, dtype=dtype, stream=stream)`` (``stream`` None: streamed when it
    does not fit); ``why`` given: never streamed, and a refusal says why the command cannot stream."""
    from depthscope.hooks import load_model  # lazy: it imports torch, --help must not
    from depthscope.hooks.devices import ModelTooLarge

    try:
        return load_model(model, device=device, dtype=dtype, stream=False if why else stream)
    except ModelTooLarge as e:
        raise e if why is None else ModelTooLarge(f"{e}; this command cannot stream the model: {why}") from None


def prepare_store(store_dir: Path | None = None) -> Path:
    """Check ``--store`` (else ``<cache>/activations``, named as ``DEPTHSCOPE_CACHE``) before any compute."""
    from depthscope.hooks import cache_dir  # lazy: hooks import torch, --help must not

    where = "--store" if store_dir is not None else "DEPTHSCOPE_CACHE"
    return check_writable_dir(cache_dir() / "activations" if store_dir is None else store_dir, where)


def prepare_output(out, command: str, identity: dict | None = None, *, force: bool = False) -> OutputClaim:
    """Check and claim the output folder ``out`` before any compute; returns the
    :class:`OutputClaim` holding its lock (release it when done; the CLI does so when the
    command ends).

    Raises :class:`~depthscope.common.errors.OutputError` when ``out`` is an existing file, a place
    that cannot be written (read-only, no permission), a folder another process is writing
    (a lock file in it), or, unless ``force``: a folder holding another run of ``command`` (its
    recorded ``identity``, e.g. the model and data, differs) or a folder of a report or a sweep
    (``EXCLUSIVE``) when ``command`` is another one. The folder records ``command: identity`` in
    :data:`MARKER`."""
    created = not Path(out).exists()
    folder = check_writable(out)
    lock = FolderLock(folder / LOCK, f"into {folder}").acquire()
    try:
        marker = folder / MARKER
        marker_existed = marker.is_file()
        old = _marker(folder)
        if not force:
            owners = [c for c in old if c in EXCLUSIVE and c != command]
            if owners:
                raise OutputError(
                    f"{folder} holds a depthscope {owners[0]} (its tables would be mixed with this {command}'s); "
                    f"use another --out or --force"
                )
            if identity is not None and command in old and old[command] not in (None, identity):
                was = ", ".join(f"{k} {v}" for k, v in old[command].items())
                raise OutputError(
                    f"{folder} holds the results of another depthscope {command} ({was}); use another --out or --force"
                )
        old[command] = identity
        atomic_text(marker, json.dumps(old, indent=1, default=str))
    except BaseException:
        lock.release()
        raise
    return OutputClaim(folder, lock, created, marker_existed)


def _marker(folder: Path) -> dict:
    """The commands and identities a folder's :data:`MARKER` records (``{}``: none, or unreadable)."""
    try:
        old = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def check_report_folder(out: Path, model: str | None, files: list[str], force: bool) -> None:
    """Refuse to mix two reports' files in one folder: ``out`` must be new, empty, hold a
    ``depthscope run`` of the same model and data (``files``: its train, test ... paths), or one
    that was killed before its end (its marker names ``run``; :func:`prepare_output` then compares
    the identity it recorded), unless ``force``; else an
    :class:`~depthscope.common.errors.InputError`."""
    run_json = out / "run.json"
    if out.exists() and not out.is_dir():
        return  # prepare_output says it is a file
    if not out.exists() or not any(not p.name.startswith(".depthscope") for p in out.iterdir()) or force:
        return
    if not run_json.is_file():
        if "run" in _marker(out):  # a run killed before its end: its stage records say what it can reuse
            return
        raise InputError(f"{out} is not empty and holds no depthscope run; use another --out or --force")
    old = json.loads(run_json.read_text())
    same_model = (model or "default") in (old.get("model_source"), old.get("model")) or (
        model is None and old.get("model") == "smollm2-135m"
    )
    same_data = not files or (files[0] == old.get("train") and files[1] == old.get("test"))
    if not (same_model and same_data):
        raise InputError(f"{out} holds the results of another run ({old.get('model')}); use another --out or --force")


class Output:
    """An output folder: writes tables (Parquet + CSV) and figures atomically, once each.

    ``out.table(df, "lens_by_site")``, ``out.figure(plot_fn, df, name="lens_metrics")`` (PNG and
    SVG) and ``out.json(summary, "norms_summary")``;
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
        from depthscope.analyses.tables import write_table  # lazy: pandas, --help must not import it

        self._claim(name)
        if self.folder is None:
            return []
        paths = write_table(df, self.folder, name)
        self.written += paths
        return paths

    def json(self, obj, name: str) -> Path | None:
        """Write ``obj`` as ``<folder>/<name>.json`` (strict JSON, NaN as null; indented, atomically)."""
        self._claim(name)
        if self.folder is None:
            return None
        path = atomic_text(self.folder / f"{name}.json", json_text(obj))
        self.written.append(path)
        return path

    def drop(self, *names: str) -> None:
        """Remove what an earlier run wrote as figure ``name`` (``.png`` and ``.svg``), or as file
        ``name`` when it has a suffix (``circuit.html``), and this run does not write (``--no-plots``):
        no figure outlives the table it was drawn from."""
        if self.folder is None:
            return
        for name in names:
            for path in [self.folder / name] if "." in name else [self.folder / f"{name}.{x}" for x in ("png", "svg")]:
                path.unlink(missing_ok=True)

    def drop_tables(self, *names: str) -> None:
        """Remove what an earlier run wrote as table ``name`` (``.parquet`` and ``.csv``) and this
        run does not write (an optional part left out: ``norms`` without ``--heads``)."""
        if self.folder is None:
            return
        for name in names:
            for x in ("parquet", "csv"):
                (self.folder / f"{name}.{x}").unlink(missing_ok=True)

    def figure(self, plot: Callable[..., object], *args, name: str, **kwargs) -> Path | None:
        """Draw ``plot(*args, path, **kwargs)`` into ``<folder>/<name>.png`` and, beside it,
        ``<name>.svg`` (vector, for the HTML report and for print; the PNG serves markdown).
        The plot functions pick the format from the path's suffix; the SVG keeps its text as
        text (``svg.fonttype: none``), so it stays small and searchable. Returns the PNG's path."""
        self._claim(name)
        if self.folder is None:
            return None
        from depthscope.analyses.style import svg_twin  # lazy: matplotlib, --help must not import it

        path = self.folder / f"{name}.png"
        svg = path.with_suffix(".svg")
        svg.unlink(missing_ok=True)  # a stale twin must not pass for this figure's
        with svg_twin(svg_rc(name)):  # savefig writes the SVG from the same figure
            plot(*args, path, **kwargs)
        self.written.append(path)
        if not svg.exists():  # a plot function that does not save through style.savefig
            import matplotlib  # lazy: --help must not import matplotlib

            with matplotlib.rc_context(svg_rc(name)):
                plot(*args, svg, **kwargs)
        self.written.append(svg)
        return path


def svg_rc(name: str) -> dict:
    """Matplotlib settings for an SVG figure: text kept as text, under the font the layout was
    measured with named first (the style's list starts with Arial, which matplotlib may not
    have; a viewer that has it would then draw text wider or narrower than laid out), and ids
    salted with the figure's name (the same figure gives the same file)."""
    from matplotlib import font_manager, rcParams  # lazy: --help must not import matplotlib

    family = rcParams["font.family"]
    used = font_manager.FontProperties(fname=font_manager.findfont(font_manager.FontProperties(family=family)))
    key = f"font.{family[0]}" if family and family[0] in ("sans-serif", "serif", "monospace") else None
    rc = {"svg.fonttype": "none", "svg.hashsalt": name}
    if key is not None:
        rc[key] = [used.get_name()] + [f for f in rcParams[key] if f != used.get_name()]
    return rc


@dataclass
class JobResult:
    """Tables by name, a JSON-able summary (the numbers a console table or report sentence
    quotes), and the files written."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
