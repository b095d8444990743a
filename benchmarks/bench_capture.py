"""Cost of capturing the residual stream at all 2L+1 sites, against a bare transformers forward
of the same model and batch, and TransformerLens 4.x ``run_with_cache`` (resid hooks only) on a
TransformerBridge, all measured in the same run (median of interleaved runs).

    python benchmarks/bench_capture.py [--quick] [--batch 8] [--tokens 128] [--repeats 7]

Goal (issue 2): capture / bare <= 1.10.
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-tl", action="store_true", help="skip the TransformerLens comparison")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.tokens, args.repeats = 2, 64, 3
    warnings.filterwarnings("ignore")
    from depthscope.hooks import load_model

    model = load_model()
    text = " ".join(ud_sentences(limit=400))
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0]
    n = args.batch * args.tokens
    ids = ids[:n].reshape(args.batch, args.tokens)
    mask = torch.ones_like(ids, dtype=torch.bool)
    hf = model.hf_model

    def bare():
        with torch.no_grad():
            hf(input_ids=ids, attention_mask=mask.long(), use_cache=False)

    def capture():
        model.residual_stream(ids, mask=mask)

    fns = {"bare transformers forward": bare, "depthscope all sites": capture}
    if not args.no_tl:
        from transformer_lens.model_bridge import TransformerBridge

        other = load_model()  # a separate copy: the bridge must not touch the model timed above
        bridge = TransformerBridge.boot_transformers("smollm2-135m", hf_model=other.hf_model, tokenizer=other.tokenizer)

        def tl_bare():
            with torch.no_grad():
                bridge(ids)

        def tl_cache():
            with torch.no_grad():
                bridge.run_with_cache(ids, names_filter=lambda name: "hook_resid" in name)

        fns["TransformerLens bridge forward"] = tl_bare
        fns["TransformerLens run_with_cache(resid)"] = tl_cache
    t = interleaved(fns, repeats=args.repeats)
    base = t["bare transformers forward"]
    print(
        f"# capture benchmark: SmolLM2-135M, batch {args.batch} x {args.tokens} tokens, "
        f"{model.n_sites} sites, median of {args.repeats} interleaved runs; {env_line()}"
    )
    for k, v in t.items():
        print(f"{k:40s} {v * 1000:9.1f} ms   ratio to bare forward {v / base:6.3f}x")
    print(f"capture_ratio={t['depthscope all sites'] / base:.3f}")


if __name__ == "__main__":
    main()
