"""Layer streaming (hooks/streaming.py): a model loaded with ``stream=True`` keeps one block's weights
resident at a time and gives the in-memory model's numbers bit for bit, across the families and in
float32 and bfloat16: the residual stream and logits, hook points below the stream (read and
written), the lens, the norms, activation patching, skipped and swapped blocks, the activation
cache and the weight digest. Each forward reads each block once and holds at most two; generation
and gradients are refused with a clear message; a model too large for memory streams by itself."""

from __future__ import annotations

import os

import pytest
import torch

from depthscope.common.digest import model_digest
from depthscope.common.errors import InputError, ModelSpecError
from depthscope.hooks import load_model
from depthscope.hooks.block_order import block_order, skip, swap
from depthscope.hooks.streaming import StreamedBlock, stream_plan
from tests.conftest import IOI_PAIRS, make_tiny

FAMILIES = ("llama", "gpt2", "gpt_neox", "bert")
TEXTS = ["The cat sat on the mat. The dog sat on the log.", "Hello world, this is a longer second sentence."]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer):
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"stream_{family}")
        make_tiny(family, vocab_size=len(tiny_tokenizer), seed=3).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        out[family] = d
    return out


def _pair(folders, family, dtype="float32"):
    return load_model(folders[family], dtype=dtype), load_model(folders[family], dtype=dtype, stream=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_stream_logits_and_digest_are_the_models_in_memory(folders, family, dtype):
    mem, st = _pair(folders, family, dtype)
    assert st.streamed and not mem.streamed
    assert all(isinstance(b, StreamedBlock) for b in st.arch.blocks)
    a, b = mem.residual_stream(TEXTS), st.residual_stream(TEXTS)
    assert torch.equal(a.resid, b.resid)
    assert (a.logits is None and b.logits is None) or torch.equal(a.logits, b.logits)
    assert model_digest(mem) == model_digest(st)  # the streamed blocks hashed as read from the files
    # between forwards every block's matrices are on the meta device (nothing resident)
    for block in st.arch.blocks:
        assert all(p.device.type == "meta" for p in block.parameters() if p.dim() >= 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_points_below_the_stream_read_and_written(folders, family):
    mem, st = _pair(folders, family)
    points = ["1.z", "1.pattern", "1.neurons", "0.heads", "2.mlp_out"]

    def ablate(z, ctx):
        z = z.clone()
        z[..., 1, :] = 0  # head 1 of layer 1
        return z

    a = mem.run(TEXTS, cache=points, hooks={"1.z": ablate})
    b = st.run(TEXTS, cache=points, hooks={"1.z": ablate})
    assert torch.equal(a.logits, b.logits)
    for p in points:
        assert torch.equal(a[p], b[p]), p


def test_analyses_on_a_streamed_model_are_the_models_in_memory(folders):
    from depthscope.analyses import activation_patching, contribution_norms, layer_interventions, logit_lens

    mem, st = _pair(folders, "llama")
    import pandas as pd

    pd.testing.assert_frame_equal(logit_lens(mem, TEXTS), logit_lens(st, TEXTS))
    pd.testing.assert_frame_equal(contribution_norms(mem, TEXTS), contribution_norms(st, TEXTS))
    clean, corrupted, target, foil = IOI_PAIRS[0]
    a = activation_patching(mem, clean, corrupted, (target, foil), sites="heads")
    b = activation_patching(st, clean, corrupted, (target, foil), sites="heads")
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(layer_interventions(mem, TEXTS), layer_interventions(st, TEXTS))


def test_each_forward_reads_each_block_once_in_the_order_it_runs(folders):
    _, st = _pair(folders, "llama")
    before = st.streamer.reads
    st.residual_stream(TEXTS)
    assert st.streamer.reads - before == st.n_layers
    with block_order(st, swap(st.n_layers, 0)):
        st.residual_stream(TEXTS)
    with block_order(st, skip(st.n_layers, 1)):
        st.residual_stream(TEXTS)
    assert st.streamer.reads - before == 3 * st.n_layers  # the identity still runs its block (exact format)
    assert not st.streamer.pending  # no read ahead left over


def test_at_most_two_blocks_are_resident_during_a_forward(folders):
    _, st = _pair(folders, "llama")
    seen = []

    def count(h, ctx):
        seen.append(sum(any(p.device.type != "meta" and p.dim() >= 2 for p in b.parameters()) for b in st.arch.blocks))

    st.run(TEXTS, hooks={f"{l}.attn": count for l in range(st.n_layers)})
    assert seen and max(seen) == 1  # the read ahead is not yet placed: only the computing block is
    assert st.streamer.bytes_read > 0


def test_the_activation_cache_of_a_streamed_model(folders, tmp_path):
    from depthscope.hooks import write_activations

    mem, st = _pair(folders, "llama")
    a = write_activations(mem, TEXTS, "resid", tmp_path / "a")
    b = write_activations(st, TEXTS, "resid", tmp_path / "b")
    import numpy as np

    assert list(a) == list(b) and len(a) == 7
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def test_generation_and_gradients_are_refused_clearly(folders):
    _, st = _pair(folders, "llama")
    with pytest.raises(InputError, match="generation is refused on a streamed model"):
        st.generate(["Hello"], max_new_tokens=2)
    with pytest.raises(InputError, match="grad=True is refused on a streamed model"):
        st.run(TEXTS, grad=True)


def test_streaming_takes_checkpoint_folders_only_and_streams_what_does_not_fit(folders, monkeypatch):
    mem = load_model(folders["llama"])
    with pytest.raises(ModelSpecError, match="already in memory"):
        load_model(mem.hf_model, stream=True)
    with pytest.raises(ModelSpecError, match="leave out device_map"):
        load_model(folders["llama"], stream=True, device_map="auto")
    from transformers import AutoConfig

    from depthscope.hooks import devices

    config = AutoConfig.from_pretrained(folders["llama"])
    plan, weights = stream_plan(config, torch.float32), devices.parameter_count(config) * 4
    free = int(1.1 * (plan.held + weights) / 2)  # fits streamed (two blocks + resident), not in memory
    monkeypatch.setattr(devices, "free_bytes", lambda device: free)
    with pytest.raises(devices.ModelTooLarge):
        load_model(folders["llama"], stream=False)  # refused with the sizes, as before
    auto = load_model(folders["llama"], stream=None)
    assert auto.streamed and torch.equal(auto.residual_stream(TEXTS).resid, mem.residual_stream(TEXTS).resid)


def test_the_plan_bounds_a_13b_shaped_llama_in_bfloat16():
    """The sizes :func:`stream_plan` gives for Llama-2-13B's shape: a block of 0.4B parameters, the
    embeddings and unembedding resident, and a forward of 2,000 tokens within 6 GB."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, vocab_size=32000
    )
    plan = stream_plan(cfg, torch.bfloat16)
    assert plan.block == pytest.approx((4 * 5120 * 5120 + 3 * 5120 * 13824 + 4 * 5120) * 2, rel=1e-6)
    assert plan.resident == 2 * 32000 * 5120 * 2 + 5120 * 2
    assert plan.peak(2000) < 6 * 2**30 and plan.tokens_within(6 * 2**30) >= 2000


#: measures, in a fresh process, the peak resident memory of loading FOLDER (streamed when the second
#: argument is 1) and one forward of TOKENS tokens through every block, above the memory before it
_PEAK_SCRIPT = """
import gc, json, re, sys
from pathlib import Path
import torch
from depthscope.hooks import load_model

def kb(key):
    return int(re.search(rf"^{key}:\\s+(\\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024

folder, stream, tokens = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
gc.collect()
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
before = kb("VmRSS")
m = load_model(folder, stream=stream)
with torch.no_grad():
    m.residual_stream(torch.randint(3, 1000, (1, tokens)), sites=[f"{m.n_layers - 1}.mlp"])
print(json.dumps({"extra": kb("VmHWM") - before, "streamed": m.streamed}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable VmHWM")
def test_a_streamed_forward_is_measured_within_its_plan(tmp_path, tiny_tokenizer):
    """Streamed memory measured, not restated from the formula: a 16-block Llama of 270 MB (float32)
    loaded and run through every block in a fresh process. In memory its peak grows by at least the
    weights; streamed, by at most the plan's bound with 128 MiB for the runtime in place of the 2 GiB
    slack (the plan's largest block, resident tensors and activations: about 26 MB here), well under
    what holding every block would take."""
    import json
    import subprocess
    import sys

    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=8,
        vocab_size=len(tiny_tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    folder = tmp_path / "llama16"
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    tokens = 256

    def peak(stream: bool) -> int:
        cmd = [sys.executable, "-c", _PEAK_SCRIPT, str(folder), "1" if stream else "0", str(tokens)]
        got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        assert got["streamed"] is stream
        return got["extra"]

    plan = stream_plan(cfg, torch.float32)
    in_memory, streamed = peak(False), peak(True)
    assert in_memory >= 0.95 * weights, (in_memory, weights)
    assert streamed <= plan.peak(tokens, slack=128 * 2**20), (streamed, plan)
    assert streamed < 0.5 * in_memory, (streamed, in_memory)


@pytest.mark.parametrize("stream", [False, True])
def test_sites_under_a_block_order_name_blocks_by_their_own_index(folders, stream):
    """With blocks 0 and 1 swapped, ``1.mlp`` is block 1's output (it runs first) and ``0.mlp`` block
    0's (it runs second): the hidden states after positions 0 and 1 of transformers' own forward
    (before this fix the site capture keyed block inputs by position and failed)."""
    model = load_model(folders["llama"], stream=stream)
    ids, mask = model.tokenize(TEXTS)
    with block_order(model, swap(model.n_layers, 0)), torch.no_grad():
        rs = model.residual_stream(ids, mask=mask)
        hidden = model.hf_model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states
    assert torch.equal(rs["1.mlp"], hidden[1]) and torch.equal(rs["0.mlp"], hidden[2])
