"""Independent jobs on several threads (common/threads.py: side_by_side) and the per-site solver's
blocks solved side by side (probes/solvers/subspace.py): results in order and equal to one
thread's, the first error raised and the other jobs told to stop, the intra-op thread count
restored."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from depthscope.common.threads import Stopped, side_by_side
from depthscope.probes.solvers import subspace
from depthscope.probes.solvers.classifiers import BatchedProbe
from depthscope.probes.solvers.training import train_probe
from tests.test_probes_fit import _subspace_case


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_jobs_run_on_their_own_threads_with_one_intra_op_thread_each(two_threads):
    seen = []

    def job(k):
        def run(stop):
            seen.append((threading.current_thread() is threading.main_thread(), torch.get_num_threads()))
            return k * k

        return run

    assert side_by_side([job(k) for k in range(5)], workers=2) == [0, 1, 4, 9, 16]
    assert all(not main and n == 1 for main, n in seen)
    assert torch.get_num_threads() == 2
    seen.clear()
    assert side_by_side([job(k) for k in range(3)], workers=1) == [0, 1, 4]  # inline, threads untouched
    assert seen == [(True, 2)] * 3


def test_the_first_error_stops_the_other_jobs_and_is_raised(two_threads):
    stopped = threading.Event()

    def slow(crew):
        for _ in range(500):  # at most 5 s: the failing job stops it long before
            try:
                crew.step()
            except Stopped:
                stopped.set()
                raise
            time.sleep(0.01)
        return "finished"

    def failing(crew):
        time.sleep(0.05)
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        side_by_side([slow, failing], workers=2)
    assert stopped.is_set()
    assert torch.get_num_threads() == 2


def test_the_last_running_job_takes_every_thread(two_threads):
    """While a job waits to start, each running job steps on one thread; once none waits, the
    one still running steps on both."""
    release = threading.Event()
    threads = []

    def quick(crew):
        crew.step()
        threads.append(("quick", torch.get_num_threads()))
        release.wait(5)
        return 0

    def long(crew):
        crew.step()
        threads.append(("long, others waiting", torch.get_num_threads()))
        release.set()
        for _ in range(200):  # until the two quick jobs are done (they take milliseconds)
            time.sleep(0.01)
            crew.step()
            if torch.get_num_threads() == 2:
                break
        threads.append(("long, alone", torch.get_num_threads()))
        return 1

    assert side_by_side([long, quick, quick], workers=2) == [1, 0, 0]
    assert threads[0] == ("long, others waiting", 1) or threads[0][0] == "quick"
    assert ("long, others waiting", 1) in threads and ("long, alone", 2) in threads
    assert torch.get_num_threads() == 2


def test_blocks_solved_side_by_side_fit_as_one_thread_does(monkeypatch, two_threads):
    """Three one-unit blocks (a state budget of two units), solved on two threads and on one:
    the same optima (each unit is its own problem)."""
    from depthscope.common import threads

    f, y, l2 = _subspace_case()
    monkeypatch.setattr(subspace, "STATE_BYTES", 2 * subspace.unit_bytes(len(f), 20, 2, 5))  # two units
    monkeypatch.setattr(threads, "SMALL_WORK", 0.0)  # the small case keeps its threads
    calls = []
    real = subspace.side_by_side
    monkeypatch.setattr(
        subspace, "side_by_side", lambda jobs, workers: calls.append((len(jobs), workers)) or real(jobs, workers)
    )
    out = []
    for count in (2, 1):
        torch.set_num_threads(count)
        p = BatchedProbe(n_sites=3, d=20, n_spans=1, n_classes=5, n_heads=2, l2=l2)
        log = train_probe(p, f, y)
        out.append((p.W.detach().clone(), p.b.detach().clone(), log))
    assert calls == [(3, 2), (2, 1)]  # two threads: one-unit blocks, two at a time; one: two-unit blocks
    (W2, b2, log2), (W1, b1, log1) = out
    assert log2.converged.all() and log1.converged.all()
    # the last block's products move to two threads, so rounding differs: the same optima
    assert abs(log2.objective - log1.objective).max() <= 1e-6 * abs(log1.objective).max()
    torch.testing.assert_close(W2, W1, rtol=0, atol=2e-4)
    torch.testing.assert_close(b2, b1, rtol=0, atol=2e-4)
