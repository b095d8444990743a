"""Skipped sublayers (hooks/sublayer_skip.py): a skipped module hands on zeros of its output's shape,
its hooks still run, and the model is restored after the context, also on error; checked against
the plain forward with hooks that replace the same outputs, on three decoder families."""

from __future__ import annotations

import pytest
import torch

from depthscope.hooks.sublayer_skip import out_width, skipped

TEXTS = ["the cat sat on the mat", "a dog ran far away from home today"]


def _zero(t, ctx):
    return torch.zeros_like(t)


def _mlps(model):
    return [(m, None) for m in model.arch.mlp]


def _qkv(model):
    a = model.arch
    return [(p, out_width(p)) for kind in (a.q_proj, a.k_proj, a.v_proj) for p in kind]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_a_skipped_mlp_writes_zeros_and_its_hooks_still_run(tiny_factory, family):
    model = tiny_factory(family, n_layers=3)
    ids, mask = model._prepare(TEXTS, None)
    L = model.n_layers
    zeroed = model.run(ids, mask=mask, hooks={f"{layer}.mlp_out": _zero for layer in range(L)}, cache=["1.mlp_in"])
    seen = []
    with skipped(_mlps(model)):
        part = model.run(ids, mask=mask, hooks={"2.mlp_out": lambda t, ctx: seen.append(t.clone())}, cache=["1.mlp_in"])
    assert torch.equal(zeroed.logits, part.logits)
    assert torch.equal(zeroed.cache["1.mlp_in"], part.cache["1.mlp_in"])  # l.mlp_in: the MLP's input, read
    assert len(seen) == 1 and not seen[0].any()  # l.mlp_out: reached, and zero


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_skipped_projections_change_nothing_once_the_heads_are_replaced(tiny_factory, family):
    """With q/k/v skipped the model's own attention runs on zeros; replacing ``l.z`` by the clean
    heads' outputs gives back the clean logits exactly as replacing them in the plain forward does."""
    model = tiny_factory(family, n_layers=3)
    ids, mask = model._prepare(TEXTS, None)
    z = [f"{layer}.z" for layer in range(model.n_layers)]
    clean = model.run(ids, mask=mask, cache=z)
    put = {name: (lambda t, ctx, v=clean.cache[name]: v) for name in z}
    plain = model.run(ids, mask=mask, hooks=put)
    with skipped(_qkv(model)):
        part = model.run(ids, mask=mask, hooks=put)
        bare = model.run(ids, mask=mask)
    assert torch.equal(plain.logits, part.logits)
    assert not torch.allclose(bare.logits, clean.logits)  # without the replacement the skip shows


def test_the_model_is_restored_after_the_context_also_on_error(tiny_factory):
    model = tiny_factory("llama", n_layers=2)
    ids, mask = model._prepare(TEXTS, None)
    before = model.run(ids, mask=mask).logits
    mods = [m for m, _ in _mlps(model) + _qkv(model)]
    with pytest.raises(RuntimeError, match="boom"), skipped(_mlps(model) + _qkv(model)):
        assert all("forward" in m.__dict__ for m in mods)
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in mods)
    assert torch.equal(model.run(ids, mask=mask).logits, before)
