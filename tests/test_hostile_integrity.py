"""Nothing corrupted or mistaken for another model's is reused.

Activation stores carry the sha256 of their files (recorded while writing) and of their own
``meta.json``; a zeroed or random ``feats.bin``, bad row offsets or a bad shape are named in a
warning and extracted again, never read (features equal those of a fresh extraction). Which
layer checks content: :func:`~depthscope.common.stamps.file_digest` hashes each store file on its
first open in a process and again whenever the file's version (inode, size, mtime, ctime)
changes, so a rewrite with size and mtime restored is caught in the same process. The store key
and a sweep's ``duplicate_of`` use a digest of every weight: two models that agree on any
2048-value sample but differ elsewhere get different keys and are not duplicates; identical
weights share a key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny

from depthscope.common import digest, stamps
from depthscope.probes.corpora.spans import SpanTable, map_spans, tokenize_passages
from depthscope.probes.store.activations import extract_spans
from depthscope.probes.store.features import Features
from depthscope.probes.store.shards import extract_sharded

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [
    "The cat sat on the mat.",
    "A bird flew over the house and sang in the morning.",
    "Researchers measured how the stream grows.",
    "In 1889 the tower was completed.",
]


def spans_of(model):
    """Every word of TEXTS as a span: ``(tokenized, table)``."""
    tok = tokenize_passages(model.tokenizer, TEXTS, max_tokens=64)
    p, cs, ce = [], [], []
    for i, t in enumerate(TEXTS):
        for m in re.finditer(r"\w+", t):
            p.append(i), cs.append(m.start()), ce.append(m.end())
    return tok, map_spans(tok, SpanTable(np.array(p), np.array(cs), np.array(ce)))


def extract(model, store_dir, **kw):
    tok, table = spans_of(model)
    return extract_spans(model, tok, table, store_dir=store_dir, progress=False, dtype="float32", **kw)


def resident(store) -> torch.Tensor:
    """The store's standardised features as the probes hold them (every span, one per example)."""
    ids = np.nonzero(~store.skipped)[0][:, None]
    f = Features(store, ids).fit_standardiser()
    assert f.make_resident(seed=0)
    return f.resident.float().clone()


def rewrite_keeping_times(path, data: bytes) -> None:
    """Replace the bytes of ``path`` in place (same inode, same size) and restore its atime and
    mtime: only the ctime shows the write."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def _zeroed(store):
    f = store.path / "feats.bin"
    rewrite_keeping_times(f, bytes(f.stat().st_size))
    return f


def _random(store):
    f = store.path / "feats.bin"
    rewrite_keeping_times(f, np.random.default_rng(0).bytes(f.stat().st_size))
    return f


def _offsets(store):
    f = store.path / "rows.npy"
    rows = np.load(f)
    rows[len(rows) // 2, 0] = 10**9  # a span's rows far past the end of the store
    np.save(f, rows)
    return f


def _shape(store):
    f = store.path / "meta.json"
    meta = json.loads(f.read_text())
    meta["shape"][0] *= 2  # more rows than the file holds
    f.write_text(json.dumps(meta))
    return f


def _shape_resealed(store):
    """A shape edit with meta.json's own checksum recomputed: the file sizes still disagree."""
    from depthscope.probes.store.activations import _meta_digest

    f = store.path / "meta.json"
    meta = json.loads(f.read_text())
    meta["shape"][0] += 1
    meta["meta_sha256"] = _meta_digest(meta)
    f.write_text(json.dumps(meta))
    return store.path / "feats.bin"


CORRUPTIONS = {"zeroed": _zeroed, "random": _random, "offsets": _offsets, "shape": _shape, "resealed": _shape_resealed}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupted_store_is_named_and_extracted_again(tiny_factory, tmp_path, caplog, kind):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    fresh = extract(m, tmp_path / "fresh")
    first = extract(m, tmp_path / "store")
    assert not first.reused and extract(m, tmp_path / "store").reused  # intact: reused as is
    bad_file = CORRUPTIONS[kind](first)
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        again = extract(m, tmp_path / "store")
    assert not again.reused
    assert str(bad_file) in caplog.text and "extracting it again" in caplog.text
    torch.testing.assert_close(resident(again), resident(fresh), rtol=0, atol=0)
    ids = np.arange(len(fresh.n_rows))
    np.testing.assert_array_equal(again.gather(ids)[0].numpy(), fresh.gather(ids)[0].numpy())
    assert extract(m, tmp_path / "store").reused  # the rebuilt store is intact


def test_a_corrupted_shard_is_extracted_again(tiny_factory, tmp_path, caplog):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    tok, table = spans_of(m)
    kw = dict(n_shards=3, store_dir=tmp_path / "sh", dtype="float32")
    ref = extract_sharded(m, tok, table, **kw)
    ids = np.arange(len(table))
    want = ref.gather(ids)[0].numpy().copy()
    shard = tmp_path / "sh" / ref.meta["shards"][1]["key"] / "feats.bin"
    rewrite_keeping_times(shard, bytes(shard.stat().st_size))
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        again = extract_sharded(m, tok, table, **kw)
    assert not again.reused and str(shard) in caplog.text
    np.testing.assert_array_equal(again.gather(ids)[0].numpy(), want)


def test_a_rewrite_with_size_and_mtime_restored_is_caught_in_the_same_process(tiny_factory, tmp_path, monkeypatch):
    """Even once this process remembers the store's digest (its files settled), a same-size,
    same-mtime rewrite of feats.bin is hashed again and refused."""
    m = tiny_factory("llama", n_layers=1, d_model=32)
    want = resident(extract(m, tmp_path / "fresh"))
    store = extract(m, tmp_path / "store")
    time.sleep(0.05)  # past the file system's timestamp tick: the rewrite gets a later ctime
    monkeypatch.setattr(stamps, "_now", lambda: time.time_ns() + 10 * stamps.SETTLED_NS)  # files count as settled
    hashed = []
    real = stamps.file_sha256
    monkeypatch.setattr(stamps, "file_sha256", lambda p, *a: hashed.append(p.name) or real(p, *a))
    assert extract(m, tmp_path / "store").reused and "feats.bin" in hashed  # hashed once, remembered
    hashed.clear()
    assert extract(m, tmp_path / "store").reused and hashed == []  # unchanged version: not read again
    _zeroed(store)
    again = extract(m, tmp_path / "store")
    assert not again.reused and "feats.bin" in hashed
    torch.testing.assert_close(resident(again), want, rtol=0, atol=0)


def test_file_digest_is_remembered_per_version_of_the_file(tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    time.sleep(0.05)
    hashed = []
    real = stamps.file_sha256
    monkeypatch.setattr(stamps, "file_sha256", lambda p, *a: hashed.append(1) or real(p, *a))
    assert stamps.file_digest(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert stamps.file_digest(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert len(hashed) == 2  # a file changed within SETTLED_NS of the read is never remembered
    monkeypatch.setattr(stamps, "_now", lambda: time.time_ns() + 10 * stamps.SETTLED_NS)
    stamps.file_digest(f)
    stamps.file_digest(f)
    assert len(hashed) == 3  # settled: remembered, the second call reads nothing
    rewrite_keeping_times(f, b"b" * 4096)
    assert stamps.file_digest(f) == hashlib.sha256(b"b" * 4096).hexdigest() and len(hashed) == 4
    copy = tmp_path / "copy.bin"
    copy.write_bytes(b"c" * 4096)
    os.utime(copy, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))  # a copy with the same metadata
    assert stamps.file_digest(copy) == hashlib.sha256(b"c" * 4096).hexdigest()


def sampled_digest(model) -> str:
    """The former store key's weight digest, written out: 2048 strided values per tensor."""
    h = hashlib.sha256(json.dumps(model.fingerprint(), sort_keys=True, default=str).encode())
    for name, t in model.hf_model.named_parameters():
        flat = t.detach().reshape(-1)
        h.update(name.encode() + str(tuple(t.shape)).encode())
        h.update(flat[:: max(1, flat.numel() // 2048)].float().numpy().tobytes())
    return h.hexdigest()[:16]


def edit_outside_the_sample(model) -> None:
    """Change one embedding value of a token the texts use, at a position no 2048-value stride
    of the embedding samples (the embedding is tied: the unembedding changes with it)."""
    emb = model.hf_model.get_input_embeddings().weight
    step = emb.numel() // 2048
    assert step >= 2  # the tensor is larger than the sample
    row = int(spans_of(model)[0].ids[0][1])
    col = next(c for c in range(emb.shape[1]) if (row * emb.shape[1] + c) % step)
    with torch.no_grad():
        emb[row, col] += 0.5


def test_store_key_sees_every_weight(tiny_factory, tmp_path):
    a, same, b = (tiny_factory("llama", n_layers=1, d_model=32, seed=0) for _ in range(3))
    edit_outside_the_sample(b)
    assert sampled_digest(a) == sampled_digest(b)  # a sample cannot tell them apart
    assert digest.model_digest(a) == digest.model_digest(same) != digest.model_digest(b)
    sa = extract(a, tmp_path / "s")
    assert extract(same, tmp_path / "s").reused  # identical weights: the same key
    sb = extract(b, tmp_path / "s")
    assert not sb.reused and sb.path != sa.path
    ids = np.arange(len(sa.n_rows))
    assert not np.array_equal(sb.gather(ids)[0].numpy(), sa.gather(ids)[0].numpy())
    ref = extract(b, tmp_path / "fresh")
    np.testing.assert_array_equal(sb.gather(ids)[0].numpy(), ref.gather(ids)[0].numpy())


def test_weight_digest_covers_every_parameter_and_its_dtype(tiny_factory):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    seen = {digest.model_digest(m)}
    for _, p in m.hf_model.named_parameters():
        with torch.no_grad():
            p.view(-1)[-1] += 1.0  # the last value of each tensor in turn
        seen.add(digest.model_digest(m))
    assert len(seen) == 1 + len(list(m.hf_model.parameters()))
    before = digest.model_digest(m)
    m.hf_model.to(torch.float64)
    assert digest.model_digest(m) != before


def one_row(model):
    rs = model.residual_stream(TEXTS[:1])
    df = rs.site_frame()
    df["norm"] = rs.resid[:, 0, 0].norm(dim=-1).numpy()
    return {"by_site": df}


def test_sweep_duplicates_need_identical_weights(tiny_tokenizer, tmp_path):
    from depthscope.analyses.sweeps.series import Checkpoint, combine, sweep
    from depthscope.hooks import load_model

    def save(name, edit=False):
        hf = make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=1, d_model=32, seed=0)
        if edit:
            edit_outside_the_sample(load_model(hf, tokenizer=tiny_tokenizer))
        hf.save_pretrained(tmp_path / name, safe_serialization=True)
        tiny_tokenizer.save_pretrained(tmp_path / name)
        return Checkpoint(name, str(tmp_path / name), int(name[4:]))

    cks = [save("step0"), save("step1"), save("step2", edit=True)]
    res = sweep(cks, one_row, tmp_path / "out", progress=False)
    assert not res.failed, res.failed
    dup = res.tables["by_site"].groupby("checkpoint")["duplicate_of"].first()
    assert dup["step1"] == "step0" and dup["step2"] is None and dup["step0"] is None
    # markers of another digest algorithm (an older sample digest) prove nothing
    for name in ("step0", "step1"):
        marker = tmp_path / "out" / "checkpoints" / f"{name}.done.json"
        done = json.loads(marker.read_text())
        marker.write_text(json.dumps({**done, "digest": "same", "digest_algorithm": "sha256-strided-2048"}))
    dup = combine(tmp_path / "out")["by_site"].groupby("checkpoint")["duplicate_of"].first()
    assert pd.isna(dup["step1"]) and pd.isna(dup["step2"])
