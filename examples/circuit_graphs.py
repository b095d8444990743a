"""Circuits as graphs on IOI: every edge scored (EAP), the top circuits run exactly, faithfulness.

What it shows
    MIB's graph of the model (senders: the embeddings, every head, every MLP; receivers: every
    query head's q, k and v input, every MLP's input, the logits) scored edge by edge with EAP over
    IOI pairs from ``examples/ioi_dataset.py`` (the clean and corrupted prompts of a pair have the
    same number of tokens: the corrupted one swaps a name). Then the circuits made of the top 0.1 %
    ... 100 % of edges run exactly (every other edge ablated to its corrupted value), their
    faithfulness f(k) beside seeded random circuits of the same sizes, CPR and CMD.

Writes (under --out)
    ioi_pairs.jsonl                the pairs
    edges.csv / .parquet           every edge: sender, receiver, score
    faithfulness.csv / .parquet    f(k) per size, the random circuits' mean and spread
    faithfulness_curve.png         the curve with the random band
    circuit.png                    the smallest circuit with f >= 0.8 (else the top 100 edges), drawn
    circuit.html                   the same, interactive (self-contained)

Run
    python examples/circuit_graphs.py                          # 8 pairs, default model
    python examples/circuit_graphs.py --n-pairs 4 --random-draws 1 --method eap-ig --steps 3
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _ioi():
    spec = importlib.util.spec_from_file_location("ioi_dataset", HERE / "ioi_dataset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/circuit_graphs", help="output folder")
    p.add_argument("--n-pairs", type=int, default=8, help="IOI pairs to build")
    p.add_argument("--method", default="eap", choices=["eap", "eap-ig"], help="edge scores")
    p.add_argument("--steps", type=int, default=5, help="EAP-IG's steps")
    p.add_argument("--random-draws", type=int, default=3, help="random circuits per size")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from depthscope.analyses import (
        circuit_faithfulness,
        circuit_html,
        edge_attribution,
        plot_circuit,
        plot_faithfulness,
        smallest_faithful,
        split_pairs,
        write_table,
    )
    from depthscope.hooks import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    ioi = _ioi()
    path = ioi.write_pairs(ioi.build_pairs(model.tokenizer, args.n_pairs), out / "ioi_pairs.jsonl")

    train, held = split_pairs(path, train_fraction=0.5, seed=0)  # score on half, judge on the other half
    edges = edge_attribution(model, train, method=args.method, steps=args.steps)
    write_table(edges, out, "edges")
    curve = circuit_faithfulness(model, held, edges, random_draws=args.random_draws)
    write_table(curve, out, "faithfulness")
    plot_faithfulness(curve, out / "faithfulness_curve.png")
    best = smallest_faithful(curve)
    n = int(best["n_edges"]) if best is not None and best["n_edges"] <= 500 else 100
    plot_circuit(edges, out / "circuit.png", n_edges=n)
    circuit_html(edges, out / "circuit.html", n_edges=n)

    a = curve.attrs
    print(f"model {model.name}: {len(edges):,} edges scored ({args.method}) over {len(train)} pairs")
    print(f"judged on the {len(held)} held-out pairs")
    print(f"CPR {a['cpr']:.3f} (random {a['cpr_random']:.3f}), CMD {a['cmd']:.3f} (random {a['cmd_random']:.3f})")
    print(curve[["k", "n_edges", "f", "f_random"]].to_string(index=False))


if __name__ == "__main__":
    main()
