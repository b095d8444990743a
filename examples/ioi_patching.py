"""Indirect-object identification (IOI): activation patching and attribution patching.

What it shows
    The clean prompt "When Mary and John went to the store, John gave a drink to" makes the
    model prefer " Mary" over " John"; the corrupted prompt repeats Mary instead of John, so it
    does not. The metric is the logit difference logit(" Mary") - logit(" John") at the last
    token. Patching copies a clean activation into the corrupted run and reports the
    *fraction recovered*: (patched - corrupted) / (clean - corrupted).

    1. ``activation_patching`` at every residual site (embed, l.attn, l.mlp), one row per
       patched position (``--positions each``; ``last`` is cheaper): where along depth and
       along the prompt the name information flows to the last token.
    2. ``activation_patching`` with ``sites="heads"``: one patch per attention head (the head's
       write into the stream, at the last position): which heads carry it.
    3. ``attribution_patching``: the same two tables estimated from one forward and one
       backward pass, and its Spearman rank agreement with the exact tables.

Outputs (in ``--out``)
    ioi_sites.csv / .parquet     residual-site patches, exact and attribution (``method`` column)
    ioi_heads.csv / .parquet     per-head patches, exact and attribution
    ioi_sites.png                site x position heatmap of the fraction recovered (exact)
    ioi_heads.png                layer x head heatmap (exact)
    ioi_attribution_vs_exact.png the per-head estimate against the exact value

Run
    python examples/ioi_patching.py                          # default model, 40 s-2 min on 2 cores
    python examples/ioi_patching.py --positions last         # cheaper: last position only
    python examples/ioi_patching.py --model path/to/hf-folder-or.gguf --out ioi/
    python examples/ioi_patching.py --clean "..." --corrupted "..." --target " A" --foil " B"
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/ioi_patching", help="output folder")
    p.add_argument("--clean", default="When Mary and John went to the store, John gave a drink to")
    p.add_argument("--corrupted", default="When Mary and John went to the store, Mary gave a drink to")
    p.add_argument("--target", default=" Mary", help="the token the clean prompt should predict (one token)")
    p.add_argument("--foil", default=" John", help="the token it is compared with (one token)")
    p.add_argument(
        "--positions",
        default="each",
        choices=["each", "last"],
        help="residual sites: patch every position separately (each) or the last one only (last)",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import pandas as pd

    from depthscope.analyses import (
        activation_patching,
        attribution_patching,
        plot_attribution_vs_exact,
        plot_patching_heads,
        plot_patching_sites,
        write_table,
    )
    from depthscope.hooks import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    print(f"model {model.name}: {model.n_layers} blocks, d_model {model.d_model}")
    # A (target, foil) pair means logit(target) - logit(foil) at the last token; any function
    # logits [batch, pos, vocab] -> [batch] works too (see depthscope.analyses.circuits.prompts).
    metric = (args.target, args.foil)
    common = dict(clean=args.clean, corrupted=args.corrupted, metric=metric)

    # 1. Residual sites. The exact table runs many patched copies of the corrupted prompt as
    # rows of one batch; the attribution table is one forward and one backward.
    sites = activation_patching(model, **common, positions=args.positions)
    sites_est = attribution_patching(model, **common, positions=args.positions)
    # 2. Heads: "heads" = every layer's per-head write (l.heads), at the last position.
    heads = activation_patching(model, **common, sites="heads")
    heads_est = attribution_patching(model, **common, sites="heads")

    # One tidy table per kind of patch; the ``method`` column tells exact from estimate.
    sites_all = pd.concat([sites, sites_est], ignore_index=True)
    heads_all = pd.concat([heads, heads_est], ignore_index=True)
    write_table(sites_all, out, "ioi_sites")
    write_table(heads_all, out, "ioi_heads")

    plot_patching_sites(sites_all, out / "ioi_sites.png", method="activation")
    plot_patching_heads(heads_all, out / "ioi_heads.png", method="activation")
    plot_attribution_vs_exact(heads_all, out / "ioi_attribution_vs_exact.png")

    # 3. Agreement between the estimate and the exact values (rows are the same patches in
    # the same order in both tables).
    rho_heads = heads_est["fraction_recovered"].corr(heads["fraction_recovered"], method="spearman")
    last = sites["position"] == sites["position"].max()
    rho_sites = sites_est.loc[last, "fraction_recovered"].corr(sites.loc[last, "fraction_recovered"], method="spearman")

    clean_m, corrupted_m = float(heads["clean_metric"].iloc[0]), float(heads["corrupted_metric"].iloc[0])
    print(f"logit({args.target!r}) - logit({args.foil!r}): clean {clean_m:.2f}, corrupted {corrupted_m:.2f}")
    # Where the residual stream carries the difference: at each position where the prompts
    # differ, and at the last one, the sites whose patch alone recovers at least half of it.
    print(f"{len(sites)} residual-site patches; sites recovering >= 50%:")
    changed = sites.loc[sites["token"] != sites["clean_token"], "position"].unique().tolist()
    for pos in sorted(set(changed) | {int(sites["position"].max())}):
        at = sites[(sites["position"] == pos) & (sites["fraction_recovered"] >= 0.5)]
        here = sites[sites["position"] == pos]
        r = here.iloc[0]
        where = f"position {pos} ({r['clean_token']!r} clean, {r['token']!r} corrupted)"
        first_last = f"{at['label'].iloc[0]} .. {at['label'].iloc[-1]}" if len(at) else "none"
        span = f"{first_last} ({len(at)} of {len(here)} sites)"
        print(f"  {where}: {span}")
    print(f"{len(heads)} head patches; the top 3 heads (fraction recovered, exact):")
    for _, r in heads.nlargest(3, "fraction_recovered").iterrows():
        print(f"  head {int(r['layer'])}.{int(r['head'])}: {r['fraction_recovered']:.3f}")
    print(f"Spearman(attribution, exact): heads {rho_heads:.3f}, residual sites at the last position {rho_sites:.3f}")
    print(f"tables and figures in {out}/")


if __name__ == "__main__":
    main()
