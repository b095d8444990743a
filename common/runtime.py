"""Process-level runtime settings for analysis jobs (the command line applies them; library
users opt in).

:func:`tune_allocator` keeps large freed blocks in glibc's heap instead of returning them to
the OS. PyTorch on CPU allocates every intermediate with ``malloc``; blocks above glibc's
mmap threshold (at most 32 MB by default) are mapped fresh and page-faulted on every use, so
a probe training step over ``[sites x batch x d_model]`` features or a forward over a long
batch pays for zeroing new pages each time; on probe fitting that is a large share of the time.
Blocks from ``mmap_threshold`` (256 MB) up are still mapped: copies of whole feature sets and
all-site activations are made once per stage, and a freed one returns to the OS at once rather
than staying in the heap, where blocks of changing sizes would fragment it and hold the peak
memory of every stage at once. Every thread allocates from that one heap (glibc gives each thread
that allocates a heap of its own by default, and each would keep its own freed blocks).

:func:`release_memory` hands the heap's free pages back to the OS (glibc's ``malloc_trim``).
Jobs call it where one stage's working set ends and another's begins (after the lens, the
norms, each probe task and each phase of its fit): the blocks a stage kept for reuse are of no
use to the next, whose allocations have other sizes, and would otherwise add to its peak.

:func:`peak_memory` is the process's peak resident memory since :func:`reset_peak_memory`
(Linux: ``VmHWM``, reset through ``/proc/self/clear_refs``), so a job can record each stage's
own peak; elsewhere it is the peak since the process started (``ru_maxrss``).
"""

from __future__ import annotations

import ctypes
import gc
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_done = False


def tune_allocator(mmap_threshold: int = 1 << 28, trim_threshold: int = 1 << 29) -> bool:
    """Raise glibc's mmap and trim thresholds and keep one heap for every thread (Linux/glibc
    only; a no-op elsewhere or when ``DEPTHSCOPE_NO_MALLOPT`` is set). Returns True when
    applied. The cost: memory freed by the process stays reserved for its later allocations, up
    to ``trim_threshold`` above the heap's top and blocks below ``mmap_threshold``. One heap,
    because threads that allocate (the probe solver's blocks side by side) would otherwise each
    keep freed blocks in a heap of their own, on top of the main one."""
    global _done
    if _done:
        return True
    if os.environ.get("DEPTHSCOPE_NO_MALLOPT"):
        return False
    mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    ok = (
        mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
        and mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
        and mallopt(M_ARENA_MAX, 1) == 1
    )
    _done = ok
    return ok


def release_memory(collect: bool = False) -> bool:
    """Return the heap's free memory to the OS (glibc ``malloc_trim(0)``; a no-op returning False
    elsewhere). Costs a walk of the heap's free lists, milliseconds: call it between stages, not
    in loops. ``collect``: first collect unreachable reference cycles (``gc.collect``, a few
    hundred milliseconds with torch and transformers loaded), where a large object in a cycle
    was just dropped: a model's modules and their hooks form some."""
    if collect:
        gc.collect()
    trim = _libc("malloc_trim", [ctypes.c_size_t])
    if trim is None:
        return False
    trim(0)
    return True


def _libc(name: str, argtypes: list):
    """The C library's function ``name`` (returning int) with ``argtypes``, or None where the
    process's C library has none (not glibc)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def reset_peak_memory() -> bool:
    """Start a new peak-memory window for :func:`peak_memory` (Linux 4.0 and later: write ``5``
    to ``/proc/self/clear_refs``); False where that is not possible (the window then runs from
    the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory() -> int:
    """Peak resident memory in bytes since :func:`reset_peak_memory` (``VmHWM``), or since the
    process started where there is no ``/proc`` (``ru_maxrss``: kilobytes on Linux, bytes on
    macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
