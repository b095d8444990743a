"""SAEs and transcoders: SAELens's layout read and written, the ``l.mlp_in`` point they read,
and splicing into a forward pass (features readable and writable, the model unchanged until a
feature is edited), each checked against plain PyTorch hooks on the transformers modules."""

from __future__ import annotations

import json

import pytest
import torch

from depthscope.common.errors import InputError
from depthscope.hooks import SAE, load_sae, save_sae

TEXTS = ["When Mary and John went to the store, John gave a drink to", "The cat sat"]


def random_sae(d_in: int, d_sae: int, arch: str = "topk", *, d_out: int | None = None, seed: int = 0, **kw) -> SAE:
    g = torch.Generator().manual_seed(seed)
    d_out = d_out or d_in
    w = dict(
        W_enc=torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        b_enc=torch.randn(d_sae, generator=g) * 0.1,
        W_dec=torch.randn(d_sae, d_out, generator=g) / d_sae**0.5,
        b_dec=torch.randn(d_out, generator=g) * 0.1,
    )
    if "jumprelu" in arch:
        kw["threshold"] = torch.rand(d_sae, generator=g) * 0.2
    if arch in ("transcoder", "jumprelu_transcoder", "topk_transcoder"):
        kw.setdefault("apply_b_dec_to_input", False)
    return SAE(**w, architecture=arch, **kw)


def hand_encode(sae: SAE, x: torch.Tensor) -> torch.Tensor:
    """SAELens's encode written out for the settings used in these tests (no normalisation)."""
    xin = x - sae.b_dec if sae.apply_b_dec_to_input else x
    pre = xin @ sae.W_enc + sae.b_enc
    if sae.architecture in ("topk", "topk_transcoder"):
        flat = pre.reshape(-1, pre.shape[-1])
        keep = torch.zeros_like(flat, dtype=torch.bool)
        for row in range(flat.shape[0]):
            keep[row, flat[row].argsort(descending=True)[: sae.k]] = True
        return torch.where(keep, flat.clamp(min=0), torch.zeros_like(flat)).reshape(pre.shape)
    acts = pre.clamp(min=0)
    return acts * (pre > sae.threshold) if sae.threshold is not None else acts


# ----------------------------------------------------------------------------------- the format


@pytest.mark.parametrize(
    "arch", ["standard", "topk", "jumprelu", "transcoder", "jumprelu_transcoder", "topk_transcoder"]
)
def test_save_load_round_trip_and_encode(tmp_path, arch):
    kw = {"k": 3} if "topk" in arch else {}
    d_out = 7 if "transcoder" in arch else None
    sae = random_sae(5, 11, arch, d_out=d_out, hook_name="blocks.1.hook_resid_post", **kw)
    save_sae(sae, tmp_path / "sae", model_name="tiny")
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert cfg["architecture"] == arch and cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    assert cfg.get("k") == kw.get("k") and cfg.get("d_out") == d_out
    back = load_sae(tmp_path / "sae")
    assert (back.architecture, back.k, back.is_transcoder) == (arch, kw.get("k"), "transcoder" in arch)
    for n in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(back, n), getattr(sae, n))
    x = torch.randn(4, 6, 5)
    assert torch.allclose(back.encode(x), hand_encode(sae, x), atol=1e-6)
    if "transcoder" not in arch:
        assert torch.allclose(back.reconstruct(x), hand_encode(sae, x) @ sae.W_dec + sae.b_dec, atol=1e-6)


def test_topk_by_hand():
    """k = 1 on a 2-latent SAE with identity weights: the larger entry survives, ReLU'd."""
    eye = torch.eye(2)
    sae = SAE(eye, torch.zeros(2), eye, torch.zeros(2), architecture="topk", k=1)
    assert torch.equal(sae.encode(torch.tensor([[3.0, -1.0], [-2.0, -5.0]])), torch.tensor([[3.0, 0.0], [0.0, 0.0]]))


def test_pre_6_config_and_log_threshold(tmp_path):
    """An older SAELens config (hook_point at the top level, topk through activation_fn_kwargs) and
    a JumpReLU checkpoint storing log_threshold load as what they mean."""
    from safetensors.torch import save_file

    sae = random_sae(4, 6, "topk", k=2)
    (tmp_path / "a").mkdir()
    save_file(
        {n: getattr(sae, n) for n in ("W_enc", "b_enc", "W_dec", "b_dec")}, tmp_path / "a" / "sae_weights.safetensors"
    )
    old = {"d_in": 4, "d_sae": 6, "hook_point": "blocks.0.hook_mlp_out", "activation_fn_str": "topk"}
    old["activation_fn_kwargs"] = {"k": 2}
    (tmp_path / "a" / "cfg.json").write_text(json.dumps(old))
    got = load_sae(tmp_path / "a")
    assert got.architecture == "topk" and got.k == 2 and got.hook_name == "blocks.0.hook_mlp_out"
    j = random_sae(4, 6, "jumprelu")
    (tmp_path / "b").mkdir()
    state = {n: getattr(j, n) for n in ("W_enc", "b_enc", "W_dec", "b_dec")} | {"log_threshold": j.threshold.log()}
    save_file(state, tmp_path / "b" / "sae_weights.safetensors")
    (tmp_path / "b" / "cfg.json").write_text(json.dumps({"architecture": "jumprelu", "d_in": 4, "d_sae": 6}))
    assert torch.allclose(load_sae(tmp_path / "b").threshold, j.threshold, atol=1e-6)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "cfg.json").unlink(), "no cfg.json"),
        (lambda d: (d / "cfg.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "cfg.json").write_text(json.dumps({"architecture": "gated"})), "not supported"),
        (lambda d: (d / "cfg.json").write_text(json.dumps({"architecture": "topk", "k": 99})), "exceeds"),
        (
            lambda d: (d / "cfg.json").write_text(json.dumps({"normalize_activations": "expected_average_only_in"})),
            "scaling",
        ),
        (lambda d: (d / "sae_weights.safetensors").write_bytes(b"\x00" * 20), "safetensors"),
    ],
)
def test_bad_folders_are_clear_errors(tmp_path, damage, message):
    save_sae(random_sae(4, 6, "standard"), tmp_path / "s")
    damage(tmp_path / "s")
    with pytest.raises(InputError, match=message):
        load_sae(tmp_path / "s")


def test_wrong_shapes_and_nan_refused(tmp_path):
    sae = random_sae(4, 6, "standard")
    bad = SAE(sae.W_enc, sae.b_enc, sae.W_dec[:, :3], sae.b_dec, architecture="standard")
    save_sae(bad, tmp_path / "shape")
    with pytest.raises(InputError, match="shapes do not fit"):
        load_sae(tmp_path / "shape")
    sae.W_enc[0, 0] = float("nan")
    save_sae(sae, tmp_path / "nan")
    with pytest.raises(InputError, match="NaN"):
        load_sae(tmp_path / "nan")


# ----------------------------------------------------------------------------- the mlp_in point

MLPS = {
    "llama": lambda hf, l: hf.model.layers[l].mlp,
    "gpt2": lambda hf, l: hf.transformer.h[l].mlp,
    "gpt_neox": lambda hf, l: hf.gpt_neox.layers[l].mlp,
}


@pytest.mark.parametrize("family", sorted(MLPS))
def test_mlp_in_is_the_mlp_modules_input(tiny_factory, family):
    m = tiny_factory(family)
    seen = {}
    handles = [
        MLPS[family](m.hf_model, l).register_forward_pre_hook(lambda mod, a, l=l: seen.__setitem__(l, a[0].detach()))
        for l in range(m.n_layers)
    ]
    try:
        ids, mask = m.tokenize(TEXTS)
        with torch.no_grad():
            m.hf_model(input_ids=ids, attention_mask=mask.long())
    finally:
        for h in handles:
            h.remove()
    run = m.run(TEXTS, cache=[f"{l}.mlp_in" for l in range(m.n_layers)] + ["blocks.1.ln2.hook_normalized"])
    for l in range(m.n_layers):
        assert torch.equal(run[f"{l}.mlp_in"], seen[l])
    assert torch.equal(run["blocks.1.ln2.hook_normalized"], seen[1])


# ------------------------------------------------------------------------------------- splicing


@pytest.fixture(scope="module")
def llama(tiny_factory):
    return tiny_factory("llama")


def test_splice_keeps_the_model_exact_and_caches_features(llama):
    sae = random_sae(llama.d_model, 96, "topk", k=8)
    plain = llama.run(TEXTS, cache=["1.mlp"])
    run = llama.run(
        TEXTS, saes={"1.mlp": sae}, cache=["1.mlp.sae.features", "1.mlp.sae.error", "1.mlp.sae.reconstruction"]
    )
    assert torch.equal(run.logits, plain.logits)  # nothing edited: bit for bit
    x = plain["1.mlp"]
    assert torch.allclose(run["1.mlp.sae.features"], hand_encode(sae, x), atol=1e-5)
    assert torch.allclose(run["1.mlp.sae.reconstruction"] + run["1.mlp.sae.error"], x, atol=1e-5)
    assert run["blocks.1.hook_resid_post.sae.features"] is run["1.mlp.sae.features"]


def plain_block_hook(model, layer: int, fn):
    """A forward hook on the transformers decoder layer replacing its output hidden states."""

    def hook(mod, args, out):
        return (fn(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else fn(out)

    return model.hf_model.model.layers[layer].register_forward_hook(hook)


def plain_logits(model, texts, layer: int, fn):
    ids, mask = model.tokenize(texts)
    h = plain_block_hook(model, layer, fn)
    try:
        with torch.no_grad():
            return model.hf_model(input_ids=ids, attention_mask=mask.long()).logits
    finally:
        h.remove()


def test_feature_ablation_and_keep_error_false_match_plain_hooks(llama):
    sae = random_sae(llama.d_model, 96, "standard")
    j = int(hand_encode(sae, llama.run(TEXTS, cache=["1.mlp"])["1.mlp"]).sum((0, 1)).argmax())

    def ablate(f, ctx):
        f = f.clone()
        f[..., j] = 0
        return f

    run = llama.run(TEXTS, saes={"1.mlp": sae}, hooks={"1.mlp.sae.features": ablate})
    ref = plain_logits(llama, TEXTS, 1, lambda h: h - hand_encode(sae, h)[..., j : j + 1] * sae.W_dec[j])
    assert torch.allclose(run.logits, ref, atol=1e-4)
    run = llama.run(TEXTS, saes={"1.mlp": sae}, keep_error=False)
    ref = plain_logits(llama, TEXTS, 1, lambda h: hand_encode(sae, h) @ sae.W_dec + sae.b_dec)
    assert torch.allclose(run.logits, ref, atol=1e-4)


def test_splice_gradients(llama):
    """With grad=True the logits and the gradient at the input are the model's own, and the
    features' gradient is the output's gradient through the decoder (d out / d f = W_dec)."""
    sae = random_sae(llama.d_model, 64, "topk", k=6)
    plain = llama.run(TEXTS, cache=["embed", "1.mlp"], grad=True)
    plain.logits[..., 5].sum().backward()
    run = llama.run(TEXTS, saes={"1.mlp": sae}, cache=["embed", "1.mlp", "1.mlp.sae.features"], grad=True)
    run.logits[..., 5].sum().backward()
    assert torch.allclose(run.logits, plain.logits, atol=1e-5)
    assert torch.allclose(run.grad("embed"), plain.grad("embed"), atol=1e-5)
    assert torch.allclose(run.grad("1.mlp.sae.features"), run.grad("1.mlp") @ sae.W_dec.T, atol=1e-5)


def test_transcoder_reads_mlp_in_and_writes_mlp_out(llama):
    tc = random_sae(llama.d_model, 80, "transcoder", hook_name="blocks.1.ln2.hook_normalized")
    plain = llama.run(TEXTS, cache=["1.mlp_in", "1.mlp_out"])
    run = llama.run(TEXTS, saes=[tc], cache=["1.mlp_in.sae.reconstruction", "1.mlp_in.sae.error"])
    assert torch.equal(run.logits, plain.logits)
    got = run["1.mlp_in.sae.reconstruction"] + run["1.mlp_in.sae.error"]
    assert torch.allclose(got, plain["1.mlp_out"], atol=1e-5)
    x = plain["1.mlp_in"]
    assert torch.allclose(run["1.mlp_in.sae.reconstruction"], hand_encode(tc, x) @ tc.W_dec + tc.b_dec, atol=1e-5)
    mlp = llama.hf_model.model.layers[1].mlp
    h = mlp.register_forward_hook(lambda mod, a, out: hand_encode(tc, a[0]) @ tc.W_dec + tc.b_dec)
    try:
        ids, mask = llama.tokenize(TEXTS)
        with torch.no_grad():
            ref = llama.hf_model(input_ids=ids, attention_mask=mask.long()).logits
    finally:
        h.remove()
    assert torch.allclose(llama.run(TEXTS, saes=[tc], keep_error=False).logits, ref, atol=1e-4)


def test_generation_with_an_sae(llama):
    sae = random_sae(llama.d_model, 64, "topk", k=4)
    plain = llama.generate(["The cat sat"], max_new_tokens=4)
    out = llama.generate(["The cat sat"], max_new_tokens=4, saes={"0.mlp": sae}, cache=["0.mlp.sae.features"])
    assert torch.equal(out.sequences, plain.sequences)
    steps = out.cache["0.mlp.sae.features"]
    assert len(steps) == out.steps and steps[1].shape[-2:] == (1, 64)
    assert (steps[1] > 0).sum(-1).max() <= 4


def test_splice_errors(llama):
    sae = random_sae(llama.d_model, 32, "standard")
    with pytest.raises(InputError, match="no SAE attached at 2.mlp"):
        llama.run(TEXTS, saes={"1.mlp": sae}, cache=["2.mlp.sae.features"])
    with pytest.raises(InputError, match="after '.sae.'"):
        llama.run(TEXTS, saes={"1.mlp": sae}, cache=["1.mlp.sae.latents"])
    with pytest.raises(InputError, match="not an SAE"):
        llama.run(TEXTS, saes={"1.mlp": "sae.pt"})
    with pytest.raises(InputError, match="names no hook point"):
        llama.run(TEXTS, saes=[sae])
    with pytest.raises(InputError, match="expected a tensor of shape"):
        llama.run(TEXTS, saes={"1.mlp": sae}, hooks={"1.mlp.sae.features": lambda f, ctx: f[..., :3]})
