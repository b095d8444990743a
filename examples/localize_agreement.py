"""Where does the model keep the subject's number, and at which depth does it move? Three curves.

What it shows
    Subject-verb number agreement with attractors ("The key near the cabinets" -> " is"/" are";
    ``agreement_examples``): one property three ways at every residual site. Decodable: a linear
    probe of ``feats:Number`` on the bundled EWT sample (``causal_tests``). Needed: its ``used``,
    the extra next-token loss when LEACE erases it beyond a random erasure of the same rank.
    Computed with: interchange intervention accuracy (IIA) on held-out agreement examples at the
    subject's position (SUBJ) and at the last position (END): put the source's vector there and
    count how often the verb then agrees with the source's subject. Then DAS (one learned
    direction, trained on the other half of the examples) at a few sites, beside a random
    direction of the same size.

Outputs (in ``--out``)
    agreement.jsonl                   the generated examples (for this model's tokenizer)
    localize.csv / .parquet           full-vector IIA per site and position (interchange)
    localize_probes.csv / .parquet    probe accuracy and 'used' per site (feats:Number)
    localize_das.csv / .parquet       DAS (dim 1) IIA and the random direction's, per site and position
    localize_three_curves.png         decodable, needed, computed with, against depth
    localize_das.png                  DAS's IIA against depth with the random direction's

Run
    python examples/localize_agreement.py                    # the default model: the docs' figure
    python examples/localize_agreement.py --n 120 --sites embed,10.mlp,20.mlp,29.mlp --das-sites 10.mlp
    python examples/localize_agreement.py --only-solved      # IIA on the examples the model solves
    python examples/localize_agreement.py --model path/to/hf-folder --out localize/
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/localize_agreement", help="output folder")
    p.add_argument("--n", type=int, default=200, help="agreement examples (half train DAS, half test)")
    p.add_argument("--sites", default="resid", help="sites of the interchange and the probes: 'resid' or a comma list")
    p.add_argument("--das-sites", default="4.mlp,12.mlp,20.mlp,26.mlp,28.mlp,29.mlp", help="DAS sites ('' : none)")
    p.add_argument("--epochs", type=int, default=4, help="DAS epochs")
    p.add_argument(
        "--only-solved", action="store_true", help="keep the examples the model answers right (base and source)"
    )
    p.add_argument("--probe-sentences", type=int, default=100, help="EWT train sentences of the probe (test: half)")
    p.add_argument("--probe-tokens", type=int, default=600, help="held-out tokens of the loss behind 'used'")
    return p.parse_args(argv)


def _fits(label: str, n_layers: int) -> bool:
    """True for ``embed`` and for ``l.attn`` / ``l.mlp`` with ``l`` below ``n_layers``."""
    head = label.split(".")[0]
    return label == "embed" or (head.isdigit() and int(head) < n_layers)


def main(argv=None):
    args = parse_args(argv)
    from depthscope.analyses import (
        CausalConfig,
        agreement_examples,
        causal_tests,
        das,
        interchange,
        plot_iia,
        plot_three_curves,
        split_examples,
        write_counterfactuals,
        write_table,
    )
    from depthscope.hooks import load_model, parse_sites
    from depthscope.probes import DataConfig, ExtractionConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    examples = agreement_examples(model, args.n, seed=0)
    if args.only_solved:  # IIA on the examples the model solves (docs/localize.md)
        from depthscope.analyses import solved

        n = len(examples)
        examples = [e for e, ok in zip(examples, solved(model, examples)) if ok]
        print(f"--only-solved: kept {len(examples)} of {n} examples")
    write_counterfactuals(examples, out / "agreement.jsonl")
    train, test = split_examples(examples, 0.5, seed=0)
    wanted = None if args.sites == "resid" else [s for s in args.sites.split(",") if _fits(s, model.n_layers)]
    sites = parse_sites(wanted, model.n_layers)

    t0 = time.perf_counter()
    table = interchange(model, test, sites=sites, positions="SUBJ,END")  # full-vector, held-out half
    write_table(table, out, "localize")
    t1 = time.perf_counter()
    cfg = CausalConfig(
        tasks=["feats:Number"],
        controls=2,
        bootstrap=200,
        max_text_tokens=args.probe_tokens,
        data=DataConfig(max_train_sentences=args.probe_sentences, max_test_sentences=max(args.probe_sentences // 2, 1)),
        extraction=ExtractionConfig(sites=sites),
    )
    probes = causal_tests(model, cfg).table
    write_table(probes, out, "localize_probes")
    plot_three_curves(table, probes, out / "localize_three_curves.png")
    t2 = time.perf_counter()

    das_sites = [s for s in args.das_sites.split(",") if s and _fits(s, model.n_layers)]
    if das_sites:
        from depthscope.analyses import LocalizeConfig

        res = das(
            model, train, test, sites=das_sites, positions="SUBJ,END", dim=1, config=LocalizeConfig(epochs=args.epochs)
        )
        write_table(res.table, out, "localize_das")
        plot_iia(res.table, out / "localize_das.png")
        cols = ["label", "position", "iia", "iia_low", "iia_high", "iia_random", "iia_unchanged"]
        print(res.table[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    t3 = time.perf_counter()
    cols = ["label", "position", "iia", "iia_low", "iia_high", "iia_unchanged", "logit_diff"]
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"seconds: interchange {t1 - t0:.0f}, probes and erasure {t2 - t1:.0f}, DAS {t3 - t2:.0f}")
    print(f"wrote {out / 'localize_three_curves.png'}")


if __name__ == "__main__":
    main()
