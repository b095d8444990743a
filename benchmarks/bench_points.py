"""Caching every hook point vs the residual sites only (issue 12): time and memory of
``model.run(cache="all")`` (which routes attention through the eager pattern path),
``cache=<every point but the pattern>`` and ``cache="resid"``, against a bare transformers
forward, measured in the same run (median of interleaved runs). Memory is the bytes the cache
holds.

    python benchmarks/bench_points.py [--quick] [--batch 4] [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import env_line, interleaved, ud_sentences  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small batch, few repeats")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.tokens, args.repeats = 2, 64, 3
    warnings.filterwarnings("ignore")
    from depthscope.hooks import load_model, point_names

    model = load_model()
    text = " ".join(ud_sentences(limit=400))
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0][: args.batch * args.tokens]
    ids = ids.reshape(args.batch, args.tokens)
    no_pattern = [n for n in point_names(model.n_layers) if not n.endswith(".pattern")]
    caches = {"resid": "resid", "all but pattern": no_pattern, "all": "all"}

    def bare():
        with torch.no_grad():
            model.hf_model(input_ids=ids, use_cache=False)

    fns = {"bare forward": bare}
    for k, c in caches.items():
        fns[f"cache={k}"] = lambda c=c: model.run(ids, cache=c)
    t = interleaved(fns, repeats=args.repeats)
    mem = {
        k: sum(v.numel() * v.element_size() for v in model.run(ids, cache=c).cache.values()) for k, c in caches.items()
    }
    print(
        f"# hook-point cache benchmark: SmolLM2-135M, batch {args.batch} x {args.tokens} tokens, "
        f"median of {args.repeats} interleaved runs; {env_line()}"
    )
    for k, v in t.items():
        print(f"{k:24s} {v * 1000:9.1f} ms   ratio to bare {v / t['bare forward']:6.2f}x")
    for k, b in mem.items():
        print(f"cache={k:18s} {b / 2**20:9.1f} MiB  ratio to resid {b / mem['resid']:6.2f}x")
    print(
        f"time_ratio_all_vs_resid={t['cache=all'] / t['cache=resid']:.2f} "
        f"memory_ratio_all_vs_resid={mem['all'] / mem['resid']:.2f}"
    )


if __name__ == "__main__":
    main()
