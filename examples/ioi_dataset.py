"""An IOI dataset: prompt pairs from several templates, and patching over the whole dataset.

What it shows
    Indirect-object identification (Wang et al. 2022) is a circuit result over many prompts, not
    one. ``build_pairs`` makes clean/corrupted pairs from templates of different token lengths:
    the clean prompt "When Mary and John went to the store, John gave a drink to" should name the
    indirect object (target " Mary", foil " John"); the corrupted prompt swaps the subject of the
    second clause ("..., Mary gave a drink to"). Names are kept only when they are one token with
    a leading space in the model's tokenizer, and each pair names its positions from the
    tokenizer: ``IO`` and ``S1`` (first mentions), ``S2`` (the second clause's subject) and
    ``END`` (the last token). The pairs are written as JSONL (the format ``depthscope patch
    --pairs`` reads) and patched with the dataset API:

    1. every attention head at the last position: means over pairs with the IOI normalisation
       ``(mean patched - mean corrupted) / (mean clean - mean corrupted)`` and a 95% bootstrap
       interval over pairs; the top heads are printed;
    2. the residual sites at the named positions (``positions="each"`` patches each name);
    3. attribution patching of both tables beside the exact values, with the Spearman rank
       correlation of estimate and exact.

Outputs (in ``--out``)
    ioi_pairs.jsonl              the dataset, one pair per line (clean, corrupted, target, foil, positions)
    ioi_heads.csv / .parquet     per-head means over pairs, exact and attribution (``method`` column)
    ioi_sites.csv / .parquet     residual sites at the named positions, exact and attribution
    ioi_heads.png                layer x head heatmap of the exact means
    ioi_sites.png                site x named position heatmap of the exact means
    ioi_attribution_vs_exact.png the per-head estimate against the exact means

Run
    python examples/ioi_dataset.py                           # 12 pairs, default model, about 1 min on 2 cores
    python examples/ioi_dataset.py --n-pairs 4 --sites embed,10.mlp,20.mlp    # a quick look
    python examples/ioi_dataset.py --model path/to/hf-folder-or.gguf --n-pairs 40 --out ioi-data/
    python examples/ioi_dataset.py --n-pairs 40 --pairs-only --out ioi-data/   # the JSONL only

``build_pairs(tokenizer, n_pairs)`` is importable (the tests and the benchmark build their datasets
with it): ``importlib`` on this file, or copy it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

#: IOI templates of different token lengths; {A} and {B} are the two names of the first clause
#: (the indirect object IO and the subject S, in either order), {C} the second clause's subject
TEMPLATES = (
    "When {A} and {B} went to the store, {C} gave a drink to",
    "When {A} and {B} went to the park, {C} gave a ball to",
    "Then, {A} and {B} had a long argument, and afterwards {C} said to",
    "After the lunch, {A} and {B} went to the garden. {C} gave a flower to",
    "While {A} and {B} were working at the old house, {C} handed the keys to",
    "Friends {A} and {B} found a bone at the beach, and later {C} threw it to",
)
#: candidate names (without the leading space); build_pairs keeps those that are one token
NAMES = ("Mary", "John", "Alice", "Bob", "Tom", "Sarah", "James", "Anna", "Paul", "Emma", "David", "Kate")


def single_token_names(tokenizer, names=NAMES) -> list[str]:
    """The names that ``tokenizer`` encodes as one token with a leading space (" Mary")."""
    return [n for n in names if len(tokenizer(" " + n, add_special_tokens=False)["input_ids"]) == 1]


def _positions(tokenizer, clean: str, corrupted: str, io: str, s: str) -> dict[str, int]:
    """Named positions of one pair from its tokens: IO, S1 (first mentions), S2 (the second
    clause's subject: the last S in the clean prompt, IO in the corrupted one), END."""
    c, k = tokenizer(clean)["input_ids"], tokenizer(corrupted)["input_ids"]
    io_id, s_id = (tokenizer(" " + n, add_special_tokens=False)["input_ids"][0] for n in (io, s))
    s2 = len(c) - 1 - c[::-1].index(s_id)
    if len(c) != len(k) or k[s2] != io_id:
        raise ValueError(f"the names do not tokenize alike in {clean!r} and {corrupted!r}")
    return {"IO": c.index(io_id), "S1": c.index(s_id), "S2": s2, "END": -1}


def build_pairs(tokenizer, n_pairs: int = 12, names=NAMES, templates=TEMPLATES, seed: int = 0) -> list:
    """``n_pairs`` IOI :class:`~depthscope.analyses.circuits.pairs.PromptPair` s cycling through
    ``templates`` (so lengths differ), the two names drawn from the single-token ``names``
    (seeded), the first clause's order alternating (IO first, then S first). Target: the
    indirect object; foil: the subject."""
    from depthscope.analyses import PromptPair

    ok = single_token_names(tokenizer, names)
    if len(ok) < 2:
        raise ValueError(f"fewer than two of the names {list(names)} are one token in this tokenizer")
    rng, pairs = random.Random(seed), []
    for i in range(n_pairs):
        template = templates[i % len(templates)]
        io, s = rng.sample(ok, 2)
        a, b = (io, s) if (i + i // len(templates)) % 2 == 0 else (s, io)
        clean, corrupted = template.format(A=a, B=b, C=s), template.format(A=a, B=b, C=io)
        positions = _positions(tokenizer, clean, corrupted, io, s)
        pairs.append(PromptPair(clean, corrupted, " " + io, " " + s, positions))
    return pairs


def write_pairs(pairs, path) -> Path:
    """The pairs as JSONL, one JSON object per line (what ``read_pairs`` and ``--pairs`` read)."""
    path = Path(path)
    rows = [
        dict(clean=p.clean, corrupted=p.corrupted, target=p.target, foil=p.foil, positions=p.positions) for p in pairs
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/ioi_dataset", help="output folder")
    p.add_argument("--n-pairs", type=int, default=12, help="pairs to build (cycling through the templates)")
    p.add_argument("--seed", type=int, default=0, help="seed of the name draws")
    p.add_argument("--pairs-only", action="store_true", help="write ioi_pairs.jsonl and stop (for depthscope patch)")
    p.add_argument(
        "--sites", default="resid", help="residual sites patched at the named positions (comma-separated; 'resid': all)"
    )
    return p.parse_args(argv)


def _spearman(exact, estimate) -> float:
    """Rank correlation of the estimate with the exact means over the same patches."""
    keys = ["point", "head", "position_name"]
    a, b = (t.set_index(keys)["fraction_recovered"] for t in (exact, estimate))
    return float(a.corr(b.reindex(a.index), method="spearman"))


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
    pairs = build_pairs(model.tokenizer, args.n_pairs, seed=args.seed)
    path = write_pairs(pairs, out / "ioi_pairs.jsonl")
    lengths = sorted({len(model.tokenizer(p.clean)["input_ids"]) for p in pairs})
    print(f"model {model.name}: {len(pairs)} pairs written to {path} (token lengths {lengths})")
    if args.pairs_only:
        return

    # 1. Every head at the last position; the path reads the same pairs as the list would.
    heads = activation_patching(model, path, sites="heads", positions="last")
    heads_est = attribution_patching(model, path, sites="heads", positions="last")
    # 2. Residual sites at each named position (IO, S1, S2, END): one patch per site and name.
    sites = activation_patching(model, path, sites=args.sites, positions="each")
    sites_est = attribution_patching(model, path, sites=args.sites, positions="each")

    heads_all = pd.concat([heads, heads_est], ignore_index=True)
    sites_all = pd.concat([sites, sites_est], ignore_index=True)
    write_table(heads_all, out, "ioi_heads")
    write_table(sites_all, out, "ioi_sites")
    plot_patching_heads(heads_all, out / "ioi_heads.png", method="activation")
    plot_patching_sites(sites_all, out / "ioi_sites.png", method="activation")
    plot_attribution_vs_exact(heads_all, out / "ioi_attribution_vs_exact.png")

    r = heads.iloc[0]
    print(
        f"mean logit difference over {int(r['n_pairs'])} pairs: clean {r['clean_metric']:.2f}, "
        f"corrupted {r['corrupted_metric']:.2f}"
    )
    print("top heads at the last position (fraction recovered of the mean, 95% bootstrap interval over pairs):")
    for _, h in heads.nlargest(5, "fraction_recovered").iterrows():
        print(
            f"  head {int(h['layer'])}.{int(h['head'])}: {h['fraction_recovered']:+.3f} "
            f"[{h['fraction_low']:+.3f}, {h['fraction_high']:+.3f}]"
        )
    print("residual sites recovering >= 50% at each named position:")
    for name, at in sites.groupby("position_name", sort=False):
        top = at[at["fraction_recovered"] >= 0.5]
        span = f"{top['label'].iloc[0]} .. {top['label'].iloc[-1]}" if len(top) else "none"
        print(f"  {name}: {span} ({len(top)} of {len(at)} sites)")
    print(
        f"Spearman(attribution, exact): heads {_spearman(heads, heads_est):.3f}, "
        f"residual sites {_spearman(sites, sites_est):.3f}"
    )
    print(f"tables and figures in {out}/")


if __name__ == "__main__":
    main()
