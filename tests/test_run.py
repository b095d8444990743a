"""model.run / model.generate: replacing a point equals the same edit made with plain PyTorch hooks
on the transformers model; gradients equal autograd through transformers; generation with hooks;
left padding; hooks removed after errors; bad input refused clearly."""

from __future__ import annotations

import pytest
import torch

from depthscope.hooks import HookContext, InputError, UnsupportedArchitecture
from depthscope.hooks.attention import _HANDLERS

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The capital of France is", "Hello world, this is a longer second sentence."]
# module paths written out independently of depthscope's architecture map
BLOCKS = {
    "llama": "model.layers",
    "gpt2": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "bert": "bert.encoder.layer",
    "olmo2": "model.layers",
}
O_PROJ = {
    "llama": "self_attn.o_proj",
    "gpt2": "attn.c_proj",
    "gpt_neox": "attention.dense",
    "bert": "attention.output.dense",
    "olmo2": "self_attn.o_proj",
}
DOWN = {
    "llama": "mlp.down_proj",
    "gpt2": "mlp.c_proj",
    "gpt_neox": "mlp.dense_4h_to_h",
    "bert": "output.dense",
    "olmo2": "mlp.down_proj",
}
ATTN = {
    "llama": "self_attn",
    "gpt2": "attn",
    "gpt_neox": "attention",
    "bert": "attention.output.dense",
    "olmo2": "post_attention_layernorm",
}  # the attention write (l.attn_out)
MLP = {"llama": "mlp", "gpt2": "mlp", "gpt_neox": "mlp", "bert": "output.dense", "olmo2": "post_feedforward_layernorm"}
SITE_ATTN = {**ATTN, "bert": "attention"}  # the module whose output makes the l.attn site
ALL = ["llama", "gpt2", "gpt_neox", "bert", "olmo2"]


@pytest.fixture(scope="module")
def model_of(tiny_factory, tokenizer):
    """tiny_factory plus OLMo-2 (sandwich norms), from test_points' helper."""
    from test_points import make_family

    from depthscope.hooks import load_model

    olmo = load_model(make_family("olmo2", len(tokenizer)), tokenizer=tokenizer)
    return lambda family: olmo if family == "olmo2" else tiny_factory(family)


def _get(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def plain_logits(hm, ids, mask, module_path, layer, hook, pre=False):
    """Logits of the transformers model with one plain PyTorch hook at a module of block ``layer``."""
    mod = _get(_get(hm.hf_model, BLOCKS[hm.arch.family])[layer], module_path)
    h = mod.register_forward_pre_hook(hook) if pre else mod.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return hm.hf_model(input_ids=ids, attention_mask=mask.long()).logits
    finally:
        h.remove()


def assert_no_hooks_left(hm, impl):
    for m in hm.hf_model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
    assert not _HANDLERS
    assert hm.hf_model.config._attn_implementation == impl


# ---------------------------------------------------------------------------- replacing


@pytest.mark.parametrize("family", ALL)
def test_replacing_points_equals_plain_hooks(model_of, family):
    hm = model_of(family)
    ids, mask = hm.tokenize(TEXTS)
    _H, dh = hm.arch.n_heads, hm.arch.d_head

    def zero_head_z(t, ctx):
        t = t.clone()
        t[..., 1, :] = 0
        return t

    def plain_zero_head(mod, args):
        x = args[0].clone()
        x[..., dh : 2 * dh] = 0
        return (x,)

    got = hm.run(ids, mask=mask, hooks={"1.z": zero_head_z}).logits
    want = plain_logits(hm, ids, mask, O_PROJ[family], 1, plain_zero_head, pre=True)
    assert rel_err(got, want) < 1e-6
    base = hm.run(ids, mask=mask).logits
    assert rel_err(got, base) > 1e-3  # the edit did something

    # scaling head 2's write == scaling its z (the projection is linear)
    def scale_head(t, ctx):
        t = t.clone()
        t[..., 2, :] *= 3.0
        return t

    def plain_scale_z(mod, args):
        x = args[0].clone()
        x[..., 2 * dh : 3 * dh] *= 3.0
        return (x,)

    got = hm.run(ids, mask=mask, hooks={"blocks.0.attn.hook_result": scale_head}).logits
    assert rel_err(got, plain_logits(hm, ids, mask, O_PROJ[family], 0, plain_scale_z, pre=True)) < 1e-5

    def zero_some(t, ctx):
        t = t.clone()
        t[..., :10] = 0
        return t

    got = hm.run(ids, mask=mask, hooks={"2.neurons": zero_some}).logits
    want = plain_logits(hm, ids, mask, DOWN[family], 2, lambda m, a: (zero_some(a[0], None),), pre=True)
    assert rel_err(got, want) < 1e-6

    def plain_zero_attn(mod, args, out):
        return (torch.zeros_like(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else torch.zeros_like(out)

    got = hm.run(ids, mask=mask, hooks={"blocks.1.hook_attn_out": lambda t, ctx: torch.zeros_like(t)}).logits
    assert rel_err(got, plain_logits(hm, ids, mask, ATTN[family], 1, plain_zero_attn)) < 1e-6
    got = hm.run(ids, mask=mask, hooks={"0.mlp_out": lambda t, ctx: 2 * t}).logits
    assert rel_err(got, plain_logits(hm, ids, mask, MLP[family], 0, lambda m, a, o: 2 * o)) < 1e-6
    assert_no_hooks_left(hm, hm.hf_model.config._attn_implementation)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_replacing_the_pattern_feeds_z(tiny_factory, family):
    """z is exactly the replaced pattern times the (expanded) values; the identity edit changes nothing."""
    hm = tiny_factory(family)
    impl = hm.hf_model.config._attn_implementation
    ids, mask = hm.tokenize(TEXTS)
    base = hm.run(ids, mask=mask, cache=["0.pattern"])
    same = hm.run(ids, mask=mask, hooks={"0.pattern": lambda t, ctx: t.clone()}, cache=["1.mlp"])
    assert rel_err(same.logits, base.logits) < 1e-6

    def uniform(t, ctx):  # attend uniformly to every real earlier token
        causal = torch.ones(t.shape[-2:], dtype=torch.bool).tril()
        allowed = causal & ctx.mask[:, None, None, :]
        return (allowed.to(t.dtype) / allowed.sum(-1, keepdim=True)).expand(t.shape).contiguous()

    values = {}
    attn = _get(hm.hf_model, BLOCKS[family])[0]
    if family == "llama":
        h = attn.self_attn.v_proj.register_forward_hook(lambda m, a, o: values.__setitem__("v", o))
    else:
        h = attn.attn.c_attn.register_forward_hook(lambda m, a, o: values.__setitem__("v", o.split(hm.d_model, 2)[2]))
    try:
        run = hm.run(ids, mask=mask, hooks={"0.pattern": uniform}, cache=["0.pattern", "0.z"])
    finally:
        h.remove()
    v = values["v"].view(*ids.shape, -1, hm.arch.d_head).transpose(1, 2)  # [b, kv heads, pos, dh]
    v = v.repeat_interleave(hm.arch.n_heads // v.shape[1], dim=1)
    z = torch.matmul(run["0.pattern"], v).transpose(1, 2)
    assert torch.allclose(run["0.pattern"].sum(-1), torch.ones(1))
    assert rel_err(run["0.z"], z) < 1e-6
    assert rel_err(run.logits, base.logits) > 1e-3
    assert_no_hooks_left(hm, impl)


def test_old_style_hooks_and_context(tiny_llama):
    """fn(stream, label) hooks written for model.hooks work in run: the context is the label."""
    seen = []

    def old(stream, label):
        seen.append(label)
        assert label == "1.attn" and isinstance(label, str)
        return None

    def new(t, ctx):
        assert isinstance(ctx, HookContext) and ctx.kind == "neurons" and ctx.layer == 0 and ctx.step is None
        assert ctx.mask.shape == t.shape[:2] and torch.equal(ctx.positions[0], torch.arange(t.shape[1]))
        seen.append(ctx.name)

    hm = tiny_llama
    run = hm.run(TEXTS, hooks={"1.attn": old, "0.neurons": [new, new]}, cache="resid")
    assert seen == ["0.neurons", "0.neurons", "1.attn"]
    rs = hm.residual_stream(TEXTS)
    assert torch.equal(run["1.attn"], rs["1.attn"]) and torch.equal(run.logits, rs.logits)
    # the same edit through the old API and the new one
    edit = lambda t, lab: t * 0.5  # noqa: E731
    with hm.hooks({"1.attn": edit}):
        with torch.no_grad():
            want = hm.hf_model(input_ids=run.input_ids, attention_mask=run.mask.long()).logits
    assert torch.equal(hm.run(TEXTS, hooks={"1.attn": edit}).logits, want)


# ---------------------------------------------------------------------------- gradients


def leaf_grad(hm, ids, mask, module, target, pre: bool):
    """Autograd through transformers: a plain hook swaps the tensor at ``module`` for a leaf."""
    leaf = {}

    def swap(x):
        leaf["t"] = x.detach().requires_grad_(True)
        return leaf["t"]

    if pre:
        h = module.register_forward_pre_hook(
            lambda m, a, k: ((swap(a[0]),) + a[1:], k) if a else (a, {**k, "hidden_states": swap(k["hidden_states"])}),
            with_kwargs=True,
        )
    else:
        h = module.register_forward_hook(
            lambda m, a, o: (swap(o[0]),) + tuple(o[1:]) if isinstance(o, tuple) else swap(o)
        )
    try:
        logits = hm.hf_model(input_ids=ids, attention_mask=mask.long()).logits
        logits[0, -1, target].backward()
    finally:
        h.remove()
    return leaf["t"].grad


@pytest.mark.parametrize("family", ALL)
def test_gradients_equal_autograd(model_of, family):
    hm = model_of(family)
    ids, mask = hm.tokenize(TEXTS[:1])
    names = ["embed", "0.attn", "0.mlp", "1.attn_out", "1.neurons", "1.z", "1.heads", "1.mlp_out", "2.pattern"]
    run = hm.run(ids, mask=mask, cache=names, grad=True)
    run.logits[0, -1, 7].backward()
    blocks = _get(hm.hf_model, BLOCKS[family])
    want = {
        "embed": leaf_grad(hm, ids, mask, blocks[0], 7, pre=True),
        "0.attn": leaf_grad(hm, ids, mask, _get(blocks[0], SITE_ATTN[family]), 7, pre=False),
        "0.mlp": leaf_grad(hm, ids, mask, blocks[1], 7, pre=True),
        "1.attn_out": leaf_grad(hm, ids, mask, _get(blocks[1], ATTN[family]), 7, pre=False),
        "1.neurons": leaf_grad(hm, ids, mask, _get(blocks[1], DOWN[family]), 7, pre=True),
        "1.mlp_out": leaf_grad(hm, ids, mask, _get(blocks[1], MLP[family]), 7, pre=False),
    }
    zg = leaf_grad(hm, ids, mask, _get(blocks[1], O_PROJ[family]), 7, pre=True)
    want["1.z"] = zg.view(*zg.shape[:-1], hm.arch.n_heads, -1)
    og = leaf_grad(hm, ids, mask, _get(blocks[1], O_PROJ[family]), 7, pre=False)
    want["1.heads"] = og.unsqueeze(-2).expand(*og.shape[:-1], hm.arch.n_heads, og.shape[-1])
    for name, g in want.items():
        assert run.grad(name).shape == run[name].shape
        assert rel_err(run.grad(name), g) < 1e-5, name
    # the pattern: autograd through transformers' own eager attention weights (the tensor its
    # eager function multiplies with the values), the input of block 0 a leaf
    old = hm.hf_model.config._attn_implementation
    hm.hf_model.set_attn_implementation("eager")
    h = blocks[0].register_forward_pre_hook(
        lambda m, a, k: (
            ((a[0].detach().requires_grad_(True),) + a[1:], k)
            if a
            else (a, {**k, "hidden_states": k["hidden_states"].detach().requires_grad_(True)})
        ),
        with_kwargs=True,
    )
    try:
        out = hm.hf_model(input_ids=ids, attention_mask=mask.long(), output_attentions=True)
        out.attentions[2].retain_grad()
        out.logits[0, -1, 7].backward()
    finally:
        h.remove()
        hm.hf_model.set_attn_implementation(old)
    assert rel_err(run.grad("2.pattern"), out.attentions[2].grad) < 1e-5
    assert float(run.grad("2.pattern").abs().max()) > 0


def test_grad_errors(tiny_llama):
    run = tiny_llama.run(TEXTS, cache=["1.z"])
    with pytest.raises(InputError, match="grad=True"):
        run.grad("1.z")
    run = tiny_llama.run(TEXTS, cache=["1.z"], grad=True)
    with pytest.raises(InputError, match="backward"):
        run.grad("1.z")
    with pytest.raises(KeyError, match="not cached"):
        run.grad("1.neurons")
    with torch.inference_mode(), pytest.raises(InputError, match="inference_mode"):
        tiny_llama.run(TEXTS, grad=True)


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_zero_edit_equals_plain_generate(tiny_factory, family):
    hm = tiny_factory(family)
    impl = hm.hf_model.config._attn_implementation
    prompts = ["The capital of France is", "Hi"]
    ids, mask = hm.tokenize(prompts, padding_side="left")
    with torch.no_grad():
        plain = hm.hf_model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=hm.tokenizer.pad_token_id,
        )
    seen = []

    def zero_edit(t, ctx):
        seen.append((ctx.name, ctx.step, ctx.positions.clone(), ctx.mask.shape[1]))
        return t + 0

    hooks = {name: zero_edit for name in ["embed", "0.pattern", "0.z", "1.heads", "1.neurons", "2.mlp", "1.attn"]}
    out = hm.generate(prompts, max_new_tokens=6, hooks=hooks)
    assert torch.equal(out.sequences, plain)
    assert out.steps == 6 and len(out.tokens) == 2 and len(out.text) == 2
    assert torch.equal(out.tokens[0], plain[0, ids.shape[1] :][: len(out.tokens[0])])
    assert out.text[0] == hm.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    steps = sorted({s for _, s, _, _ in seen})
    assert steps == list(range(6))
    n_real = mask.sum(1)
    for name, step, pos, n_keys in seen:
        if step == 0:
            assert torch.equal(pos[0, -int(n_real[0]) :], torch.arange(int(n_real[0])))
            assert torch.equal(pos[1, -int(n_real[1]) :], torch.arange(int(n_real[1])))
        else:  # one new row per prompt, at its absolute position
            assert pos.shape == (2, 1) and torch.equal(pos[:, 0], n_real + step - 1), name
            assert n_keys == ids.shape[1] + step
    assert_no_hooks_left(hm, impl)


def test_steering_changes_the_greedy_continuation(tiny_llama):
    hm = tiny_llama
    base = hm.generate("The capital of France is", max_new_tokens=5)
    direction = hm.hf_model.get_input_embeddings().weight[1234]

    def steer(t, ctx):
        return t + 50 * direction / direction.norm()

    steered = hm.generate("The capital of France is", max_new_tokens=5, hooks={"1.mlp": steer})
    assert not torch.equal(base.tokens[0], steered.tokens[0])
    # steering toward a token's embedding on a tied model makes that token the continuation
    assert (steered.tokens[0] == 1234).float().mean() > 0.5


def test_hooks_removed_after_errors(tiny_llama):
    hm = tiny_llama
    impl = hm.hf_model.config._attn_implementation

    def fail_late(t, ctx):
        if ctx.step == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hm.generate("Hello there", max_new_tokens=5, hooks={"0.pattern": fail_late, "1.z": fail_late})
    assert_no_hooks_left(hm, impl)
    with pytest.raises(RuntimeError, match="boom"):
        hm.run(TEXTS, hooks={"1.pattern": lambda t, c: (_ for _ in ()).throw(RuntimeError("boom"))}, cache="all")
    assert_no_hooks_left(hm, impl)
    with pytest.raises(InputError):
        hm.run(TEXTS, hooks={"2.neurons": lambda t, c: t[..., :3]}, cache=["0.pattern"])
    assert_no_hooks_left(hm, impl)


def test_generate_refuses_encoders_and_bad_input(tiny_factory, tiny_llama):
    with pytest.raises(UnsupportedArchitecture, match="encoder"):
        tiny_factory("bert").generate("Hello", max_new_tokens=3)
    with pytest.raises(InputError, match="left"):
        tiny_llama.generate(TEXTS, max_new_tokens=3, padding_side="right")
    with pytest.raises(InputError, match="max_new_tokens"):
        tiny_llama.generate("Hello", max_new_tokens=0)


# ---------------------------------------------------------------------------- padding


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padding_equals_single_prompts(tiny_factory, family):
    """A left-padded batch equals each prompt run alone at its real tokens (absolute positions
    for GPT-2's learned position embeddings)."""
    hm = tiny_factory(family)
    run = hm.run(TEXTS, padding_side="left", cache=["1.mlp", "2.pattern", "0.attn"])
    rs = hm.residual_stream(TEXTS, padding_side="left")
    assert not run.mask[0, 0] and run.mask[:, -1].all()
    for b, text in enumerate(TEXTS):
        alone = hm.run(text, cache=["1.mlp", "2.pattern", "0.attn"])
        m = run.mask[b]
        n = int(m.sum())
        assert torch.equal(run.positions[b, m], torch.arange(n))
        assert rel_err(run.logits[b, m], alone.logits[0]) < 1e-5
        assert rel_err(run["1.mlp"][b, m], alone["1.mlp"][0]) < 1e-5
        assert rel_err(rs["0.attn"][b, m], alone["0.attn"][0]) < 1e-5
        assert rel_err(run["2.pattern"][b][:, m][:, :, m], alone["2.pattern"][0]) < 1e-5
    ids, mask = hm.tokenize(TEXTS, padding_side="left")
    assert torch.equal(ids, run.input_ids)


# ---------------------------------------------------------------------------- bad input


def test_bad_input(tiny_llama):
    hm = tiny_llama
    with pytest.raises(InputError, match=r"Valid names.*blocks\.<l>\.attn\.hook_pattern"):
        hm.run(TEXTS, cache=["blocks.1.hook_pattern"])
    with pytest.raises(InputError, match="unknown hook point '7.z'"):
        hm.run(TEXTS, hooks={"7.z": lambda t, c: None})
    wrong = r"hook at 1\.z returned \(2, 10, 4\) torch.float32, expected shape \(2, 10, 4, 16\)"
    with pytest.raises(InputError, match=wrong):
        hm.run(TEXTS, hooks={"1.z": lambda t, c: t[..., 0]})
    with pytest.raises(InputError, match=r"hook at 0\.mlp_out returned .*float16.*expected .*float32"):
        hm.run(TEXTS, hooks={"0.mlp_out": lambda t, c: t.half()})
    with pytest.raises(InputError, match="not callable"):
        hm.run(TEXTS, hooks={"0.z": 3})
    with pytest.raises(InputError, match="padding_side"):
        hm.run(TEXTS, padding_side="middle")
    run = hm.run(TEXTS, cache=["0.z"])
    with pytest.raises(KeyError, match="not cached"):
        run["1.z"]
    assert "blocks.0.attn.hook_z" in run and "1.z" not in run and "nonsense" not in run
    assert torch.equal(run["blocks.0.attn.hook_z"], run["0.z"])


def test_generate_cache_per_step_equals_run_on_the_sequence(tiny_llama):
    """With the key/value cache, step k's pattern row and stream equal a plain run over the
    sequence generated so far, at its last position."""
    hm = tiny_llama
    out = hm.generate("The capital of France is", max_new_tokens=4, cache=["1.pattern", "2.mlp"])
    assert len(out.cache["1.pattern"]) == out.steps == 4
    seq = out.sequences
    P = seq.shape[1] - 4
    assert out.cache["1.pattern"][0].shape[-2:] == (P, P)
    for k in range(1, 4):
        full = hm.run(seq[:, : P + k], cache=["1.pattern", "2.mlp"])
        assert out.cache["1.pattern"][k].shape == (1, hm.arch.n_heads, 1, P + k)
        assert rel_err(out.cache["1.pattern"][k][0, :, 0], full["1.pattern"][0, :, -1]) < 1e-5
        assert rel_err(out.cache["2.mlp"][k][0, 0], full["2.mlp"][0, -1]) < 1e-5


def test_stack_and_grad_on_inference_weights(tiny_factory, tokenizer):
    hm = tiny_factory("gpt2")
    run = hm.run(TEXTS, cache="resid")
    rs = hm.residual_stream(TEXTS)
    assert torch.equal(run.stack("resid"), rs.resid)
    assert run.stack(["1.mlp", "0.attn"]).shape == (2, *rs.resid.shape[1:])
    from conftest import make_tiny

    from depthscope.hooks import load_model

    with torch.inference_mode():
        frozen = load_model(make_tiny("llama", vocab_size=len(tokenizer)), tokenizer=tokenizer)
    assert frozen.run(TEXTS).logits is not None  # reading works
    with pytest.raises(InputError, match="inference tensors"):
        frozen.run(TEXTS, grad=True, cache=["1.z"])
    assert_no_hooks_left(frozen, frozen.hf_model.config._attn_implementation)


@pytest.mark.parametrize("name", ["embed", "1.attn", "1.mlp", "1.attn_out", "1.z", "1.heads", "1.neurons", "1.pattern"])
def test_patching_clean_values_into_a_corrupted_run(tiny_factory, name):
    """Activation patching's anchor: a residual site patched with its clean value everywhere turns
    the corrupted run into the clean one downstream, exactly; any point patched is what the model
    then uses (its cache equals the clean value) and moves the output away from the corrupted run."""
    hm = tiny_factory("llama")
    ids_c, _ = hm.tokenize("When Mary and John went to the store, John gave")
    ids_x, _ = hm.tokenize("When Mary and John went to the store, Mary gave")
    assert ids_c.shape == ids_x.shape
    c = hm.run(ids_c, cache=[name])
    x = hm.run(ids_x)
    p = hm.run(ids_x, hooks={name: lambda t, ctx: c[ctx.name]}, cache=[name])
    assert rel_err(x.logits, c.logits) > 1e-3
    assert torch.equal(p[name], c[name])
    assert rel_err(p.logits, x.logits) > 1e-4
    if name in ("embed", "1.attn", "1.mlp"):
        assert rel_err(p.logits, c.logits) < 1e-6, name
