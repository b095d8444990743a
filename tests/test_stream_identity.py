"""A streamed model's store identity (hooks/stream_identity.py): it reads no block weight, yet a
checkpoint whose weights change (same names, shapes and dtypes) is never taken for the old one: a
fine-tune saved over it, a tensor edited in place with its size and mtime restored; an embedding
edited in memory changes it too. The same files (reloaded, or moved) keep it, so a store resumes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import safetensors
import torch

from depthscope.common.errors import OutputError
from depthscope.hooks import CacheSettings, load_model, write_activations
from depthscope.hooks.stream_identity import store_digest
from depthscope.hooks.streaming import _header
from tests.conftest import make_tiny

N_LAYERS = 3
TEXTS = ["The cat sat on the mat.", "A second document about dogs and logs.", "Short one."]
SETTINGS = CacheSettings(chunk_tokens=16, progress=False)


@pytest.fixture
def folder(tmp_path, tiny_tokenizer):
    d = tmp_path / "ckpt"
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=N_LAYERS, seed=3).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _rchar() -> int:
    """Bytes this process has read through read calls (Linux; 0 elsewhere: the bound then holds)."""
    if not os.path.exists("/proc/self/io"):
        return 0
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def test_the_identity_reads_no_block_weight(folder, monkeypatch):
    st = load_model(folder, stream=True)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    opened, real = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a) or real(*a, **k))
    before, read0 = list(st.streamer.reads_by_block), _rchar()
    digest = store_digest(st)
    read = _rchar() - read0
    assert opened == [] and st.streamer.reads_by_block == before  # no tensor read, no block read
    assert read < weights / 20, (read, weights)  # the headers, not the weights
    assert digest == store_digest(load_model(folder, stream=True))  # the same files: the same identity


def test_a_streamed_store_is_written_and_resumed_with_one_read_per_pass(folder, tmp_path):
    st = load_model(folder, stream=True)
    before = list(st.streamer.reads_by_block)
    a = write_activations(st, TEXTS, "resid", tmp_path / "st", settings=SETTINGS)
    assert [x - y for x, y in zip(st.streamer.reads_by_block, before)] == [1] * N_LAYERS  # the pass only
    mem = load_model(folder)
    want = write_activations(mem, TEXTS, "resid", tmp_path / "mem", settings=SETTINGS)
    for name in want:
        assert np.array_equal(np.asarray(want[name][:]), np.asarray(a[name][:])), name
    digest = store_digest(st)
    moved = tmp_path / "elsewhere" / folder.name  # the store records the model's name: the folder's
    moved.parent.mkdir()
    shutil.move(folder, moved)  # a checkpoint moved keeps its files' inodes and ctimes
    again = load_model(moved, stream=True)
    assert store_digest(again) == digest
    before = list(again.streamer.reads_by_block)
    write_activations(again, TEXTS, "resid", tmp_path / "st", settings=SETTINGS)  # complete: nothing to compute
    assert again.streamer.reads_by_block == before


def test_new_weights_of_the_same_shapes_are_not_taken_for_the_old(folder, tmp_path, tiny_tokenizer):
    old = load_model(folder, stream=True)
    digest = store_digest(old)
    write_activations(old, TEXTS, "resid", tmp_path / "st", settings=SETTINGS)
    # a fine-tune saved over the checkpoint: the same names, dtypes, shapes and offsets
    heads = {f.name: _header(f) for f in folder.glob("*.safetensors")}
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=N_LAYERS, seed=4).save_pretrained(folder)
    assert {f.name: _header(f) for f in folder.glob("*.safetensors")} == heads
    new = load_model(folder, stream=True)
    assert store_digest(new) != digest
    with pytest.raises(OutputError, match="model_digest"):
        write_activations(new, TEXTS, "resid", tmp_path / "st", settings=SETTINGS)
    got = write_activations(
        new, TEXTS, "resid", tmp_path / "st", settings=CacheSettings(chunk_tokens=16, progress=False, overwrite=True)
    )
    want = write_activations(load_model(folder), TEXTS, "resid", tmp_path / "mem", settings=SETTINGS)
    for name in want:
        assert np.array_equal(np.asarray(want[name][:]), np.asarray(got[name][:])), name


def test_a_block_tensor_edited_in_place_with_its_mtime_restored_changes_the_identity(folder):
    digest = store_digest(load_model(folder, stream=True))
    f = next(folder.glob("*.safetensors"))
    start, head = _header(f)
    name = next(
        n for n in head if n.startswith("model.layers.1.") and n.endswith("weight") and len(head[n]["shape"]) == 2
    )
    st = os.stat(f)
    with open(f, "r+b") as h:  # one value of a block matrix, in place: same size
        h.seek(start + head[name]["data_offsets"][0])
        value = h.read(4)
        h.seek(-4, os.SEEK_CUR)
        h.write(bytes(b ^ 0x01 for b in value))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns
    assert store_digest(load_model(folder, stream=True)) != digest


def test_a_resident_tensor_edited_in_memory_changes_the_identity(folder):
    st = load_model(folder, stream=True)
    digest = store_digest(st)
    with torch.no_grad():
        st.hf_model.get_input_embeddings().weight[3, 0] += 1.0
    assert store_digest(st) != digest
