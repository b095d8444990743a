"""The weight digests that key stores and resumed stages take a streamed model's identity without
a read of its blocks (:func:`~depthscope.hooks.stream_identity.store_digest`): the probes'
activation store (one and sharded), ``depthscope run``'s resumed stages, the transcoders' stages,
a tuned lens's record of its model, a sweep's record of each checkpoint.
Each reads no block weight, and a fine-tune saved over the checkpoint (same names, shapes and
offsets) changes it; a model in memory keeps its full digest there."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import safetensors

from depthscope.analyses.features.config import TranscoderTrainConfig
from depthscope.analyses.jobs import transcoders
from depthscope.analyses.jobs.base import Output
from depthscope.analyses.lens.lenses import LensMismatchError, TunedLens
from depthscope.analyses.report.main_job import _Stages
from depthscope.analyses.sweeps import series
from depthscope.common.digest import model_digest
from depthscope.common.resume import Stages
from depthscope.hooks import load_model
from depthscope.hooks.stream_identity import ALGORITHM as STREAMED
from depthscope.hooks.stream_identity import store_digest
from depthscope.probes.corpora.spans import SpanTable, map_spans, tokenize_passages
from depthscope.probes.store.activations import extract_spans
from depthscope.probes.store.shards import _shard_keys, slice_spans
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
N_LAYERS = 3
TEXTS = ["The cat sat on the mat.", "A second document about dogs and logs.", "Short one here."]


@pytest.fixture
def folder(tmp_path, tiny_tokenizer):
    d = tmp_path / "ckpt"
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=N_LAYERS, seed=3).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _fine_tune(folder, tiny_tokenizer) -> None:
    """Other weights saved over the checkpoint, with the same names, dtypes, shapes and offsets."""
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=N_LAYERS, seed=4).save_pretrained(folder)


def _no_read(model, monkeypatch, fn):
    """``fn()``, asserting that it opens no tensor file and reads no block of ``model``."""
    opened, real = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a) or real(*a, **k))
    before = list(model.streamer.reads_by_block)
    out = fn()
    assert opened == [] and model.streamer.reads_by_block == before
    monkeypatch.setattr(safetensors, "safe_open", real)
    return out


def _spans(model):
    tok = tokenize_passages(model.tokenizer, TEXTS, max_tokens=32)
    p, cs, ce = [], [], []
    for i, t in enumerate(TEXTS):
        for m in re.finditer(r"\w+", t):
            p.append(i), cs.append(m.start()), ce.append(m.end())
    return tok, map_spans(tok, SpanTable(np.array(p), np.array(cs), np.array(ce)))


def test_the_probe_store_is_keyed_and_reused_without_a_block_read(folder, tmp_path, tiny_tokenizer, monkeypatch):
    st = load_model(folder, stream=True)
    tok, table = _spans(st)
    kw = {"sites": [0, 2], "pooling": "mean", "dtype": "float32"}
    run = {"store_dir": tmp_path / "s", "progress": False, **kw}
    first = extract_spans(st, tok, table, **run)
    assert not first.reused
    again = _no_read(st, monkeypatch, lambda: extract_spans(st, tok, table, **run))
    assert again.reused and again.path == first.path  # found by its key, which read no block
    slices = [slice_spans(tok, table, 0, 4), slice_spans(tok, table, 4, len(table))]
    keys = _no_read(st, monkeypatch, lambda: _shard_keys(st, slices, kw))
    mem = load_model(folder)
    assert _shard_keys(mem, slices, kw) != keys  # in memory: the full digest, as before
    _fine_tune(folder, tiny_tokenizer)
    new = load_model(folder, stream=True)
    assert not set(_shard_keys(new, slices, kw)) & set(keys)
    assert not extract_spans(new, tok, table, **run).reused


def test_the_report_stages_key_a_streamed_model_without_a_block_read(folder, tmp_path, tiny_tokenizer, monkeypatch):
    st = load_model(folder, stream=True)
    key = _no_read(st, monkeypatch, lambda: _Stages(Stages(tmp_path), st, Output(tmp_path), print).model)
    assert key[0] == store_digest(st)
    mem = load_model(folder)
    assert _Stages(Stages(tmp_path), mem, Output(tmp_path), print).model[0] == model_digest(mem)
    _fine_tune(folder, tiny_tokenizer)
    assert _Stages(Stages(tmp_path), load_model(folder, stream=True), Output(tmp_path), print).model != key


class _Keyed(Exception):
    """Raised by the patched stage_key: the job's key, taken before any training."""


def _transcoder_key(model, tmp_path, monkeypatch) -> dict:
    """The model part of the transcoders' stage keys, training nothing."""
    monkeypatch.setattr(transcoders, "split_rows", lambda *a: ((), ()))
    monkeypatch.setattr(transcoders, "_tokens_digest", lambda *a: "tokens")

    def stage_key(**kw):
        raise _Keyed(kw["model"])

    monkeypatch.setattr(transcoders, "stage_key", stage_key)
    with pytest.raises(_Keyed) as got:
        transcoders.transcoders_train_job(model, TEXTS, TranscoderTrainConfig(), Output(tmp_path / "tc"))
    return got.value.args[0]


def test_the_transcoder_stages_key_a_streamed_model_without_a_block_read(folder, tmp_path, tiny_tokenizer, monkeypatch):
    st = load_model(folder, stream=True)
    key = _no_read(st, monkeypatch, lambda: _transcoder_key(st, tmp_path, monkeypatch))
    assert key == store_digest(st)
    mem = load_model(folder)
    assert _transcoder_key(mem, tmp_path, monkeypatch) == model_digest(mem)
    _fine_tune(folder, tiny_tokenizer)
    assert _transcoder_key(load_model(folder, stream=True), tmp_path, monkeypatch) != key


def test_a_tuned_lens_of_a_streamed_model_is_recorded_and_checked_without_a_block_read(
    folder, tiny_tokenizer, monkeypatch
):
    st = load_model(folder, stream=True)
    lens = _no_read(st, monkeypatch, lambda: TunedLens.identity(st))
    assert lens.model_info["digest"] == store_digest(st) and lens.model_info["digest_algorithm"] == STREAMED
    _no_read(st, monkeypatch, lambda: lens.check(st))
    mem = load_model(folder)
    of_mem = TunedLens.identity(mem)
    assert of_mem.model_info["digest"] == model_digest(mem)  # in memory: the full digest, as before
    of_mem.check(st)  # a lens of the model in memory still fits it streamed (its weights read in full)
    with pytest.raises(LensMismatchError, match="stream=True"):
        lens.check(mem)  # the files' identity cannot be compared with a model in memory
    lens.check(mem, strict=False)
    _fine_tune(folder, tiny_tokenizer)
    new = load_model(folder, stream=True)
    for old in (lens, of_mem):
        with pytest.raises(LensMismatchError, match="weights: lens digest"):
            old.check(new)


def test_a_sweep_records_a_streamed_checkpoint_without_a_block_read(folder, tmp_path, tiny_tokenizer, monkeypatch):
    ck_dir = tmp_path / "sweep" / "checkpoints"
    ck_dir.mkdir(parents=True)
    models = {"a": load_model(folder, stream=True), "b": load_model(folder, stream=True), "c": load_model(folder)}

    def run(name):
        done = series._run_checkpoint(
            series.Checkpoint(name, name, None),
            fn=lambda model: {"t": pd.DataFrame({"x": [1.0]})},
            ck_dir=ck_dir,
            load=models.get,
            kwargs={},
            reference=None,
            allow_mixed=False,
        )
        assert done["status"] == "done", done
        return json.loads((ck_dir / f"{name}.done.json").read_text())

    a = _no_read(models["a"], monkeypatch, lambda: run("a"))
    assert a["digest"] == store_digest(models["a"]) and a["digest_algorithm"] == STREAMED
    assert run("b")["digest"] == a["digest"]  # the same files
    assert run("c")["digest"] == model_digest(models["c"])  # in memory: every weight, as before
    _fine_tune(folder, tiny_tokenizer)
    models["d"] = load_model(folder, stream=True)
    assert run("d")["digest"] != a["digest"]
    dup = series.combine(tmp_path / "sweep", order=["a", "b", "c", "d"])["t"]["duplicate_of"].tolist()
    assert dup == [None, "a", None, None]  # the same files; never the model in memory, nor the fine-tune
