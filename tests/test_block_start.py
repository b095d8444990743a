"""Forwards that start at a block (hooks/block_start.py): equal, bit for bit, to the full forward
with the same hooks, on every decoder family; the model restored after; bad calls refused."""

from __future__ import annotations

import pytest
import torch

from depthscope.common.errors import InputError
from depthscope.hooks import from_block
from depthscope.hooks.sites import site_labels

TEXTS = ["the cat sat on the mat", "a dog ran far away from home today"]


def _scale(h, ctx):
    return h * 0.5 + 1.0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_starting_at_a_block_equals_the_full_forward(tiny_factory, family):
    model = tiny_factory(family, n_layers=4)
    ids, mask = model._prepare(TEXTS, None)
    labels = site_labels(model.n_layers)
    for block in range(model.n_layers):
        start = model.residual_stream(ids, sites=[2 * block], mask=mask, return_logits=False).resid[0]
        for site in (labels[2 * block + 1], labels[2 * block + 2], labels[-1]):
            full = model.run(ids, mask=mask, hooks={site: _scale}, cache=[site])
            with from_block(model, block, start):
                part = model.run(ids, mask=mask, hooks={site: _scale}, cache=[site])
            assert torch.equal(full.logits, part.logits), (family, block, site)
            assert torch.equal(full.cache[site], part.cache[site]), (family, block, site)
    # restored: a plain forward after the contexts is the plain forward
    assert torch.equal(model.run(ids, mask=mask).logits, model.run(ids, mask=mask).logits)


def test_the_given_stream_is_what_the_blocks_see(tiny_factory):
    """A different stream changes the output: the blocks before are not run, the stream is used."""
    model = tiny_factory("llama", n_layers=3)
    ids, mask = model._prepare(TEXTS, None)
    start = model.residual_stream(ids, sites=[2], mask=mask, return_logits=False).resid[0]
    ran = []
    handle = model.arch.blocks[0].register_forward_hook(lambda *a: ran.append(1))
    with from_block(model, 1, start):
        same = model.run(ids, mask=mask).logits
    handle.remove()
    assert ran == []  # block 0 computed nothing
    with from_block(model, 1, torch.zeros_like(start)):
        zero = model.run(ids, mask=mask).logits
    assert torch.equal(same, model.run(ids, mask=mask).logits)
    assert not torch.allclose(same, zero)


def test_bad_calls_are_refused_and_the_model_restored(tiny_factory):
    model = tiny_factory("llama", n_layers=3)
    ids, mask = model._prepare(TEXTS, None)
    before = model.run(ids, mask=mask).logits
    with pytest.raises(InputError, match="block must be in"):
        with from_block(model, 3, torch.zeros(1)):
            pass
    with pytest.raises(InputError, match="needs the stream"):
        with from_block(model, 2, None):
            pass
    with pytest.raises(InputError, match="the stream given is"):
        with from_block(model, 1, torch.zeros(1, 2, model.d_model)):
            model.run(ids, mask=mask)
    assert torch.equal(model.run(ids, mask=mask).logits, before)
    assert all(type(b).__name__ != "Skipped" for b in model.arch.blocks)
