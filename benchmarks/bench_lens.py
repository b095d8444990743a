"""Logit-lens speed and memory against its physical floor, measured in the same run.

The floor of a logit lens over every site is the unembedding matmuls themselves:
``[sites * tokens, d] @ [d, vocab]``. This script runs ``logit_lens`` (all 2L+1 sites of the
real default model, every metric) on English text (the UD English EWT dev sentences joined into
one text, from ``../shared/data/ud``, cut into windows) and, for every decoded chunk, right after
it, times one bare matmul of exactly that chunk's shape into a preallocated output (the fastest
form). Each corpus length runs in a fresh subprocess. It prints

* ``floor ratio`` = (decode + metrics time) / (bare matmul time)  -- goal <= 1.5
* peak resident memory (ru_maxrss of a fresh subprocess) at two corpus lengths -- goal: flat.

Forward passes are excluded from the ratio (they are the model, not the lens) but printed. One
torch thread by default (``--threads``): on a shared 2-core machine two threads spin-wait on each
other and the timings become noise.

    python benchmarks/bench_lens.py           # 256 and 768 tokens, 64-token windows (~2-3 min on 2 cores)
    python benchmarks/bench_lens.py --quick   # 128 and 384 tokens, 32-token windows (~1-2 min)

Both lengths span several forward passes (2 windows each), so the comparison is between steady
states: the first forward of a process also grows glibc's heap thresholds once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
UD = Path(os.environ.get("DEPTHSCOPE_UD", HERE.parent.parent / "shared" / "data" / "ud")) / "en_ewt-ud-dev.conllu"


def ud_sentences(path: Path = UD) -> list[str]:
    if not path.is_file():
        sys.exit(f"UD English EWT not found at {path} (set DEPTHSCOPE_UD to the folder holding en_ewt-ud-dev.conllu)")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# text = "):
                out.append(line[len("# text = ") :].strip())
    return out


def child(n_tokens: int, token_chunk: int | None, window: int, batch_size: int, threads: int | None) -> dict:
    """Run the lens on the first n_tokens tokens of the EWT dev text; report times and memory."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from depthscope.analyses import lens as L
    from depthscope.hooks import load_model

    model = load_model()
    W = model.arch.unembed.weight
    text = " ".join(ud_sentences())
    ids = torch.tensor(model.tokenizer(text)["input_ids"][:n_tokens])[None]
    model.residual_stream(ids[:, :8])  # touch every weight once: the baseline is a warm model
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    floor = {"s": 0.0, "rows": 0, "chunks": 0}
    orig = L._Decoder.run

    def run(self, xs, *a, **k):
        out = orig(self, xs, *a, **k)
        R = xs.shape[0] * xs.shape[1]
        x = xs.reshape(R, -1)
        t0 = time.perf_counter()
        torch.mm(x, W.t(), out=self.Z[:R])  # the bare unembedding matmul of this chunk's shape
        floor["s"] += time.perf_counter() - t0
        floor["rows"] += R
        floor["chunks"] += 1
        return out

    L._Decoder.run = run
    timings: dict = {}
    t0 = time.perf_counter()
    df = L.logit_lens(model, ids, timings=timings, token_chunk=token_chunk, window=window, batch_size=batch_size)
    wall = time.perf_counter() - t0
    L._Decoder.run = orig
    decode = timings["decode_s"] - floor["s"]  # the patched run also spent the floor's time
    return {
        "tokens": int(df["n_positions"].iloc[0]),
        "sites": len(df),
        "rows": floor["rows"],
        "chunks": floor["chunks"],
        "forward_s": timings["forward_s"],
        "decode_s": decode,
        "floor_s": floor["s"],
        "wall_s": wall,
        "threads": torch.get_num_threads(),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "maxrss_loaded_mb": rss_loaded / 1024,
        "kl_embed": float(df["kl_to_final"].iloc[0]),
        "kl_mid": float(df["kl_to_final"].iloc[len(df) // 2]),
        "kl_last": float(df["kl_to_final"].iloc[-1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller corpora (128 and 384 tokens)")
    ap.add_argument("--tokens", type=int, nargs=2, default=None, help="the two corpus lengths")
    ap.add_argument("--token-chunk", type=int, default=None, help="tokens per decoded chunk (default: lens default)")
    ap.add_argument("--window", type=int, default=None, help="tokens per window (default 64; 32 with --quick)")
    ap.add_argument("--batch-size", type=int, default=2, help="windows per forward (default 2)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine two threads spin-wait on each other; 0 = torch's default)",
    )
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.token_chunk, args.window, args.batch_size, args.threads)))
        return
    lengths = args.tokens or ([128, 384] if args.quick else [256, 768])
    args.window = args.window or (32 if args.quick else 64)
    results = []
    for n in lengths:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(n),
            "--window",
            str(args.window),
            "--batch-size",
            str(args.batch_size),
        ]
        if args.token_chunk:
            cmd += ["--token-chunk", str(args.token_chunk)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-3000:])
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(
        f"logit lens, SmolLM2-135M (61 sites, vocab 49152), UD English EWT dev text in windows of "
        f"{args.window} tokens, {args.batch_size} windows per forward, {results[0]['threads']} torch thread(s)"
    )
    print(
        f"{'tokens':>7} {'rows':>7} {'forward s':>10} {'decode s':>9} {'floor s':>8} {'ratio':>6} "
        f"{'peak RSS MB':>12} {'warm model RSS MB':>18}"
    )
    for r in results:
        print(
            f"{r['tokens']:>7} {r['rows']:>7} {r['forward_s']:>10.1f} {r['decode_s']:>9.1f} {r['floor_s']:>8.1f} "
            f"{r['decode_s'] / r['floor_s']:>6.2f} {r['maxrss_mb']:>12.0f} {r['maxrss_loaded_mb']:>18.0f}"
        )
    dec = sum(r["decode_s"] for r in results)
    flo = sum(r["floor_s"] for r in results)
    a, b = results
    print(
        f"floor ratio (decode + all metrics) / (bare unembedding matmuls, same shapes): {dec / flo:.2f}x  (goal <= 1.5)"
    )
    print(
        f"peak memory: {a['maxrss_mb']:.0f} MB at {a['tokens']} tokens, {b['maxrss_mb']:.0f} MB at {b['tokens']} "
        f"tokens ({b['tokens'] / a['tokens']:.1f}x longer; {b['maxrss_mb'] - a['maxrss_mb']:+.0f} MB)  (goal: flat); "
        f"above the warm model: {a['maxrss_mb'] - a['maxrss_loaded_mb']:.0f} and "
        f"{b['maxrss_mb'] - b['maxrss_loaded_mb']:.0f} MB"
    )
    print(
        f"KL(final || lens) at {b['tokens']} tokens: embed {b['kl_embed']:.2f}, middle site {b['kl_mid']:.2f}, "
        f"last {b['kl_last']:.2e} nats"
    )


if __name__ == "__main__":
    main()
