"""One entry point for every benchmark: ``python -m benchmarks [--quick] [--only capture,norms]``.

Runs each benchmark module (capture, norms, probes, lens) under one thread setting, prints ONE
table (figure, depthscope, baseline, ratio, goal, met?) with the machine's load, cpu count and
thread count beside it, and writes the same rows as CSV and JSON under benchmarks/results/
(git-ignored; ``latest.csv`` / ``latest.json`` are the last run). Exit status 1 only when a
benchmark could not run; unmet goals are reported in the table.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import time
import traceback
import warnings

from benchmarks._common import Row, Settings, failed_row, format_table, machine, machine_line, write_results

BENCHES = ["capture", "norms", "probes", "probe_fit", "lens", "points", "patching", "sweep", "extraction"]
# self-contained benchmarks: ``run(quick[, threads]) -> list[dict]`` rows with figure, depthscope and
# baseline (numbers in the unit given here), ratio and a numeric goal compared with the operator here
DICT_BENCHES = {"patching": (">=", "s"), "sweep": (">=", "s"), "extraction": ("<=", "MB"), "probe_fit": (">=", "")}


def _cell(v, unit: str) -> str:
    return f"{v:.4g} {unit}".strip() if isinstance(v, float) else str(v)


def _as_rows(name: str, got: list) -> list[Row]:
    op, unit = DICT_BENCHES[name]
    rows = []
    for r in got:
        if isinstance(r, Row):
            rows.append(r)
            continue
        goal = r.get("goal")
        goal = "" if goal is None else (goal.rstrip("x") if isinstance(goal, str) else f"{op} {goal:g}")
        ratio = r.get("ratio")
        if (ratio is None or ratio != ratio) and isinstance(r.get("depthscope"), float):
            ratio = r["depthscope"]  # a figure whose goal bounds depthscope's value itself (a difference)
        rows.append(
            Row(
                figure=r["figure"],
                depthscope=_cell(r.get("depthscope", ""), unit),
                baseline=_cell(r.get("baseline", ""), unit),
                ratio=float("nan") if ratio is None else float(ratio),
                goal=goal,
                note=str(r.get("note", "")),
                bench=name,
            )
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes: the whole table in under 5 minutes on 2 cores")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for every arm (torch and BLAS/OpenMP via threadpoolctl); default 1",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per figure (at least 5)")
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    args = ap.parse_args(argv)
    settings = Settings(quick=args.quick, threads=args.threads, rounds=args.rounds)
    settings.pin()
    warnings.filterwarnings("ignore")
    info_start = machine(settings)
    print(f"# depthscope benchmarks{' (--quick)' if args.quick else ''}: {machine_line(info_start)}", flush=True)
    rows, t0 = [], time.perf_counter()
    for name in [b.strip() for b in args.only.split(",") if b.strip()]:
        if name not in BENCHES:
            ap.error(f"unknown benchmark {name!r}; choose from {BENCHES}")
        t = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.bench_{name}")
            if name in DICT_BENCHES:
                kw = {"threads": settings.threads} if "threads" in inspect.signature(module.run).parameters else {}
                got = _as_rows(name, module.run(quick=settings.quick, **kw))
            else:
                got = module.run(settings)
        except Exception as e:  # one failed benchmark still leaves the others' figures
            traceback.print_exc()
            got = [failed_row(name, e)]
        rows += got
        print(f"  {name}: {len(got)} figures in {time.perf_counter() - t:.0f} s", flush=True)
    info = machine(settings)
    info["load_avg_at_start"] = info_start["load_avg_1_5_15"]
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print()
    print(format_table(rows))
    print(
        f"\nmachine: {machine_line(info)} (load at start {info_start['load_avg_1_5_15'][0]:.2f}); "
        f"{info['seconds']:.0f} s in all"
    )
    for r in rows:
        if r.note:
            print(f"  {r.figure.strip()}: {r.note}")
    paths = write_results(rows, info)
    print(f"results: {paths['csv']} and {paths['json']}")
    return 1 if any(r.figure.endswith("FAILED") for r in rows) else 0  # unmet goals are in the table, not errors


if __name__ == "__main__":
    raise SystemExit(main())
