"""Progress bars for long work: shown with an ETA on a terminal, quiet in logs and CI.

=====================================  ===========================================================
``progress_bar(total, desc=, unit=,    a ``tqdm`` bar (use as a context manager or call
enabled=, initial=)``                  ``update``/``close``); off when ``enabled`` is False, when
                                       stderr is not a terminal, or when ``$CI`` is set
``track(iterable, desc=, ...)``        the same bar over an iterable
``spinner(desc)``                      a context: an animated line with the elapsed time, for
                                       one step of unknown length (GGUF conversion)
``bars_enabled()``                     whether bars are shown in this process
=====================================  ===========================================================

Every stage that can take more than a few seconds (lens, norms, extraction, probe fitting,
tuned-lens training, sweeps, conversion, patching) draws its bar through this module, so one
rule decides when bars appear: ``DEPTHSCOPE_PROGRESS=1`` forces them on, ``=0`` off.
"""

from __future__ import annotations

import os
import sys


def bars_enabled() -> bool:
    """Bars on a terminal only: ``$DEPTHSCOPE_PROGRESS`` (1/0) decides first, then ``$CI`` (off),
    then whether stderr is a TTY."""
    forced = os.environ.get("DEPTHSCOPE_PROGRESS")
    if forced is not None and forced.strip() != "":
        return forced.strip().lower() not in ("0", "false", "no", "off")
    if os.environ.get("CI"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _options(desc: str, unit: str, enabled: bool, kw: dict) -> dict:
    kw.setdefault("leave", False)
    kw.setdefault("dynamic_ncols", True)
    return dict(desc=desc, unit=unit, disable=not (enabled and bars_enabled()), file=sys.stderr, **kw)


def progress_bar(total: int | float | None = None, *, desc: str, unit: str = "it", enabled: bool = True, **kw):
    """A ``tqdm`` bar on stderr (rate and ETA when ``total`` is known), disabled unless
    ``enabled`` and :func:`bars_enabled`; it disappears when done (``leave=False``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, **_options(desc, unit, enabled, kw))


def track(iterable, *, desc: str, unit: str = "it", enabled: bool = True, total: int | None = None, **kw):
    """``iterable`` wrapped in a bar like :func:`progress_bar`'s (``total`` defaults to its ``len``)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, **_options(desc, unit, enabled, kw))


def spinner(desc: str, enabled: bool = True):
    """A context manager showing ``desc`` with a spinner and the elapsed time while its block runs
    (rich's status line); nothing when bars are off."""
    import contextlib

    if not (enabled and bars_enabled()):
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(desc)
