"""Files written whole or not at all: the one atomic writer every module uses.

| function | writes |
|---|---|
| ``atomic_write(path, write)`` | ``write(tmp)`` on a temporary file beside ``path``, then a rename over ``path`` |
| ``atomic_text(path, text)`` | a text file (JSON, Markdown, HTML) |
| ``json_text(obj, indent)`` | strict JSON (a NaN or infinity becomes ``null``: what every summary is written with) |
| ``preallocate(path, n_bytes)`` | a file whose blocks are reserved now (a full disk fails here, not in a memmap) |
| ``check_writable(folder)`` | an output folder, created and probed before any compute |
| ``check_writable_dir(path, what)`` | any folder written (a store, a cache), checked alike, named by ``what`` |
| ``FolderLock(path)`` | an exclusive ``flock`` on a lock file: one writer per folder or store |

A reader sees the old file or the new one, never a part; a failed or interrupted write leaves
no temporary file behind. Files are made readable by all (0644): tables and reports are shared.
A full disk, a read-only file system or a missing permission is an
:class:`~depthscope.common.errors.OutputError` that names the path (the CLI prints it, exit 1).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Union

from depthscope.common.errors import OutputError

PathLike = Union[str, "os.PathLike[str]"]


#: errors of the place written to (not of the data): they become an OutputError naming the path
PLACE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}


#: what a writer that drops ``errno`` keeps of it in its message (pyarrow, matplotlib, safetensors)
PLACE_MESSAGES = ("no space left", "read-only file system", "permission denied", "quota exceeded")


def _os_errno(e: BaseException) -> int | None:
    """``e.errno``, or the number a Rust writer (safetensors) prints as ``(os error N)``."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = re.search(r"\(os error (\d+)\)", str(e))
    return int(m.group(1)) if m else None


def is_place_error(e: BaseException) -> bool:
    """True for an error about the place written to (disk full, read-only, permission): an OSError,
    or safetensors' ``SafetensorError`` wrapping an I/O error (which carries only a message);
    pyarrow's and matplotlib's wrappers sometimes drop ``errno`` and keep only the message."""
    if isinstance(e, OutputError):  # an OutputError already names its path
        return False
    if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
        return False
    if _os_errno(e) in PLACE_ERRNOS:
        return True
    msg = str(e).lower()
    return any(s in msg for s in PLACE_MESSAGES)


def output_error(path: PathLike, e: BaseException, option: str = "--out"):
    """The :class:`~depthscope.common.errors.OutputError` for a place error ``e`` (:func:`is_place_error`)
    raised writing ``path`` (``option``: the command-line option that chooses the place)."""
    code = _os_errno(e)
    why = getattr(e, "strerror", None) or (os.strerror(code) if code is not None else str(e))
    full = code in (errno.ENOSPC, errno.EDQUOT) or "no space left" in why.lower()
    hint = f"free some space or use another {option}" if full else f"use another {option}"
    return OutputError(f"cannot write {path}: {why} ({hint})")


def atomic_write(path: PathLike, write: Callable[[str], object]) -> Path:
    """Write ``path`` through ``write(tmp_path)`` and an atomic rename; returns ``path``. A full disk,
    read-only place or missing permission raises :class:`~depthscope.common.errors.OutputError`
    naming ``path``; the file is then untouched (old content or absent) and no temporary is left."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if is_place_error(e):
            raise output_error(path, e) from e
        raise
    return path


def atomic_text(path: PathLike, text: str) -> Path:
    """Write a text file (UTF-8) atomically; returns ``path``."""
    return atomic_write(path, lambda t: Path(t).write_text(text, encoding="utf-8"))


def _finite(obj):
    """``obj`` with every NaN or infinite float (numpy's too) replaced by None, containers rebuilt."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) or type(obj).__name__ in ("float32", "float64", "float16"):
        return float(obj) if math.isfinite(obj) else None
    return obj


def json_text(obj, indent: int | None = 2) -> str:
    """``obj`` as strict JSON (RFC 8259): NaN and infinities, which ``json.dumps`` writes as the
    bare words ``NaN``/``Infinity`` that no strict parser reads, become ``null``; anything not JSON
    (a path, a dtype) by ``str``."""
    return json.dumps(_finite(obj), indent=indent, default=str, allow_nan=False)


def preallocate(path: PathLike, n_bytes: int) -> Path:
    """Create ``path`` with ``n_bytes`` reserved on disk (``posix_fallocate``; a plain size where
    the file system cannot reserve). A memmap written on a full disk dies of SIGBUS: reserving
    first turns that into an OSError (ENOSPC) the caller can name (:func:`output_error`)."""
    path = Path(path)
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, max(int(n_bytes), 1))
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            f.truncate(max(int(n_bytes), 1))
    return path


def check_writable(folder: PathLike) -> Path:
    """Create the output folder ``folder`` (and parents) and prove a file can be written there,
    before any compute (:func:`check_writable_dir` for ``--out``). Returns the folder."""
    return check_writable_dir(folder, "--out")


def check_writable_dir(path: PathLike, what: str) -> Path:
    """Create the folder ``path`` (and parents) and prove a file can be written there, before any
    compute. ``what`` names the option or variable that chose the place (``"--out"``,
    ``"--store"``, ``"DEPTHSCOPE_CACHE"``): an existing file of that name, a file on its path, a
    read-only or unwritable place raise :class:`~depthscope.common.errors.OutputError` naming
    ``what`` and ``path``, with nothing created. Returns the folder."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{what} {folder} is an existing file, not a folder; use another {what}")
    created = _missing_parents(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".depthscope-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _remove_empty(created)
        if isinstance(e, FileExistsError) or e.errno == errno.ENOTDIR:
            raise OutputError(
                f"cannot create the folder {folder} ({what}): a part of its path is a file; use another {what}"
            ) from e
        raise output_error(folder, e, option=what) from e
    return folder


def _missing_parents(folder: Path) -> list[Path]:
    """The folders of ``folder``'s path (itself included) that do not exist yet, deepest first."""
    missing = []
    for p in [folder, *folder.parents]:
        if os.path.lexists(p):
            break
        missing.append(p)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed check created (deepest first), where they are still empty."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            pass


class FolderLock:
    """An exclusive lock on ``path`` (a lock file, created): ``acquire(wait=False)`` takes it or
    raises :class:`~depthscope.common.errors.OutputError` saying which process holds it
    (``wait=True``: blocks until it is free, after ``on_wait()``). The lock is ``fcntl.flock`` on
    an open file, so the kernel drops it when its process dies: a killed run never leaves a
    stale lock. ``release()`` (or leaving a ``with`` block) frees it. ``option`` names the option
    (or variable) that chose the place, for the messages."""

    def __init__(self, path: PathLike, what: str = "this folder", option: str = "--out"):
        self.path, self.what, self.option, self._fd = Path(path), what, option, None

    def acquire(self, wait: bool = False, on_wait: Callable[[], object] | None = None) -> FolderLock:
        if self._fd is not None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise output_error(self.path, e, option=self.option) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise OutputError(
                    f"another depthscope process (pid {holder}) is writing {self.what}; "
                    f"wait for it to finish or use another {self.option}"
                ) from None
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
