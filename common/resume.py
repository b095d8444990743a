"""Stage records: what lets a job run again in its output folder reuse the stages it finished.

=============================  ====================================================================
:func:`code_digest()`          sha256 of depthscope's own source files (``common``, ``hooks``,
                               ``probes``, ``analyses``): work done by other code is never reused
:func:`stage_key(**parts)`     the digest of a stage's inputs (``parts``, as JSON) and of the code
:func:`file_digests(sources)`  sha256 of each input file, for a key (None: an input is no file)
:func:`sealed(record)`         ``record`` with the digest of its content; :func:`unsealed(text)`
                               the record a text holds when that digest holds (every resume
                               record is written and read through these two)
:class:`Stages(folder)`        the records in ``folder/.depthscope-stages``: ``files(name, key)``
                               and ``record_files(name, key, paths)`` for a stage that writes
                               files of its own; ``tables(name, key)`` and ``keep_tables(name,
                               key, tables)`` for one whose result is a few tables
=============================  ====================================================================

A stage is reused only when its record's key equals the key of the inputs it would run on now,
and every file the record lists is there with the sha256 it had when written, and the record
itself matches the digest of its content it carries (a value edited in it is never served). A record is written
after the stage's files, atomically, so a run killed mid-stage leaves no record of that stage
and a rerun computes it again. Anything else (no record, another key, a file missing, edited or
corrupted, a record that does not parse) means the stage is computed again; the reason is logged
when a record was there. The key takes in the code's digest, so a record never outlives a change
to depthscope, released or not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

import pandas as pd

from depthscope.common.files import atomic_text, atomic_write
from depthscope.common.stamps import file_digest

log = logging.getLogger("depthscope")

#: the folder of stage records inside an output folder (hidden, like the folder's other markers)
FOLDER = ".depthscope-stages"
#: the record format; another version's records are never read (2: records carry their digest)
VERSION = 2
#: what the log says when a stage is not reused
AGAIN = "computing it again"
#: depthscope's packages, siblings of this one in an installed wheel and in a source checkout
PACKAGES = ("common", "hooks", "probes", "analyses")


@cache
def code_digest() -> str:
    """sha256 of every ``.py`` file of depthscope's packages, by relative path and content (computed
    once per process: about 200 files, a few milliseconds)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def stage_key(**parts) -> str:
    """The key of a stage: sha256 of ``parts`` (JSON, keys sorted, anything else by ``str``) and
    :func:`code_digest`."""
    text = json.dumps({"code": code_digest(), **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_digests(sources: Mapping[str, object]) -> dict | None:
    """sha256 of each named input file (None values skipped): what a key says of data read from
    files. None when an input is not a path (a parsed corpus in memory has no file to name its
    content, so nothing computed from it is kept)."""
    out = {}
    for name, source in sources.items():
        if source is None:
            continue
        if not isinstance(source, (str, os.PathLike)):
            return None
        out[name] = file_digest(source)
    return out


def _content_digest(record: Mapping) -> str:
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


def sealed(record: Mapping) -> dict:
    """``record`` (a JSON object) with ``digest``: the sha256 of the rest of its content."""
    return {**record, "digest": _content_digest(record)}


def unsealed(text: str) -> dict | None:
    """The record in ``text`` when it parses as a JSON object whose ``digest`` is that of the rest of
    its content; None when it does not (edited, truncated, corrupted, or written before digests)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("digest") != _content_digest(record):
        return None
    return record


def _file_name(name: str) -> str:
    """A file-system name for stage ``name``: its safe characters plus a hash of the whole name, so
    two names never share a file (``feats:Number`` and ``feats_Number``)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


class Stages:
    """The stage records of output folder ``folder``; ``Stages(None)`` keeps and reuses nothing
    (a job run without a folder). With ``reuse=False`` the stages are recorded but none is reused
    (a run told to compute everything again leaves records for the next one)."""

    def __init__(self, folder: Path | str | None, reuse: bool = True):
        self.folder = Path(folder) if folder is not None else None
        self.root = self.folder / FOLDER if self.folder is not None else None
        self.reuse = reuse

    def __bool__(self) -> bool:
        return self.root is not None

    def _record(self, name: str) -> Path:
        return self.root / f"{_file_name(name)}.json"

    def _read(self, name: str, key: str) -> dict | None:
        """Stage ``name``'s record when it is there, parses and has key ``key``; else None (the
        reason logged when a record was there)."""
        if not self or not self.reuse:
            return None
        path = self._record(name)
        if not path.is_file():
            return None
        try:
            record = unsealed(path.read_text())
        except (OSError, UnicodeDecodeError):
            record = None
        ok = record is not None and record.get("version") == VERSION and isinstance(record.get("files"), dict)
        if not ok:
            log.warning(
                "%s: the record of an earlier run in %s cannot be read or fails its digest (edited or corrupted); %s",
                name,
                self.folder,
                AGAIN,
            )
            return None
        if record.get("key") != key:
            log.info("%s: an earlier run in %s had other inputs, settings or code; %s", name, self.folder, AGAIN)
            return None
        return record

    def _verified(self, name: str, record: dict, base: Path) -> dict | None:
        """``{relative name: path}`` of the record's files when each is there with its digest."""
        paths = {}
        for rel, digest in record["files"].items():
            path = base / rel
            try:
                same = path.is_file() and file_digest(path) == digest
            except OSError:
                same = False
            if not same:
                log.warning("%s: %s is missing or changed since an earlier run wrote it; %s", name, path, AGAIN)
                return None
            paths[rel] = path
        return paths

    def _write(self, name: str, key: str, base: Path, paths: Sequence[Path], **extra) -> None:
        files = {str(Path(p).relative_to(base)): file_digest(p) for p in paths}
        record = {"version": VERSION, "name": name, "key": key, "files": files, **extra}
        atomic_text(self._record(name), json.dumps(sealed(record), indent=1))

    def files(self, name: str, key: str) -> list[Path] | None:
        """The files (in ``folder``) stage ``name`` wrote when its record has ``key`` and each file
        is unchanged; else None."""
        record = self._read(name, key)
        paths = self._verified(name, record, self.folder) if record is not None else None
        return list(paths.values()) if paths is not None else None

    def record_files(self, name: str, key: str, paths: Sequence[Path]) -> None:
        """Record that stage ``name`` with ``key`` wrote ``paths`` (files in ``folder``), after them."""
        if self:
            self._write(name, key, self.folder, paths)

    def tables(self, name: str, key: str) -> dict | None:
        """The tables :meth:`keep_tables` kept for stage ``name`` with ``key`` (None where a table
        was None), or None when there are none to reuse."""
        record = self._read(name, key)
        paths = self._verified(name, record, self.root) if record is not None else None
        if paths is None:
            return None
        try:
            return {t: (pd.read_parquet(paths[f]) if f in paths else None) for t, f in dict(record["tables"]).items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: the tables of an earlier run cannot be read (%s); %s", name, e, AGAIN)
            return None

    def keep_tables(self, name: str, key: str, tables: Mapping[str, pd.DataFrame | None]) -> None:
        """Keep stage ``name``'s ``tables`` (Parquet, one file each; a None table is recorded as
        None), then its record."""
        if not self:
            return
        stem, written, names = _file_name(name), [], {}
        for table, df in tables.items():
            rel = f"{stem}.{table}.parquet"
            names[table] = rel
            if df is not None:
                written.append(atomic_write(self.root / rel, lambda tmp, df=df: df.to_parquet(tmp)))
        self._write(name, key, self.root, written, tables=names)
