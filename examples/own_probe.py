"""Your own probe: scikit-learn on depthscope's per-word residual-stream features.

What it shows
    ``depthscope.probes.word_features`` turns sentences (a CoNLL-U file, parsed sentences or
    lists of words) into raw float32 features ``[sites, n_words, d_model]``, one vector per word
    per residual site (pooled over the word's subwords exactly as depthscope's own probes do),
    with an index table (sentence, word, form, and the gold CoNLL-U columns upos, xpos, lemma,
    feats, head, deprel). From there any classifier works; here a binary property of a word,
    "is this word a noun" (``--property upos=NOUN``; any ``column=value`` of the index works,
    e.g. ``deprel=nsubj``), learned by a scikit-learn ``LogisticRegression`` per site on the
    bundled UD English EWT sample, scored on its test part.

    Beside it, a control task (Hewitt & Liang 2019): the same probe on labels drawn at random
    once per word form (with the property's base rate), which a probe can only fit by memorising
    words. Selectivity = accuracy - control accuracy.

Outputs (in ``--out``)
    own_probe.csv / .parquet   one row per site: accuracy, control accuracy, selectivity, majority baseline
    own_probe.png              accuracy (and control, majority baseline) against depth

Run
    python examples/own_probe.py                                  # upos=NOUN at every site, 1-4 min on 2 cores
    python examples/own_probe.py --property deprel=nsubj --sites embed,5.mlp,10.mlp,20.mlp,29.mlp
    python examples/own_probe.py --model path/to/hf-folder-or.gguf --out my-probe/
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="anything load_model accepts (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/own_probe", help="output folder")
    p.add_argument("--property", default="upos=NOUN", help="column=value of the word index (upos, deprel, ...)")
    p.add_argument("--sites", default=None, help="comma-separated site labels (default: every site)")
    p.add_argument("--max-train-sentences", type=int, default=100, help="train sentences sampled (0: all 300)")
    p.add_argument("--max-test-sentences", type=int, default=50, help="test sentences sampled (0: all 150)")
    p.add_argument("--C", type=float, default=0.1, help="inverse L2 strength of the logistic regression")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import pandas as pd
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from depthscope.analyses import write_table
    from depthscope.analyses.style import lineplot_by_sublayer, plt, savefig
    from depthscope.hooks import load_model
    from depthscope.probes import read_conllu, sample_data, word_features

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    column, _, value = args.property.partition("=")
    if not value:
        raise SystemExit(f"--property must be column=value, got {args.property!r}")
    model = load_model(args.model)
    sites = args.sites.split(",") if args.sites else None  # None: all 2L+1 sites
    print(f"model {model.name}: {model.n_layers} blocks; probing '{column} == {value}'")

    # 1. Features. read_conllu samples max_sentences sentences (seeded); word_features runs each
    # sentence through the model once and keeps one vector per word per site.
    data = sample_data()
    train_sents = read_conllu(data["ewt_train"], max_sentences=args.max_train_sentences or None, seed=args.seed)
    test_sents = read_conllu(data["ewt_test"], max_sentences=args.max_test_sentences or None, seed=args.seed)
    train = word_features(model, train_sents, sites=sites)
    test = word_features(model, test_sents, sites=sites)
    if column not in train.index.columns:
        raise SystemExit(f"no column {column!r} in the word index; columns: {list(train.index.columns)}")
    y_train = (train.index[column].astype(str) == value).to_numpy()  # compared as text (head=0 works)
    y_test = (test.index[column].astype(str) == value).to_numpy()
    if y_train.all() or not y_train.any():
        raise SystemExit(f"every train word or none has {column} == {value}: nothing to learn (more sentences?)")
    print(
        f"{len(y_train)} train words ({y_train.mean():.1%} positive), {len(y_test)} test words "
        f"({y_test.mean():.1%} positive); features {train.features.shape} (sites, words, d_model)"
    )

    # 2. Control labels: one random label per word form, with the property's base rate.
    rng = np.random.default_rng(args.seed)
    forms = sorted(set(train.index["form"].str.lower()) | set(test.index["form"].str.lower()))
    control_of = dict(zip(forms, rng.random(len(forms)) < y_train.mean()))
    c_train = train.index["form"].str.lower().map(control_of).to_numpy()
    c_test = test.index["form"].str.lower().map(control_of).to_numpy()

    # 3. One probe per site (standardised features, L2-regularised logistic regression).
    def fit_score(X_train, y, X_test, y_true):
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=args.C, max_iter=2000))
        probe.fit(X_train, y)
        return probe.score(X_train, y), probe.score(X_test, y_true)

    rows = []
    majority = max(y_test.mean(), 1 - y_test.mean())
    for i in range(len(train.sites)):
        train_acc, acc = fit_score(train.features[i], y_train, test.features[i], y_test)
        _, control_acc = fit_score(train.features[i], c_train, test.features[i], c_test)
        rows.append(
            {
                "train_accuracy": train_acc,
                "accuracy": acc,
                "control_accuracy": control_acc,
                "selectivity": acc - control_acc,
                "majority_accuracy": majority,
            }
        )
    # train.sites holds the shared site columns (site, label, layer, sublayer, depth).
    df = pd.concat([train.sites.reset_index(drop=True), pd.DataFrame(rows)], axis=1)
    df.insert(0, "property", args.property)
    df["n_train"], df["n_test"] = len(y_train), len(y_test)
    write_table(df, out, "own_probe")

    # 4. Figure: accuracy per site coloured by sublayer, the control dashed, the baseline dotted.
    fig, ax = plt.subplots(figsize=(8, 4))
    lineplot_by_sublayer(ax, df, "accuracy", ylabel="test accuracy", n_layers=model.n_layers)
    ax.plot(df["depth"], df["control_accuracy"], ls="--", color="#7f7f7f", lw=1.2, label="control task")
    ax.axhline(majority, ls=":", color="black", lw=1.0, label="majority class")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(f"Logistic-regression probe for {column} == {value}: {model.name}", fontsize=10)
    savefig(fig, out / "own_probe.png")

    best = df.loc[df["accuracy"].idxmax()]
    most_selective = df.loc[df["selectivity"].idxmax()]
    emb = df.iloc[0]
    print(
        f"embedding {emb['label']}: {emb['accuracy']:.1%}; best site {best['label']}: {best['accuracy']:.1%}; "
        f"most selective {most_selective['label']}: {most_selective['selectivity']:+.1%} over control; "
        f"majority class {majority:.1%}"
    )
    print(f"table and figure in {out}/")


if __name__ == "__main__":
    main()
