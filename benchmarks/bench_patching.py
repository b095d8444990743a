"""Batched activation patching against one forward per site, on the default model (issue 12).

Both sides patch the clean IOI prompt's stream into the corrupted run at every one of the 61
residual sites (last position) and read the logit difference ' Mary' - ' John'; both include the
clean run that captures the activations. depthscope: :func:`activation_patching` (every patch a
batch row, the rows sharing one key/value cache of the unpatched prefix; also timed without that
reuse, ``reuse_prefix=False``, as a second row with no goal). Baseline: the same hooks through
``model.run``, one forward per site (what a user writes without batching). Threads are pinned,
everything is warmed up, then run in turn (A B C A B C ...) for ``rounds`` rounds; the median and
the spread (min-max) are printed. Goal: >= 3x.

    python benchmarks/bench_patching.py [--quick] [--threads 1]

``run(quick) -> list[dict]`` returns rows ``{figure, depthscope, baseline, ratio, goal, met}``
(seconds per full patching sweep) for the benchmarks entry point.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
GOAL = 3.0


def _one_per_site(model, target: int, foil: int) -> list[float]:
    """The baseline: capture the clean stream, then one patched forward per site."""
    clean = model.run(CLEAN, cache="resid")
    out = []
    for label in model.labels:
        value = clean[label][:, -1]

        def patch(t, ctx, value=value):
            t = t.clone()
            t[:, -1] = value
            return t

        logits = model.run(CORRUPTED, hooks={label: patch}).logits
        out.append(float(logits[0, -1, target] - logits[0, -1, foil]))
    return out


def _interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    for f in fns.values():  # warm-up
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return times


def run(quick: bool = False, threads: int = 1) -> list[dict]:
    """Median seconds of both ways over interleaved rounds (5 quick, 9 otherwise)."""
    from depthscope.analyses.patching import activation_patching
    from depthscope.hooks import load_model

    torch.set_num_threads(threads)
    model = load_model()
    tok = model.tokenizer
    target, foil = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" Mary", " John"))
    batched = activation_patching(model, CLEAN, CORRUPTED, (target, foil))
    single = _one_per_site(model, target, foil)
    err = max(abs(a - b) for a, b in zip(batched["metric"], single))
    if err > 1e-3:
        raise AssertionError(f"batched and one-per-site patching disagree by {err:.2e}")
    times = _interleaved(
        {
            "depthscope": lambda: activation_patching(model, CLEAN, CORRUPTED, (target, foil)),
            "no_prefix": lambda: activation_patching(model, CLEAN, CORRUPTED, (target, foil), reuse_prefix=False),
            "baseline": lambda: _one_per_site(model, target, foil),
        },
        rounds=5 if quick else 9,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    common = {"baseline": med["baseline"], "rounds": len(times["baseline"]), "threads": threads, "max_abs_diff": err}
    name = f"activation patching, {model.n_sites} residual sites, last position"
    rows = []
    for key, what, goal in [
        ("depthscope", "batched rows sharing the unpatched prefix", GOAL),
        ("no_prefix", "batched rows, every position recomputed (reuse_prefix=False)", None),
    ]:
        ratio = med["baseline"] / med[key]
        rows.append(
            {
                "figure": f"{name}: {what} vs one forward per site",
                "depthscope": med[key],
                "ratio": ratio,
                "goal": goal,
                "met": None if goal is None else ratio >= goal,
                "spread": (min(times[key]), max(times[key])),
                "baseline_spread": (min(times["baseline"]), max(times["baseline"])),
                **common,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 interleaved rounds instead of 9")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned; default 1)")
    args = ap.parse_args()
    rows = run(args.quick, args.threads)
    r0 = rows[0]
    print(
        f"# torch {torch.__version__}, {r0['threads']} thread(s), median of {r0['rounds']} interleaved rounds "
        f"(spread min-max); batched == one-per-site within {r0['max_abs_diff']:.1e}"
    )
    lo, hi = r0["baseline_spread"]
    print(f"one forward per site (baseline)  {r0['baseline']:7.3f} s   ({lo:.3f}-{hi:.3f})")
    for r in rows:
        lo, hi = r["spread"]
        goal = "" if r["goal"] is None else f"   goal >= {r['goal']:g}x: {'met' if r['met'] else 'NOT met'}"
        print(f"{r['figure']}\n    {r['depthscope']:7.3f} s ({lo:.3f}-{hi:.3f})   speed-up {r['ratio']:.2f}x{goal}")


if __name__ == "__main__":
    main()
