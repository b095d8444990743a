"""Intra-op torch threads for small work: one thread where synchronising several costs more than
it saves (badly so on a busy machine).

=========================  ====================================================================
``threads_for(work)``      context: one intra-op thread when ``work`` (multiply-adds per step)
                           is below ``SMALL_WORK``, the current count otherwise
``one_thread()``           context: one intra-op thread, whatever the work
``set_threads(n)``         torch's intra-op threads, ``n`` checked against the machine first
``free_cores()``           the cores this process can get now: its CPUs less the others running
``auto_threads()``         the commands' default: torch's count, at most :func:`free_cores`
``side_by_side(jobs, n)``  independent jobs on ``n`` threads, each with one intra-op thread
=========================  ====================================================================

The previous thread count is restored when the block ends, also on an error. A thread count is at
most :data:`~depthscope.common.settings.CPUS` (a few per CPU of this machine): torch takes any
count, and absurd ones allocate gigabytes of per-thread buffers or crash.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from depthscope.common.settings import CPUS, check_number, cpu_count

#: multiply-adds per step below which one thread is faster than several
SMALL_WORK = 2e7


@contextlib.contextmanager
def threads_for(work: float):
    """One intra-op thread inside the block when ``work < SMALL_WORK``; unchanged otherwise."""
    old = torch.get_num_threads()
    single = work < SMALL_WORK and old > 1
    if single:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if single:
            torch.set_num_threads(old)


def one_thread():
    """One intra-op thread inside the block (copying rows, small per-step work)."""
    return threads_for(0.0)


def set_threads(threads: int, name: str = "threads") -> None:
    """``torch.set_num_threads(threads)`` for an integer from 1 to :data:`~depthscope.common.settings.CPUS`
    (else an InputError naming ``name`` and the bound)."""
    check_number(name, threads, minimum=1, maximum=CPUS)
    torch.set_num_threads(threads)


def _others_running(samples: int = 5, gap: float = 0.02) -> float | None:
    """The processes other than this one that are running or ready to run, now: the median of
    ``samples`` reads of ``/proc/stat``'s ``procs_running`` (which counts this process too), ``gap``
    seconds apart; None where the file is not there."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat", encoding="ascii") as f:
                line = next((ln for ln in f if ln.startswith("procs_running ")), None)
        except OSError:
            return None
        if line is None:
            return None
        counts.append(int(line.split()[1]) - 1)
        if i + 1 < samples:
            time.sleep(gap)
    return float(sorted(counts)[len(counts) // 2])


def free_cores(load: float | None = None) -> int:
    """The cores this process can get now: the CPUs it may run on less the other processes that are
    running now (``load``, if given, in their place), at least 1. "Now" is read from
    ``/proc/stat`` (a median over 0.1 s), not from the load average: that lags by minutes, so the
    command a user ran just before would count against the next one. Where ``/proc`` is absent,
    the one-minute load average stands in."""
    cpus = cpu_count()
    if load is None:
        load = _others_running()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # neither (Windows): every CPU
            return cpus
    return max(1, min(cpus, int(cpus - load + 0.5)))


def auto_threads() -> int:
    """The commands' default intra-op thread count (``--threads`` not given): torch's own choice (the
    physical cores), but no more than :func:`free_cores`, read once when the command starts. On a
    shared machine threads beyond the free cores add no speed: torch's threads spin-wait for each
    other over a forward's many small products (docs/benchmarks.md, "Threads on a shared CPU")."""
    return max(1, min(torch.get_num_threads(), free_cores()))


class Stopped(Exception):
    """Raised by a job of :func:`side_by_side` that found its stop event set: another job failed
    or the caller was interrupted."""


def side_by_side(jobs: Sequence[Callable[[threading.Event], object]], workers: int) -> list:
    """The results of ``jobs`` (independent of each other), in order, computed on ``workers``
    threads, each running its torch operations on one intra-op thread; ``workers <= 1`` or a
    single job: one after another on the calling thread, its thread count unchanged. Each job
    receives an event that is set once another job failed or the caller was interrupted: it
    should check it between steps and stop (raising :class:`Stopped`, say). The first error is
    raised once every started job has returned.

    Several small products side by side use the cores better than each product split across
    them: torch releases the interpreter lock inside its operations, and a product of a few
    dozen columns on one thread saves the threads' synchronisation. Each job's arithmetic is
    that of one thread whatever ``workers`` is, so its results do not depend on the schedule.
    The intra-op thread count is restored afterwards (``torch.set_num_threads`` in a worker
    also sets MKL's, which is process-wide)."""
    stop = threading.Event()
    if workers <= 1 or len(jobs) <= 1:
        return [job(stop) for job in jobs]
    old = torch.get_num_threads()

    def run(job):
        torch.set_num_threads(1)  # this thread's OpenMP count (and MKL's, restored below)
        return job(stop)

    pool = ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="depthscope")
    futures = [pool.submit(run, job) for job in jobs]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        torch.set_num_threads(old)
