"""``depthscope causal`` at its defaults: CPU seconds per site against its arithmetic floor, with the
edited forwards starting at their site's block and, as the baseline, from the embedding.

The defaults: upos on the bundled EWT sample (its train and test sentences), the held-out text the
test sentences, LEACE and 4 raw controls per site, 1000 bootstrap resamples. The run is restricted
to ``--sites`` (default: three sites spread through the depth, embed, 14.attn and 29.mlp, whose
mean depth is the whole model's) and scaled to the 61 sites: the per-site stage (the five edited forwards of a site)
times 61, plus what the run does once (extraction, probe fits, the clean loss).

=====================  ======================================================================
arm                    what runs
=====================  ======================================================================
``from site``          ``causal_tests`` as shipped: every edited forward starts at its site's
                       block from the clean stream there (:mod:`depthscope.analyses.causal.erasure.prefix`)
``from embedding``     the same with the streams turned off (``PREFIX_BYTES = 0``): every forward
                       runs the whole model (the behaviour before)
=====================  ======================================================================

The floor is counted as ``bench_job_flops`` counts the main job's, in a first run of the shipped
arm under FLOP counting (:func:`benchmarks.bench_job_flops.counting_mode`, which slows it, so it
is not timed): the FLOPs of every matrix product (the extraction forward, the probe fits, the
clean loss and streams, the edited forwards), divided by this core's peak float32 rate on one
large product. The two arms are then timed in this process on ``--threads`` threads (default 1),
the extraction store warm::

    python -m benchmarks.bench_causal [--sites embed,14.attn,29.mlp] [--threads 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

#: the functions that name a phase of the causal run (outermost wins, as in bench_job_flops)
PHASES = {
    "load_and_extract": "extraction",
    "site_accuracy": "probe fits",
    "_erasers": "erasure fits",
    "advance": "clean streams",
    "_site_effect": "edited forwards",
}


def causal_label(frame) -> tuple[str, str, str]:
    """``("causal", "", phase)`` of a product: the outermost phase function on the stack; the
    clean loss (``doc_nll`` called from ``causal_tests``) is its own phase."""
    phase = ""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    for name in names:  # inner to outer: the outermost match stays
        if name in PHASES:
            phase = PHASES[name]
    if "advance" in names:  # the streams advance inside a site's stage, but are the depth's one clean forward
        phase = "clean streams"
    if not phase and "doc_nll" in names:
        phase = "clean loss"
    return "causal", "", phase or "other"


def run(model, cfg, sites, plain: bool, counting=None) -> tuple[float, float, dict]:
    """One ``causal_tests`` at ``sites``: (CPU seconds, wall seconds, info)."""
    from dataclasses import replace

    import depthscope.hooks.late_start as prefix
    from depthscope.analyses.causal.erasure.used import causal_tests

    saved = prefix.PREFIX_BYTES
    prefix.PREFIX_BYTES = 0 if plain else saved
    cfg = replace(cfg, extraction=replace(cfg.extraction, sites=sites))
    try:
        c0, w0 = time.process_time(), time.perf_counter()
        if counting is not None:
            with counting:
                res = causal_tests(model, cfg)
        else:
            res = causal_tests(model, cfg)
        return time.process_time() - c0, time.perf_counter() - w0, res
    finally:
        prefix.PREFIX_BYTES = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", default="embed,14.attn,29.mlp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    import benchmarks.bench_job_flops as flops
    from depthscope.analyses.causal.erasure.config import CausalConfig
    from depthscope.hooks import load_model
    from depthscope.hooks.sites import parse_sites

    torch.set_num_threads(args.threads)
    model = load_model(dtype=torch.float32)
    sites = parse_sites([s.strip() for s in args.sites.split(",")], model.n_layers)
    cfg = CausalConfig()
    mode = flops.counting_mode(causal_label)
    run(model, cfg, sites, plain=False, counting=mode)  # the FLOPs (and a warm extraction store)
    cpu_site, wall_site, res = run(model, cfg, sites, plain=False)
    cpu_plain, wall_plain, res_plain = run(model, cfg, sites, plain=True)
    same = res.table.equals(res_plain.table)
    rate = flops.peak_rate(torch.float32)
    by_phase = collections.Counter()
    for (_, _, phase), n in mode.flops.items():
        by_phase[phase] += n
    n, full = len(sites), 2 * model.n_layers + 1
    cpu = {k[2]: v for k, v in mode.cpu.items()}
    # per site: the edited forwards and the fits; once: extraction, the clean loss and streams
    scale = {p: full / n if p in ("edited forwards", "probe fits", "erasure fits") else 1.0 for p in by_phase}
    floor_61 = sum(by_phase[p] * scale[p] for p in by_phase) / rate
    cpu_61 = sum(cpu.get(p, 0.0) * scale[p] for p in by_phase)
    rows = {
        "sites": [str(s) for s in args.sites.split(",")],
        "threads": args.threads,
        "peak_gflops_float32": rate / 1e9,
        "tflop_by_phase": {p: v / 1e12 for p, v in by_phase.items()},
        "cpu_by_phase_counted": cpu,
        "cpu_s_61_sites_from_phases_counted": cpu_61,
        "cpu_s": {"from site": cpu_site, "from embedding": cpu_plain},
        "wall_s": {"from site": wall_site, "from embedding": wall_plain},
        "tables_equal": bool(same),
        "floor_cpu_s_these_sites": sum(by_phase.values()) / rate,
        "floor_cpu_s_61_sites": floor_61,
        "n_lm_tokens": int(res.table["n_lm_tokens"].iloc[0]),
        "n_train": int(res.table["n_train"].iloc[0]),
        "n_test": int(res.table["n_test"].iloc[0]),
    }
    print(json.dumps(rows, indent=1))
    print(
        f"{n} sites, {rows['n_lm_tokens']} held-out tokens, {rows['n_train']} / {rows['n_test']} words: "
        f"from site {cpu_site:.0f} CPU-s, from embedding {cpu_plain:.0f} CPU-s "
        f"({cpu_plain / cpu_site:.2f}x); floor {rows['floor_cpu_s_these_sites']:.0f} CPU-s: "
        f"from site at {cpu_site / rows['floor_cpu_s_these_sites']:.2f}x its floor; 61 sites: a floor of "
        f"{floor_61:.0f} CPU-s ({cpu_61:.0f} by the counted run's phases); tables equal: {same}",
        file=sys.stderr,
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
