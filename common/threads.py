"""Intra-op torch threads for small work: one thread where synchronising several costs more than
it saves (badly so on a busy machine).

=========================  ====================================================================
``threads_for(work)``      context: one intra-op thread when ``work`` (multiply-adds per step)
                           is below ``SMALL_WORK``, the current count otherwise
``one_thread()``           context: one intra-op thread, whatever the work
``set_threads(n)``         torch's intra-op threads, ``n`` checked against the machine first
=========================  ====================================================================

The previous thread count is restored when the block ends, also on an error. A thread count is at
most :data:`~depthscope.common.settings.CPUS` (a few per CPU of this machine): torch takes any
count, and absurd ones allocate gigabytes of per-thread buffers or crash.
"""

from __future__ import annotations

import contextlib

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
