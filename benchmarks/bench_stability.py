"""How far E_Delta moves with the seed and the epoch cap, on the bundled EWT sample (default model).

Issue 13's stability figure: ``run_probes`` on the bundled UD EWT sample (``sample_data()``,
train -> test, the default model and the default protocol), once per seed and stacking setting,
and the largest change of each task's E_Delta between the seeds (the "shift"). What the seed
changes once every probe has converged: the folds the penalty is chosen on, the stacking's fold
draws and the control labels. The epoch cap is not varied here: a converged run is unchanged by
a larger cap (``tests/test_probes_run.py::test_cap_beyond_convergence_changes_nothing``), and
the table says whether every probe converged.

``--stack`` lists stacking settings ``FOLDSxDRAWS`` (``stack_folds`` x ``stack_draws``; the
default protocol is ``2x2``) to compare: more folds make each fold probe nearer the full-train
probe (less noise per draw), more draws average draws; both cost out-of-fold refits. The
activation store is reused across runs (``--store``), so only the first run extracts.

    python -m benchmarks.bench_stability [--tasks upos,deprel] [--seeds 0,1,2] [--stack 2x2,5x1]

Long: one upos run of the default protocol takes about 3 minutes on 2 cores, deprel about 12.
Prints one row per task, stacking setting and seed (E_Delta, its interval, convergence, the
penalty, seconds), then the shift per task and setting; ``--csv`` writes the rows.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd


def run(tasks, seeds, stacks, store: str, threads: int | None = None) -> pd.DataFrame:
    """One row per (task, stacking setting, seed): E_Delta and what the run converged to."""
    import torch

    from depthscope.probes import run_probes, sample_data

    if threads:
        torch.set_num_threads(threads)
    data = sample_data()
    rows = []
    for folds, draws in stacks:
        for seed in seeds:
            t0 = time.perf_counter()
            res = run_probes(
                None,
                ",".join(tasks),
                data["ewt_train"],
                data["ewt_test"],
                store_dir=store,
                progress=False,
                seed=seed,
                stack_folds=folds,
                stack_draws=draws,
            )
            secs = time.perf_counter() - t0
            for _, s in res.summary.iterrows():
                rows.append(
                    {
                        "task": s["task"],
                        "stack": f"{folds}x{draws}",
                        "seed": seed,
                        "expected_layer_delta": s["expected_layer_delta"],
                        "lo": s["expected_layer_delta_lo"],
                        "hi": s["expected_layer_delta_hi"],
                        "converged": bool(s["converged"]),
                        "l2": s["l2"],
                        "seconds_run": round(secs, 1),
                    }
                )
            print(pd.DataFrame(rows).tail(len(res.summary)).to_string(index=False, header=False), flush=True)
    return pd.DataFrame(rows)


def shifts(df: pd.DataFrame) -> pd.DataFrame:
    """The largest change of E_Delta between seeds, per task and stacking setting."""
    g = df.groupby(["task", "stack"])["expected_layer_delta"]
    return pd.DataFrame({"min": g.min(), "max": g.max(), "shift": g.max() - g.min(), "runs": g.size()}).reset_index()


def _pairs(text: str) -> list:
    out = []
    for part in text.split(","):
        folds, draws = part.lower().split("x")
        out.append((int(folds), int(draws)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_stability", description=__doc__)
    ap.add_argument("--tasks", default="upos")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--stack", default="2x2", help="FOLDSxDRAWS settings, comma-separated (default protocol 2x2)")
    ap.add_argument("--store", default=".depthscope-stability-store", help="activation store, reused across runs")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args(argv)
    df = run(
        [t.strip() for t in a.tasks.split(",") if t.strip()],
        [int(s) for s in a.seeds.split(",")],
        _pairs(a.stack),
        a.store,
        a.threads,
    )
    print(df.to_string(index=False))
    print(shifts(df).to_string(index=False))
    if a.csv:
        df.to_csv(a.csv, index=False)


if __name__ == "__main__":
    main()
