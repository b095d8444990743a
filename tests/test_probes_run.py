"""The probing suite end to end: extraction into the on-disk store (values, reuse), run_probes
on tiny models and (briefly) on the real default model against an independent scikit-learn
probe on transformers' hidden states, bad input at run level, plots and the CLI."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from depthscope.common.errors import InputError
from depthscope.probes import extract_spans, read_conllu, run_probes
from depthscope.probes.corpora.spans import SpanTable, build_passages, map_spans, tokenize_passages

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
EWT_TRAIN = os.path.join(UD, "ewt_tiny_train.conllu")
EWT_TEST = os.path.join(UD, "ewt_tiny_test.conllu")
GUM_TRAIN = os.path.join(UD, "gum_tiny_train.conllu")
GUM_TEST = os.path.join(UD, "gum_tiny_test.conllu")

FAST = dict(max_epochs=200, progress=False)


def word_table(model, corpus, max_tokens=128):
    passages, where = build_passages(corpus.sentences, "sentence")
    tok = tokenize_passages(model.tokenizer, [p.text for p in passages], max_tokens=max_tokens)
    rows = [(si, w.start, w.end) for si, s in enumerate(corpus.sentences) for w in s.words]
    p, cs, ce = (np.array(v, dtype=np.int64) for v in zip(*rows))
    return tok, map_spans(tok, SpanTable(p, cs, ce))


@pytest.mark.parametrize("pooling", ["last", "first", "mean", "attn"])
def test_store_rows_equal_the_residual_stream(tiny_llama, tmp_path, pooling):
    c = read_conllu(EWT_TEST, max_sentences=6)
    tok, table = word_table(tiny_llama, c)
    store = extract_spans(
        tiny_llama, tok, table, pooling=pooling, store_dir=tmp_path, dtype="float32", batch_tokens=64, progress=False
    )
    assert store.feats.shape[1:] == (tiny_llama.n_sites, tiny_llama.d_model)
    for i in [0, 3, len(table) - 1]:
        p = int(table.passage[i])
        ids = torch.from_numpy(tok.ids[p])[None]
        rs = tiny_llama.residual_stream(ids, return_logits=False).resid[:, 0]  # [S, T, D]
        f, l = int(table.first[i]), int(table.last[i])
        want = {"last": rs[:, l], "first": rs[:, f], "mean": rs[:, f : l + 1].mean(1)}.get(pooling)
        a, n = store.row_start[i], store.n_rows[i]
        got = torch.from_numpy(np.array(store.feats[a : a + n]))
        if pooling == "attn":
            assert n == l - f + 1 and torch.allclose(got.permute(1, 0, 2), rs[:, f : l + 1], atol=1e-5)
        else:
            assert n == 1 and torch.allclose(got[0], want, atol=1e-5)


def test_store_is_reused_and_keyed(tiny_factory, tmp_path):
    m = tiny_factory("llama", n_layers=2, d_model=32)
    c = read_conllu(EWT_TEST, max_sentences=5)
    tok, table = word_table(m, c)
    a = extract_spans(m, tok, table, store_dir=tmp_path, progress=False)
    b = extract_spans(m, tok, table, store_dir=tmp_path, progress=False)
    assert not a.reused and b.reused and a.path == b.path
    assert np.array_equal(np.asarray(a.feats), np.asarray(b.feats))
    c2 = extract_spans(m, tok, table, sites=[0, 2], store_dir=tmp_path, progress=False)
    assert c2.path != a.path and c2.feats.shape[1] == 2
    np.testing.assert_array_equal(np.asarray(c2.feats)[:, 1], np.asarray(a.feats)[:, 2])
    other = tiny_factory("llama", n_layers=2, d_model=32, seed=1)  # same config, other weights
    d = extract_spans(other, tok, table, store_dir=tmp_path, progress=False)
    assert d.path != a.path and not d.reused
    # no temporary folders left behind (the per-key lock files stay: unlinking a lock file races)
    assert len([p for p in tmp_path.iterdir() if p.suffix != ".lock"]) == 3


def test_run_probes_tiny_end_to_end(tiny_llama, tmp_path):
    res = run_probes(tiny_llama, "upos,deprel,feats:Number", EWT_TRAIN, EWT_TEST, store_dir=tmp_path, **FAST)
    S = tiny_llama.n_sites
    bs = res.by_site
    for col in [
        "task",
        "site",
        "label",
        "layer",
        "sublayer",
        "depth",
        "accuracy",
        "macro_f1",
        "control_accuracy",
        "selectivity",
    ]:
        assert col in bs.columns
    assert len(bs) == 3 * S and list(bs["site"][:S]) == list(range(S))
    assert bs["depth"].iloc[:3].tolist() == [0.0, 0.5, 1.0]
    assert ((bs["accuracy"] >= 0) & (bs["accuracy"] <= 1)).all()
    assert np.allclose(bs["selectivity"], bs["accuracy"] - bs["control_accuracy"])
    s = res.summary.set_index("task")
    assert list(res.summary["task"]) == ["upos", "feats:Number", "deprel"]  # pipeline order
    for col in ["expected_layer_delta", "expected_layer_mix", "best_label", "best_accuracy", "n_train", "n_test"]:
        assert col in res.summary.columns
    assert (0 <= s["expected_layer_mix"]).all() and (s["expected_layer_mix"] <= tiny_llama.n_layers).all()
    # trained to convergence, one penalty per task chosen on folds of train (no dev given)
    assert s["converged"].all() and not s["hit_max_epochs"].any() and bs["converged"].all()
    assert (s["epochs_sites"] < 200).all() and (s["solver"] == "subspace").all()
    assert (s["l2_chosen_on"] == "2 folds of train").all()
    assert all(bs[bs.task == t]["l2"].eq(s.loc[t, "l2"]).all() for t in s.index)
    n_words = read_conllu(EWT_TRAIN).n_words
    assert s.loc["upos", "n_train"] == n_words and s.loc["deprel", "n_train"] == n_words
    mix = res.mixing
    assert np.allclose(mix.groupby("task")["mix_weight"].sum(), 1, atol=1e-5)
    # the embedding alone beats the majority class on upos (words carry their tag)
    assert bs[(bs.task == "upos") & (bs.site == 0)]["accuracy"].iloc[0] > s.loc["upos", "majority_accuracy"]
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.probe import write_outputs

    out = Output(tmp_path / "out")
    write_outputs(res, out)  # the probe job's writer (probes/ never writes tables or figures)
    names = {p.name for p in out.written}
    assert {
        "probes_by_site.csv",
        "probes_by_site.parquet",
        "probes_summary.csv",
        "probes_summary.parquet",
        "probes_mixing.csv",
        "probes_accuracy.png",
        "probes_tenney.png",
    } <= names
    back = pd.read_csv(tmp_path / "out" / "probes_by_site.csv")
    assert list(back.columns[:10]) == [
        "task",
        "site",
        "label",
        "layer",
        "sublayer",
        "depth",
        "accuracy",
        "macro_f1",
        "control_accuracy",
        "selectivity",
    ]
    # a re-run reuses the store: no forward pass
    again = run_probes(tiny_llama, "upos", EWT_TRAIN, EWT_TEST, store_dir=tmp_path, **FAST)
    assert all(again.info["stores_reused"].values())


def test_gum_entity_and_coref_with_document_context(tiny_factory, tmp_path):
    m = tiny_factory("gpt2", n_layers=2, d_model=32)
    res = run_probes(
        m, ["entity", "coref"], GUM_TRAIN, GUM_TEST, store_dir=tmp_path, pooling="mean", max_tokens=96, **FAST
    )
    s = res.summary.set_index("task")
    assert s.loc["coref", "context"] == "document" and s.loc["entity", "context"] == "sentence"
    assert s.loc["coref", "n_classes"] == 2 and s.loc["entity", "n_classes"] >= 5
    assert set(res.info["stores"]) == {"train/sentence", "train/document", "test/sentence", "test/document"}


def test_attn_pooling_and_mlp_probe_run(tiny_factory, tmp_path):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    res = run_probes(
        m, "entity", GUM_TRAIN, GUM_TEST, store_dir=tmp_path, pooling="attn", probe="mlp", hidden=16, **FAST
    )
    assert res.summary["pooling"].iloc[0] == "attn" and res.summary["probe"].iloc[0] == "mlp"
    assert res.by_site["accuracy"].notna().all()


def test_bad_input_at_run_level(tiny_factory, tmp_path):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    kw = dict(store_dir=tmp_path, **FAST)
    with pytest.raises(InputError, match=r"feats:Nonexistent.*no examples in train"):
        run_probes(m, "feats:Nonexistent", EWT_TRAIN, EWT_TEST, **kw)
    with pytest.raises(InputError, match="nothing is left to test on"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_probes(m, "upos", EWT_TRAIN, EWT_TRAIN, **kw)
    with pytest.raises(InputError, match="also occur in train"):
        run_probes(m, "upos", EWT_TRAIN, EWT_TRAIN, overlap="error", **kw)
    with pytest.warns(UserWarning, match="also occur in train"):
        res = run_probes(m, "upos", EWT_TRAIN, EWT_TRAIN, overlap="keep", **kw)
    assert res.summary["n_overlap"].iloc[0] == len(read_conllu(EWT_TRAIN))
    with pytest.raises(InputError, match="unknown task"):
        run_probes(m, "sentiment", EWT_TRAIN, EWT_TEST, **kw)
    with pytest.raises(InputError, match="pooling"):
        run_probes(m, "upos", EWT_TRAIN, EWT_TEST, pooling="max", **kw)
    with pytest.raises(InputError, match="dev"):
        run_probes(m, "upos", EWT_TRAIN, EWT_TEST, l2="dev", **kw)


def test_unseen_labels_and_uncovered_spans_are_counted(tiny_factory, tmp_path):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    train = read_conllu(EWT_TRAIN)
    test = read_conllu(EWT_TEST)
    # relabel one test word with a tag train never has
    test.sentences[0].words[0].upos = "NEWTAG"
    # max_tokens 12 truncates long sentences: their later words have no subword
    res = run_probes(m, "upos", train, test, store_dir=tmp_path, max_tokens=12, **FAST)
    s = res.summary.iloc[0]
    assert s["n_test_unseen_labels"] == 1
    n_words_test = test.n_words
    assert s["n_skipped_test"] > 0 and s["n_test"] + s["n_skipped_test"] == n_words_test
    assert s["n_skipped_train"] > 0


def test_sites_subset_and_l2_from_dev(tiny_llama, tmp_path):
    res = run_probes(
        tiny_llama,
        "upos",
        EWT_TRAIN,
        EWT_TEST,
        dev=EWT_TEST,
        sites=["embed", "1.attn", "2.mlp"],
        l2="dev",
        store_dir=tmp_path,
        overlap="keep",
        mdl=True,
        **FAST,
    )
    assert res.by_site["label"].tolist() == ["embed", "1.attn", "2.mlp"]
    bs = res.by_site
    assert (bs["mdl_uniform_bits"] == bs["n_train"] * np.log2(res.summary["n_classes"].iloc[0])).all()
    assert np.allclose(bs["mdl_compression"], bs["mdl_uniform_bits"] / bs["mdl_online_bits"])
    assert (bs["mdl_compression"] > 1).all()  # the embedding of a random model still names the word
    from depthscope.probes import L2_GRID, L2_LADDER

    assert res.by_site["l2"].nunique() == 1 and res.by_site["l2"].iloc[0] in L2_LADDER  # one penalty per task
    s = res.summary.iloc[0]
    assert s["l2_chosen_on"] == "dev" and s["l2"] == res.by_site["l2"].iloc[0]
    acc = dict(kv.split(": ") for kv in s["l2_heldout_accuracy"].split("; "))
    assert {f"{v:g}" for v in L2_GRID} <= set(acc) and float(acc[f"{s['l2']:g}"]) == max(map(float, acc.values()))
    assert res.by_site["depth"].tolist() == [0.0, 1.5, 3.0]


def test_cli_probe(tiny_factory, tiny_tokenizer, tmp_path):
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["probe", "--help"])
    assert r.exit_code == 0 and "--task" in r.output and "--max-train-sentences" in r.output
    m = tiny_factory("llama", n_layers=1, d_model=32)
    folder = tmp_path / "tiny"
    m.hf_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    r = runner.invoke(
        app,
        [
            "probe",
            "--task",
            "upos,deprel",
            "--train",
            EWT_TRAIN,
            "--test",
            EWT_TEST,
            "--model",
            str(folder),
            "--max-train-sentences",
            "20",
            "--max-epochs",
            "5",
            "--stack-draws",
            "3",
            "--stack-folds",
            "3",
            "--stack-l2",
            "0.1",
            "--store",
            str(tmp_path / "st"),
            "--no-plots",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    by_site = pd.read_csv(out / "probes_by_site.csv")
    summ = pd.read_parquet(out / "probes_summary.parquet")
    assert set(by_site["task"]) == {"upos", "deprel"} and len(by_site) == 2 * 3
    assert summ["n_train"].iloc[0] == read_conllu(EWT_TRAIN, max_sentences=20).n_words
    assert (summ["stack_draws"] == 3).all() and (summ["stack_folds"] == 3).all()  # they reach the cumulative probes
    assert (summ["stack_l2"] == 0.1).all()
    r = runner.invoke(
        app,
        [
            "probe",
            "--task",
            "upos",
            "--train",
            str(tmp_path / "missing.conllu"),
            "--test",
            EWT_TEST,
            "--model",
            str(folder),
            "--out",
            str(out),
        ],
    )
    assert r.exit_code != 0


@pytest.mark.slow
def test_real_model_agrees_with_sklearn_on_hf_hidden_states(default_model, tmp_path):
    """upos on the fixture at block outputs: depthscope's per-site accuracy vs an independent
    pipeline (transformers output_hidden_states, own word -> last-subword map, sklearn)."""
    from sklearn.linear_model import LogisticRegression

    m = default_model
    sites = ["3.mlp", "9.mlp"]
    res = run_probes(m, "upos", EWT_TRAIN, EWT_TEST, sites=sites, store_dir=tmp_path, progress=False, l2=1e-3)
    ours = dict(zip(res.by_site["label"], res.by_site["accuracy"]))

    def hf_features(path, layers):
        corpus = read_conllu(path)
        tok = m.tokenizer
        tok.padding_side = "right"
        enc = tok([s.text for s in corpus], return_offsets_mapping=True, return_tensors="pt", padding=True)
        with torch.no_grad():  # the decoder body only (no LM head), right padding, one batch
            hs = m.hf_model.model(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True
            ).hidden_states
        xs, ys = {l: [] for l in layers}, []
        for b, s in enumerate(corpus):
            real = enc["attention_mask"][b].bool().numpy()
            starts = enc["offset_mapping"][b, :, 0].numpy()
            ends = enc["offset_mapping"][b, :, 1].numpy()
            for w in s.words:
                last = max(i for i in range(len(ends)) if real[i] and starts[i] < w.end and ends[i] > w.start)
                for l in layers:
                    xs[l].append(hs[l + 1][b, last].numpy())
                ys.append(w.upos)
        return {l: np.stack(v) for l, v in xs.items()}, np.array(ys)

    side = m.tokenizer.padding_side
    try:
        xtr, ytr = hf_features(EWT_TRAIN, [3, 9])
        xte, yte = hf_features(EWT_TEST, [3, 9])
    finally:
        m.tokenizer.padding_side = side
    for layer in (3, 9):
        mu, sd = xtr[layer].mean(0), xtr[layer].std(0) + 1e-6
        clf = LogisticRegression(C=1 / (2e-3 * len(ytr)), max_iter=300)
        clf.fit((xtr[layer] - mu) / sd, ytr)
        ref = (clf.predict((xte[layer] - mu) / sd) == yte).mean()
        assert abs(ours[f"{layer}.mlp"] - ref) < 0.04, (layer, ours, ref)
        assert ref > 0.6


def test_cap_beyond_convergence_changes_nothing(tiny_llama, tmp_path):
    """Probes stop at convergence, not at the cap: once every fit has converged, doubling
    max_epochs gives the same tables (the fits are deterministic). This is why the GUM runs
    report no cap shift where every probe converged."""
    out = [
        run_probes(tiny_llama, "upos", EWT_TRAIN, EWT_TEST, store_dir=tmp_path, progress=False, max_epochs=cap)
        for cap in (300, 600)
    ]
    assert out[0].summary["converged"].all() and not out[0].summary["hit_max_epochs"].any()
    pd.testing.assert_frame_equal(out[0].by_site, out[1].by_site)
    cols = ["expected_layer_delta", "expected_layer_mix", "l2", "epochs_sites", "epochs_cumulative", "epochs_mix"]
    pd.testing.assert_frame_equal(out[0].summary[cols], out[1].summary[cols])
