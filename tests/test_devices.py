"""Devices and precision: names resolved or refused clearly, models loaded in float32, bfloat16 and
float16 and exact against transformers at a per-dtype tolerance, analyses in half precision with
float32 tables, too-large models refused with the sizes. CUDA tests skip without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny

from depthscope.hooks import load_model
from depthscope.hooks.devices import (
    TOLERANCE,
    DeviceError,
    ModelTooLarge,
    check_fits,
    parameter_count,
    resolve_device,
    resolve_dtype,
)

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HALF = [torch.bfloat16, torch.float16]
TEXTS = ["The cat sat on the mat and looked at the dog.", "A bird flew over the house."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama saved as a Hugging Face folder (safetensors, config, tokenizer)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama", vocab_size=len(tiny_tokenizer)).save_pretrained(d, safe_serialization=True)
    tiny_tokenizer.save_pretrained(d)
    return d


def reference_logits(folder, dtype, device="cpu"):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tok = tf.AutoTokenizer.from_pretrained(folder)
    enc = tok(TEXTS[0], return_tensors="pt").to(device)
    with torch.no_grad():
        return hf(**enc).logits.float().cpu(), enc["input_ids"]


def test_names_resolved_and_refused():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float16") is torch.float16
    assert resolve_dtype(None) is torch.float32 and resolve_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(DeviceError, match="float32, bfloat16 or float16"):
        resolve_dtype("int8")
    with pytest.raises(DeviceError, match="unsupported dtype"):
        resolve_dtype(torch.float64)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device("tpu0")
    with pytest.raises(DeviceError, match="visible|no CUDA"):
        resolve_device("cuda:99")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu_is_a_clear_error(folder):
    with pytest.raises(DeviceError, match="sees no CUDA GPU.*--device cpu"):
        load_model(folder, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_dtype_loading_exact_vs_transformers(folder, dtype):
    """The hooked forward reads the stream without changing it: its logits equal transformers'
    in the same dtype within TOLERANCE[dtype] (relative to the logits' scale)."""
    m = load_model(folder, dtype=dtype)
    assert m.dtype == dtype and m.device.type == "cpu"
    ref, ids = reference_logits(folder, dtype)
    rs = m.residual_stream(ids)
    assert rs.resid.dtype == dtype
    got = rs.logits.float().cpu()
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_close_to_float32(folder, dtype):
    """A half-precision model computes the same function as float32 to its rounding: the final
    distribution's KL to float32 is small."""
    m32, mh = load_model(folder), load_model(folder, dtype=dtype)
    ids, mask = m32.tokenize(TEXTS)
    lp32 = m32.residual_stream(ids, mask=mask).logits.float().log_softmax(-1)[mask]
    lph = mh.residual_stream(ids, mask=mask).logits.float().log_softmax(-1)[mask]
    kl = (lp32.exp() * (lp32 - lph)).sum(-1).max().item()
    assert kl < {torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_analyses_in_half_precision_give_float_tables(folder, dtype):
    """Lens and norms on a half-precision model: finite float64/float32 metrics that agree with the
    float32 model's to the dtype's rounding (reductions are taken in float32 or wider)."""
    from depthscope.analyses.lens.logit import logit_lens
    from depthscope.analyses.norms import contribution_norms

    m32, mh = load_model(folder), load_model(folder, dtype=dtype)
    a, b = logit_lens(m32, TEXTS), logit_lens(mh, TEXTS)
    assert b["kl_to_final"].dtype.kind == "f" and b["kl_to_final"].dtype.itemsize >= 4
    assert np.isfinite(b["kl_to_final"]).all()
    np.testing.assert_allclose(b["kl_to_final"], a["kl_to_final"], atol=0.05 if dtype == torch.float16 else 0.3)
    na, nb = contribution_norms(m32, TEXTS), contribution_norms(mh, TEXTS)
    assert np.isfinite(nb["stream_norm"]).all()
    np.testing.assert_allclose(nb["stream_norm"], na["stream_norm"], rtol=1e-2 if dtype == torch.float16 else 3e-2)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_patching_and_probes_in_half_precision(folder, dtype):
    """Activation patching and probe features of a half-precision model: float tables close to
    float32's (mean-pooled probe features are summed in float32 whatever the model's dtype)."""
    from depthscope.analyses.circuits.patching.activation import activation_patching
    from depthscope.probes import run_probes, sample_data

    s = sample_data()
    out = {}
    for dt in (torch.float32, dtype):
        m = load_model(folder, dtype=dt)
        t, f = (m.tokenizer(x, add_special_tokens=False)["input_ids"][0] for x in (" cat", " dog"))
        p = activation_patching(m, "The cat sat on the mat and the", "The dog sat on the mat and the", (t, f))
        r = run_probes(m, ["upos"], s["ewt_train"], s["ewt_test"], progress=False, max_train_sentences=40,
                       max_test_sentences=20, max_epochs=5, pooling="mean")  # fmt: skip
        out[dt] = (p["metric"].to_numpy(), r.by_site["accuracy"].to_numpy())
    assert out[dtype][0].dtype.kind == "f" and np.isfinite(out[dtype][0]).all()
    np.testing.assert_allclose(out[dtype][0], out[torch.float32][0], atol=0.01)
    np.testing.assert_allclose(out[dtype][1], out[torch.float32][1], atol=0.05)


def test_in_memory_model_keeps_or_changes_placement(tiny_tokenizer):
    hf = make_tiny("llama", vocab_size=len(tiny_tokenizer))
    assert load_model(hf, tokenizer=tiny_tokenizer).dtype == torch.float32
    m = load_model(hf, tokenizer=tiny_tokenizer, dtype="bf16")
    assert m.dtype == torch.bfloat16


def test_too_large_refused_with_sizes(folder, monkeypatch):
    import transformers as tf

    n = parameter_count(tf.AutoConfig.from_pretrained(folder))
    ref = make_tiny("llama", vocab_size=tf.AutoConfig.from_pretrained(folder).vocab_size)
    assert n == sum(p.numel() for p in ref.parameters())
    with pytest.raises(ModelTooLarge, match=r"70\.00B parameters: 130\.39 GiB in bfloat16.*GiB free"):
        check_fits(70_000_000_000, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr("depthscope.hooks.devices.free_bytes", lambda device: 1000)
    with pytest.raises(ModelTooLarge, match="GiB in float32 .* but cpu has 0.00 GiB free"):
        load_model(folder)


def test_device_map_needs_accelerate(folder, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    with pytest.raises(DeviceError, match=r"pip install 'accelerate"):
        load_model(folder, device_map="auto")
    with pytest.raises(Exception, match="either device"):
        load_model(folder, device="cuda:0", device_map="auto")


# ----------------------------------------------------------------------------- on a GPU
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_cuda_exact_vs_transformers(folder, dtype):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    m = load_model(folder, device="cuda", dtype=dtype)
    assert m.device.type == "cuda" and m.dtype == dtype
    ref, ids = reference_logits(folder, dtype, "cuda")
    rs = m.residual_stream(ids)  # CPU ids: moved to the model's device
    assert rs.resid.device.type == "cuda"
    scale = ref.abs().max().item()
    assert (rs.logits.float().cpu() - ref).abs().max().item() <= TOLERANCE[dtype] * scale


@CUDA
def test_cuda_analyses_tables_on_cpu(folder):
    from depthscope.analyses.lens.logit import logit_lens
    from depthscope.analyses.norms import contribution_norms

    cpu, gpu = load_model(folder), load_model(folder, device="cuda")
    a, b = logit_lens(cpu, TEXTS), logit_lens(gpu, TEXTS)
    np.testing.assert_allclose(b["kl_to_final"], a["kl_to_final"], rtol=1e-3, atol=1e-5)
    na, nb = contribution_norms(cpu, TEXTS), contribution_norms(gpu, TEXTS)
    np.testing.assert_allclose(nb["stream_norm"], na["stream_norm"], rtol=1e-4)


@CUDA
def test_cuda_lens_decodes_larger_chunks_with_the_same_numbers(folder):
    """On a GPU the lens's default chunk is larger than the CPU's (fewer launches), within a
    quarter of the card's free memory, and gives what one position per chunk gives."""
    from depthscope.analyses.lens.logit import _token_chunk, logit_lens

    gpu = load_model(folder, device="cuda")
    cuda = torch.device("cuda")
    on_gpu, on_cpu = _token_chunk(None, 61, 49152, cuda), _token_chunk(None, 61, 49152, torch.device("cpu"))
    assert on_gpu > 4 * on_cpu
    assert on_gpu * 61 * 49152 * 8 <= torch.cuda.mem_get_info(cuda)[0] // 4
    big, one = logit_lens(gpu, TEXTS), logit_lens(gpu, TEXTS, token_chunk=1)
    for col in ("kl_to_final", "entropy", "cross_entropy", "top1_agreement"):
        np.testing.assert_allclose(big[col], one[col], rtol=1e-5, atol=1e-6)


@CUDA
def test_cuda_patching_matches_the_cpu(folder):
    """Activation, attribution and path patching with the model on the GPU (each reads its
    per-patch flags and estimates back in one transfer) give the CPU's tables."""
    from conftest import IOI_PAIRS

    from depthscope.analyses.circuits.pairs import PromptPair
    from depthscope.analyses.circuits.patching.activation import activation_patching, attribution_patching
    from depthscope.analyses.circuits.patching.paths import path_patching

    cpu, gpu = load_model(folder), load_model(folder, device="cuda")
    pairs = [PromptPair(*p) for p in IOI_PAIRS[:2]]
    for fn, kw in [
        (activation_patching, {}),
        (activation_patching, {"sites": "heads"}),
        (attribution_patching, {"sites": "heads"}),
        (path_patching, {}),
    ]:
        a, b = fn(cpu, pairs, **kw), fn(gpu, pairs, **kw)
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(b["metric"], a["metric"], rtol=1e-3, atol=1e-4, err_msg=fn.__name__)


@CUDA
def test_cuda_device_map_auto(folder):
    pytest.importorskip("accelerate")
    m = load_model(folder, device_map="auto")
    ref, ids = reference_logits(folder, torch.float32, "cuda")
    got = m.residual_stream(ids).logits.float().cpu()
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_forwards_from_a_block_and_streamed_equal_the_full_forward(folder, dtype):
    """On the card: a forward started at a block from the stream entering it
    (``depthscope.hooks.from_block``) equals the full forward with the same hook, and a model
    streamed from host memory onto the card gives the in-memory model's sites and logits, bit for bit."""
    from depthscope.hooks import from_block

    gpu = load_model(folder, dtype=dtype, device="cuda")
    ids, mask = gpu._prepare(TEXTS, None)

    def scale(h, ctx):
        return h * 0.5

    full = gpu.run(ids, mask=mask, hooks={"1.mlp": scale}).logits
    start = gpu.residual_stream(ids, sites=[2], mask=mask, return_logits=False).resid[0]
    with from_block(gpu, 1, start):
        part = gpu.run(ids, mask=mask, hooks={"1.mlp": scale}).logits
    assert torch.equal(full, part)
    streamed = load_model(folder, dtype=dtype, device="cuda", stream=True)
    a, b = gpu.residual_stream(ids, mask=mask), streamed.residual_stream(ids, mask=mask)
    assert torch.equal(a.resid, b.resid) and torch.equal(a.logits, b.logits)


@CUDA
def test_cuda_causal_forwards_from_the_sites_block_equal_the_plain_forwards(folder, tmp_path, monkeypatch):
    """``causal_tests`` on the card: the same table with the sites' forwards started at their
    block and with every forward from the embedding."""
    import pandas as pd
    from conftest import small_causal_config

    import depthscope.hooks.late_start as prefix
    from depthscope.analyses.causal.erasure.used import causal_tests

    cfg = small_causal_config(tmp_path / "store", controls=1, bootstrap=0)
    gpu = load_model(folder, device="cuda")
    starts = causal_tests(gpu, cfg).table
    monkeypatch.setattr(prefix, "PREFIX_BYTES", 0)
    pd.testing.assert_frame_equal(causal_tests(gpu, cfg).table, starts, check_exact=True)


def test_cli_device_and_dtype_options(folder, monkeypatch, capsys):
    """``--device``/``--dtype`` reach load_model: a bad value is a one-line error, no traceback (the
    command runs in this process: an exception that escaped the command's error handling would fail
    the test with its traceback)."""
    from conftest import run_cli

    code, _, err = run_cli(["info", "-m", folder, "--dtype", "bf16", "-p", "the cat"], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli(["info", "-m", folder, "--dtype", "int4"], monkeypatch, capsys)
    assert code != 0 and "unknown dtype 'int4'" in err and "Traceback" not in err
    if not torch.cuda.is_available():
        code, _, err = run_cli(["info", "-m", folder, "--device", "cuda"], monkeypatch, capsys)
        assert code != 0 and "sees no CUDA GPU" in err and "Traceback" not in err
