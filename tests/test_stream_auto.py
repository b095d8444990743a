"""Big models that run the first time (issue 66): a model whose weights do not fit streams by default
(the plan printed), ``--no-stream`` refuses it naming ``--stream``, the streamed bound and only the
remedies this machine has; every loader streams (folders, hub-cache ids, GGUF converted tensor by
tensor); an index naming the wrong shard is refused before the pass; ``info --stream`` plans a
config-only 70B folder. "Does not fit" is simulated by the free-memory function, not big models."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import make_tiny, run_cli

from depthscope.common.errors import CheckpointError
from depthscope.hooks import devices, load_model
from depthscope.hooks.devices import ModelTooLarge
from depthscope.hooks.streaming import stream_plan

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The keys to the cabinet are on the table.", "A short one."]
SAMPLE = os.path.join(os.path.dirname(__file__), "fixtures", "lens", "ewt_sample.txt")


def _free_between(folder, dtype=torch.float32) -> int:
    """Free bytes between the streamed weights held (largest block + resident) and all the weights,
    each with the 10% headroom: the model fits streamed and not in memory."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    plan = stream_plan(config, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    weights = devices.parameter_count(config) * size
    held = plan.block + plan.resident
    assert held < weights
    return int(1.1 * (held + weights) / 2)


@pytest.fixture
def deep_dir(tmp_path, tiny_tokenizer):
    """A tiny Llama with 8 blocks: its largest block and resident tensors are well under its weights."""
    d = tmp_path / "deep"
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=8).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def test_a_model_that_does_not_fit_streams_by_default_and_says_so(deep_dir, monkeypatch, caplog):
    mem = load_model(deep_dir)
    assert not mem.streamed  # it fits: in memory, as before
    monkeypatch.setattr(devices, "free_bytes", lambda device: _free_between(deep_dir))
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        auto = load_model(deep_dir)
    assert auto.streamed
    said = caplog.text
    assert "do not fit" in said and "streamed bound" in said and "each forward reads" in said
    assert torch.equal(auto.residual_stream(TEXTS).resid, mem.residual_stream(TEXTS).resid)


def test_no_stream_refuses_naming_stream_the_bound_and_only_the_remedies_here(deep_dir, monkeypatch):
    monkeypatch.setattr(devices, "free_bytes", lambda device: _free_between(deep_dir))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelTooLarge) as e:
        load_model(deep_dir, stream=False)
    msg = str(e.value)
    assert "--no-stream" in msg and "streamed, it would hold" in msg and "GiB" in msg
    assert "smaller --dtype" in msg  # float32: a 16-bit dtype halves it
    assert "device_map" not in msg  # no GPU here
    free16 = _free_between(deep_dir, torch.bfloat16)
    monkeypatch.setattr(devices, "free_bytes", lambda device: free16)
    with pytest.raises(ModelTooLarge) as e:
        load_model(deep_dir, stream=False, dtype="bfloat16")
    assert "smaller --dtype" not in str(e.value)  # already 16 bits


def test_a_model_too_large_even_streamed_is_refused_with_both_sizes(deep_dir, monkeypatch):
    monkeypatch.setattr(devices, "free_bytes", lambda device: 1000)
    with pytest.raises(ModelTooLarge, match="even streamed .* would hold .* GiB"):
        load_model(deep_dir)


def test_the_command_line_streams_by_default_and_refuses_with_no_stream(
    deep_dir, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setattr(devices, "free_bytes", lambda device: _free_between(deep_dir))
    base = ["lens", "--text", SAMPLE, "--model", deep_dir, "--max-tokens", "30"]
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        code, stdout, err = run_cli([*base, "--out", tmp_path / "auto"], monkeypatch, capsys)
    assert code == 0, err
    assert "streaming them block by block" in caplog.text and "streamed bound" in caplog.text
    code, _, err = run_cli([*base, "--out", tmp_path / "off", "--no-stream"], monkeypatch, capsys)
    assert code != 0 and "leave out --no-stream" in err and "Traceback" not in err


def test_a_command_that_cannot_stream_says_why(deep_dir, tmp_path, monkeypatch):
    from depthscope.analyses.commands import common

    monkeypatch.setattr(devices, "free_bytes", lambda device: _free_between(deep_dir))
    with pytest.raises(ModelTooLarge, match="this command cannot stream the model: it computes gradients"):
        common.loader(type("O", (), {"model": str(deep_dir), "device": "cpu", "dtype": "float32"})())()


def test_a_hub_cache_id_streams(tmp_path, monkeypatch, tiny_tokenizer):
    import huggingface_hub.constants as hc

    hub = tmp_path / "hub"
    repo = hub / "models--someorg--tiny-deep"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=8).save_pretrained(snap)
    tiny_tokenizer.save_pretrained(snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub))
    mem = load_model("someorg/tiny-deep")
    st = load_model("someorg/tiny-deep", stream=True)
    assert st.streamed and not mem.streamed
    assert torch.equal(st.residual_stream(TEXTS).resid, mem.residual_stream(TEXTS).resid)
    monkeypatch.setattr(devices, "free_bytes", lambda device: _free_between(snap))
    assert load_model("someorg/tiny-deep").streamed  # auto


def test_an_index_naming_the_wrong_shard_is_refused_before_the_pass(tmp_path, tiny_tokenizer):
    d = tmp_path / "sharded"
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=4).save_pretrained(d, max_shard_size="200KB")
    tiny_tokenizer.save_pretrained(d)
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shards = sorted(set(data["weight_map"].values()))
    assert len(shards) > 1
    name = "model.layers.3.mlp.down_proj.weight"
    wrong = next(s for s in shards if s != data["weight_map"][name])
    right = data["weight_map"][name]
    data["weight_map"][name] = wrong
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"names {wrong} for tensor '{name}'.*it is in {right}"):
        load_model(d, stream=True)


def test_a_gguf_stream_request_without_the_cache_is_an_error(tmp_path):
    from depthscope.hooks.loading import default_gguf_path

    gguf = default_gguf_path()
    with pytest.raises(CheckpointError, match="use_cache=False writes none"):
        load_model(str(gguf), stream=True, use_cache=False)


@pytest.mark.slow
def test_a_gguf_without_a_conversion_converts_tensor_by_tensor_and_streams(tmp_path, monkeypatch):
    """The default model's GGUF on a fresh cache: converted into shards one tensor at a time (the
    whole-model conversion is never called), streamed, and equal to the in-memory conversion."""
    from depthscope.hooks import gguf_convert, loading

    gguf = loading.default_gguf_path()
    mem = load_model()  # the shared cache's whole-model conversion
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 64 << 20)

    def no_whole(path):
        raise AssertionError("the whole-model conversion ran")

    monkeypatch.setattr(loading, "_convert_gguf", no_whole)
    st = load_model(str(gguf), stream=True)
    assert st.streamed
    target = loading.cache_dir() / "models" / loading._gguf_cache_key(gguf)
    assert len(list(target.glob("model-*.safetensors"))) > 1
    a, b = st.residual_stream(TEXTS), mem.residual_stream(TEXTS)
    assert torch.equal(a.resid, b.resid)
    assert load_model(str(gguf), stream=True).streamed  # served from the new cache


def test_info_stream_plans_a_70b_config_without_weights(tmp_path, monkeypatch, capsys):
    import transformers as tf

    d = tmp_path / "llama3-70b"
    tf.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ).save_pretrained(d)
    monkeypatch.setenv("DEPTHSCOPE_READ_RATE", "0.5")
    from depthscope.hooks import stream_choice

    stream_choice.read_rate.cache_clear()
    code, out, err = run_cli(["info", "--model", d, "--stream", "--dtype", "bfloat16"], monkeypatch, capsys)
    stream_choice.read_rate.cache_clear()
    assert code == 0, err
    text = " ".join(out.split())
    assert "70.55B parameters" in text and "streamed bound" in text and "80 blocks" in text
    assert "at this disk's 0.50 GB/s" in text


def test_the_read_rate_is_measured_once(monkeypatch):
    from depthscope.hooks import stream_choice

    monkeypatch.delenv("DEPTHSCOPE_READ_RATE", raising=False)
    stream_choice.read_rate.cache_clear()
    rate = stream_choice.read_rate(8 << 20)
    assert rate > 0 and stream_choice.read_rate(8 << 20) == rate
    stream_choice.read_rate.cache_clear()


def test_a_bad_read_rate_is_named(monkeypatch, tmp_path):
    from depthscope.common.errors import InputError
    from depthscope.hooks import stream_choice

    monkeypatch.setenv("DEPTHSCOPE_READ_RATE", "fast")
    stream_choice.read_rate.cache_clear()
    with pytest.raises(InputError, match="DEPTHSCOPE_READ_RATE is 'fast'"):
        stream_choice.read_rate()
    stream_choice.read_rate.cache_clear()
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert stream_choice.paper_plan(None, "float32") is None  # the default model is no folder here
