"""The main job's arithmetic: the products each stage and probe phase performs, and the CPU time they need at best.

================  ==============================================================================
figure            what is measured
================  ==============================================================================
TFLOP             the floating-point operations of every matrix product (``mm``, ``bmm``,
                  ``addmm``, ``baddbmm``, ``addmv``, ``mv``, attention; torch's own formulas,
                  :mod:`torch.utils.flop_counter`) that ``run_report`` computes on one thread, by
                  stage (load, lens, norms, probes) and, in the probes, by task and phase (the
                  extraction forward, the penalty search, the per-site probes, the out-of-fold
                  refits, the stacking, the scalar mix, MDL)
peak rate         this machine's rate for one large square product on one thread, float32 and
                  bfloat16 (the best of five, after a warm-up): no product runs faster
floor             TFLOP / peak rate: the CPU seconds the products alone take, even at the peak
                  rate; the job cannot take fewer CPU seconds than its floor without doing fewer
                  products (fewer tokens, examples, sites, classes or solver passes)
CPU seconds       each stage's CPU seconds (the run's ``run.json``); each phase's is the CPU time
                  between consecutive products of that phase, so the work around the products
                  counts, and the gaps between phases (the report, the plots) do not
================  ==============================================================================

The job runs in this process with one intra-op thread, so every product runs on the calling
thread, where the counting mode sees it, in a fresh activation store (the extraction forward
counts). Counting passes every torch operation through Python and walks the stack at each
product, which adds CPU time: time the job with ``bench_main_job``, not with this run.
``--tasks`` picks the probe tasks; ``--run-args`` passes more ``depthscope run`` options
(``--precision bfloat16``, ``--lens-tokens 500``). It takes as long as the job on one thread
(ten minutes or more on the embedded model)::

    python -m benchmarks.bench_job_flops
    python -m benchmarks.bench_job_flops --tasks upos --json flops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

#: the functions that name a probe phase, outermost first wins (``fit_sites`` inside ``out_of_fold`` is a refit)
PHASES = {
    "load_and_extract": "extraction",
    "choose_l2": "penalty search",
    "fit_sites": "per-site probes",
    "out_of_fold": "out-of-fold refits",
    "stack": "stacking",
    "scalar_mix": "scalar mix",
    "mix_draws": "scalar mix",
    "online_codelength": "MDL",
}
#: the functions of ``run_report`` that name a stage
STAGES = {"_lens": "lens", "_norms": "norms", "run_probe_job": "probes", "report_causal": "causal"}
#: matrix-vector products, which torch's flop counter does not count: 2 x the matrix's entries
MATVEC = ("addmv", "mv")


def label(frame) -> tuple[str, str, str]:
    """``(stage, task, phase)`` of the product called under ``frame``: the outermost stage and
    phase functions on the stack, and the task of the enclosing ``fit_task`` (its ``td``)."""
    stage = task = phase = ""
    while frame is not None:  # inner to outer: each match overrides, so the outermost one stays
        name = frame.f_code.co_name
        if name in STAGES:
            stage = STAGES[name]
        elif name == "fit_task" and "td" in frame.f_locals:
            task = str(frame.f_locals["td"].task)
        elif name in PHASES:
            phase = PHASES[name]
        frame = frame.f_back
    if stage == "probes" and not phase:
        phase = "cumulative, other" if task else "other"
    return stage or "other", task, phase


def counting_mode(labeller=None):
    """A dispatch mode that adds each product's FLOPs and the CPU time since the last product
    of the same label to ``mode.flops`` / ``mode.cpu`` (keyed by ``labeller(frame)``, default
    :func:`label`)."""
    labeller = labeller or label
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.flops, self.cpu = collections.Counter(), collections.Counter()
            self.last, self.clock = None, time.process_time()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func.overloadpacket
            name = packet.__name__
            if packet in flop_registry:
                n = flop_registry[packet](*args, **kwargs, out_val=out)
            elif name in MATVEC:
                n = 2 * (args[1] if name == "addmv" else args[0]).numel()  # addmv(input, mat, vec)
            else:
                return out
            key = labeller(sys._getframe(1))
            now = time.process_time()
            if key == self.last:
                self.cpu[key] += now - self.clock
            self.flops[key] += n
            self.last, self.clock = key, now
            return out

    return Counting()


def peak_rate(dtype, n: int = 2048) -> float:
    """FLOP/s of an ``n x n`` product on the current threads: the best of five after a warm-up."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def count_job(out: Path, run_args: list[str]):
    """``depthscope run --out out --threads 1`` (with ``run_args``) in this process, its
    ``run_report`` under :func:`counting_mode`; the mode and the run's ``run.json``."""
    from typer.main import get_command

    import depthscope.analyses.report.main_job as report
    from depthscope.analyses.cli import app

    mode, real = counting_mode(), report.run_report

    def counted(*args, **kwargs):
        with mode:
            return real(*args, **kwargs)

    report.run_report = counted  # the command imports it when it runs
    try:
        argv = ["run", "--out", str(out), "--force", "--threads", "1", *run_args]
        get_command(app).main(argv, standalone_mode=False)
    finally:
        report.run_report = real
    return mode, json.loads((out / "run.json").read_text())


def table(mode, meta: dict, rates: dict) -> list[dict]:
    """One row per stage (its CPU seconds from ``run.json``) and per probe task and phase."""
    rows = []
    by_stage = collections.Counter()
    for (stage, _, _), n in mode.flops.items():
        by_stage[stage] += n
    for stage, n in sorted(by_stage.items(), key=lambda kv: -kv[1]):
        rows.append(_row(stage, "", "", n, meta["cpu_seconds"].get(stage), rates))
    for (stage, task, phase), n in sorted(mode.flops.items(), key=lambda kv: -kv[1]):
        if stage == "probes":
            rows.append(_row(stage, task, phase, n, mode.cpu[(stage, task, phase)], rates))
    total = sum(by_stage.values())
    rows.append(_row("total", "", "", total, meta["cpu_seconds"]["total"], rates))
    return rows


def _row(stage: str, task: str, phase: str, flops: float, cpu, rates: dict) -> dict:
    floor = flops / rates["float32"]
    return {
        "stage": stage,
        "task": task,
        "phase": phase,
        "tflop": flops / 1e12,
        "floor_cpu_s_float32": floor,
        "floor_cpu_s_bfloat16": flops / rates["bfloat16"],
        "cpu_s": cpu,
        "share_of_floor": floor / cpu if cpu else None,
    }


def lines(rows: list[dict], rates: dict) -> list[str]:
    """The printed table."""
    out = [
        f"peak rate, one thread: float32 {rates['float32'] / 1e9:.1f} GFLOP/s, bfloat16 {rates['bfloat16'] / 1e9:.1f}",
        "| stage | task | phase | TFLOP | floor CPU-s (float32) | floor CPU-s (bfloat16) | CPU-s | floor / CPU-s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = f"{r['cpu_s']:.1f}" if r["cpu_s"] else "-"
        share = f"{r['share_of_floor']:.2f}" if r["share_of_floor"] else "-"
        out.append(
            f"| {r['stage']} | {r['task']} | {r['phase']} | {r['tflop']:.3f} | {r['floor_cpu_s_float32']:.1f} | "
            f"{r['floor_cpu_s_bfloat16']:.1f} | {cpu} | {share} |"
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", help="probe tasks (default: the job's)")
    ap.add_argument("--run-args", default="", help='more options for depthscope run, e.g. "--precision bfloat16"')
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    import torch

    from benchmarks.bench_main_job import fresh_cache

    run_args = shlex.split(args.run_args) + (["--task", args.tasks] if args.tasks else [])
    old = os.environ.get("DEPTHSCOPE_CACHE")
    with tempfile.TemporaryDirectory(prefix="depthscope-job-flops-") as tmp:
        os.environ["DEPTHSCOPE_CACHE"] = str(fresh_cache(Path(tmp) / "cache"))  # a fresh store: the extraction counts
        try:
            mode, meta = count_job(Path(tmp) / "run", run_args)
        finally:  # the caller's cache again
            if old is None:
                del os.environ["DEPTHSCOPE_CACHE"]
            else:
                os.environ["DEPTHSCOPE_CACHE"] = old
    rates = {"float32": peak_rate(torch.float32), "bfloat16": peak_rate(torch.bfloat16)}
    rows = table(mode, meta, rates)
    print("\n".join(lines(rows, rates)))
    if args.json:
        args.json.write_text(json.dumps({"rates": rates, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
