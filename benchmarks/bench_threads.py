"""Torch threads on a shared CPU: ``depthscope layers``, ``lens`` and ``probe`` with N threads
against one thread, with and without another process computing beside them.

    python -m benchmarks.bench_threads                 # 2 rounds, interleaved, the default model
    python -m benchmarks.bench_threads --rounds 3 --threads 2,1,auto

Each arm is one command in a fresh subprocess (``--threads N``, or no flag for ``auto``, the
commands' default), timed by its wall clock. ``--busy`` starts one extra process that runs
one-thread float32 products for as long as the arms run (the "another process computes" of a
shared machine); the arms run interleaved (A B C A B C ...) so a drift in the machine's load falls
on all of them alike. The numbers are wall seconds: what a user waits for.

Why: on a 2-core machine with anything else running, two torch threads spin-wait on each other
over the many small products of a forward pass. This benchmark is the measurement behind the
commands' default (``--threads`` auto: the cores the process can get now, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import UD


def _busy(stop) -> None:
    """One thread of float32 products until ``stop`` is set: another process computing."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _sentences(n: int) -> list[str]:
    path = UD / "en_ewt-ud-dev.conllu"
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# text = "):
                out.append(line[len("# text = ") :].strip())
                if len(out) == n:
                    break
    return out


def commands(work: Path) -> dict[str, list[str]]:
    """Each analysis at a size of about a minute on one quiet core."""
    text = work / "docs.txt"
    text.write_text("\n".join(_sentences(20)) + "\n", encoding="utf-8")
    return {
        "layers": ["layers", "--text", str(text), "--max-tokens", "200"],
        "lens": ["lens", "--text", str(text), "--max-tokens", "300"],
        "probe": [
            "probe",
            "--task",
            "upos",
            "--max-train-sentences",
            "200",
            "--max-test-sentences",
            "80",
            "--no-plots",
        ],
    }


def run_arm(cmd: list[str], threads: str, out: Path) -> float:
    flag = [] if threads == "auto" else ["--threads", threads]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["DEPTHSCOPE_PROGRESS"] = "0"
    exe = Path(sys.executable).with_name("depthscope")
    start = time.perf_counter()
    subprocess.run([str(exe), *cmd, *flag, "--out", str(out), "--force"], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", default="2,1,auto", help="comma list of thread counts; 'auto': no --threads flag")
    p.add_argument("--only", default="layers,lens,probe")
    p.add_argument("--quiet-too", action="store_true", help="also time every arm with no busy process beside it")
    a = p.parse_args(argv)
    arms = a.threads.split(",")
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        cmds = {k: v for k, v in commands(work).items() if k in a.only.split(",")}
        for name, cmd in cmds.items():  # warm-up: the store, the converted model, the page cache
            run_arm(cmd, "1", work / f"warm-{name}")
        for busy in [False, True] if a.quiet_too else [True]:
            stop = mp.Event()
            proc = mp.Process(target=_busy, args=(stop,), daemon=True) if busy else None
            if proc:
                proc.start()
            times: dict[tuple[str, str], list[float]] = {}
            try:
                for _ in range(a.rounds):
                    for name, cmd in cmds.items():
                        for t in arms:
                            times.setdefault((name, t), []).append(run_arm(cmd, t, work / f"{name}-{t}"))
            finally:
                if proc:
                    stop.set()
                    proc.join()
            load = os.getloadavg()[0]
            print(f"\n{'another process computing' if busy else 'quiet'} (load average now {load:.1f}), wall s, median")
            print(f"{'command':8} " + " ".join(f"{'threads ' + t:>12}" for t in arms) + f"  {arms[0]}/{arms[1]}")
            for name in cmds:
                med = [statistics.median(times[(name, t)]) for t in arms]
                print(f"{name:8} " + " ".join(f"{m:12.1f}" for m in med) + f"  {med[0] / med[1]:8.2f}")


if __name__ == "__main__":
    main()
