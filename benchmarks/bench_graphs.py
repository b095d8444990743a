"""Every edge scored (EAP) against the bare passes it needs, on the default model (issue 55).

depthscope: :func:`~depthscope.analyses.circuits.edges.eap.score_edges` with ``method="eap"`` over IOI
pairs built by ``examples/ioi_dataset.py`` (``--quick`` 4 pairs, else 16): MIB's graph of the model
(123,211 edges), each batch one corrupted forward without gradient, one clean forward with
gradient and one backward, the receivers' input gradients and one contraction. Baseline: the same
passes in plain transformers (``hf_model``), nothing cached and no edge scored: a corrupted
forward without gradient, then a clean forward from input embeddings that require gradient and
the backward of the pairs' logit differences, batch by batch (the batches EAP uses). Threads
pinned, both arms warmed up, then run in turn (A B A B ...) for 5 rounds (quick 3); the ratio is
the median of the per-round ratios. Goal: <= 1.5x.

    python benchmarks/bench_graphs.py [--quick] [--threads 1]

``run(quick, threads) -> list[dict]`` returns rows ``{figure, depthscope, baseline, ratio, goal, met}``
(seconds per dataset) for the benchmarks entry point.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

GOAL = 1.5
PAIRS = {True: 4, False: 16}
ROUNDS = {True: 3, False: 5}
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ioi_dataset.py"


def _ioi_pairs(tokenizer, n: int) -> list:
    spec = importlib.util.spec_from_file_location("ioi_dataset", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_pairs(tokenizer, n_pairs=n)


def _bare(hf, batches) -> None:
    """The passes EAP needs, in plain transformers: corrupted forward, clean forward and backward."""
    emb = hf.get_input_embeddings()
    for b in batches:
        with torch.no_grad():
            hf(b.corrupted)
        x = emb(b.clean).detach().requires_grad_(True)
        b.metric(hf(inputs_embeds=x).logits).sum().backward()


def run(quick: bool = False, threads: int = 1) -> list[dict]:
    from depthscope.analyses.circuits.edges.eap import BATCH_TOKENS, score_edges
    from depthscope.analyses.circuits.edges.graph import circuit_graph
    from depthscope.analyses.circuits.edges.runs import graph_batches
    from depthscope.hooks import load_model

    torch.set_num_threads(threads)
    model = load_model(dtype=torch.float32)
    pairs = _ioi_pairs(model.tokenizer, PAIRS[quick])
    _, batches = graph_batches(model, pairs, None, BATCH_TOKENS, "edge attribution")
    hf = model.hf_model
    arms = {"depthscope": lambda: score_edges(model, pairs, "eap"), "baseline": lambda: _bare(hf, batches)}
    for f in arms.values():  # warm-up
        f()
    times = {k: [] for k in arms}
    for _ in range(ROUNDS[quick]):
        for k, f in arms.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    ratio = statistics.median(a / b for a, b in zip(times["depthscope"], times["baseline"]))
    return [
        {
            "figure": f"EAP edge scores, {len(pairs)} IOI pairs, {circuit_graph(model).n_edges:,} edges",
            "depthscope": statistics.median(times["depthscope"]),
            "baseline": statistics.median(times["baseline"]),
            "ratio": ratio,
            "goal": GOAL,
            "met": ratio <= GOAL,
            "rounds": ROUNDS[quick],
            "threads": threads,
        }
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    for row in run(a.quick, a.threads):
        print(row)


if __name__ == "__main__":
    if not __package__:  # run as a file: depthscope from the environment
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
