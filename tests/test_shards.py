"""Sharded activation stores: the same rows as one store (every pooling), finished shards skipped
on a re-run, shards written by Ray tasks equal to shards written here."""

from __future__ import annotations

import functools
import importlib.util
import re

import numpy as np
import pytest
from conftest import make_tiny

from depthscope.hooks import load_model
from depthscope.probes.corpora.spans import SpanTable, map_spans, tokenize_passages
from depthscope.probes.store.activations import extract_spans
from depthscope.probes.store.shards import ShardedFeats, extract_sharded

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [
    "The cat sat on the mat.",
    "A bird flew over the house and sang in the morning.",
    "Researchers measured how the stream grows.",
    "She said that the committee would publish its findings.",
    "In 1889 the tower was completed.",
] * 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny("llama", vocab_size=len(tiny_tokenizer)).save_pretrained(d, safe_serialization=True)
    tiny_tokenizer.save_pretrained(d)
    return d


def spans_of(model):
    """Every word of TEXTS as a span."""
    tok = tokenize_passages(model.tokenizer, TEXTS, max_tokens=64)
    p, cs, ce = [], [], []
    for i, t in enumerate(TEXTS):
        for m in re.finditer(r"\w+", t):
            p.append(i), cs.append(m.start()), ce.append(m.end())
    return tok, map_spans(tok, SpanTable(np.array(p), np.array(cs), np.array(ce)))


@pytest.mark.parametrize("pooling", ["last", "mean", "attn"])
def test_sharded_store_equals_one_store_and_resumes(folder, tmp_path, pooling, monkeypatch):
    model = load_model(folder)
    tok, table = spans_of(model)
    one = extract_spans(model, tok, table, pooling=pooling, store_dir=tmp_path / "one", progress=False, dtype="float32")
    sh = extract_sharded(model, tok, table, n_shards=3, store_dir=tmp_path / "sh", pooling=pooling, dtype="float32")
    assert isinstance(sh.feats, ShardedFeats) and len(sh.meta["shards"]) == 3 and not sh.reused
    ids = np.arange(len(table))
    np.testing.assert_array_equal(sh.n_rows, one.n_rows)
    for max_len in (1, 16):
        x1, m1 = one.gather(ids, max_len)
        x2, m2 = sh.gather(ids, max_len)
        assert (m1 == m2).all()
        np.testing.assert_allclose(x2.numpy(), x1.numpy(), rtol=1e-5, atol=1e-6)  # batches differ: rounding only
    # a re-run finds every shard and runs no forward pass; a lost shard alone is redone
    calls = []
    monkeypatch.setattr(model, "residual_stream", lambda *a, **k: calls.append(1) or 1 / 0)
    again = extract_sharded(model, tok, table, n_shards=3, store_dir=tmp_path / "sh", pooling=pooling, dtype="float32")
    assert again.reused and not calls
    import shutil

    shutil.rmtree(tmp_path / "sh" / again.meta["shards"][1]["key"])
    monkeypatch.undo()
    redone = extract_sharded(model, tok, table, n_shards=3, store_dir=tmp_path / "sh", pooling=pooling, dtype="float32")
    assert not redone.reused
    np.testing.assert_array_equal(redone.gather(ids)[0].numpy(), sh.gather(ids)[0].numpy())


def test_sharded_feats_indexing():
    parts = [np.arange(i, i + 2 * n * 3, dtype=np.float32).reshape(n, 2, 3) for i, n in ((0, 4), (100, 1), (200, 3))]
    whole = np.concatenate(parts)
    f = ShardedFeats(parts)
    assert f.shape == whole.shape and len(f) == 8
    idx = np.array([[7, 0], [4, 5]])
    np.testing.assert_array_equal(f[idx], whole[idx])
    np.testing.assert_array_equal(np.asarray(f), whole)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_shards_written_by_ray_tasks(folder, tmp_path):
    from depthscope.analyses.sweeps.ray_engine import RayEngine

    model = load_model(folder)
    tok, table = spans_of(model)
    here = extract_sharded(model, tok, table, n_shards=4, store_dir=tmp_path / "a", dtype="float32")
    load = functools.partial(load_model, str(folder))
    ray = extract_sharded(
        model, tok, table, n_shards=4, store_dir=tmp_path / "b", dtype="float32", engine=RayEngine(workers=2), load=load
    )
    assert [s["key"] for s in ray.meta["shards"]] == [s["key"] for s in here.meta["shards"]]
    ids = np.arange(len(table))
    np.testing.assert_array_equal(ray.gather(ids)[0].numpy(), here.gather(ids)[0].numpy())


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_probes_on_a_sharded_store(folder, tmp_path, engine):
    """run_probes with shards=3 (here or on Ray): the probe table of the unsharded store."""
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed")
    from depthscope.probes import run_probes, sample_data

    s = sample_data()
    kw = dict(progress=False, max_train_sentences=40, max_test_sentences=20, max_epochs=5, store_dtype="float32")
    one = run_probes(str(folder), ["upos"], s["ewt_train"], s["ewt_test"], store_dir=str(tmp_path / "a"), **kw)
    sh = run_probes(str(folder), ["upos"], s["ewt_train"], s["ewt_test"], store_dir=str(tmp_path / "b"), shards=3,
                    engine=engine, workers=2, **kw)  # fmt: skip
    assert len(list((tmp_path / "b").glob("*.manifest.json"))) == 2  # train and test, 3 shards each
    np.testing.assert_allclose(sh.by_site["accuracy"], one.by_site["accuracy"], atol=0.02)
