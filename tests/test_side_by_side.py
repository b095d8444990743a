"""Independent jobs on several threads (common/threads.py: side_by_side) and the per-site solver's
blocks solved side by side (probes/solvers/subspace.py): results in order and equal to one
thread's, the first error raised and the other jobs told to stop, the intra-op thread count
restored."""

from __future__ import annotations

import threading
import time

import numpy as np
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

    def slow(stop):
        for _ in range(500):  # at most 5 s: the failing job stops it long before
            if stop.is_set():
                stopped.set()
                raise Stopped
            time.sleep(0.01)
        return "finished"

    def failing(stop):
        time.sleep(0.05)
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        side_by_side([slow, failing], workers=2)
    assert stopped.is_set()
    assert torch.get_num_threads() == 2


def test_blocks_solved_side_by_side_fit_as_one_thread_does(monkeypatch, two_threads):
    """Three one-unit blocks (a state budget of two units) solved side by side on two threads fit
    exactly as two-unit blocks on one thread do: each unit's arithmetic is one thread's. With
    fewer than ``BALANCE`` blocks per thread the blocks run one after another."""
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
    for count, balance in ((2, 1), (1, 1), (2, 4)):
        monkeypatch.setattr(subspace, "BALANCE", balance)
        torch.set_num_threads(count)
        p = BatchedProbe(n_sites=3, d=20, n_spans=1, n_classes=5, n_heads=2, l2=l2)
        log = train_probe(p, f, y)
        out.append((p.W.detach().clone(), p.b.detach().clone(), log))
    # side by side: one-unit blocks, two at a time; one thread, or too few blocks: two-unit blocks
    assert calls == [(3, 2), (2, 1), (2, 1)]
    (W2, b2, log2), (W1, b1, log1) = out[:2]
    assert log2.converged.all() and (log2.unit_epochs == log1.unit_epochs).all()
    assert torch.equal(W2, W1) and torch.equal(b2, b1)
    assert np.array_equal(log2.objective, log1.objective)


def test_the_others_running_are_read_from_proc_stat(monkeypatch, tmp_path):
    """``procs_running`` counts this process too: one running is nobody else; the median of the
    samples stands, so a short burst does not decide."""
    import builtins

    from depthscope.common import threads

    reads = iter([3, 1, 1, 5, 1])
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if path == "/proc/stat":
            f = tmp_path / "stat"
            f.write_text(f"cpu  1 2 3\nprocs_running {next(reads)}\nprocs_blocked 0\n")
            return real_open(f, *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert threads._others_running(samples=5, gap=0) == 0.0  # counts 2,0,0,4,0: the median is 0
