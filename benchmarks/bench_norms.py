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

in the order base, norms, bare, base, norms, and the peak resident memory above the starting point
during each run (polled from /proc every 5 ms). The machine is shared, so wall-clock times swing
with other processes' load; the benchmark runs torch on one thread (``--threads``) and the
headline ratio uses the CPU time of this process (``time.process_time``), the faster of the two
runs of base and norms; wall-clock ratios are printed too. Goal: norms / base <= 1.3 and a
flat peak memory across corpus lengths.

    python benchmarks/bench_norms.py            # 700 and 2100 tokens (~2-3 min)
    python benchmarks/bench_norms.py --quick    # 500 and 1000 tokens
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
        return [
            ln[len("# text = ") :].strip()
            for ln in path.read_text(encoding="utf-8").splitlines()
            if ln.startswith("# text = ")
        ]
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
    """(wall seconds, CPU seconds of this process, peak MB above the start, result)."""
    import gc

    gc.collect()
    with PeakRSS() as p:
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        dt, dc = time.perf_counter() - t, time.process_time() - c
    return dt, dc, p.mb, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller corpora (500 and 1000 tokens)")
    ap.add_argument("--tokens", type=int, nargs=2, default=None, help="the two corpus lengths")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine multi-threaded kernels spin-wait and "
        "make both wall and CPU times swing by 2x; the ratio is what matters)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = args.tokens or ([500, 1000] if args.quick else [700, 2100])

    from depthscope.analyses.norms import contribution_norms
    from depthscope.analyses.text import token_batches
    from depthscope.hooks import load_model

    model = load_model()
    sentences = load_sentences()
    print(
        f"model {model.name}: {model.n_layers} layers, d {model.d_model}; torch threads {torch.get_num_threads()}; "
        f"batch size {args.batch_size}"
    )
    # warm-up (first calls allocate and tune kernels)
    warm = documents(model, sentences, 200)
    run_bare(model, list(token_batches(model, warm, batch_size=args.batch_size)), base=False)
    contribution_norms(model, warm, batch_size=args.batch_size)

    header = (
        f"{'tokens':>7} {'batches':>7} {'widest':>6} | {'CPU s: bare':>11} {'base':>7} {'norms':>7} "
        f"{'norms/base':>10} | {'wall s: base':>12} {'norms':>7} {'norms/base':>10} | {'peak MB: base':>13} {'norms':>6}"
    )
    print(header)
    results = []
    for n in sizes:
        docs = documents(model, sentences, n)
        batches = list(token_batches(model, docs, batch_size=args.batch_size))
        n_tok = sum(int(b.mask.sum()) for b in batches)
        widest = max(b.ids.shape[1] for b in batches)
        wall = {"bare": [], "base": [], "norms": []}
        cpu = {"bare": [], "base": [], "norms": []}
        peaks = {"bare": [], "base": [], "norms": []}
        for kind in ("base", "norms", "bare", "base", "norms"):
            if kind == "norms":
                dt, dc, mb, df = measure(lambda: contribution_norms(model, docs, batch_size=args.batch_size))
                assert int(df.groupby("positions")["n_tokens"].first().sum()) == n_tok
            else:
                dt, dc, mb, _ = measure(lambda: run_bare(model, batches, base=kind == "base"))
            wall[kind].append(dt)
            cpu[kind].append(dc)
            peaks[kind].append(mb)
        w = {k: min(v) for k, v in wall.items()}  # min over runs: the least disturbed by other load
        c = {k: min(v) for k, v in cpu.items()}
        p = {k: max(v) for k, v in peaks.items()}
        results.append((n_tok, c, w, p))
        print(
            f"{n_tok:7d} {len(batches):7d} {widest:6d} | {c['bare']:11.2f} {c['base']:7.2f} {c['norms']:7.2f} "
            f"{c['norms'] / c['base']:10.2f} | {w['base']:12.2f} {w['norms']:7.2f} {w['norms'] / w['base']:10.2f} | "
            f"{p['base']:13.0f} {p['norms']:6.0f}",
            flush=True,
        )
    (n1, c1, w1, p1), (n2, c2, w2, p2) = results
    print(
        f"CPU-time ratio norms/base: {c1['norms'] / c1['base']:.2f} at {n1} tokens, {c2['norms'] / c2['base']:.2f} at {n2} "
        f"(goal <= 1.3; wall-clock {w1['norms'] / w1['base']:.2f}, {w2['norms'] / w2['base']:.2f}); peak memory of norms "
        f"{p1['norms']:.0f} MB -> {p2['norms']:.0f} MB for {n2 / n1:.1f}x the tokens (goal: flat)"
    )


if __name__ == "__main__":
    main()
