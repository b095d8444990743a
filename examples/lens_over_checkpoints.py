"""The logit lens over a series of training checkpoints: how does depth-wise prediction form?

What it shows
    1. A checkpoint series: by default a real (tiny) training run,
       ``depthscope.hooks.toy.train_tiny_series``: a 2-block Llama trained from random weights on
       the bundled EWT training text with ``--model``'s tokenizer, saved every ``--save-every``
       steps as Hugging Face folders ``step0/``, ``step50/``, ... (about a minute on a CPU). Or
       your own series with ``--checkpoint-dir`` (sub-folders ``step100/``, ``checkpoint-200/``,
       or ``.gguf`` files; the step is read from the name).
    2. ``depthscope.analyses.sweeps.series.sweep(checkpoints, "lens", ...)`` runs the logit lens
       (``logit_lens``) on each checkpoint over held-out text (the EWT test sentences) and writes
       one combined tidy table with ``checkpoint`` and ``step`` columns. Each checkpoint's
       tables are written as it finishes, so an interrupted run resumes where it stopped.
    3. A plot of the KL divergence from the final output to the lens's prediction against depth,
       one line per training step, and a checkpoint x depth heatmap of it.

Outputs (in ``--out``)
    checkpoints/step*/                       the trained series (unless --checkpoint-dir is given)
    sweep/sweep_by_site.csv / .parquet       the combined lens table (checkpoint, step, site, ..., kl_to_final, ...)
    sweep/checkpoints/, sweep/sweep.json     the sweep's per-checkpoint tables and request (for resuming)
    lens_kl_by_step.png                      KL(final || lens) against depth, one line per step
    lens_kl_heatmap.png                      the same as a checkpoint x depth heatmap

Run
    python examples/lens_over_checkpoints.py                           # train 200 steps, then sweep
    python examples/lens_over_checkpoints.py --steps 100 --save-every 25 --max-tokens 2000
    python examples/lens_over_checkpoints.py --checkpoint-dir path/to/series --out lens-series/
    depthscope sweep --checkpoint-dir examples-out/lens_over_checkpoints/checkpoints --analysis lens --out s/
                                                                       # the same sweep from the shell
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="whose tokenizer the tiny series is trained with (anything load_model accepts; default SmolLM2's)",
    )
    p.add_argument("--out", default="examples-out/lens_over_checkpoints", help="output folder")
    p.add_argument("--checkpoint-dir", default=None, help="sweep this series instead of training one")
    p.add_argument("--steps", type=int, default=200, help="training steps of the tiny series")
    p.add_argument("--save-every", type=int, default=50, help="steps between saved checkpoints")
    p.add_argument("--max-tokens", type=int, default=5000, help="tokens of held-out text the lens reads (0: all)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier sweep in --out with other options")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from depthscope.analyses import discover_checkpoints, plot_checkpoint_heatmap, plot_final_site_over_training, sweep
    from depthscope.probes import read_conllu, sample_data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = sample_data()
    held_out = [s.text for s in read_conllu(data["ewt_test"]).sentences]  # the lens reads these

    # 1. The checkpoint series.
    if args.checkpoint_dir:
        ckpt_dir = Path(args.checkpoint_dir)
    else:
        ckpt_dir = out / "checkpoints"
        if any(ckpt_dir.glob("step*/config.json")):
            print(f"reusing the series in {ckpt_dir} (delete it to train again)")
        else:
            import transformers

            from depthscope.hooks import load_model, train_tiny_series

            transformers.utils.logging.disable_progress_bar()  # no bar per saved checkpoint

            tokenizer = load_model(args.model).tokenizer
            train_text = [s.text for s in read_conllu(data["ewt_train"]).sentences]
            print(f"training a tiny Llama for {args.steps} steps on {len(train_text)} sentences ...")
            train_tiny_series(ckpt_dir, train_text, tokenizer, steps=args.steps, save_every=args.save_every)
    checkpoints = discover_checkpoints(checkpoint_dir=ckpt_dir)  # ordered by the step in their names
    print(f"{len(checkpoints)} checkpoints: {', '.join(c.name for c in checkpoints)}")

    # 2. The sweep: "lens" runs depthscope.analyses.logit_lens(model, texts, **options) on each
    # checkpoint; the options (here max_tokens) are part of the request a re-run must match.
    result = sweep(
        checkpoints,
        "lens",
        out / "sweep",
        texts=held_out,
        max_tokens=args.max_tokens or None,
        overwrite=args.overwrite,
        progress=False,
    )
    if result.failed:
        for name, err in result.failed.items():
            print(f"failed: {name}: {err}")
        raise SystemExit(1)
    df = result.tables["by_site"]  # checkpoint, step, duplicate_of, site, label, layer, sublayer, depth, metrics

    # 3. Figures from the combined table.
    plot_final_site_over_training(df, "kl_to_final", out / "lens_kl_by_step.png")
    plot_checkpoint_heatmap(df, "kl_to_final", out / "lens_kl_heatmap.png", title="KL(final || logit lens)")

    # Summary: per step, the KL at the embedding and half-way, and the final cross-entropy.
    print(f"{len(result.done)} checkpoints swept, {len(result.skipped)} already done; per step:")
    n_sites = df["site"].max()
    for (_, step), part in df.groupby(["checkpoint", "step"], sort=False):
        part = part.set_index("site")
        print(
            f"  step {step:>5}: KL(final || lens) embed {part.loc[0, 'kl_to_final']:.2f}, "
            f"{part.loc[n_sites // 2, 'label']} {part.loc[n_sites // 2, 'kl_to_final']:.2f} nats; "
            f"model's cross-entropy {part.loc[n_sites, 'cross_entropy']:.2f}"
        )
    print(f"tables in {out / 'sweep'}/, figures in {out}/")


if __name__ == "__main__":
    main()
