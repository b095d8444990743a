"""Benchmark: contribution norms cost vs a bare forward pass, and peak memory vs corpus length.

Real default model (SmolLM2-135M), real text: the ``# text =`` sentences of UD English EWT dev
(``../shared/data/ud/en_ewt-ud-dev.conllu`` or ``$DEPTHSCOPE_UD``), grouped into documents of
5 consecutive sentences (~130 tokens). For two corpus lengths it times, on the very same token batches and
in the same run,

* ``bare``: ``model.hf_model(ids, attention_mask)`` (the full forward, with logits),
* ``base``: ``model.hf_model.model(ids, attention_mask)`` (the blocks and final norm only, no
  unembedding: the stricter baseline, since the norms pass never needs the logits),
* ``norms``: ``contribution_norms(model, docs)`` (hooks, stacking all 61 sites, every metric,
  streaming accumulation),

in the order base, norms, bare, base, norms (the machine is shared: the faster of the two runs
of base and norms is compared, bare runs once as a reference), and the peak resident memory
above the starting point during each run (polled from /proc every 5 ms). Goal: norms / base <= 1.3 and a
flat peak memory across corpus lengths.

    python benchmarks/bench_norms.py            # 1000 and 3000 tokens (~2-3 min on an idle machine)
    python benchmarks/bench_norms.py --quick    # 600 and 1800 tokens
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_UD = HERE.parent.parent / "shared" / "data" / "ud" / "en_ewt-ud-dev.conllu"
FIXTURE = HERE.parent / "tests" / "fixtures" / "norms" / "ewt_sample.txt"


def load_sentences() -> list[str]:
    path = Path(os.environ.get("DEPTHSCOPE_UD", DEFAULT_UD))
    if path.is_file():
        return [ln[len("# text = "):].strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("# text = ")]
    print(f"note: {path} not found; using the 24-sentence test fixture (repeated)", file=sys.stderr)
    return FIXTURE.read_text(encoding="utf-8").splitlines() * 50


def documents(model, sentences: list[str], n_tokens: int, per_doc: int = 5) -> list[str]:
    """Consecutive sentences grouped into documents, until about ``n_tokens`` tokens."""
    docs, total = [], 0
    for i in range(0, len(sentences), per_doc):
        d = " ".join(sentences[i : i + per_doc])
        n = len(model.tokenizer(d)["input_ids"])
        docs.append(d)
        total += n
        if total >= n_tokens:
            break
    return docs


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the start, polled in a thread."""

    def __enter__(self):
        self.start = _rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def mb(self) -> float:
        return (self.peak - self.start) / 2**20


def run_bare(model, batches, base: bool) -> None:
    fn = model.hf_model.model if base else model.hf_model
    with torch.no_grad():
        for b in batches:
            fn(input_ids=b.ids, attention_mask=b.mask.long(), use_cache=False)


def measure(fn):
    import gc

    gc.collect()
    with PeakRSS() as p:
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
    return dt, p.mb, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller corpora (600 and 1800 tokens)")
    ap.add_argument("--tokens", type=int, nargs=2, default=None, help="the two corpus lengths")
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    sizes = args.tokens or ([600, 1800] if args.quick else [1000, 3000])

    from depthscope.analyses.norms import contribution_norms
    from depthscope.analyses.text import token_batches
    from depthscope.hooks import load_model

    model = load_model()
    sentences = load_sentences()
    print(f"model {model.name}: {model.n_layers} layers, d {model.d_model}; torch threads {torch.get_num_threads()}; "
          f"batch size {args.batch_size}")
    # warm-up (first calls allocate and tune kernels)
    warm = documents(model, sentences, 200)
    run_bare(model, list(token_batches(model, warm, batch_size=args.batch_size)), base=False)
    contribution_norms(model, warm, batch_size=args.batch_size)

    header = f"{'tokens':>7} {'batches':>7} {'widest':>6} {'bare s':>8} {'base s':>8} {'norms s':>8} {'norms/bare':>10} {'norms/base':>10} " \
             f"{'peak MB bare':>12} {'peak MB norms':>13}"
    print(header)
    results = []
    for n in sizes:
        docs = documents(model, sentences, n)
        batches = list(token_batches(model, docs, batch_size=args.batch_size))
        n_tok = sum(int(b.mask.sum()) for b in batches)
        widest = max(b.ids.shape[1] for b in batches)
        times = {"bare": [], "base": [], "norms": []}
        peaks = {"bare": [], "base": [], "norms": []}
        for kind in ("base", "norms", "bare", "base", "norms"):
            if kind == "norms":
                dt, mb, df = measure(lambda: contribution_norms(model, docs, batch_size=args.batch_size))
                assert int(df.groupby("positions")["n_tokens"].first().sum()) == n_tok
            else:
                dt, mb, _ = measure(lambda: run_bare(model, batches, base=kind == "base"))
            times[kind].append(dt)
            peaks[kind].append(mb)
        t = {k: min(v) for k, v in times.items()}  # min over runs: the least disturbed by other load
        p = {k: max(v) for k, v in peaks.items()}
        results.append((n_tok, t, p))
        print(f"{n_tok:7d} {len(batches):7d} {widest:6d} {t['bare']:8.2f} {t['base']:8.2f} {t['norms']:8.2f} {t['norms'] / t['bare']:10.2f} "
              f"{t['norms'] / t['base']:10.2f} {p['bare']:12.0f} {p['norms']:13.0f}", flush=True)
    (n1, t1, p1), (n2, t2, p2) = results
    print(f"ratio norms/base: {t1['norms'] / t1['base']:.2f} at {n1} tokens, {t2['norms'] / t2['base']:.2f} at {n2} "
          f"(goal <= 1.3); peak memory of norms {p1['norms']:.0f} MB -> {p2['norms']:.0f} MB for "
          f"{n2 / n1:.1f}x the tokens (goal: flat)")


if __name__ == "__main__":
    main()
