"""Hook points below the stream: names and aliases, and every point equal to an independent
computation with transformers (plain PyTorch hooks on module paths written out here, and
``output_attentions`` under eager attention) on tiny models of every family, sandwich-norm
families included, and on the real default model."""

from __future__ import annotations

import pytest
import torch

from depthscope.hooks import InputError, Point, load_model, parse_point, parse_points, point_names, tl_name

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The capital of France is", "Hello world, this is a longer second sentence."]
FAMILIES = ["llama", "gpt2", "gpt_neox", "bert", "olmo2", "gemma2", "gemma3"]
SANDWICH = ("olmo2", "gemma2", "gemma3")

# module paths written out independently of depthscope's architecture map
BLOCKS = {
    "llama": "model.layers",
    "gpt2": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "bert": "bert.encoder.layer",
    "olmo2": "model.layers",
    "gemma2": "model.layers",
    "gemma3": "model.layers",
}
PATHS = {  # attention write, its output projection, MLP write, its down projection
    "llama": ("self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj"),
    "gpt2": ("attn", "attn.c_proj", "mlp", "mlp.c_proj"),
    "gpt_neox": ("attention", "attention.dense", "mlp", "mlp.dense_4h_to_h"),
    "bert": ("attention.output.dense", "attention.output.dense", "output.dense", "output.dense"),
    "olmo2": ("post_attention_layernorm", "self_attn.o_proj", "post_feedforward_layernorm", "mlp.down_proj"),
}
PATHS["gemma2"] = PATHS["gemma3"] = PATHS["olmo2"]


def make_family(family: str, vocab_size: int, n_layers: int = 3, d_model: int = 64, seed: int = 0):
    """conftest's make_tiny plus the sandwich-norm families (norm weights perturbed so they matter)."""
    import transformers as tf
    from conftest import make_tiny

    if family not in SANDWICH:
        return make_tiny(family, vocab_size=vocab_size, n_layers=n_layers, d_model=d_model, seed=seed)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "olmo2":
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))
    elif family == "gemma2":
        model = tf.Gemma2ForCausalLM(
            tf.Gemma2Config(
                head_dim=16, sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common
            )
        )
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(head_dim=16, sliding_window=4, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def family_model(tokenizer):
    made = {}

    def get(family):
        if family not in made:
            made[family] = load_model(make_family(family, len(tokenizer)), tokenizer=tokenizer)
        return made[family]

    return get


def _get(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def reference(hm, family, ids, mask):
    """Every point from a plain eager transformers forward with plain PyTorch hooks."""
    hf = hm.hf_model
    attn_w, o_proj, mlp_w, down = PATHS[family]
    blocks = _get(hf, BLOCKS[family])
    H = hf.config.num_attention_heads
    ref, handles = {}, []

    def out_hook(key):
        return lambda mod, args, out: ref.__setitem__(key, out[0] if isinstance(out, tuple) else out)

    def in_hook(key):
        return lambda mod, args: ref.__setitem__(key, args[0])

    for l, block in enumerate(blocks):
        handles += [
            _get(block, attn_w).register_forward_hook(out_hook(f"{l}.attn_out")),
            _get(block, o_proj).register_forward_pre_hook(in_hook(f"{l}.z_flat")),
            _get(block, mlp_w).register_forward_hook(out_hook(f"{l}.mlp_out")),
            _get(block, down).register_forward_pre_hook(in_hook(f"{l}.neurons")),
        ]
    old = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask.long(), output_attentions=True, output_hidden_states=True)
            for l, block in enumerate(blocks):
                z = ref.pop(f"{l}.z_flat")
                ref[f"{l}.z"] = z.view(*z.shape[:-1], H, -1)
                proj = _get(block, o_proj)
                bias = proj.bias if getattr(proj, "bias", None) is not None else 0
                heads = []
                for h in range(H):  # each head alone through the projection, less its bias
                    only = torch.zeros_like(ref[f"{l}.z"])
                    only[..., h, :] = ref[f"{l}.z"][..., h, :]
                    heads.append(proj(only.flatten(-2)) - bias)
                ref[f"{l}.heads"] = torch.stack(heads, -2)
                ref[f"{l}.pattern"] = out.attentions[l]
                ref[f"{l}.proj_out"] = proj(z)
    finally:
        hf.set_attn_implementation(old)
        for h in handles:
            h.remove()
    return ref, out


# ---------------------------------------------------------------------------- names


def test_names_aliases_and_order():
    assert parse_point("3.pattern", 4) == Point("pattern", 3)
    assert parse_point("blocks.3.attn.hook_pattern", 4) == Point("pattern", 3)
    assert parse_point("blocks.2.attn.hook_z", 4) == Point("z", 2)
    assert parse_point("blocks.2.attn.hook_result", 4) == Point("heads", 2)
    assert parse_point("blocks.1.hook_attn_out", 4) == Point("attn_out", 1)
    assert parse_point("blocks.1.mlp.hook_post", 4) == Point("neurons", 1)
    assert parse_point("blocks.1.ln2.hook_normalized", 4) == Point("mlp_in", 1)
    assert parse_point("blocks.1.hook_mlp_out", 4) == Point("mlp_out", 1)
    assert parse_point("blocks.1.hook_resid_pre", 4) == Point("mlp", 0)
    assert parse_point("blocks.0.hook_resid_pre", 4) == Point("embed", -1)
    assert parse_point("blocks.1.hook_resid_mid", 4) == Point("attn", 1)
    assert parse_point(3, 4) == Point("attn", 1) and parse_point(3, 4).site == 3
    for name in point_names(4):
        p = parse_point(name, 4)
        assert p.name == name and parse_point(tl_name(p), 4) == p
    names = point_names(2)
    assert names == [
        "embed",
        "0.q",
        "0.k",
        "0.v",
        "0.rot_q",
        "0.rot_k",
        "0.scores",
        "0.pattern",
        "0.z",
        "0.heads",
        "0.attn_out",
        "0.attn",
        "0.mlp_in",
        "0.neurons",
        "0.mlp_out",
        "0.mlp",
        "1.q",
        "1.k",
        "1.v",
        "1.rot_q",
        "1.rot_k",
        "1.scores",
        "1.pattern",
        "1.z",
        "1.heads",
        "1.attn_out",
        "1.attn",
        "1.mlp_in",
        "1.neurons",
        "1.mlp_out",
        "1.mlp",
    ]
    assert [p.name for p in parse_points("resid", 2)] == ["embed", "0.attn", "0.mlp", "1.attn", "1.mlp"]
    assert [p.name for p in parse_points(["1.z", "embed", "0.mlp_out", "1.z"], 2)] == ["embed", "0.mlp_out", "1.z"]
    assert parse_points(None, 2) == []


def test_stream_words_name_the_residual_sites(tiny_llama):
    """l.resid_pre (the stream entering block l), l.resid_mid (= l.attn) and l.resid_post (= l.mlp),
    wherever points and sites are parsed; model.run reads the same tensor under either name."""
    from depthscope.hooks.sites import parse_site

    for name, point in [
        ("0.resid_pre", Point("embed", -1)),
        ("2.resid_pre", Point("mlp", 1)),
        ("2.resid_mid", Point("attn", 2)),
        ("0.resid_post", Point("mlp", 0)),
        (" 1.resid_mid ", Point("attn", 1)),
    ]:
        assert parse_point(name, 3) == point, name
        assert parse_site(name, 3) == point.site == parse_site(point.name, 3), name
    assert [p.name for p in parse_points(["1.resid_pre", "0.mlp", "0.resid_post"], 3)] == ["0.mlp"]
    with pytest.raises(InputError, match=r"layer 3 out of range 0\.\.2"):
        parse_point("3.resid_pre", 3)
    with pytest.raises(KeyError, match="out of range"):
        parse_site("3.resid_post", 3)
    run = tiny_llama.run(TEXTS[:1], cache=["1.resid_pre", "0.mlp", "2.resid_mid"])
    assert torch.equal(run["1.resid_pre"], run["0.mlp"]) and torch.equal(run["2.resid_mid"], run["2.attn"])


def test_hook_embed_is_refused_with_what_to_use():
    """TransformerLens's hook_embed is W_E[tokens] alone, not depthscope's embed (block 0's input:
    plus position embeddings in GPT-2, their LayerNorm in BERT): refused, naming 'embed'."""
    from depthscope.hooks.sites import parse_site

    with pytest.raises(InputError, match=r"token embedding alone.*'embed' \(blocks\.0\.hook_resid_pre"):
        parse_point("hook_embed", 3)
    with pytest.raises(KeyError, match="token embedding alone"):
        parse_site("hook_embed", 3)
    assert parse_point("blocks.0.hook_resid_pre", 3) == parse_point("resid_pre0", 3) == Point("embed", -1)


BAD_NAMES = ["3.pattern", "blocks.0.hook_pattern", "0.attention", "blocks.9.hook_attn_out", 99, "x"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_unknown_names_list_valid_names(bad):
    with pytest.raises(InputError) as e:
        parse_point(bad, 3)
    msg = str(e.value)
    assert repr(bad) in msg and "'<l>.<kind>'" in msg and "blocks.<l>.attn.hook_pattern" in msg and "pattern" in msg


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", FAMILIES)
def test_every_point_equals_transformers(family_model, family):
    hm = family_model(family)
    run = hm.run(TEXTS, cache="all")
    ref, out = reference(hm, family, run.input_ids, run.mask)
    L, H = hm.n_layers, hm.hf_model.config.num_attention_heads
    assert run.keys() == point_names(L)
    assert run["0.pattern"].shape == (2, H, run.input_ids.shape[1], run.input_ids.shape[1])
    for l in range(L):
        for kind in ("pattern", "z", "heads", "attn_out", "neurons", "mlp_out"):
            assert rel_err(run[f"{l}.{kind}"], ref[f"{l}.{kind}"]) < 1e-5, (l, kind)
        # heads sum to the attention write less the projection's bias
        proj = _get(_get(hm.hf_model, BLOCKS[family])[l], PATHS[family][1])
        bias = proj.bias if getattr(proj, "bias", None) is not None else 0
        assert rel_err(run[f"{l}.heads"].sum(-2) + bias, ref[f"{l}.proj_out"]) < 1e-5
        # the down projection of the neurons reproduces the MLP write (sandwich: before its norm)
        if family not in SANDWICH:
            down = _get(_get(hm.hf_model, BLOCKS[family])[l], PATHS[family][3])
            assert rel_err(down(run[f"{l}.neurons"]), run[f"{l}.mlp_out"]) < 1e-5
    hs = out.hidden_states
    assert rel_err(run["embed"], hs[0]) < 1e-6
    if hm.arch.layout == "post_norm":
        return
    # resid_post = resid_pre + attn_out + mlp_out, against transformers' own hidden states
    for l in range(L):
        post = run[f"{l}.attn_out"] + run[f"{l}.mlp_out"] + hs[l]
        target = hs[l + 1] if l < L - 1 else run[f"{l}.mlp"]
        assert rel_err(post, target) < 1e-5, l
        assert rel_err(run[f"{l}.attn"], hs[l] + run[f"{l}.attn_out"]) < 1e-6
    assert rel_err(hm.unembed.norm(run[f"{L - 1}.mlp"]), hs[L]) < 1e-5
    assert rel_err(run.logits, out.logits) < 1e-5


@pytest.mark.parametrize("family", SANDWICH)
def test_sandwich_sites_include_the_post_norm(family_model, family):
    """The residual sites of sandwich families: l.attn is resid_pre + PostNorm(Attn), which differs
    from resid_pre + Attn (the mapping OLMo-2 had as a plain Llama)."""
    hm = family_model(family)
    rs = hm.residual_stream(TEXTS)
    run = hm.run(TEXTS, cache="resid")
    ref, out = reference(hm, family, rs.input_ids, rs.mask)
    m = rs.mask  # real tokens (padding rows differ between the SDPA and eager kernels)
    raw, handles = {}, []
    for l, block in enumerate(_get(hm.hf_model, BLOCKS[family])):
        handles.append(block.self_attn.register_forward_hook(lambda mod, a, o, l=l: raw.__setitem__(l, o[0])))
    with torch.no_grad():
        hm.hf_model(input_ids=rs.input_ids, attention_mask=rs.mask.long())
    for h in handles:
        h.remove()
    for l in range(hm.n_layers):
        pre = out.hidden_states[l]
        assert rel_err(rs[f"{l}.attn"][m], (pre + ref[f"{l}.attn_out"])[m]) < 1e-5
        assert rel_err(rs[f"{l}.attn"][m], (pre + raw[l])[m]) > 1e-2  # the post-attention norm matters
        assert rel_err(run[f"{l}.attn"], rs[f"{l}.attn"]) < 1e-6
        assert hm.arch.attn[l] is _get(hm.hf_model, BLOCKS[family])[l].self_attn
    assert hm.arch.sandwich and hm.arch.layout == "sequential"
    if family == "olmo2":
        assert hm.arch.ln1[0] is None and hm.arch.ln2[0] is None  # no norm reads the stream before a sublayer


def test_default_model_every_point_exact(default_model):
    """SmolLM2-135M (GQA: 9 query heads, 3 K/V heads): every point against transformers."""
    hm = default_model
    run = hm.run(TEXTS, cache="all")
    ref, out = reference(hm, "llama", run.input_ids, run.mask)
    assert run["0.pattern"].shape[1] == 9 and run["0.z"].shape[2:] == (9, 64)
    for l in range(hm.n_layers):
        for kind in ("pattern", "z", "heads", "attn_out", "neurons", "mlp_out"):
            assert rel_err(run[f"{l}.{kind}"], ref[f"{l}.{kind}"]) < 1e-5, (l, kind)
        down = hm.hf_model.model.layers[l].mlp.down_proj
        assert rel_err(down(run[f"{l}.neurons"]), run[f"{l}.mlp_out"]) < 1e-5
        assert rel_err(run[f"{l}.heads"].sum(-2), run[f"{l}.attn_out"]) < 1e-5
    assert rel_err(run.logits, out.logits) < 1e-4
    # without a pattern the call keeps the model's own attention kernel and matches residual_stream
    rs = hm.residual_stream(TEXTS)
    r2 = hm.run(TEXTS, cache="resid")
    assert torch.equal(r2["20.attn"], rs["20.attn"]) and torch.equal(r2.logits, rs.logits)
