"""Sweep of 6 tiny checkpoints: the local engine against Ray with 2 workers (issue 14).

The series is a real tiny training run (:func:`depthscope.hooks.toy.train_tiny_series`, a
2-layer Llama with the default model's tokenizer, so the lens decodes a 49k vocabulary), saved
every 10 steps: step0 ... step50. Every side runs the logit lens over the same distinct UD
English EWT sentences (``$DEPTHSCOPE_UD``, else the bundled samples) on each checkpoint, torch
on one thread per process (the local engine in this process, each Ray worker in its own), and
their combined tables are checked equal. Timed:

* ``local``: ``sweep(..., engine=None)``, the checkpoints one after another;
* ``ray (cold)``: ``RayEngine(workers=2)`` starting its own local Ray (start, worker spawn and
  imports included: what one ``depthscope sweep --engine ray`` pays);
* ``ray (warm)``: the same on a Ray that is already up (a long-lived cluster).

The ratio is local / ray; on 2 cores the ceiling is 2x (a shared machine gives less). Goal: the
warm engine is faster than the local one. The per-checkpoint cost (local seconds / 6) feeds the
estimate for long series printed at the end.

    python benchmarks/bench_sweep.py [--quick]

``run(quick) -> list[dict]`` returns rows ``{figure, depthscope, baseline, ratio, goal, met}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extraction import distinct_sentences  # noqa: E402

N_CHECKPOINTS = 6


def _series(root: Path) -> list:
    from depthscope.analyses.sweeps.series import discover_checkpoints
    from depthscope.hooks import load_model
    from depthscope.hooks.toy import train_tiny_series

    tok = load_model().tokenizer
    train_tiny_series(root / "series", distinct_sentences(400), tok, steps=50, save_every=10, d_model=64, n_layers=2)
    cks = discover_checkpoints(checkpoint_dir=root / "series")
    assert len(cks) == N_CHECKPOINTS, cks
    return cks


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(quick: bool = False) -> list[dict]:
    """Seconds of one sweep of 6 checkpoints per engine (the machine is shared: one run each)."""
    import pandas as pd
    import ray
    import torch

    from depthscope.analyses.sweeps.ray_engine import RayEngine
    from depthscope.analyses.sweeps.series import sweep

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    texts = distinct_sentences(60 if quick else 200)
    root = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    try:
        cks = _series(root)
        kw = dict(texts=texts, progress=False)
        t_local, local = _timed(lambda: sweep(cks, "lens", root / "local", **kw))
        t_cold, cold = _timed(lambda: sweep(cks, "lens", root / "cold", engine=RayEngine(workers=2), **kw))
        path = os.pathsep.join(p for p in sys.path if p)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})  # fmt: skip
        try:
            ray.get([ray.remote(lambda: 0).remote() for _ in range(2)])  # the workers are up
            t_warm, warm = _timed(lambda: sweep(cks, "lens", root / "warm", engine=RayEngine(), **kw))
        finally:
            ray.shutdown()
        for res in (cold, warm):
            assert res.ok, res.failed
            pd.testing.assert_frame_equal(res.tables["by_site"], local.tables["by_site"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    common = {"baseline": t_local, "per_checkpoint_s": t_local / N_CHECKPOINTS, "texts": len(texts), "workers": 2}
    name = f"sweep of {N_CHECKPOINTS} tiny checkpoints (logit lens, {len(texts)} sentences), local engine vs"
    return [
        {"figure": f"{name} Ray, 2 workers, cold (Ray start included)", "depthscope": t_cold,
         "ratio": t_local / t_cold, "goal": None, "met": None, **common},
        {"figure": f"{name} Ray, 2 workers, warm (cluster up)", "depthscope": t_warm,
         "ratio": t_local / t_warm, "goal": 1.0, "met": t_local / t_warm > 1.0, **common},
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 sentences per checkpoint instead of 200")
    rows = run(ap.parse_args().quick)
    r0 = rows[0]
    print(f"# {os.cpu_count()} cores, 1 torch thread per process; tables equal across engines")
    print(f"local engine: {r0['baseline']:.1f} s ({r0['per_checkpoint_s']:.2f} s per checkpoint)")
    for r in rows:
        goal = "" if r["goal"] is None else f"   goal > {r['goal']:g}x: {'met' if r['met'] else 'NOT met'}"
        print(f"{r['figure']}\n    {r['depthscope']:.1f} s   local/ray {r['ratio']:.2f}x (ceiling 2x){goal}")


if __name__ == "__main__":
    main()
