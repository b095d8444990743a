"""Structural probes (Hewitt & Manning 2019): gold trees from CoNLL-U heads, the spanning tree and
UUAS against hand-worked examples and scipy, Spearman against scipy, the probe on synthetic
features whose tree distances are exactly linear-recoverable, and the command line."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.sparse.csgraph import minimum_spanning_tree
from scipy.stats import spearmanr

from depthscope.common.errors import InputError
from depthscope.probes import read_conllu
from depthscope.probes.corpora.tasks import build_task, tree_heads
from depthscope.probes.structural import (
    TreeSettings,
    TreeSplit,
    baseline_scores,
    fit_tree_probe,
    tree_predictions,
    tree_scores,
)
from depthscope.probes.structural_trees import (
    length_macro_mean,
    mst_edges,
    spearman_rows,
    tree_depths,
    tree_distances,
    uuas_counts,
)
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")  # small products: two threads only spin-wait on a busy machine

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
EWT_TRAIN = os.path.join(UD, "ewt_tiny_train.conllu")
EWT_TEST = os.path.join(UD, "ewt_tiny_test.conllu")

# "The cat sat on the mat ." with a multiword token (the surface "sat" split into two words is
# not English, but exercises the reader) and an empty node, which is no word
CONLLU = """# text = The cat sat on the mat.
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tcat\tcat\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3-4\tsat\t_\t_\t_\t_\t_\t_\t_\t_
3\ts\ts\tVERB\tVBD\t_\t0\troot\t_\t_
4\tat\tat\tAUX\tVBD\t_\t3\taux\t_\t_
4.1\tsat\tsit\tVERB\tVBD\t_\t_\t_\t3:conj\t_
5\ton\ton\tADP\tIN\t_\t7\tcase\t_\t_
6\tthe\tthe\tDET\tDT\t_\t7\tdet\t_\t_
7\tmat\tmat\tNOUN\tNN\t_\t3\tobl\t_\tSpaceAfter=No
8\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_

"""

# the tree, by word index: The(0) -> cat(1) -> s(2, root) <- at(3); on(4), the(5) -> mat(6) -> s; .(7) -> s
HEADS = [1, 2, -1, 2, 6, 6, 2, 2]
DEPTHS = [2, 1, 0, 1, 2, 2, 1, 1]
#         The cat s  at on the mat .
DISTANCES = [
    [0, 1, 2, 3, 4, 4, 3, 3],  # The
    [1, 0, 1, 2, 3, 3, 2, 2],  # cat
    [2, 1, 0, 1, 2, 2, 1, 1],  # s
    [3, 2, 1, 0, 3, 3, 2, 2],  # at
    [4, 3, 2, 3, 0, 2, 1, 3],  # on
    [4, 3, 2, 3, 2, 0, 1, 3],  # the
    [3, 2, 1, 2, 1, 1, 0, 2],  # mat
    [3, 2, 1, 2, 3, 3, 2, 0],  # .
]


@pytest.fixture()
def sentence(tmp_path):
    p = tmp_path / "s.conllu"
    p.write_text(CONLLU, encoding="utf-8")
    return read_conllu(p).sentences[0]


def test_gold_tree_from_conllu_heads(sentence):
    assert [w.form for w in sentence.words] == ["The", "cat", "s", "at", "on", "the", "mat", "."]
    heads = tree_heads(sentence)
    assert heads.tolist() == HEADS
    assert tree_depths(heads).tolist() == DEPTHS
    assert tree_distances(heads).tolist() == DISTANCES


def test_no_tree_is_none(sentence):
    broken = sentence.words[1]
    broken.head = 1  # "cat" under "The" under "cat": a cycle
    assert tree_heads(sentence) is None
    broken.head = 99  # a head no word has
    assert tree_heads(sentence) is None


def test_tree_task_examples(sentence):
    from depthscope.probes.corpora.conllu import Corpus

    ex = build_task(Corpus([sentence]), "structural")
    assert ex.kind == "word" and len(ex) == 8
    assert [int(x) for x in ex.labels] == HEADS
    assert ex.span1.tolist() == [[k, k + 1] for k in range(8)]


def test_uuas_against_a_hand_worked_tree():
    # gold tree over 5 words (0-based heads): 1 <- 0, 1 is the root, 2 <- 1, 3 <- 2, 4 <- 1
    heads = np.array([1, -1, 1, 2, 1])
    # predicted distances: the smallest are 0-1 (1), 1-2 (2), 2-3 (3), 3-4 (4), all else 9,
    # so Prim / Kruskal keep exactly those four edges: the chain 0-1-2-3-4
    pred = np.full((5, 5), 9.0)
    for (i, j), d in {(0, 1): 1, (1, 2): 2, (2, 3): 3, (3, 4): 4}.items():
        pred[i, j] = pred[j, i] = d
    np.fill_diagonal(pred, 0)
    assert mst_edges(pred) == {(0, 1), (1, 2), (2, 3), (3, 4)}
    # gold edges {0-1, 1-2, 2-3, 1-4}: three of the four are predicted
    assert uuas_counts(pred, heads, np.ones(5, bool)) == (3, 4)
    # word 3 is punctuation: gold edges among kept words {0-1, 1-2, 1-4}; the spanning tree of
    # the kept words 0, 1, 2, 4 is {0-1, 1-2, 2-4 (9) or 0-4 or 1-4 (9)}: ties go to the word
    # reached first by Prim from word 0, giving 0-4, so two of three
    keep = np.array([True, True, True, False, True])
    assert uuas_counts(pred, heads, keep) == (2, 3)


def test_mst_matches_scipy():
    rng = np.random.default_rng(0)
    for n in (2, 3, 7, 20):
        a = rng.uniform(0.1, 10, size=(n, n))
        a = (a + a.T) / 2
        np.fill_diagonal(a, 0)
        edges = mst_edges(a)
        ref = minimum_spanning_tree(np.triu(a)).tocoo()
        assert edges == {(min(i, j), max(i, j)) for i, j in zip(ref.row, ref.col)}
        assert np.isclose(sum(a[i, j] for i, j in edges), ref.sum())


def test_spearman_matches_scipy():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, size=(6, 12)).astype(float)  # ties
    b = rng.normal(size=(6, 12))
    b[0] = a[0] * 2 + 1  # a perfect monotone pair
    got = spearman_rows(a, b)
    want = [spearmanr(x, y).statistic for x, y in zip(a, b)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[0] == pytest.approx(1.0)
    assert np.isnan(spearman_rows(np.ones(4), np.arange(4.0)))


def test_length_macro_mean():
    # lengths 5 (values 1, 3: mean 2) and 7 (value 4); length 3 and 60 are outside 5-50
    assert length_macro_mean([1, 3, 4, 100, 100], [5, 5, 7, 3, 60]) == pytest.approx(3.0)
    assert np.isnan(length_macro_mean([1.0], [3]))


def _random_tree(rng, n: int) -> np.ndarray:
    """Heads of a random tree of ``n`` words: each word but a random root attaches to an
    earlier-visited word."""
    order = rng.permutation(n)
    heads = np.full(n, -1)
    for k in range(1, n):
        heads[order[k]] = order[rng.integers(0, k)]
    return heads


def _synthetic_split(rng, n_sent: int, dims: int, noise: int) -> tuple:
    """Sentences of random trees whose word vectors make tree distances exactly recoverable:
    the edge from word k to its head gets the unit direction ``e_k``, a word's vector is the sum
    of the edges on its path to the root (so ``||h_i - h_j||^2`` is the tree distance and
    ``||h_i||^2`` the depth), then ``noise`` random dimensions, all mixed by a random rotation."""
    heads, feats = [], []
    for _ in range(n_sent):
        n = int(rng.integers(5, dims + 1))
        h = _random_tree(rng, n)
        v = np.zeros((n, dims))
        for k in range(n):
            j = k
            while h[j] >= 0:
                v[k, j] = 1.0
                j = h[j]
        heads.append(h)
        feats.append(v)
    x = np.concatenate(feats)
    x = np.concatenate([x, rng.normal(size=(len(x), noise))], 1)
    lengths = np.array([len(h) for h in heads])
    split = TreeSplit(np.arange(len(x)), np.r_[0, np.cumsum(lengths)], heads, [np.ones(len(h), bool) for h in heads])
    return split, x


@pytest.mark.parametrize("kind", ["structural", "depth"])
def test_probe_recovers_exact_trees(kind):
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    tr, xtr = _synthetic_split(rng, 120, 10, 6)
    te, xte = _synthetic_split(rng, 40, 10, 6)
    x_train, x_test = (torch.from_numpy((x @ q).astype(np.float32)) for x in (xtr, xte))
    fit = fit_tree_probe(x_train, tr, TreeSettings(kind, rank=10, max_epochs=300, tol=1e-4, lr=1e-2))
    scores = tree_scores(tree_predictions(x_test, fit.B, te, kind), te, kind)
    main = "uuas" if kind == "structural" else "root_accuracy"
    assert scores[main] == 1.0
    assert scores["spearman"] > 0.9  # ties in gold depths and distances are broken by float noise
    base = baseline_scores(te, kind)
    assert base[main] < 0.8  # random trees are far from the linear chain / left-to-right order


def test_chain_baseline_is_the_chain():
    # a sentence whose tree is the chain 0 <- 1 <- 2 <- 3 (root 3): the chain baseline is perfect for
    # distances, and depth = position ranks it exactly backwards
    heads = [np.array([1, 2, 3, -1])]
    sp = TreeSplit(np.arange(4), np.array([0, 4]), heads, [np.ones(4, bool)])
    assert baseline_scores(sp, "structural")["uuas"] == 1.0
    assert baseline_scores(sp, "depth")["root_accuracy"] == 0.0


def test_cli_structural_on_a_tiny_model(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    args = ["probe", "--task", "structural,depth", "--train", EWT_TRAIN, "--test", EWT_TEST]
    args += ["--model", tiny_llama_dir, "--max-train-sentences", "20", "--max-epochs", "5", "--probe-rank", "8"]
    args += ["--store", tmp_path / "store", "--out", out, "--no-plots"]
    code, so, se = run_cli(args, monkeypatch, capsys)
    assert code == 0, se
    df = pd.read_csv(out / "probes_by_site.csv")
    assert set(df["task"]) == {"structural", "depth"}
    assert len(df) == 2 * 7  # 2L + 1 sites of the 3-layer model, per task
    s = df[df["task"] == "structural"]
    assert s["uuas"].between(0, 1).all() and s["baseline_uuas"].between(0, 1).all()
    d = df[df["task"] == "depth"]
    assert d["root_accuracy"].between(0, 1).all() and d["spearman"].notna().all()
    summary = pd.read_csv(out / "probes_summary.csv")
    assert set(summary["best_metric"]) == {"uuas", "root_accuracy"}
    assert "structural" in so


def test_cli_structural_bad_input(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    jsonl, other = tmp_path / "t.jsonl", tmp_path / "u.jsonl"
    jsonl.write_text('{"text": "a b", "targets": [{"span1": [0, 1], "label": "x"}]}\n')
    other.write_text('{"text": "c d", "targets": [{"span1": [0, 1], "label": "x"}]}\n')
    base = ["probe", "--task", "structural", "--model", tiny_llama_dir, "--out", tmp_path / "o"]
    code, _, se = run_cli([*base, "--train", jsonl, "--test", other], monkeypatch, capsys)
    assert code != 0 and "CoNLL-U" in se and "Traceback" not in se
    code, _, se = run_cli([*base, "--train", EWT_TRAIN, "--test", EWT_TEST, "--probe-rank", "0"], monkeypatch, capsys)
    assert code != 0 and "--probe-rank" in se and "Traceback" not in se
    args = [*base, "--train", EWT_TRAIN, "--test", EWT_TEST, "--pooling", "attn", "--store", tmp_path / "s"]
    code, _, se = run_cli([*args, "--max-train-sentences", "5", "--force"], monkeypatch, capsys)
    assert code != 0 and "pooling" in se and "Traceback" not in se


def test_tree_task_refuses_jiant_in_python():
    from depthscope.probes.corpora.conllu import Corpus, Sentence

    s = Sentence("a b", [], metadata={"targets": []})
    with pytest.raises(InputError, match="CoNLL-U"):
        build_task(Corpus([s]), "depth")


# ----------------------------------------------------------------------------- linear beside MLP
def test_linear_and_mlp_in_one_run(tiny_factory, tmp_path, monkeypatch):
    from matplotlib.colors import to_hex

    from depthscope.analyses.probing import plots
    from depthscope.probes import run_probes

    m = tiny_factory("llama", n_layers=1, d_model=32)
    kw = dict(probe="both", hidden=8, max_epochs=15, l2=0.01, stack_draws=1, min_steps=5, max_train_sentences=20)
    kw.update(store_dir=tmp_path, progress=False)
    res = run_probes(m, "upos", EWT_TRAIN, EWT_TEST, **kw)
    assert sorted(res.by_site["probe"].unique()) == ["linear", "mlp"]
    assert len(res.by_site) == 2 * 3  # 2L + 1 sites per probe
    assert sorted(res.summary["probe"]) == ["linear", "mlp"] and set(res.mixing["probe"]) == {"linear", "mlp"}
    drawn = []
    monkeypatch.setattr(plots, "savefig", lambda fig, path: drawn.append(fig))
    plots.plot_probe_curves(res.by_site, tmp_path / "a.png")
    colors = {to_hex(line.get_color()) for line in drawn[0].axes[0].get_lines()}
    assert plots.PROBE_STYLE["mlp"][0] in colors and plots.PROBE_STYLE["linear"][0] in colors
    plots.plot_tenney(res.summary, res.mixing, tmp_path / "t.png")
    assert len(drawn[1].axes) == 2 * 2  # a row (and its mix-weight twin axis) per probe
    plots.plot_overview(res.summary, tmp_path / "o.png")
    labels = [t.get_text() for t in drawn[2].axes[0].get_yticklabels()]
    assert labels == ["upos (mlp)", "upos"]


def test_tree_tasks_refuse_an_mlp_probe(tiny_factory, tmp_path):
    from depthscope.probes import run_probes
    from depthscope.probes.structural_task import task_probes

    assert task_probes("structural", "both") == ("linear",) and task_probes("upos", "both") == ("linear", "mlp")
    with pytest.raises(InputError, match="linear"):
        run_probes(None, "structural", EWT_TRAIN, EWT_TEST, probe="mlp", store_dir=tmp_path, progress=False)


def test_tree_rows_plot(tmp_path, monkeypatch):
    from depthscope.analyses.probing import plots

    frame = pd.DataFrame({"site": [0, 1, 2], "label": ["embed", "0.attn", "0.mlp"], "layer": [-1, 0, 0]})
    frame["sublayer"], frame["depth"] = ["embed", "attn", "mlp"], [0.0, 0.5, 1.0]
    df = frame.assign(task="structural", uuas=[0.2, 0.5, 0.6], spearman=[0.3, 0.6, 0.7], probe="linear")
    df["baseline_uuas"], df["baseline_spearman"] = 0.4, 0.5
    drawn = []
    monkeypatch.setattr(plots, "savefig", lambda fig, path: drawn.append(fig))
    plots.plot_probe_curves(df, tmp_path / "a.png")
    ax = drawn[0].axes[0]
    assert [tuple(line.get_ydata()) for line in ax.get_lines()][:2] == [(0.2, 0.5, 0.6), (0.4, 0.4)]
    plots.plot_overview(pd.DataFrame({"task": ["structural"], "kind": ["tree"], "n_layers": [1]}), tmp_path / "o.png")
