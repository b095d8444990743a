"""Datasets of one JSON object per line, read and checked line by line.

==============================================  ================================================
``read_jsonl(path, parse, what=, limit=)``      every object of the file through ``parse(obj,
                                                where)`` (``where``: ``"FILE:LINE"``), blank
                                                lines skipped; a bad line is an
                                                :class:`~depthscope.common.errors.InputError`
                                                naming the file and the line
==============================================  ================================================

Prompt pairs (``depthscope patch``, ``depthscope circuit``) and counterfactual examples
(``depthscope localize``) both read their files here, so a file is refused for the same reasons
with the same words whichever command reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from depthscope.common.errors import InputError


def read_jsonl(path, parse: Callable[[object, str], object], *, what: str = "examples", limit: int) -> list:
    """The items ``parse(obj, "FILE:LINE")`` makes of the objects of the JSONL file ``path``:
    refused (:class:`InputError`) when the file is absent, not UTF-8, holds a line that is not JSON,
    holds more than ``limit`` items, or none (``what`` names them in the messages)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} file {str(p)!r} does not exist or is not a file")
    out = []
    try:
        with p.open(encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:  # bad JSON, a huge integer, nesting past the stack
                    why = e.msg if isinstance(e, json.JSONDecodeError) else f"{type(e).__name__}: {str(e)[:80]}"
                    raise InputError(f"{p}:{n}: not a JSON object ({why})") from None
                out.append(parse(obj, f"{p}:{n}"))
                if len(out) > limit:
                    raise InputError(f"{p}: more than {limit} {what}; split the file")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise InputError(f"{p}: no {what} (expected one JSON object per line)")
    return out
