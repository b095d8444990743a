"""How far E_Delta moves with the seed and the epoch cap, on the bundled EWT sample (default model).

Issue 13's stability figure: ``run_probes`` on the bundled UD EWT sample (``sample_data()``,
train -> test, the default model and the default protocol), once per seed and stacking setting,
and the largest change of each task's E_Delta between the seeds (the "shift"). What the seed
changes once every probe has converged: the folds the penalty is chosen on, the stacking's fold
draws and the control labels. The epoch cap is not varied here: a converged run is unchanged by
a larger cap (``tests/test_probes_run.py::test_cap_beyond_convergence_changes_nothing``), and
the table says whether every probe converged.

``--stack`` lists stacking settings ``FOLDSxDRAWS[@L2]`` (``stack_folds`` x ``stack_draws``, and
``stack_l2`` when given; the default protocol is ``2x2@0.01``) to compare: more folds make each
fold probe nearer the full-train probe (less noise per draw), more draws average draws; both
cost out-of-fold refits. The ridge on the stacking weights is free (the stacking is refitted,
not the probes) but moves E_Delta: a stronger one spreads the weight of every prefix over more
sites. The activation store is reused across runs (``--store``), so only the first run extracts.

    python -m benchmarks.bench_stability [--tasks upos,deprel] [--seeds 0,1,2] [--stack 2x2,5x1,5x1@0.1]

Long: one upos run of the default protocol takes about 3 minutes on 2 cores, deprel about 12.
Prints one row per task, stacking setting and seed (E_Delta, its interval, the argmax-accuracy
E_Delta ``hard``, the accuracy of the all-sites cumulative probe, convergence, the penalty,
seconds), then the shift per task and setting, of both; ``--csv`` writes the rows.
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
    for folds, draws, l2 in stacks:
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
                **({} if l2 is None else {"stack_l2": l2}),
            )
            secs = time.perf_counter() - t0
            for _, s in res.summary.iterrows():
                rows.append(
                    {
                        "task": s["task"],
                        "stack": f"{folds}x{draws}@{s['stack_l2']:g}",
                        "seed": seed,
                        "expected_layer_delta": s["expected_layer_delta"],
                        "lo": s["expected_layer_delta_lo"],
                        "hi": s["expected_layer_delta_hi"],
                        "hard": s["expected_layer_delta_hard"],
                        "all_sites_accuracy": round(float(s["mix_accuracy"]), 4),
                        "converged": bool(s["converged"]),
                        "l2": s["l2"],
                        "seconds_run": round(secs, 1),
                    }
                )
            print(pd.DataFrame(rows).tail(len(res.summary)).to_string(index=False, header=False), flush=True)
    return pd.DataFrame(rows)


def shifts(df: pd.DataFrame) -> pd.DataFrame:
    """The largest change of E_Delta between seeds, per task and stacking setting (``shift``: the
    headline, soft-accuracy E_Delta; ``hard_shift``: the argmax-accuracy one)."""
    g = df.groupby(["task", "stack"])
    e, h = g["expected_layer_delta"], g["hard"]
    return pd.DataFrame(
        {"min": e.min(), "max": e.max(), "shift": e.max() - e.min(), "hard_shift": h.max() - h.min(), "runs": e.size()}
    ).reset_index()


def _pairs(text: str) -> list:
    out = []
    for part in text.split(","):
        part, _, l2 = part.partition("@")
        folds, draws = part.lower().split("x")
        out.append((int(folds), int(draws), float(l2) if l2 else None))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_stability", description=__doc__)
    ap.add_argument("--tasks", default="upos")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--stack", default="2x2", help="FOLDSxDRAWS[@L2] settings, comma-separated (default protocol 2x2@0.01)"
    )
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
