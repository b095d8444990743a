"""Content digests of cached files, so a cache never serves corrupted weights.

=================================  ================================================================
:func:`write_stamps(folder)`       sha256 of every file in ``folder``, stored in ``folder/STAMPS``
:func:`verify_stamps(folder)`      the files that are missing, unstamped or whose content no longer
                                   matches (``None``: no stamps)
:func:`stat_key(path)`             what identifies one state of a file: path, device, inode, size,
                                   mtime and ctime
=================================  ================================================================

The model cache (:mod:`depthscope.hooks.loading`) stamps a GGUF's converted safetensors when it
writes them and verifies them before serving. Verification never rests on metadata alone: each
file's content is hashed the first time a process verifies it, and again whenever its
:func:`stat_key` changed. Any write changes the ctime, which ``os.utime`` cannot set back, so a
same-size rewrite with its mtime restored is hashed again; within one process an unchanged file
is not re-read. A zeroed block or random bytes are seen, warned about and converted again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from depthscope.common.files import atomic_text

STAMPS = "depthscope-stamps.json"
ALGORITHM = "sha256"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


#: (stat_key, sha256) pairs whose content this process has verified
_VERIFIED: set[tuple] = set()


def stat_key(path: Path) -> tuple:
    """Path, device, inode, size, mtime and ctime of a file: any write changes it."""
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def write_stamps(folder) -> Path:
    """Hash every file of ``folder`` (not sub-folders) into ``folder/STAMPS``; returns its path."""
    folder = Path(folder)
    files = {p.name: {"sha256": file_sha256(p)} for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMPS}
    return atomic_text(folder / STAMPS, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1))


def verify_stamps(folder) -> list[str] | None:
    """Names of the files of ``folder`` that are unstamped, missing, or whose content differs from
    their stamp (``[]``: all verified); ``None`` when the folder has no (readable) stamps. Content
    is hashed unless this process verified the file in the same :func:`stat_key` state."""
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
        key = (*stat_key(f), digest)  # stat before hashing: a write while hashing changes it
        if key in _VERIFIED:
            continue
        if file_sha256(f) != digest:
            bad.append(name)
        else:
            _VERIFIED.add(key)
    return bad
