"""The model cache cannot serve corrupted weights. A GGUF's conversion is stamped with a content
digest when written and verified before it is served (hashed once per process, and again whenever
a file's inode, size, mtime or ctime changed: never trusted on metadata alone); a mismatch warns
and converts again. CLI error messages never point at Python-only arguments."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import torch

import depthscope.hooks.loading as loading
from depthscope.common.stamps import STAMPS, verify_stamps, write_stamps

ROOT = Path(__file__).resolve().parents[1]


def test_stamps_see_a_zeroed_block_and_trust_an_untouched_file(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    write_stamps(tmp_path)
    assert (tmp_path / STAMPS).is_file() and verify_stamps(tmp_path) == []
    with open(f, "r+b") as h:
        h.seek(4096)
        h.write(b"\0" * 1024)
    assert verify_stamps(tmp_path) == ["w.bin"]


def test_a_copy_with_the_same_content_is_accepted_and_a_same_metadata_rewrite_is_not(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc" * 1000)
    write_stamps(tmp_path)
    os.utime(f, ns=(1, 1))  # touched, same bytes
    assert verify_stamps(tmp_path) == [] and verify_stamps(tmp_path) == []
    st = f.stat()
    with open(f, "r+b") as h:  # same size, mtime set back: only the content (and ctime) changed
        h.write(b"xyz")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert verify_stamps(tmp_path) == ["w.bin"]
    (tmp_path / "extra.bin").write_bytes(b"?")  # an unstamped file in a stamped folder
    assert verify_stamps(tmp_path) == ["extra.bin", "w.bin"]


def test_no_stamps_is_none(tmp_path):
    assert verify_stamps(tmp_path) is None
    (tmp_path / STAMPS).write_text("not json")
    assert verify_stamps(tmp_path) is None


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_factory, tiny_tokenizer):
    """A GGUF whose 'conversion' is the tiny Llama (counted), and a private cache."""
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(256))
    tiny = tiny_factory("llama", n_layers=1, d_model=32)
    conversions = []

    import transformers

    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def model_from(path, *a, gguf_file=None, **k):
        if gguf_file is None:
            return real_model(path, *a, **k)
        conversions.append(gguf_file)
        return tiny.hf_model

    def tok_from(path, *a, gguf_file=None, **k):
        return tiny_tokenizer if gguf_file is not None else real_tok(path, *a, **k)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_from)
    return gguf, conversions, tiny


def _cached(gguf):
    return loading.cache_dir() / "models" / loading._gguf_cache_key(gguf)


def test_corrupted_cache_is_detected_warned_and_converted_again(fake_gguf, caplog):
    gguf, conversions, tiny = fake_gguf
    loading.load_model(str(gguf))
    target = _cached(gguf)
    assert len(conversions) == 1 and (target / STAMPS).is_file()
    loading.load_model(str(gguf))
    assert len(conversions) == 1  # a good cache is served
    st = target / "model.safetensors"
    with open(st, "r+b") as h:  # a zeroed block inside the weights
        h.seek(st.stat().st_size // 2)
        h.write(b"\0" * 4096)
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        m = loading.load_model(str(gguf))
    assert len(conversions) == 2
    assert "changed since it was written (model.safetensors)" in caplog.text and "converting again" in caplog.text
    assert verify_stamps(target) == []
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(m.hf_model(ids).logits, tiny.hf_model(ids).logits)


def test_cache_without_stamps_is_converted_again(fake_gguf, caplog):
    gguf, conversions, _ = fake_gguf
    loading.load_model(str(gguf))
    (_cached(gguf) / STAMPS).unlink()
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        loading.load_model(str(gguf))
    assert len(conversions) == 2 and "carries no content digest" in caplog.text


def test_random_bytes_in_the_cache_are_converted_again(fake_gguf):
    gguf, conversions, _ = fake_gguf
    loading.load_model(str(gguf))
    st = _cached(gguf) / "model.safetensors"
    st.write_bytes(os.urandom(st.stat().st_size))
    loading.load_model(str(gguf))
    assert len(conversions) == 2


# options the CLI does not have: an error message that names one (as `name=`) points a CLI user
# at nothing. Python callers read the argument in the docstrings.
PYTHON_ONLY = re.compile(r"\b(check_finite|allow_mixed|resume|dtype|store_dtype|positions)=")


def test_error_messages_name_cli_options_when_they_name_arguments():
    """Every message that names a Python argument also names its CLI option (--...)."""
    bad = []
    for path in [*ROOT.glob("hooks/*.py"), *ROOT.glob("probes/*.py"), *ROOT.glob("analyses/**/*.py")]:
        text = path.read_text()
        for m in re.finditer(r"raise \w+\(\s*((?:f?\"[^\"]*\"\s*)+)", text):
            msg = m.group(1)
            if PYTHON_ONLY.search(msg) and "--" not in msg:
                bad.append(f"{path.relative_to(ROOT)}: {msg[:100]}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_real_model_cache_with_a_zeroed_block_is_converted_again(tmp_path, monkeypatch, caplog, default_model):
    """The reported case: the default model's cached conversion with a zeroed block made it
    predict ' the' after 'The capital of France is'; now the block is seen and the model converted
    again, and it predicts ' Paris'."""
    from conftest import copy_default_conversion

    copy_default_conversion(tmp_path)
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path))
    m = loading.load_model()
    target = next((tmp_path / "models").iterdir())
    st = target / "model.safetensors"
    with open(st, "r+b") as h:
        h.seek(st.stat().st_size // 3)
        h.write(b"\0" * (8 << 20))
    del m
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        m = loading.load_model()
    assert "changed since it was written (model.safetensors)" in caplog.text
    ids = m.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        top = int(m.hf_model(ids).logits[0, -1].argmax())
    assert m.tokenizer.decode([top]) == " Paris"
