"""Forwards that start late (hooks/late_start.py, hooks/block_start.py): at a block from the stream
entering it, or at a position from a key/value prefix, with hooks that edit a site after the start,
equal to the full forward on every decoder family; bad streams and hook points before the start
refused with what was expected; the interventions (hooks/interventions.py)."""

from __future__ import annotations

import pytest
import torch

from depthscope.common.errors import InputError
from depthscope.hooks import from_block, late_start, load_model
from depthscope.hooks.interventions import FeatureSwap, SubspaceSwap, Unchanged, VectorSwap
from depthscope.hooks.late_start import Budget, KVPrefix, tail_logits
from depthscope.hooks.sites import site_labels

FAMILIES = ["llama", "gpt2", "gpt_neox", "qwen2", "gemma2"]
TEXT = "the cat sat on the mat and a dog ran far away"


def _hf(family: str, vocab: int):
    """conftest's tiny models, plus a tiny Qwen2 and (test_points') Gemma-2."""
    import transformers as tf
    from conftest import make_tiny
    from test_points import make_family

    if family == "qwen2":
        torch.manual_seed(0)
        cfg = tf.Qwen2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return tf.Qwen2ForCausalLM(cfg).eval()
    if family == "gemma2":
        return make_family("gemma2", vocab, n_layers=3)
    return make_tiny(family, vocab_size=vocab, n_layers=3)


@pytest.fixture(scope="module")
def family_model(tiny_tokenizer):
    made = {}

    def get(family):
        if family not in made:
            made[family] = load_model(_hf(family, len(tiny_tokenizer)), tokenizer=tiny_tokenizer)
        return made[family]

    return get


def _edit(at: int | None = None):
    """A hook scaling the stream (at position ``at`` only, when given)."""

    def fn(h, ctx):
        new = h.clone()
        if at is None:
            return h * 0.5 + 1.0
        new[:, at] = h[:, at] * 0.5 + 1.0
        return new

    return fn


@pytest.mark.parametrize("family", FAMILIES)
def test_a_block_start_equals_the_full_forward(family_model, family):
    model = family_model(family)
    ids = model._prepare([TEXT, TEXT[:20]], None)[0]
    mask = model._prepare([TEXT, TEXT[:20]], None)[1]
    labels = site_labels(model.n_layers)
    for block in range(model.n_layers):
        stream = model.residual_stream(ids, sites=[2 * block], mask=mask, return_logits=False).resid[0]
        site = labels[2 * block + 1]  # l.attn: after the start
        full = model.run(ids, mask=mask, hooks={site: _edit()})
        with from_block(model, block, stream):
            part = model.run(ids, mask=mask, hooks={site: _edit()})
        assert torch.equal(full.logits, part.logits), (family, block)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_position_start_equals_the_full_forward(family_model, family):
    """Positions ``start..`` from the prompt's key/value prefix, with an edit at a position after the
    start, give the full forward's logits there (to float rounding: the attention over the cached
    keys is one matrix product of other shapes); the prefix is kept whole for the next use."""
    model = family_model(family)
    ids = model._prepare([TEXT], None)[0].expand(3, -1)
    n = ids.shape[1]
    labels = site_labels(model.n_layers)
    for start in (1, n // 2, n - 1):
        prefix = KVPrefix.build(model, ids[:1], start).repeat(3)
        kept = prefix.nbytes
        assert kept > 0
        for site in (labels[1], labels[-1]):
            at = n - 1
            full = model.run(ids, hooks={site: _edit(at)}).logits[:, start:]
            part = prefix.forward(ids, {site: _edit(at - start)})
            torch.testing.assert_close(part, full, rtol=0, atol=2e-6)
            assert prefix.nbytes == kept  # not appended to
            last = tail_logits(model, ids, {site: _edit(at - start)}, prefix, last_only=True)
            assert torch.equal(last[:, -1], part[:, -1]) or torch.allclose(last[:, -1], part[:, -1], atol=2e-6)
        edited = prefix.forward(ids, {labels[-1]: _edit(n - 1 - start)})
        plain = prefix.forward(ids, {})
        assert not torch.allclose(edited[:, -1], plain[:, -1])  # the hook ran on the tail


def test_no_prefix_without_positions_or_for_an_encoder(family_model, tiny_factory):
    model = family_model("llama")
    ids = model._prepare([TEXT], None)[0]
    assert KVPrefix.build(model, ids, 0) is None
    assert KVPrefix.build(tiny_factory("bert", n_layers=2), ids, 3) is None
    # no prefix: every position, a plain forward with the hooks
    got = tail_logits(model, ids, {"1.mlp": _edit()})
    assert torch.equal(got, model.run(ids, hooks={"1.mlp": _edit()}).logits)


def test_the_budget_closes_once_and_is_read_at_each_call(monkeypatch):
    monkeypatch.setattr(late_start, "PREFIX_BYTES", 10)
    b = Budget()
    assert b.take(6) and not b.take(6) and not b.take(0)  # closed for good
    monkeypatch.setattr(late_start, "PREFIX_BYTES", 0)
    assert Budget().take(0) and not Budget().take(1)


# ----------------------------------------------------------------------------- bad calls (issue 68)
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda s: s.tolist(), "a torch.Tensor"),
        (lambda s: s.long(), "dtype torch.float32"),
        (lambda s: s.half(), "dtype torch.float32"),
        (lambda s: s.double(), "dtype torch.float32"),
        (lambda s: torch.empty(s.shape, device="meta"), "device cpu"),
    ],
)
def test_a_stream_of_the_wrong_type_dtype_or_device_is_refused(family_model, make, match):
    model = family_model("llama")
    ids, mask = model._prepare([TEXT], None)
    stream = model.residual_stream(ids, sites=[2], mask=mask, return_logits=False).resid[0]
    with pytest.raises(InputError, match=match):
        with from_block(model, 1, make(stream)):
            model.run(ids, mask=mask)
    assert all(type(b).__name__ != "Skipped" for b in model.arch.blocks)


def test_a_hook_point_before_the_start_block_names_the_skipped_blocks(family_model):
    model = family_model("llama")
    ids, mask = model._prepare([TEXT], None)
    stream = model.residual_stream(ids, sites=[4], mask=mask, return_logits=False).resid[0]
    with from_block(model, 2, stream):
        for point in ("0.mlp", "1.z", "1.resid_pre"):
            with pytest.raises(InputError, match=r"blocks 0\.\.1, which this forward skips.*block 2"):
                model.run(ids, mask=mask, hooks={point: _edit()})
        with pytest.raises(InputError, match=r"blocks 0\.\.1"):
            model.run(ids, mask=mask, cache=["1.attn"])
        # the embedding and block 2 on are reached
        got = model.run(ids, mask=mask, cache=["embed", "2.attn"])
    full = model.run(ids, mask=mask, cache=["embed", "2.attn"])
    assert torch.equal(got["2.attn"], full["2.attn"]) and torch.equal(got["embed"], full["embed"])


# ----------------------------------------------------------------------------- interventions
def test_the_interventions():
    g = torch.Generator().manual_seed(0)
    base, source = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    assert Unchanged()(base, source) is base
    assert torch.equal(VectorSwap()(base.half(), source), source.half())
    r = torch.linalg.qr(torch.randn(6, 2, generator=g))[0]
    got = SubspaceSwap(r)(base, source)
    torch.testing.assert_close(got @ r, source @ r)  # the source's coordinates in the subspace
    q = torch.linalg.qr(torch.cat([r, torch.randn(6, 4, generator=g)], 1))[0][:, 2:]  # r's complement
    torch.testing.assert_close(got @ q, base @ q)  # the base's elsewhere
    idx = torch.tensor([0, 5, 5, 2])
    got = FeatureSwap(idx)(base, source)
    for i, j in enumerate(idx.tolist()):
        assert got[i, j] == source[i, j]
        others = [k for k in range(6) if k != j]
        assert torch.equal(got[i, others], base[i, others])


# ----------------------------------------------------------------------------- callers
def test_layer_interventions_start_at_their_block_with_the_same_numbers(tiny_factory, monkeypatch):
    """The skip and swap forwards start at their block from the clean stream (analyses/causal/
    layers.py): block 0 runs once per batch (the unmodified forward) and the skips and swaps of
    block 0; the table equals the one of full forwards (budget 0), bit for bit."""
    import pandas as pd

    from depthscope.analyses.causal.erasure.layers import layer_interventions

    model = tiny_factory("llama", n_layers=4)
    texts = ["the cat sat on the mat", "a dog ran far away from home today"]
    ran = []
    handle = model.arch.blocks[0].register_forward_hook(lambda *a: ran.append(1))
    try:
        late = layer_interventions(model, texts, batch_size=2)
    finally:
        handle.remove()
    assert len(ran) == 3  # the unmodified forward, skip 0 (its identity runs the block) and swap 0
    monkeypatch.setattr(late_start, "PREFIX_BYTES", 0)
    pd.testing.assert_frame_equal(late, layer_interventions(model, texts, batch_size=2), check_exact=True)
