"""bfloat16 models without float32 copies: loading keeps the checkpoint's bfloat16 storages, the
checks before loading read only headers, digests hash the tensors in place, capture equals plain
torch forward hooks exactly, and the logit lens's statistics (float32 accumulation) agree with
float64 references computed here.

Tiny Llama models (fast tier); the memory figures of 360M / 1.1B models are benchmarks
(``benchmarks/bench_scale.py``), not tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny
from safetensors.torch import load_file

from depthscope.analyses import logit_lens
from depthscope.common.digest import _tensor_bytes, digest_tensors
from depthscope.hooks import load_model
from depthscope.hooks import model_checks as mc

pytestmark = pytest.mark.usefixtures("one_thread")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny untied Llama saved as a bfloat16 safetensors folder, with the tiny tokenizer."""
    d = tmp_path_factory.mktemp("tiny_llama_bf16")
    hf = make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=3, d_model=64, seed=3)
    hf.config.tie_word_embeddings = False
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone() * 3.0)  # logits of a few nats
    hf.to(BF16).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def bf16_model(bf16_dir):
    return load_model(bf16_dir, dtype=BF16)


def _storages(module: torch.nn.Module) -> dict[int, tuple[int, torch.dtype]]:
    """Distinct storages behind the parameters: data pointer -> (bytes, dtype)."""
    return {p.untyped_storage().data_ptr(): (p.untyped_storage().nbytes(), p.dtype) for p in module.parameters()}


def test_bf16_load_keeps_bf16_storages(bf16_dir, bf16_model):
    """Every parameter is bfloat16, its values are the file's bits, and the storages behind the
    parameters hold no more bytes than the parameters in bfloat16 (no float32 copy anywhere)."""
    hf = bf16_model.hf_model
    saved = load_file(str(bf16_dir / "model.safetensors"))
    params = dict(hf.named_parameters())
    assert {p.dtype for p in params.values()} == {BF16}
    assert set(saved) == set(params)
    for name, t in saved.items():
        assert t.dtype == BF16 and torch.equal(params[name].view(torch.int16), t.view(torch.int16)), name
    stores = _storages(hf)
    assert {dt for _, dt in stores.values()} == {BF16}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    storage_bytes = sum(b for b, _ in stores.values())
    assert storage_bytes <= param_bytes * 1.01 + 4096, (storage_bytes, param_bytes)


def test_checks_read_headers_only(bf16_dir, monkeypatch):
    """``check_weights`` (run before loading) compares shapes from safetensors headers: no tensor is read."""
    import safetensors

    reads = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.h = real(*a, **k)

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *a):
            return self.h.__exit__(*a)

        def get_tensor(self, name):
            reads.append(name)
            return self.h.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.h, name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(bf16_dir)
    meta = mc.meta_model(config, tf.AutoModelForCausalLM)
    assert all(p.device.type == "meta" for p in meta.parameters())
    mc.check_weights(meta, [bf16_dir / "model.safetensors"], str(bf16_dir))
    assert reads == []
    bad = {**config.to_dict(), "intermediate_size": 96}  # shapes that disagree are still refused
    meta_bad = mc.meta_model(tf.LlamaConfig(**bad), tf.AutoModelForCausalLM)
    with pytest.raises(mc.ModelSpecError):
        mc.check_weights(meta_bad, [bf16_dir / "model.safetensors"], str(bf16_dir))
    assert reads == []


def test_digest_hashes_in_place(bf16_model):
    """The digest reads each bfloat16 parameter's own memory (no copy) and equals sha256 written here."""
    import hashlib
    import json

    p = bf16_model.hf_model.lm_head.weight
    buf = _tensor_bytes(p)
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data == p.data_ptr()
    h = hashlib.sha256()
    head = json.dumps(["w", str(p.dtype), list(p.shape), p.numel() * 2])
    h.update(head.encode() + b"\0")
    h.update(p.detach().view(torch.int16).numpy().tobytes())
    assert digest_tensors([("w", p)]) == h.hexdigest()[:32]


def plain_sites(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every residual site of a Llama by plain torch hooks: the embedding's output, then per block
    its input plus its attention's output (as the block adds them) and the block's output; and the logits."""
    got, handles = {}, []
    model = hf.model

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    handles.append(model.embed_tokens.register_forward_hook(lambda m, i, o: got.__setitem__("embed", o)))
    for layer, block in enumerate(model.layers):
        handles.append(
            block.register_forward_pre_hook(
                lambda m, a, k, layer=layer: got.__setitem__(("in", layer), a[0] if a else k["hidden_states"]),
                with_kwargs=True,
            )
        )
        handles.append(
            block.self_attn.register_forward_hook(lambda m, i, o, layer=layer: got.__setitem__(("a", layer), first(o)))
        )
        handles.append(
            block.register_forward_hook(lambda m, i, o, layer=layer: got.__setitem__(("out", layer), first(o)))
        )
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    sites = [got["embed"]]
    for layer in range(len(model.layers)):
        sites += [got[("in", layer)] + got[("a", layer)], got[("out", layer)]]
    return torch.stack(sites), logits


def test_bf16_capture_equals_plain_hooks(bf16_model, tiny_tokenizer):
    """Capture in bfloat16 holds the very bits plain forward hooks see (no upcast on the way)."""
    ids = torch.tensor(tiny_tokenizer(["The cat sat on the mat, and the dog lay by the door."])["input_ids"])
    rs = bf16_model.residual_stream(ids)
    ref, logits = plain_sites(bf16_model.hf_model, ids)
    assert rs.resid.dtype == BF16 and rs.resid.shape == ref.shape
    assert torch.equal(rs.resid, ref)
    assert torch.equal(rs.logits, logits)


def _reference_metrics(hf, streams: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, lowp: bool) -> dict:
    """Per-site means of KL(final || site), entropy and next-token cross-entropy in float64.
    ``lowp``: each site decoded by the model's own bfloat16 norm and unembedding (the logits the
    lens reduces); else decoded in float32 from float32 copies of the weights."""
    norm, head = hf.model.norm, hf.lm_head
    with torch.no_grad():
        if lowp:
            z = head(norm(streams)).double()
        else:
            w = norm.weight.float()
            x = streams.float()
            x = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
            z = (x @ head.weight.float().T).double()
    lq = torch.log_softmax(z, -1)  # [S, B, T, V]
    lp = torch.log_softmax(logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    ent = -(lq.exp() * lq).sum(-1)
    ce = -lq[:, :, :-1].gather(-1, ids[:, 1:].expand(lq.shape[0], -1, -1).unsqueeze(-1)).squeeze(-1)
    return {
        "kl_to_final": kl.flatten(1).mean(1),
        "entropy": ent.flatten(1).mean(1),
        "cross_entropy": ce.flatten(1).mean(1),
    }


def test_bf16_lens_statistics_match_float64_references(bf16_model, tiny_tokenizer):
    """The lens on a bfloat16 model decodes in bfloat16 and reduces in float32: its means equal a
    float64 reduction of the same bfloat16 logits within 1e-5 nats (found: 2e-7; a bfloat16
    reduction of the entropy errs by 2e-3 here), and a float32 decoding within 5e-3 nats (found:
    4e-4; the bfloat16 rounding of the logits). The last
    site is the model's own distribution: KL 0."""
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun all day."
    ids = torch.tensor(tiny_tokenizer([text])["input_ids"])
    df = logit_lens(bf16_model, ids, token_chunk=3)  # several chunks
    streams, logits = plain_sites(bf16_model.hf_model, ids)
    same = _reference_metrics(bf16_model.hf_model, streams, logits, ids, lowp=True)
    fp32 = _reference_metrics(bf16_model.hf_model, streams, logits, ids, lowp=False)
    assert float(same["entropy"].min()) > 1.0  # a spread distribution: accumulation errors would show
    for name in ("kl_to_final", "entropy", "cross_entropy"):
        got = torch.tensor(df[name].to_numpy(), dtype=torch.float64)
        assert torch.allclose(got, same[name], rtol=0, atol=1e-5), (name, (got - same[name]).abs().max())
        assert torch.allclose(got, fp32[name], rtol=0, atol=5e-3), (name, (got - fp32[name]).abs().max())
    assert df["kl_to_final"].iloc[-1] == 0.0


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation torch makes while ``fn`` runs (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events()] + [0])


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_finite_check_makes_no_float32_copy(dtype):
    """The NaN/inf check on captured low-precision streams allocates at most one site's float32
    copy (a float32 sum of all of it would copy the whole result to float32 first), and still
    finds a NaN or an inf."""
    from depthscope.common.errors import NonFiniteActivationError
    from depthscope.hooks.model import refuse_non_finite

    x = torch.randn(6, 4, 32, 64).to(dtype)
    labels = [f"s{i}" for i in range(6)]
    assert _largest_allocation(lambda: refuse_non_finite(x, labels)) <= 2 * x[0].numel() * 4
    assert _largest_allocation(lambda: x.sum(dtype=torch.float32)) >= x.numel() * 4  # what it avoids
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 1, 5, 7] = bad
        with pytest.raises(NonFiniteActivationError, match="s3"):
            refuse_non_finite(y, labels)
