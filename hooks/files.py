"""Files written whole or not at all: the one atomic writer every module uses.

| function | writes |
|---|---|
| ``atomic_write(path, write)`` | ``write(tmp)`` on a temporary file beside ``path``, then a rename over ``path`` |
| ``atomic_text(path, text)`` | a text file (JSON, Markdown, HTML) |

A reader sees the old file or the new one, never a part; a failed or interrupted write leaves
no temporary file behind. Files are made readable by all (0644): tables and reports are shared.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def atomic_write(path: PathLike, write: Callable[[str], object]) -> Path:
    """Write ``path`` through ``write(tmp_path)`` and an atomic rename; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_text(path: PathLike, text: str) -> Path:
    """Write a text file (UTF-8) atomically; returns ``path``."""
    return atomic_write(path, lambda t: Path(t).write_text(text, encoding="utf-8"))
