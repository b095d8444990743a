"""The attention's inside as hook points: ``l.q``, ``l.k``, ``l.v`` (projection outputs per head),
``l.rot_q``, ``l.rot_k`` (as the attention function gets them) and ``l.scores`` (pre-softmax,
mask added), read, written, differentiated and used in generation, each against an independent
computation with transformers: plain PyTorch hooks on module paths written out here, the modeling
file's own ``apply_rotary_pos_emb``, ``output_attentions=True`` under eager attention, and the
modeling file's eager attention function wrapped for one layer."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from test_points import make_family, rel_err

from depthscope.common.errors import UnsupportedArchitecture
from depthscope.hooks import Point, load_model, parse_point, point_names, tl_name

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The capital of France is", "Hello world, this is a longer second sentence."]
FAMILIES = ["llama", "gpt2", "gpt_neox", "bert", "olmo2", "gemma2", "gemma3"]
# attention module of each block (the one that calls the attention function), written out here
ATTN = {
    "llama": ("model.layers", "self_attn"),
    "gpt2": ("transformer.h", "attn"),
    "gpt_neox": ("gpt_neox.layers", "attention"),
    "bert": ("bert.encoder.layer", "attention.self"),
}
ATTN["olmo2"] = ATTN["gemma2"] = ATTN["gemma3"] = ATTN["llama"]
SEPARATE = {"bert": ("query", "key", "value")}  # else q_proj, k_proj, v_proj; gpt2 / gpt_neox are fused


def _get(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


@pytest.fixture(scope="module")
def fam(tiny_tokenizer):
    made = {}

    def get(family):
        if family not in made:
            made[family] = load_model(make_family(family, len(tiny_tokenizer)), tokenizer=tiny_tokenizer)
        return made[family]

    return get


def attn_modules(hf, family):
    blocks, path = ATTN[family]
    return [_get(b, path) for b in _get(hf, blocks)]


def proj_modules(attn, family):
    if family == "gpt2":
        return (attn.c_attn,) * 3
    if family == "gpt_neox":
        return (attn.query_key_value,) * 3
    return tuple(getattr(attn, n) for n in SEPARATE.get(family, ("q_proj", "k_proj", "v_proj")))


def split_qkv(family, outs, n_heads, d_head):
    """q, k, v [batch, pos, heads, d_head] from the projections' raw outputs."""
    if family == "gpt2":
        return [t.unflatten(-1, (n_heads, d_head)) for t in outs[0].split(n_heads * d_head, dim=-1)]
    if family == "gpt_neox":
        return list(outs[0].unflatten(-1, (n_heads, 3 * d_head)).chunk(3, dim=-1))
    return [t.unflatten(-1, (-1, d_head)) for t in outs]


def head_dim(hf):
    cfg = hf.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def reference(hf, family, ids, mask):
    """Per layer q, k, v, rot_q, rot_k and the eager pattern, from a plain eager forward."""
    attns, raw, handles = attn_modules(hf, family), {}, []
    for l, attn in enumerate(attns):
        mods = proj_modules(attn, family)
        for i, m in enumerate(dict.fromkeys(mods)):  # a fused projection once
            handles.append(m.register_forward_hook(lambda mod, a, o, key=(l, i): raw.__setitem__(key, o)))
        handles.append(
            attn.register_forward_pre_hook(
                lambda mod, a, kw, l=l: raw.__setitem__((l, "pe"), kw.get("position_embeddings")), with_kwargs=True
            )
        )
    old = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask.long(), output_attentions=True)
    finally:
        hf.set_attn_implementation(old)
        for h in handles:
            h.remove()
    H, dh, ref = hf.config.num_attention_heads, head_dim(hf), {}
    for l, attn in enumerate(attns):
        n = 1 if family in ("gpt2", "gpt_neox") else 3
        q, k, v = split_qkv(family, [raw[(l, i)] for i in range(n)], H, dh)
        ref[l] = dict(q=q, k=k, v=v, pattern=out.attentions[l])
        rq, rk = q, k
        with torch.no_grad():
            if family == "olmo2":  # the query/key norms act on the whole projection output
                rq, rk = (
                    attn.q_norm(q.flatten(-2)).unflatten(-1, q.shape[-2:]),
                    attn.k_norm(k.flatten(-2)).unflatten(-1, k.shape[-2:]),
                )
            elif family == "gemma3":  # per head
                rq, rk = attn.q_norm(q), attn.k_norm(k)
            pe = raw[(l, "pe")]
            if pe is not None:
                rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
                rq, rk = rope(rq, rk, *pe, unsqueeze_dim=2)
        ref[l].update(rot_q=rq, rot_k=rk)
    return ref, out


def score_scale(hf, family):
    if family in ("gemma2", "gemma3"):
        return hf.config.query_pre_attn_scalar**-0.5
    return head_dim(hf) ** -0.5


# ---------------------------------------------------------------------------- names


def test_aliases_and_order():
    aliases = {
        "q": "attn.hook_q",
        "k": "attn.hook_k",
        "v": "attn.hook_v",
        "rot_q": "attn.hook_rot_q",
        "rot_k": "attn.hook_rot_k",
        "scores": "attn.hook_attn_scores",
    }
    for kind, tl in aliases.items():
        assert parse_point(f"blocks.2.{tl}", 4) == Point(kind, 2)
        assert parse_point(f"2.{kind}", 4) == Point(kind, 2) and tl_name(Point(kind, 2)) == f"blocks.2.{tl}"
    assert point_names(1)[:8] == ["embed", "0.q", "0.k", "0.v", "0.rot_q", "0.rot_k", "0.scores", "0.pattern"]


# ---------------------------------------------------------------------------- reading


@pytest.mark.parametrize("family", FAMILIES)
def test_read_equals_transformers(fam, family):
    hm = fam(family)
    kinds = ["q", "k", "v", "rot_q", "rot_k", "scores", "pattern"]
    run = hm.run(TEXTS, cache=[f"{l}.{k}" for l in range(hm.n_layers) for k in kinds])
    ref, _ = reference(hm.hf_model, family, run.input_ids, run.mask)
    cfg = hm.hf_model.config
    H, KV = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for l in range(hm.n_layers):
        assert run[f"{l}.q"].shape[2] == H and run[f"{l}.k"].shape[2] == KV and run[f"{l}.v"].shape[2] == KV
        for kind in ("q", "k", "v", "rot_q", "rot_k", "pattern"):
            assert run[f"{l}.{kind}"].shape == ref[l][kind].shape, (l, kind)
            assert rel_err(run[f"{l}.{kind}"], ref[l][kind]) < 1e-5, (l, kind)
        # the scores: softmax gives transformers' pattern; at the keys the mask allows they are
        # q.k^T scaled (soft-capped in Gemma-2); elsewhere the mask's large negative value
        scores, pattern = run[f"{l}.scores"], ref[l]["pattern"]
        assert rel_err(torch.softmax(scores.float(), -1), pattern) < 1e-5
        rk = ref[l]["rot_k"].repeat_interleave(H // KV, dim=2)
        qk = torch.einsum("bqhd,bkhd->bhqk", ref[l]["rot_q"], rk) * score_scale(hm.hf_model, family)
        if family == "gemma2":
            qk = torch.tanh(qk / cfg.attn_logit_softcapping) * cfg.attn_logit_softcapping
        allowed = (pattern > 0) & run.mask[:, None, :, None]  # padded queries may see only masked keys
        assert rel_err(scores[allowed], qk[allowed]) < 1e-5
        assert bool((scores[pattern == 0] < -1e30).all())
    if family in ("gpt2", "bert"):  # no rotary: rot_q, rot_k are q, k
        assert torch.equal(run["0.rot_q"], run["0.q"]) and torch.equal(run["0.rot_k"], run["0.k"])


def test_matches_transformer_lens_bridge(tiny_tokenizer):
    """TransformerLens names the same tensors: a bridge over the same tiny Llama gives equal
    hook_q/k/v, hook_rot_q/k and hook_attn_scores (where unmasked) to depthscope on an unbridged copy."""
    from conftest import make_tiny
    from transformer_lens.model_bridge import TransformerBridge

    plain = load_model(make_tiny("llama", vocab_size=len(tiny_tokenizer)), tokenizer=tiny_tokenizer)
    btok = copy.deepcopy(tiny_tokenizer)
    btok.init_kwargs.update(name_or_path="tiny", add_bos_token=True)  # what the bridge's tokenizer setup reads
    bridge = TransformerBridge.boot_transformers(
        "llama-tiny", hf_model=make_tiny("llama", vocab_size=len(tiny_tokenizer)), tokenizer=btok
    )
    ids = torch.tensor([tiny_tokenizer(TEXTS[0])["input_ids"]])
    run = plain.run(ids, cache=["1.q", "1.k", "1.v", "1.rot_q", "1.rot_k", "1.scores"])
    _, cache = bridge.run_with_cache(
        ids,
        names_filter=lambda n: (
            n.startswith("blocks.1.attn.hook_") and "input" not in n and n.split("_")[-1] not in ("in", "result")
        ),
    )
    for kind in ("q", "k", "v", "rot_q", "rot_k"):
        assert rel_err(run[f"1.{kind}"], cache[f"blocks.1.attn.hook_{kind}"]) < 1e-5, kind
    theirs = cache["blocks.1.attn.hook_attn_scores"]
    ok = torch.isfinite(theirs) & (theirs > -1e30)
    assert rel_err(run["1.scores"][ok], theirs[ok]) < 1e-5 and bool((run["1.scores"][~ok] < -1e30).all())
    # on the bridge itself q/k/v are the projections' outputs; the attention-function points are refused
    hm = load_model(bridge, tokenizer=tiny_tokenizer)
    assert rel_err(hm.run(ids, cache=["1.q"])["1.q"], cache["blocks.1.attn.hook_q"]) < 1e-5
    for name in ("1.pattern", "1.scores", "blocks.1.attn.hook_rot_k"):
        with pytest.raises(UnsupportedArchitecture, match="TransformerBridge"):
            hm.run(ids, cache=[name])


# ---------------------------------------------------------------------------- writing


def _zero_head(part: int, head: int, family: str, d_head: int, n_heads: int):
    """A plain hook zeroing one head of q (0), k (1) or v (2) in a projection's raw output."""

    def hook(mod, args, out):
        out = out.clone()
        if family == "gpt2":
            lo = part * n_heads * d_head + head * d_head
            out[..., lo : lo + d_head] = 0
        elif family == "gpt_neox":
            lo = head * 3 * d_head + part * d_head
            out[..., lo : lo + d_head] = 0
        else:
            out[..., head * d_head : (head + 1) * d_head] = 0
        return out

    return hook


@pytest.mark.parametrize(
    "family,kind",
    [
        ("llama", "q"),
        ("llama", "k"),
        ("gpt2", "k"),
        ("gpt_neox", "q"),
        ("gpt_neox", "v"),
        ("bert", "v"),
        ("olmo2", "q"),
    ],
)
def test_write_equals_plain_hook(fam, family, kind):
    hm = fam(family)
    part, head, layer = "qkv".index(kind), 1, 1
    hf, dh = hm.hf_model, head_dim(hm.hf_model)

    def zero(t, ctx):
        t = t.clone()
        t[:, :, head] = 0
        return t

    base = hm.run(TEXTS)
    ours = hm.run(TEXTS, hooks={f"{layer}.{kind}": zero}, cache=[f"{layer}.{kind}"])
    assert bool((ours[f"{layer}.{kind}"][:, :, head] == 0).all())
    mod = proj_modules(attn_modules(hf, family)[layer], family)[part]
    handle = mod.register_forward_hook(_zero_head(part, head, family, dh, hf.config.num_attention_heads))
    try:
        with torch.no_grad():
            want = hf(input_ids=ours.input_ids, attention_mask=ours.mask.long()).logits
    finally:
        handle.remove()
    m = ours.mask
    assert rel_err(ours.logits[m], want[m]) < 1e-5
    assert rel_err(ours.logits[m], base.logits[m]) > 1e-4  # the edit matters


def _wrapped_eager(monkeypatch, hf, family, layer, edit):
    """The modeling file's eager attention with ``edit(query, key, mask) -> (query, key, mask)``
    applied in one layer, and the model switched to eager attention."""
    modeling = sys.modules[type(attn_modules(hf, family)[0]).__module__]
    orig = modeling.eager_attention_forward

    def eager(module, query, key, value, attention_mask, **kw):
        if module.layer_idx == layer:
            query, key, attention_mask = edit(query, key, attention_mask)
        return orig(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(modeling, "eager_attention_forward", eager)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_rot_and_score_writes_equal_an_edited_eager_attention(fam, family, monkeypatch):
    """Adding to the scores is adding to the additive mask; replacing rot_q / rot_k is replacing
    the query / key the eager attention function gets."""
    hm = fam(family)
    hf, layer = hm.hf_model, 1
    base = hm.run(TEXTS)
    ids, mask = base.input_ids, base.mask
    P = ids.shape[1]
    g = torch.Generator().manual_seed(0)
    bias = 3 * torch.randn(1, hf.config.num_attention_heads, P, P, generator=g)

    def halve_q(t, ctx):
        return t * 0.5

    def zero_k(t, ctx):
        t = t.clone()
        t[:, :, 0] = 0
        return t

    cases = {
        "scores": (lambda t, ctx: t + bias, lambda q, k, m: (q, k, m + bias)),
        "rot_q": (halve_q, lambda q, k, m: (q * 0.5, k, m)),
        "rot_k": (zero_k, lambda q, k, m: (q, torch.cat([torch.zeros_like(k[:, :1]), k[:, 1:]], 1), m)),
    }
    old = hf.config._attn_implementation
    for kind, (ours_fn, edit) in cases.items():
        ours = hm.run(TEXTS, hooks={f"{layer}.{kind}": ours_fn})
        with monkeypatch.context() as mp:
            _wrapped_eager(mp, hf, family, layer, edit)
            hf.set_attn_implementation("eager")
            try:
                with torch.no_grad():
                    want = hf(input_ids=ids, attention_mask=mask.long()).logits
            finally:
                hf.set_attn_implementation(old)
        assert rel_err(ours.logits[mask], want[mask]) < 1e-5, kind
        assert rel_err(ours.logits[mask], base.logits[mask]) > 1e-4, kind


# ---------------------------------------------------------------------------- gradients


def test_gradients(fam):
    """l.q's gradient equals the gradient at the q projection's output (plain hooks, eager); the
    scores' gradient is the softmax Jacobian applied to the pattern's gradient."""
    hm = fam("llama")
    hf, layer, tok = hm.hf_model, 1, 7
    run = hm.run(TEXTS[:1], cache=[f"{layer}.q", f"{layer}.scores", f"{layer}.pattern", f"{layer}.rot_k"], grad=True)
    run.logits[0, -1, tok].backward()
    kept = {}

    def keep(mod, args, out):
        out.retain_grad()
        kept["q"] = out

    handle = hf.model.layers[layer].self_attn.q_proj.register_forward_hook(keep)
    old = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        embeds = hf.get_input_embeddings()(run.input_ids).detach().requires_grad_(True)  # weights are frozen
        hf(inputs_embeds=embeds).logits[0, -1, tok].backward()
    finally:
        hf.set_attn_implementation(old)
        handle.remove()
        hf.zero_grad(set_to_none=True)
    want = kept["q"].grad.unflatten(-1, (hf.config.num_attention_heads, -1))
    assert rel_err(run.grad(f"{layer}.q"), want) < 1e-5
    p, gp = run[f"{layer}.pattern"].detach(), run.grad(f"{layer}.pattern")
    assert rel_err(run.grad(f"{layer}.scores"), p * (gp - (gp * p).sum(-1, keepdim=True))) < 1e-5
    assert run.grad(f"{layer}.rot_k").shape == run[f"{layer}.rot_k"].shape
    assert float(run.grad(f"{layer}.rot_k").abs().max()) > 0


# ---------------------------------------------------------------------------- generation


def test_generation_hook_on_q(fam, tiny_tokenizer):
    hm = fam("llama")
    hf, layer, n = hm.hf_model, 0, 6
    steps = []

    def negate_q(t, ctx):
        steps.append((ctx.step, t.shape[1]))
        return -t

    prompt = TEXTS[1]
    out = hm.generate([prompt], max_new_tokens=n, hooks={f"{layer}.q": negate_q}, cache=[f"{layer}.rot_k"])
    P = len(tiny_tokenizer(prompt)["input_ids"])
    assert steps == [(0, P)] + [(k, 1) for k in range(1, n)]
    # rot_k covers every key the attention sees at each step, cached ones included
    assert [t.shape[1] for t in out.cache[f"{layer}.rot_k"]] == [P + k for k in range(n)]

    ids = torch.tensor([tiny_tokenizer(prompt)["input_ids"]])
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        free = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        handle = hf.model.layers[layer].self_attn.q_proj.register_forward_hook(lambda m, a, o: -o)
        try:
            want = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        finally:
            handle.remove()
    assert torch.equal(out.sequences, want)
    assert not torch.equal(want, free)  # the edit changes the tokens


# ---------------------------------------------------------------------------- refusals


def test_unreached_point_is_an_error(tiny_factory):
    """A point whose module the forward never runs is refused after the forward, never silently
    missing from the cache (here: the architecture map pointed at modules outside the model)."""
    hm = tiny_factory("llama")
    hm.arch.attn_fn[1] = torch.nn.Linear(2, 2)
    hm.arch.q_proj[0] = torch.nn.Linear(2, 2)
    with pytest.raises(UnsupportedArchitecture, match=r"\['0.q', '1.pattern'\].*never reached"):
        hm.run(TEXTS, cache=["0.q", "1.pattern", "1.z"])
    with pytest.raises(UnsupportedArchitecture, match="1.scores"):
        hm.run(TEXTS, hooks={"1.scores": lambda t, c: None})
    assert "1.z" in hm.run(TEXTS, cache=["1.z"])  # other points still work


def test_scores_refused_where_the_formula_does_not_fit(fam, monkeypatch):
    """A family whose eager attention does something the generic score formula does not (here:
    a doubled scale) is refused for l.scores, naming the family and the point; the pattern stays."""
    hm = fam("llama")
    modeling = sys.modules[type(hm.hf_model.model.layers[0].self_attn).__module__]
    orig = modeling.eager_attention_forward
    monkeypatch.setattr(
        modeling,
        "eager_attention_forward",
        lambda m, q, k, v, mask, scaling, **kw: orig(m, q, k, v, mask, 2 * scaling, **kw),
    )
    with pytest.raises(UnsupportedArchitecture, match=r"llama.*l\.scores"):
        hm.run(TEXTS, cache=["1.scores"])
    assert hm.run(TEXTS, cache=["1.pattern"])["1.pattern"].shape[1] == 4


# ---------------------------------------------------------------------------- the real model


def test_default_model_qkv(default_model):
    """SmolLM2-135M (9 query heads, 3 key/value heads): q, k, v are the projections' outputs."""
    hm = default_model
    run = hm.run(TEXTS, cache=["5.q", "5.k", "5.v"])
    attn, got = hm.hf_model.model.layers[5].self_attn, {}
    handles = [
        getattr(attn, f"{x}_proj").register_forward_hook(lambda m, a, o, x=x: got.__setitem__(x, o)) for x in "qkv"
    ]
    try:
        with torch.no_grad():
            hm.hf_model(input_ids=run.input_ids, attention_mask=run.mask.long())
    finally:
        for h in handles:
            h.remove()
    assert run["5.q"].shape[2:] == (9, 64) and run["5.k"].shape[2:] == (3, 64) and run["5.v"].shape[2:] == (3, 64)
    for x in "qkv":
        assert rel_err(run[f"5.{x}"], got[x].unflatten(-1, (-1, 64))) < 1e-6, x
