"""Tenney-style probing: at which depth does a linguistic property become linearly decodable?

What it shows
    ``run_probes`` on the bundled Universal Dependencies English EWT sample (``sample_data()``):
    for each task (``upos`` part-of-speech tags by default; ``deprel`` dependency labels too
    with ``--tasks upos,deprel``) it trains one linear probe per residual site (embed, after
    each attention sublayer, after each MLP sublayer), a control task beside it (selectivity,
    Hewitt & Liang 2019), a scalar mix over all sites (E_s) and cumulative probes over growing
    prefixes of sites (the expected layer E_Delta of Tenney, Das & Pavlick 2019).

    The caps keep it cheap: ``--max-train-sentences`` / ``--max-test-sentences`` sample that
    many sentences of each split (0 = the whole bundled sample, 300 / 150 sentences).

Outputs (in ``--out``)
    probes_by_site.csv / .parquet   one row per (task, site): accuracy, control accuracy, selectivity, ...
    probes_summary.csv / .parquet   one row per task: E_Delta with its 95% interval, E_s, best site, ...
    probes_mixing.csv / .parquet    one row per (task, site): scalar-mix weight, cumulative score, Delta
    probes_accuracy.png             accuracy and selectivity per site (the library's plot_probe_curves)
    probes_tenney.png               Tenney et al.'s figure: Delta per depth, mix weights, E_Delta, E_s

Run
    python examples/tenney_probing.py                                   # upos, 40/20 sentences: minutes
    python examples/tenney_probing.py --tasks upos,deprel --max-train-sentences 0 --max-test-sentences 0
    python examples/tenney_probing.py --model path/to/hf-folder-or.gguf --out probes/
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/tenney_probing", help="output folder")
    p.add_argument("--tasks", default="upos", help="comma-separated: upos, deprel, feats:Number, xpos, ...")
    p.add_argument("--max-train-sentences", type=int, default=40, help="train sentences sampled (0: all 300)")
    p.add_argument("--max-test-sentences", type=int, default=20, help="test sentences sampled (0: all 150)")
    p.add_argument("--max-epochs", type=int, default=200, help="cap on probe training passes (warns if hit)")
    p.add_argument("--seed", type=int, default=0, help="sampling, control labels and folds")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from depthscope.analyses import plot_probe_curves, plot_tenney, write_table
    from depthscope.hooks import load_model
    from depthscope.probes import run_probes, sample_data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    print(f"model {model.name}: {model.n_layers} blocks, {model.n_sites} sites")

    data = sample_data()  # paths of the bundled CoNLL-U excerpts
    res = run_probes(
        model,
        args.tasks,
        data["ewt_train"],
        data["ewt_test"],
        # any field of ProbeConfig / ExtractionConfig / DataConfig can be passed by name;
        # 0 (or None) means no cap
        max_train_sentences=args.max_train_sentences or None,
        max_test_sentences=args.max_test_sentences or None,
        max_epochs=args.max_epochs,
        seed=args.seed,
    )

    # Three tidy tables (shared site columns: site, label, layer, sublayer, depth).
    write_table(res.by_site, out, "probes_by_site")
    write_table(res.summary, out, "probes_summary")
    write_table(res.mixing, out, "probes_mixing")
    # The library's figures, drawn from those tables only.
    plot_probe_curves(res.by_site, out / "probes_accuracy.png")
    plot_tenney(res.summary, res.mixing, out / "probes_tenney.png")

    for _, r in res.summary.iterrows():
        print(
            f"{r['task']}: E_Delta {r['expected_layer_delta']:.2f} "
            f"[{r['expected_layer_delta_lo']:.1f}, {r['expected_layer_delta_hi']:.1f}] blocks of {r['n_layers']}"
            f" (meaningful: {bool(r['expected_layer_delta_meaningful'])}), E_s {r['expected_layer_mix']:.2f}; "
            f"best site {r['best_label']} at {r['best_accuracy']:.1%} "
            f"(majority class {r['majority_accuracy']:.1%}); {int(r['n_train'])} train / {int(r['n_test'])} test words"
        )
    print(f"tables and figures in {out}/")


if __name__ == "__main__":
    main()
