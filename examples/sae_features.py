"""Which depth, feature by feature: small TopK SAEs at a few sites, sparse probing beside the dense probe.

What it shows
    ``sae_train_job`` trains a TopK SAE at each of ``--sites`` on the text of the bundled UD
    English EWT sample (activations streamed to a store, position 0 left out) and saves it in
    SAELens's layout; ``sparse_probing`` then asks, at each of those depths, how well UPOS is
    recovered by the k best SAE features per tag (k = 1, 4, 16) compared with a dense linear probe
    on the whole stream; ``feature_lens`` reads the best NOUN feature of the deepest site through
    the logit lens. Finally the SAE of the first site is spliced into a forward pass and its best
    NOUN feature ablated, to see how much the next-token distribution moves.

Outputs (in ``--out``)
    saes/<site>/                      cfg.json + sae_weights.safetensors per site (sae_lens loads them)
    sae_metrics.csv / .parquet        variance explained, L0, dead latents, CE loss scores, KL per site
    sparse_probing.csv / .parquet     one row per (site, k): accuracy, dense accuracy, majority
    sparse_probing_tags.csv / .parquet  one row per (site, tag, k): F1 and the best single feature
    sparse_probing.png                accuracy against depth, one line per k, the dense probe beside

Run
    python examples/sae_features.py                                   # 3 sites of the default model, a few minutes
    python examples/sae_features.py --sites 2.mlp,8.mlp,16.mlp,24.mlp --latents 2048 --epochs 8
    python examples/sae_features.py --model path/to/hf-folder-or.gguf --out my-saes/
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/sae_features", help="output folder")
    p.add_argument("--sites", default="3.mlp,9.mlp,18.mlp", help="comma-separated residual sites")
    p.add_argument("--latents", type=int, default=1024, help="SAE latents per site")
    p.add_argument("--k", type=int, default=16, help="active latents per token (TopK)")
    p.add_argument("--tokens", type=int, default=4000, help="training tokens per site")
    p.add_argument("--eval-tokens", type=int, default=800, help="held-out tokens per site")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=256)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import pandas as pd

    from depthscope.analyses import (
        SaeTrainConfig,
        feature_lens,
        plot_sparse_probing,
        read_documents,
        sae_train_job,
        sparse_probing,
        write_table,
    )
    from depthscope.analyses.jobs import Output
    from depthscope.hooks import load_model, load_sae
    from depthscope.probes import sample_data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    data = sample_data()
    texts = read_documents(data["ewt_train"]) + read_documents(data["ewt_test"])
    cfg = SaeTrainConfig(
        latents=args.latents,
        k=args.k,
        tokens=args.tokens,
        eval_tokens=args.eval_tokens,
        epochs=args.epochs,
        batch_size=args.batch_size,
    )
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]

    # 1. One SAE per site, each in its own folder with its metrics.
    saes, metrics = {}, []
    for site in sites:
        res = sae_train_job(model, texts, site, cfg, Output(out / "saes" / site))
        saes[site] = load_sae(out / "saes" / site / "sae")
        metrics.append(res.metrics)
        row = res.metrics.iloc[0]
        print(f"{site}: variance explained {row.variance_explained:.2f}, CE loss score {row.ce_loss_score:.2f}")
    write_table(pd.concat(metrics, ignore_index=True), out, "sae_metrics")

    # 2. Sparse probing per depth, beside the dense probe.
    sp = sparse_probing(model, saes, data["ewt_train"], data["ewt_test"], ks=(1, 4, 16), min_count=10)
    write_table(sp.by_k, out, "sparse_probing")
    write_table(sp.by_tag, out, "sparse_probing_tags")
    plot_sparse_probing(sp.by_k, out / "sparse_probing.png", n_layers=model.n_layers)
    print(sp.by_k[["label", "k", "accuracy", "dense_accuracy"]].to_string(index=False))

    # 3. The best NOUN feature: its top tokens, and its effect when ablated.
    best = sp.by_tag.query("k == 1 and tag == 'NOUN'").sort_values("depth")
    if len(best):
        last = best.iloc[-1]
        lens = feature_lens(model, saes[last["label"]], [int(last["feature"])], top=8)
        print(f"NOUN feature {int(last['feature'])} at {last['label']} reads as: {lens.token.tolist()}")
        first = best.iloc[0]
        feature = int(first["feature"])

        def ablate(f, ctx):
            f = f.clone()
            f[..., feature] = 0
            return f

        prompt = ["The old man walked his dog in the park"]
        plain = model.run(prompt, saes={first["label"]: saes[first["label"]]})
        edited = model.run(
            prompt, saes={first["label"]: saes[first["label"]]}, hooks={f"{first['label']}.sae.features": ablate}
        )
        moved = (edited.logits.log_softmax(-1) - plain.logits.log_softmax(-1)).abs().max()
        print(
            f"ablating NOUN feature {feature} at {first['label']} moves a log-probability by up to {float(moved):.3f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
