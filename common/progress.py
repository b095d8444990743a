"""Progress of long work: a bar with an ETA on a terminal, plain log lines anywhere else.

=====================================  ===========================================================
``progress_bar(total, desc=, unit=,    a progress object (use as a context manager or call
enabled=, initial=)``                  ``update``/``close``/``set_postfix``): a ``tqdm`` bar when
                                       :func:`bars_enabled`, else log lines (below)
``track(iterable, desc=, ...)``        the same over an iterable
``spinner(desc)``                      a context for one step of unknown length (GGUF
                                       conversion): an animated line with the elapsed time on a
                                       terminal, else log lines
``bars_enabled()``                     whether bars are drawn in this process
``log_enabled()``                      whether log lines replace them
=====================================  ===========================================================

Every stage that can take more than a few seconds (lens, norms, extraction, probe fitting,
tuned-lens training, sweeps, conversion, patching) reports through this module, so one rule
decides what appears on stderr:

* a terminal (stderr is a TTY, ``$CI`` unset), or ``DEPTHSCOPE_PROGRESS=1``: ``tqdm`` bars that
  disappear when done;
* otherwise (a log file, a pipe, CI): plain lines, so a job written to a log is never silent for
  minutes: one when the work has run for ``LogProgress.grace`` seconds (2; ``logit lens:
  0/4096 tok``: work that ends sooner, such as one small probe fit, writes nothing), then at most one every
  ``$DEPTHSCOPE_PROGRESS_EVERY`` seconds (default 10) with the rate and the time left, and one
  when it ends with the elapsed time (``logit lens: finished 4096/4096 tok in 2 min 05 s``);
* ``DEPTHSCOPE_PROGRESS=0``: nothing.

``enabled=False`` on a call silences that one (a caller's own ``progress=False``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time

from rich.console import Console
from tqdm.auto import tqdm

__all__ = ["progress_bar", "track", "spinner", "bars_enabled", "log_enabled", "log_interval", "LogProgress"]

#: seconds between two log lines of one task, unless ``$DEPTHSCOPE_PROGRESS_EVERY`` says otherwise
DEFAULT_EVERY = 10.0
_OFF = ("0", "false", "no", "off")

# the clock of the log lines (tests replace it)
_clock = time.monotonic


def _forced() -> bool | None:
    """``$DEPTHSCOPE_PROGRESS`` as True (1), False (0) or None (unset or blank)."""
    forced = os.environ.get("DEPTHSCOPE_PROGRESS")
    if forced is None or forced.strip() == "":
        return None
    return forced.strip().lower() not in _OFF


def bars_enabled() -> bool:
    """Bars on a terminal only: ``$DEPTHSCOPE_PROGRESS`` (1/0) decides first, then ``$CI`` (off),
    then whether stderr is a TTY."""
    forced = _forced()
    if forced is not None:
        return forced
    if os.environ.get("CI"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def log_enabled() -> bool:
    """Log lines where bars are not drawn, unless ``DEPTHSCOPE_PROGRESS=0``."""
    return _forced() is not False and not bars_enabled()


def log_interval() -> float:
    """Seconds between two log lines of one task: ``$DEPTHSCOPE_PROGRESS_EVERY`` (a number >= 0;
    0 writes a line at every update), else :data:`DEFAULT_EVERY`."""
    raw = os.environ.get("DEPTHSCOPE_PROGRESS_EVERY", "").strip()
    try:
        every = float(raw) if raw else DEFAULT_EVERY
    except ValueError:
        return DEFAULT_EVERY
    return every if math.isfinite(every) and every >= 0 else DEFAULT_EVERY


def _emit(line: str) -> None:
    """One log line on the current stderr (looked up at each call: pytest and callers swap it)."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):  # a closed or broken stderr must not stop the work
        pass


def _duration(seconds: float) -> str:
    """'0.4 s', '12 s', '2 min 05 s', '1 h 03 min'."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _rate(done: float, seconds: float, unit: str) -> str:
    if seconds <= 0 or done <= 0:
        return ""
    r = done / seconds
    return f"{r:.3g} {unit}/s" if r >= 1 or unit == "it" else f"{1 / r:.3g} s/{unit}"


class LogProgress:
    """What :func:`progress_bar` returns where bars are not drawn: the subset of ``tqdm``'s API
    depthscope uses (``update``, ``close``, ``set_postfix``, ``set_postfix_str``,
    ``set_description``, ``refresh``, ``write``, ``reset``, ``n``, ``total``, iteration, context
    manager), writing plain lines to stderr: one ``grace`` seconds after the start, then one
    every ``every`` seconds (at an update, or from a timer thread when a step takes longer),
    and one when closed. Work closed within ``grace`` seconds writes
    nothing: its enclosing stage reports it, and a log is not flooded by many short fits."""

    disable = False
    #: seconds a task runs before its first line (0: at once)
    grace = 2.0
    #: a timer thread writes the start line and a line every ``every`` seconds without updates
    heartbeat = True

    def __init__(
        self,
        iterable=None,
        *,
        total: float | None = None,
        desc: str = "",
        unit: str = "it",
        initial: float = 0,
        every: float | None = None,
        **_ignored,
    ):
        if total is None and iterable is not None:
            try:
                total = len(iterable)
            except (TypeError, AttributeError):
                total = None
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = initial
        self.initial = initial
        self.every = log_interval() if every is None else every
        self.postfix = ""
        self.closed = False
        self.start_t = self.last_t = _clock()
        self._lock = threading.Lock()
        self._announced = False
        self._stop = threading.Event()
        if self.grace <= 0:
            self._announce()
        if self.heartbeat:
            threading.Thread(target=self._watch, daemon=True, name=f"progress {desc}").start()

    def _watch(self) -> None:
        """The timer: the start line after ``grace`` seconds, then a line whenever ``every``
        seconds pass without one (a long step between two updates is not silent)."""
        if self.grace > 0 and not self._stop.wait(self.grace):
            self._announce()
        while not self._stop.wait(max(self.every, 0.05)):
            with self._lock:
                now = _clock()
                if self.closed or now - self.last_t < self.every:
                    continue
                self.last_t = now
                self._announced = True
            _emit(self._line(now))

    def _announce(self) -> None:
        """The first line (the start), once, unless the task is already closed."""
        with self._lock:
            if self._announced or self.closed:
                return
            self._announced = True
        _emit(self._line())

    # --- the lines
    def _amount(self, percent: bool = True) -> str:
        done = _count(self.n)
        if self.total is None:
            return f"{done} {self.unit}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total and percent else ""
        return f"{done}/{_count(self.total)} {self.unit}{pct}"

    def _line(self, now: float | None = None, *, end: bool = False) -> str:
        head = f"{self.desc}: " if self.desc else ""
        post = f", {self.postfix}" if self.postfix else ""
        if now is None:  # the start
            return f"{head}{self._amount()}{post}"
        elapsed = now - self.start_t
        if end:
            return f"{head}finished {self._amount(percent=False)} in {_duration(elapsed)}{post}"
        bits = [self._amount()]
        done = self.n - self.initial
        rate = _rate(done, elapsed, self.unit)
        if rate:
            bits.append(rate)
        if self.total is not None and done > 0 and self.total > self.n:
            bits.append(f"{_duration(elapsed * (self.total - self.n) / done)} left")
        else:
            bits.append(f"{_duration(elapsed)} elapsed")
        return head + ", ".join(bits) + post

    # --- tqdm's API
    def update(self, n: float = 1) -> bool:
        with self._lock:
            if self.closed:
                return False
            self.n += n
            now = _clock()
            if now - self.last_t < self.every or (self.total is not None and self.n >= self.total):
                return False  # too soon; or complete: the end line says so
            self.last_t = now
            self._announced = True  # a progress line also announces the task
        _emit(self._line(now))
        return True

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            announced = self._announced
        self._stop.set()
        if announced:
            _emit(self._line(_clock(), end=True))

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = dict(ordered_dict or {}, **kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self, *args, **kwargs) -> None:
        """Nothing: lines come with :meth:`update` (rate limited) and :meth:`close`."""

    def clear(self, *args, **kwargs) -> None:
        """Nothing to clear in a log."""

    def write(self, s: str, *args, **kwargs) -> None:
        _emit(str(s))

    def reset(self, total: float | None = None) -> None:
        self.n = self.initial = 0
        if total is not None:
            self.total = total
        self.start_t = self.last_t = _clock()

    def __iter__(self):
        if self.iterable is None:
            raise TypeError("this progress object wraps no iterable")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return f"LogProgress({self._amount()!r}, desc={self.desc!r})"


def _options(desc: str, unit: str, kw: dict) -> dict:
    kw.setdefault("leave", False)
    kw.setdefault("dynamic_ncols", True)
    return dict(desc=desc, unit=unit, file=sys.stderr, **kw)


def progress_bar(total: int | float | None = None, *, desc: str, unit: str = "it", enabled: bool = True, **kw):
    """Progress of ``total`` units (unknown: None): a ``tqdm`` bar on stderr (rate and ETA when
    ``total`` is known, gone when done) when :func:`bars_enabled`, log lines
    (:class:`LogProgress`) when :func:`log_enabled`; a silent ``tqdm`` when ``enabled`` is False
    or ``DEPTHSCOPE_PROGRESS=0``."""
    if enabled and bars_enabled():
        return tqdm(total=total, **_options(desc, unit, kw))
    if enabled and log_enabled():
        return LogProgress(total=total, desc=desc, unit=unit, **kw)
    return tqdm(total=total, disable=True, **_options(desc, unit, kw))


def track(iterable, *, desc: str, unit: str = "it", enabled: bool = True, total: int | None = None, **kw):
    """``iterable`` wrapped like :func:`progress_bar` (``total`` defaults to its ``len``)."""
    if enabled and bars_enabled():
        return tqdm(iterable, total=total, **_options(desc, unit, kw))
    if enabled and log_enabled():
        return LogProgress(iterable, total=total, desc=desc, unit=unit, **kw)
    return tqdm(iterable, total=total, disable=True, **_options(desc, unit, kw))


@contextlib.contextmanager
def _log_spinner(desc: str, every: float):
    """Log lines for a step of unknown length: ``desc...`` at the start, ``desc... 20 s`` every
    ``every`` seconds from a background thread, and how long it took at the end."""
    start = _clock()
    stop = threading.Event()
    _emit(f"{desc}...")

    def beat():
        while not stop.wait(max(every, 0.05)):
            _emit(f"{desc}... {_duration(_clock() - start)}")

    thread = threading.Thread(target=beat, name="depthscope-progress", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join(timeout=1.0)
        took = _duration(_clock() - start)
        _emit(f"{desc}: done in {took}" if ok else f"{desc}: stopped after {took}")


def spinner(desc: str, enabled: bool = True):
    """A context manager for one step of unknown length: on a terminal, ``desc`` with a spinner
    and the elapsed time (rich's status line); elsewhere the log lines of :func:`progress_bar`
    (start, every ``$DEPTHSCOPE_PROGRESS_EVERY`` seconds, end); nothing when off."""
    if enabled and bars_enabled():
        return Console(stderr=True).status(desc)
    if enabled and log_enabled():
        return _log_spinner(desc, log_interval())
    return contextlib.nullcontext()
