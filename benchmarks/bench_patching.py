"""Batched activation patching against one forward per site, on the default model (issue 12).

Both sides patch the clean IOI prompt's stream into the corrupted run at every one of the 61
residual sites (last position) and read the logit difference ' Mary' - ' John'; both include the
clean run that captures the activations. depthscope: :func:`activation_patching` (every patch a
batch row, the rows sharing one key/value cache of the unpatched prefix; also timed without that
reuse, ``reuse_prefix=False``, as a second row with no goal). Baseline: the same hooks through
``model.run``, one forward per site (what a user writes without batching). Threads are pinned,
everything is warmed up, then run in turn (A B C A B C ...) for ``rounds`` rounds; the median and
the spread (min-max) are printed. Goal: >= 3x.

Second case, a dataset (issue 34): every attention head (30 x 9) at the last position over IOI
pairs built by ``examples/ioi_dataset.py`` (six templates, 14-18 tokens; 100 pairs, ``--quick``
10). depthscope: ``activation_patching(model, pairs, sites="heads")`` (means over pairs).
Baseline: a plain transformers loop, one forward per pair and head with a forward pre-hook on
that layer's ``o_proj`` setting the head's slice at the last position to its clean value (plus a
clean and a corrupted forward per pair; ``logits_to_keep=1`` where transformers has it). The
pairs are split into 5 rounds; each round runs both arms on its pairs in turn (A B A B ..., both
warmed up on other pairs first), timed in CPU seconds of the process with one thread, so the
rounds together patch every pair once per arm; the ratio is the median of the paired per-round
ratios (goal <= 0.3), and both arms' means must agree within 1e-3. Memory: the peak resident
growth of one dataset call in a fresh subprocess at 25 and at 100 pairs (``--quick``: 10 and
40), whose ratio is near 1 when memory is bounded by one pair and one chunk of rows (goal <= 1.25;
the per-pair table itself, 270 rows a pair, is the only part that grows).

    python benchmarks/bench_patching.py [--quick] [--threads 1] [--only sites|dataset]

``run(quick) -> list[dict]`` returns rows ``{figure, depthscope, baseline, ratio, goal, met}``
(seconds per full patching sweep; megabytes for the memory row) for the benchmarks entry point.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
GOAL = 3.0
#: the dataset case: pairs timed (quick, full), pairs of the two memory runs, rounds, goals
DATASET_PAIRS = {True: 10, False: 100}
MEMORY_PAIRS = {True: (10, 40), False: (25, 100)}
DATASET_ROUNDS = 5
DATASET_GOAL, MEMORY_GOAL = 0.3, 1.25
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ioi_dataset.py"
if not __package__:  # run as a file (python benchmarks/bench_patching.py): benchmarks._common importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def run(quick: bool = False, threads: int = 1, only: str | None = None) -> list[dict]:
    """Both cases (``only``: ``sites`` or ``dataset``): the residual sites of one pair, median
    seconds over interleaved rounds (5 quick, 9 otherwise), and the dataset of IOI pairs."""
    from depthscope.hooks import load_model

    torch.set_num_threads(threads)
    model = load_model()
    rows = [] if only == "dataset" else _sites_rows(model, quick, threads)
    return rows if only == "sites" else rows + _dataset_rows(model, quick, threads)


def _sites_rows(model, quick: bool, threads: int) -> list[dict]:
    """The residual sites of the IOI pair: batched against one forward per site."""
    from depthscope.analyses.circuits.patching.activation import activation_patching

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


# ----------------------------------------------------------------------------- a dataset of pairs
def ioi_pairs(tokenizer, n_pairs: int, seed: int = 0) -> list:
    """IOI pairs of ``examples/ioi_dataset.py`` (its templates cycle, so lengths differ)."""
    spec = importlib.util.spec_from_file_location("ioi_dataset_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_pairs(tokenizer, n_pairs, seed=seed)


def _head_loop(model, pairs) -> list[tuple[float, float, np.ndarray]]:
    """The baseline: per pair, the clean run's o_proj inputs at the last position, the corrupted
    metric, and one corrupted forward per head with that head's slice set to its clean value.
    Returns (clean, corrupted, patched [layers, heads]) per pair."""
    hf, tok = model.hf_model, model.tokenizer
    layers, n_heads = hf.model.layers, hf.config.num_attention_heads
    d_head = hf.config.hidden_size // n_heads
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
    out = []
    for p in pairs:
        c, k = (tok(x, return_tensors="pt")["input_ids"].to(hf.device) for x in (p.clean, p.corrupted))
        t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))
        z = {}
        grabs = [
            layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, i=i, z=z: z.__setitem__(i, a[0][0, -1].clone())
            )
            for i, layer in enumerate(layers)
        ]
        try:
            with torch.no_grad():
                lg = hf(input_ids=c, **keep).logits
        finally:
            for g in grabs:
                g.remove()
        clean = float(lg[0, -1, t] - lg[0, -1, f])
        with torch.no_grad():
            lg = hf(input_ids=k, **keep).logits
        corrupted, patched = float(lg[0, -1, t] - lg[0, -1, f]), np.empty((len(layers), n_heads))
        for i, layer in enumerate(layers):
            for h in range(n_heads):

                def put(m, a, sl=slice(h * d_head, (h + 1) * d_head), v=z[i]):
                    x = a[0].clone()
                    x[0, -1, sl] = v[sl]
                    return (x,)

                handle = layer.self_attn.o_proj.register_forward_pre_hook(put)
                try:
                    with torch.no_grad():
                        lg = hf(input_ids=k, **keep).logits
                finally:
                    handle.remove()
                patched[i, h] = float(lg[0, -1, t] - lg[0, -1, f])
        out.append((clean, corrupted, patched))
    return out


def _loop_means(got) -> np.ndarray:
    """The baseline's mean patched metric per head over its pairs, [layers * heads] in layer order."""
    return np.mean([g[2] for g in got], axis=0).reshape(-1)


def _dataset_timing(model, quick: bool) -> dict:
    """Both arms over the pairs, split into rounds (each arm on a round's pairs in turn), after a
    warm-up of both on other pairs; CPU seconds of this process per round, and the largest
    difference of the two arms' mean patched metrics."""
    from depthscope.analyses.circuits.patching.activation import activation_patching

    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    pairs = ioi_pairs(model.tokenizer, DATASET_PAIRS[quick])
    warm = ioi_pairs(model.tokenizer, 2, seed=1)
    arms = {
        "depthscope": lambda ps: activation_patching(model, ps, sites="heads", positions="last"),
        "baseline": lambda ps: _head_loop(model, ps),
    }
    for fn in arms.values():
        fn(warm)
    times, err = {k: [] for k in arms}, 0.0
    for r in range(DATASET_ROUNDS):
        chunk, got = pairs[r::DATASET_ROUNDS], {}
        for k, fn in arms.items():
            t = clock()
            got[k] = fn(chunk)
            times[k].append(clock() - t)
        ours = got["depthscope"].sort_values(["layer", "head"])["metric"].to_numpy()
        err = max(err, float(np.abs(ours - _loop_means(got["baseline"])).max()))
    if err > 1e-3:
        raise AssertionError(f"dataset patching and the hook loop disagree by {err:.2e}")
    lengths = sorted({len(model.tokenizer(p.clean)["input_ids"]) for p in pairs})
    return {"times": times, "err": err, "n_pairs": len(pairs), "lengths": lengths, "clock": clock.__name__}


def dataset_peak(n_pairs: int) -> dict:
    """(Memory subprocess) the peak resident growth of one dataset call over ``n_pairs`` pairs,
    after a warm-up call on every template; with the size of the per-pair table it builds."""
    from benchmarks._common import measure_peak
    from depthscope.analyses.circuits.patching.activation import activation_patching, patch_pairs
    from depthscope.hooks import load_model

    model = load_model()
    activation_patching(model, ioi_pairs(model.tokenizer, 6, seed=1), sites="heads")
    pairs = ioi_pairs(model.tokenizer, n_pairs)
    got = measure_peak(lambda: len(activation_patching(model, pairs, sites="heads")))
    table = patch_pairs(model, pairs[:1], sites="heads").memory_usage(deep=True).sum() * n_pairs
    return {"extra": got["extra"], "hwm_reset": got["hwm_reset"], "table": float(table), "n_pairs": n_pairs}


def _dataset_rows(model, quick: bool, threads: int) -> list[dict]:
    """The dataset case's two rows: time against the hook loop, peak memory at 4x the pairs."""
    from benchmarks._common import LIVE_MEMORY_ENV, peak_memory

    t = _dataset_timing(model, quick)
    ours, base = t["times"]["depthscope"], t["times"]["baseline"]
    ratio = statistics.median(a / b for a, b in zip(ours, base))
    small, large = (
        peak_memory("bench_patching", "dataset_peak", threads, env=LIVE_MEMORY_ENV, n_pairs=n)
        for n in MEMORY_PAIRS[quick]
    )
    mem = large["extra"] / small["extra"]
    lo, hi = t["lengths"][0], t["lengths"][-1]
    name = f"IOI dataset patching, 270 heads at the last position, {t['n_pairs']} pairs of {lo}-{hi} tokens"
    clock = "cpu" if t["clock"] == "process_time" else "wall"
    return [
        {
            "figure": f"{name}: activation_patching / one forward per patch (transformers pre-hooks)",
            "depthscope": sum(ours),
            "baseline": sum(base),
            "ratio": ratio,
            "goal": f"<= {DATASET_GOAL:g}",
            "met": ratio <= DATASET_GOAL,
            "spread": (min(ours), max(ours)),
            "baseline_spread": (min(base), max(base)),
            "rounds": DATASET_ROUNDS,
            "threads": threads,
            "max_abs_diff": t["err"],
            "note": f"{clock} seconds over all pairs (5 rounds of {t['n_pairs'] // DATASET_ROUNDS} pairs, "
            f"ratio = median of the per-round ratios); means agree within {t['err']:.1e}",
        },
        {
            "figure": f"dataset patching peak RSS growth, 270 heads: {large['n_pairs']} / {small['n_pairs']} pairs",
            "depthscope": f"{large['extra'] / 2**20:.1f} MB",
            "baseline": f"{small['extra'] / 2**20:.1f} MB",
            "ratio": mem,
            "goal": f"<= {MEMORY_GOAL:g}",
            "met": mem <= MEMORY_GOAL,
            "note": f"fresh subprocess per size (live memory); the per-pair table is "
            f"{large['table'] / 2**20:.1f} MB at {large['n_pairs']} pairs, {small['table'] / 2**20:.1f} MB at "
            f"{small['n_pairs']}",
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 interleaved rounds instead of 9; 10 pairs, not 100")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned; default 1)")
    ap.add_argument("--only", choices=["sites", "dataset"], default=None, help="one case only")
    args = ap.parse_args()
    rows = run(args.quick, args.threads, args.only)
    print(f"# torch {torch.__version__}, {args.threads} thread(s); spreads are min-max over rounds")
    for r in rows:
        if "spread" not in r:  # the memory row
            print(
                f"{r['figure']}\n    {r['depthscope']} vs {r['baseline']}   ratio {r['ratio']:.2f}   "
                f"goal {r['goal']}: {'met' if r['met'] else 'NOT met'}\n    {r['note']}"
            )
            continue
        lo, hi = r["spread"]
        blo, bhi = r["baseline_spread"]
        if isinstance(r["goal"], str):  # the dataset row: depthscope / baseline
            goal = f"   goal {r['goal']}: {'met' if r['met'] else 'NOT met'}"
            how = f"ratio {r['ratio']:.3f}"
        else:
            goal = "" if r["goal"] is None else f"   goal >= {r['goal']:g}x: {'met' if r['met'] else 'NOT met'}"
            how = f"speed-up {r['ratio']:.2f}x"
        print(
            f"{r['figure']}\n    {r['depthscope']:7.3f} s (rounds {lo:.3f}-{hi:.3f}) "
            f"vs baseline {r['baseline']:7.3f} s ({blo:.3f}-{bhi:.3f})   {how}{goal}; within {r['max_abs_diff']:.1e}"
        )
        if r.get("note"):
            print(f"    {r['note']}")


if __name__ == "__main__":
    main()
