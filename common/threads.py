"""Intra-op torch threads for small work: one thread where synchronising several costs more than
it saves (badly so on a busy machine).

=========================  ====================================================================
``threads_for(work)``      context: one intra-op thread when ``work`` (multiply-adds per step)
                           is below ``SMALL_WORK``, the current count otherwise
``one_thread()``           context: one intra-op thread, whatever the work
``set_threads(n)``         torch's intra-op threads, ``n`` checked against the machine first
``side_by_side(jobs, n)``  independent jobs on ``n`` threads, each with its share of them
=========================  ====================================================================

The previous thread count is restored when the block ends, also on an error. A thread count is at
most :data:`~depthscope.common.settings.CPUS` (a few per CPU of this machine): torch takes any
count, and absurd ones allocate gigabytes of per-thread buffers or crash.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from depthscope.common.settings import CPUS, check_number

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


class Stopped(Exception):
    """Raised by :meth:`Crew.step` in a job of :func:`side_by_side` once another job failed or
    the caller was interrupted."""


class Crew:
    """What each job of :func:`side_by_side` shares with the others: :meth:`step`, to call
    between its steps."""

    def __init__(self, workers: int, jobs: int):
        self.workers, self.pending, self.running = workers, jobs, 0
        self.stop, self.lock = threading.Event(), threading.Lock()

    def step(self) -> None:
        """Raise :class:`Stopped` once the jobs are stopped; else set this thread's intra-op
        threads to its share of the workers: one while jobs wait to start, and the workers split
        among the jobs still running once none waits (the last job's products use every thread,
        instead of leaving the others idle)."""
        if self.stop.is_set():
            raise Stopped
        with self.lock:
            want = 1 if self.pending else max(1, self.workers // max(self.running, 1))
        if self.workers > 1 and torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _run(self, job: Callable):
        with self.lock:
            self.pending -= 1
            self.running += 1
        torch.set_num_threads(1)  # this thread's OpenMP count (and MKL's, process-wide: restored after)
        try:
            return job(self)
        finally:
            with self.lock:
                self.running -= 1


def side_by_side(jobs: Sequence[Callable[[Crew], object]], workers: int) -> list:
    """The results of ``jobs`` (independent of each other), in order, computed on ``workers``
    threads; ``workers <= 1`` or a single job: one after another on the calling thread. Each job
    receives the :class:`Crew` and calls its :meth:`~Crew.step` between steps: while jobs wait to
    start, each job's torch operations run on one intra-op thread, and once none waits the
    running ones share the workers; after a job failed (or the caller was interrupted) the step
    raises :class:`Stopped`. The first error is raised once every started job has returned.

    Several small products side by side use the cores better than each product split across
    them: torch releases the interpreter lock inside its operations, and a product of a few
    dozen columns on one thread saves the threads' synchronisation. The intra-op thread count
    is restored afterwards (``torch.set_num_threads`` in a worker also sets MKL's, which is
    process-wide)."""
    crew = Crew(workers, len(jobs))
    if workers <= 1 or len(jobs) <= 1:
        crew.workers = 1
        return [job(crew) for job in jobs]
    old = torch.get_num_threads()
    pool = ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="depthscope")
    futures = [pool.submit(crew._run, job) for job in jobs]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
    except BaseException:
        crew.stop.set()
        raise
    finally:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        torch.set_num_threads(old)
