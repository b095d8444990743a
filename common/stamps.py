"""Content digests of files, so a cache never serves corrupted bytes.

=================================  ================================================================
:func:`file_sha256(path)`          sha256 (hex) of a file's bytes, streamed
:func:`file_digest(path)`          the same, hashed once per process per version of the file
:func:`forget_digests()`           forget what :func:`file_digest` remembers
:func:`write_stamps(folder)`       sha256 of every file in ``folder``, stored in ``folder/STAMPS``
:func:`verify_stamps(folder)`      the files that are missing, unstamped or whose content no longer
                                   matches (``None``: no stamps)
=================================  ================================================================

The model cache (:mod:`depthscope.hooks.loading`) stamps a GGUF's converted safetensors when it
writes them and verifies them before serving; the probes' activation stores record and verify
their files' digests the same way (:mod:`depthscope.probes.store.activations`).

Verification never rests on metadata alone. :func:`file_digest` remembers, for this process
only, the digest of each version of a file: a version is its device, inode, size, mtime and
ctime. Every write to a file moves its ctime, which no user call can set back (``os.utime``
restores mtime but moves ctime), and a copy is a new inode, so a file rewritten in place with its
size and mtime restored, or a copy with the same metadata, is hashed again. Timestamps are coarse
(a clock tick, a second on some file systems), so two writes close together can share a ctime: a
version is remembered only once its ctime is ``SETTLED_NS`` older than the start of the read,
after which any write gets a later ctime. A new process hashes every file it verifies once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from depthscope.common.files import atomic_text

STAMPS = "depthscope-stamps.json"
ALGORITHM = "sha256"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 (hex) of the bytes of ``path``, read in ``chunk``-byte blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


#: file versions whose digest this process remembers (oldest forgotten first)
MEMO_SIZE = 4096
#: how much older than a read a file's ctime must be for its digest to be remembered (ns)
SETTLED_NS = 2_000_000_000
_memo: dict[tuple, str] = {}
_now = time.time_ns


def _version(path: Path) -> tuple:
    """What identifies one version of a file: device, inode, size, mtime and ctime (ns)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _keep(version: tuple, digest: str) -> None:
    if len(_memo) >= MEMO_SIZE:
        _memo.pop(next(iter(_memo)))
    _memo[version] = digest


def file_digest(path) -> str:
    """sha256 (hex) of the bytes of ``path``, streamed; a settled version of the file this process
    has already hashed (same device, inode, size, mtime and ctime) is not read again."""
    path = Path(path)
    before = _version(path)
    if before in _memo:
        return _memo[before]
    start = _now()
    digest = file_sha256(path)
    if _version(path) == before and before[4] < start - SETTLED_NS:  # unchanged while read, and settled
        _keep(before, digest)
    return digest


def forget_digests() -> None:
    """Forget every remembered file digest (the next :func:`file_digest` of each file reads it)."""
    _memo.clear()


def write_stamps(folder) -> Path:
    """Hash every file of ``folder`` (not sub-folders) into ``folder/STAMPS``; returns its path."""
    folder = Path(folder)
    files = {p.name: {"sha256": file_sha256(p)} for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMPS}
    return atomic_text(folder / STAMPS, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1))


def verify_stamps(folder) -> list[str] | None:
    """Names of the files of ``folder`` that are unstamped, missing, or whose content differs from
    their stamp (``[]``: all verified); ``None`` when the folder has no (readable) stamps. Content
    is hashed unless this process hashed the same settled version of the file (:func:`file_digest`)."""
    folder = Path(folder)
    try:
        record = json.loads((folder / STAMPS).read_text())
        files = record["files"] if record.get("algorithm") == ALGORITHM else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    if not isinstance(files, dict) or not files:
        return None
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != STAMPS}
    bad = sorted(present - files.keys())
    for name, stamp in files.items():
        f, digest = folder / name, stamp.get("sha256") if isinstance(stamp, dict) else None
        if not f.is_file() or not digest:
            bad.append(name)
            continue
        if file_digest(f) != digest:
            bad.append(name)
    return bad
