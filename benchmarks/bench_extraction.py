"""Sharded activation extraction: peak memory at 1x and 4x the corpus (issue 14).

Real default model (SmolLM2-135M), real text (distinct UD English EWT train sentences), every word a span,
every residual site, float16 store. In a fresh subprocess per corpus size it extracts the store
as shards of a fixed size (:func:`depthscope.probes.store.shards.extract_sharded`, 2 shards at 1x,
8 at 4x) and then reads every span's rows twice in batches of 256, as a probe's epochs do
(``store.gather``), summing them. The peak resident memory of the subprocess (``ru_maxrss``)
is compared: goal, peak(4x) / peak(1x) <= 1.10 (flat: a shard is written and closed before
the next, and rows are read with ``pread``, so neither the store nor the rows read stay
resident).

    python benchmarks/bench_extraction.py [--quick]

``run(quick) -> list[dict]`` returns rows ``{figure, depthscope, baseline, ratio, goal, met}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOAL = 1.10

CHILD = r"""
import json, re, resource, sys, tempfile, time, shutil
import numpy as np, torch
from depthscope.hooks import load_model
from depthscope.probes.store.shards import extract_sharded
from depthscope.probes.corpora.spans import SpanTable, map_spans, tokenize_passages

torch.set_num_threads(1)
n, shards = int(sys.argv[1]), int(sys.argv[2])
texts = json.load(open(sys.argv[3]))[:n]
model = load_model()
tok = tokenize_passages(model.tokenizer, texts, max_tokens=128)
p, cs, ce = [], [], []
for i, t in enumerate(texts):
    for m in re.finditer(r"\w+", t):
        p.append(i); cs.append(m.start()); ce.append(m.end())
table = map_spans(tok, SpanTable(np.array(p), np.array(cs), np.array(ce)))
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
d = tempfile.mkdtemp(prefix="bench-extract-")
try:
    t0 = time.perf_counter()
    store = extract_sharded(model, tok, table, n_shards=shards, store_dir=d, pooling="last", dtype="float16")
    t1 = time.perf_counter()
    total = 0.0
    for _ in range(2):
        for a in range(0, len(table), 256):
            x, _m = store.gather(np.arange(a, min(a + 256, len(table))))
            total += float(x.sum())
    t2 = time.perf_counter()
    size = sum(f.stat().st_size for f in __import__("pathlib").Path(d).rglob("feats.bin"))
finally:
    shutil.rmtree(d, ignore_errors=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"sentences": n, "spans": len(table), "shards": shards, "store_mb": size / 2**20,
                  "after_load_mb": after_load, "peak_mb": peak, "extract_s": t1 - t0, "read_s": t2 - t1}))
"""


def distinct_sentences(n: int) -> list[str]:
    """``n`` distinct sentences: UD English EWT train (``$DEPTHSCOPE_UD`` or ../shared/data/ud),
    else the bundled EWT and GUM samples (790). Repeated sentences would share shards (a shard's
    key is its content), which would flatter the memory figure."""
    sys.path.insert(0, str(HERE))
    from _common import UD

    folder = Path(os.environ.get("DEPTHSCOPE_UD", UD))
    files = [folder / "en_ewt-ud-train.conllu"]
    if not files[0].is_file():
        files = sorted((HERE.parent / "probes" / "data").glob("*.conllu"))
    seen: dict[str, None] = {}
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.startswith("# text = "):
                seen.setdefault(line[len("# text = ") :])
    if len(seen) < n:
        raise SystemExit(f"only {len(seen)} distinct sentences in {files}; set DEPTHSCOPE_UD to the UD folder")
    return list(seen)[:n]


def _measure(n: int, shards: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(distinct_sentences(n), f)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), str(shards), f.name], capture_output=True, text=True, env=env
        )
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    """Peak RSS (MB) of sharded extraction plus two streaming read passes at 1x and 4x the corpus."""
    base = 150 if quick else 500
    one, four = _measure(base, 2), _measure(4 * base, 8)
    ratio = four["peak_mb"] / one["peak_mb"]
    return [
        {
            "figure": f"peak RSS, sharded extraction + 2 read passes, {four['sentences']} vs {one['sentences']} "
            f"sentences ({four['store_mb']:.0f} vs {one['store_mb']:.0f} MB of store)",
            "depthscope": four["peak_mb"],
            "baseline": one["peak_mb"],
            "ratio": ratio,
            "goal": GOAL,
            "met": ratio <= GOAL,
            "one": one,
            "four": four,
        }
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="150 and 600 sentences instead of 500 and 2000")
    for r in run(ap.parse_args().quick):
        for k in ("one", "four"):
            m = r[k]
            print(
                f"{m['sentences']:5d} sentences, {m['spans']:6d} spans, {m['shards']} shards, "
                f"store {m['store_mb']:.0f} MB: "
                f"peak RSS {m['peak_mb']:.0f} MB (after loading the model {m['after_load_mb']:.0f} MB), "
                f"extract {m['extract_s']:.1f} s, read x2 {m['read_s']:.1f} s"
            )
        print(
            f"{r['figure']}\n    peak 4x / 1x = {r['ratio']:.3f}   "
            f"goal <= {r['goal']}: {'met' if r['met'] else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
