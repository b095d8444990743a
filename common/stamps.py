"""Content digests of cached files, so a cache never serves corrupted weights.

=================================  ================================================================
:func:`write_stamps(folder)`       sha256, size and mtime of every file in ``folder``, stored in
                                   ``folder/STAMPS``
:func:`verify_stamps(folder)`      the files whose content no longer matches (``None``: no stamps);
                                   a file whose size and mtime are unchanged is trusted without
                                   re-reading it, a changed one is re-hashed (and its stamp renewed
                                   when the content still matches, e.g. after a copy)
=================================  ================================================================

The model cache (:mod:`depthscope.hooks.loading`) stamps a GGUF's converted safetensors when it
writes them and verifies them on every load: a zeroed block or random bytes in the cache are seen
(the write changes the mtime), warned about and converted again.
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


def _stamp(path: Path, digest: str) -> dict:
    st = path.stat()
    return {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_stamps(folder) -> Path:
    """Hash every file of ``folder`` (not sub-folders) into ``folder/STAMPS``; returns its path."""
    folder = Path(folder)
    files = {p.name: _stamp(p, file_sha256(p)) for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMPS}
    return atomic_text(folder / STAMPS, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1))


def verify_stamps(folder) -> list[str] | None:
    """Names of the stamped files of ``folder`` that are missing or whose content changed; ``[]``
    when all match, ``None`` when the folder has no (readable) stamps."""
    folder = Path(folder)
    try:
        record = json.loads((folder / STAMPS).read_text())
        files = record["files"] if record.get("algorithm") == ALGORITHM else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    if not isinstance(files, dict) or not files:
        return None
    bad, renewed = [], False
    for name, stamp in files.items():
        p = folder / name
        if not p.is_file():
            bad.append(name)
            continue
        st = p.stat()
        if st.st_size == stamp.get("size") and st.st_mtime_ns == stamp.get("mtime_ns"):
            continue  # unchanged since it was hashed
        digest = file_sha256(p)
        if digest != stamp.get("sha256"):
            bad.append(name)
        else:
            files[name], renewed = _stamp(p, digest), True
    if renewed and not bad:
        try:
            atomic_text(folder / STAMPS, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1))
        except OSError:
            pass  # a read-only cache still verifies, by hashing each time
    return bad
