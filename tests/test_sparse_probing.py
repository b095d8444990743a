"""Sparse probing (``depthscope.analyses.features.probing``): its dense probe is ``run_probes``'s
per-site probe (the same rows at the same sites, data and words), the k-feature probes rank a
planted feature first, bad input is refused before anything is extracted, and the feature lens
reads a decoder direction as the model's own final norm and unembedding do."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from depthscope.analyses.features.probing import _site, _site_rows, feature_lens, sparse_probing
from depthscope.common.errors import InputError
from depthscope.hooks.sae import SAE
from depthscope.probes import run_probes, sample_data

#: the settings both entry points run with (a small sample: the numbers only have to agree)
SETTINGS = dict(max_train_sentences=120, max_test_sentences=60, max_epochs=200, progress=False)


def _sae(d: int, d_sae: int = 96, seed: int = 0, **kw) -> SAE:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d_sae, generator=g)
    return SAE(W, torch.zeros(d_sae), torch.randn(d_sae, d, generator=g), torch.zeros(d), **kw)


def _words(x: np.ndarray) -> SimpleNamespace:
    """Examples' stream vectors ``x [n, d]`` as the probes' features read them: one store row
    per example at one site."""
    store = SimpleNamespace(feats=x[:, None, :], row_start=np.arange(len(x)), release=lambda: None)
    return SimpleNamespace(store=store, span_ids=np.arange(len(x))[:, None])


def test_planted_feature_is_ranked_first_and_separates_its_tag():
    """An SAE whose codes are relu(x) (identity weights); dimension 3 is on exactly for tag 0, so
    it is tag 0's best single feature and one feature separates the two tags perfectly."""
    rng = np.random.default_rng(0)
    y = np.array([0, 1] * 200)
    x = rng.normal(size=(400, 8)).astype(np.float32) * 0.1
    x[:, 3] = np.where(y == 0, 2.0, -1.0)
    eye = torch.eye(8)
    sae = SAE(eye, torch.zeros(8), eye, torch.zeros(8), apply_b_dec_to_input=False)
    td = SimpleNamespace(
        y={"train": y[:300], "test": y[300:]}, feats={"train": _words(x[:300]), "test": _words(x[300:])}
    )
    site = _site(sae, td, 0, [0, 1], 2, y[300:], 1.0)
    by_k, by_tag = _site_rows(site, (1, 2), ["A", "B"])
    assert by_k[0]["accuracy"] == 1.0 and by_k[0]["converged"]
    a1 = next(r for r in by_tag if r["tag"] == "A" and r["k"] == 1)
    assert a1["feature"] == 3 and a1["f1"] == 1.0


def test_dense_probe_is_run_probes_at_the_same_sites(tiny_llama, tmp_path):
    """The issue's test: at the same sites, data and settings, sparse probing's dense rows are
    ``run_probes``'s ``by_site`` rows (accuracy, macro-F1, control, penalty, the words counted),
    and its k-feature probes are scored on those same words."""
    data = sample_data()
    sites = ["0.mlp", "1.mlp"]
    args = (data["ewt_train"], data["ewt_test"])
    ref = run_probes(tiny_llama, "upos", *args, sites=sites, store_dir=tmp_path, **SETTINGS)
    saes = {s: _sae(tiny_llama.d_model, seed=i) for i, s in enumerate(sites)}
    got = sparse_probing(tiny_llama, saes, *args, ks=(1, 4), store_dir=tmp_path, min_count=5, **SETTINGS)
    cols = ["label", "accuracy", "macro_f1", "control_accuracy", "l2", "n_train", "n_test", "majority_accuracy"]
    by_site = ref.by_site.sort_values("site").reset_index(drop=True)
    assert got.dense[cols].to_dict("records") == by_site[cols].to_dict("records")
    for label, acc in zip(by_site["label"], by_site["accuracy"]):
        assert (got.by_k.loc[got.by_k["label"] == label, "dense_accuracy"] == acc).all()
    summary = ref.summary.iloc[0]
    assert (got.by_k["n_train"] == summary["n_train"]).all() and (got.by_k["n_test"] == summary["n_test"]).all()
    assert (got.by_k["majority"] == summary["majority_accuracy"]).all()
    assert (got.by_k["l2"] == summary["l2"]).all()
    assert sorted(got.by_k["label"].unique()) == sites
    assert (got.by_k.groupby("label")["n_features"].diff().dropna() >= 0).all()
    assert got.by_k["accuracy"].between(0, 1).all() and got.by_k["converged"].all()
    assert set(got.by_tag.query("k == 1")["feature"]) <= set(range(96))


def test_bad_input_is_refused_before_extraction(tiny_llama):
    data = sample_data()
    d = tiny_llama.d_model
    args = (data["ewt_train"], data["ewt_test"])
    with pytest.raises(InputError, match="two spans or whole trees"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, task="deprel")
    with pytest.raises(InputError, match="transcoder"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d, architecture="transcoder")}, *args)
    with pytest.raises(InputError, match="trained at 'blocks.0.hook_resid_post'"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d, hook_name="blocks.0.hook_resid_post")}, *args)
    with pytest.raises(InputError, match="ks must be integers"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, ks=(0, 2))
    with pytest.raises(InputError, match="ks must be integers"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d, d_sae=8)}, *args, ks=(16,))
    with pytest.raises(InputError, match="one kind"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, probe="both")
    with pytest.raises(InputError, match="pooling"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, pooling="attn")
    with pytest.raises(InputError, match="keys of saes"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, sites=["1.mlp"])
    with pytest.raises(InputError, match="min_count"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, min_count=0)
    with pytest.raises(InputError, match="unknown probe setting"):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, nonsense=1)
    with pytest.raises(InputError, match="pass dev="):
        sparse_probing(tiny_llama, {"1.mlp": _sae(d)}, *args, l2="dev")
    with pytest.raises(InputError, match="at least one SAE"):
        sparse_probing(tiny_llama, {}, *args)


def test_feature_lens_reads_decoder_directions_as_the_model_decodes(tiny_llama):
    sae = _sae(tiny_llama.d_model, d_sae=128)
    lens = feature_lens(tiny_llama, sae, [5, 7], top=3)
    hf = tiny_llama.hf_model
    with torch.no_grad():
        ref = hf.lm_head(hf.model.norm(sae.W_dec[[5, 7]]))
    assert lens[lens.feature == 7].token_id.tolist() == ref[1].topk(3).indices.tolist()
    with pytest.raises(InputError, match="out of range"):
        feature_lens(tiny_llama, sae, [128])
