"""depthscope's calls into transformers use the current API: the key/value cache keyword and the
returned cache are found on every decoder family, so activation patching really reuses the
corrupted prompt's prefix (a lost cache would silently fall back to full forwards)."""

from __future__ import annotations

import warnings

import pytest
import torch

from depthscope.analyses.circuits.patching.runs import _prefix_cache
from depthscope.hooks.arch import cache_keyword, returned_cache


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_prefix_cache_is_returned_and_accepted_without_deprecation(tiny_factory, family):
    model = tiny_factory(family)
    ids, _ = model.tokenize(["When Mary and John went to the store"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        past = _prefix_cache(model, ids, 3, 2)
        assert past is not None, "the prefix cache was lost: patching would not reuse the prefix"
        out = model.hf_model(
            input_ids=ids[:, 3:].expand(2, -1),
            attention_mask=torch.ones(2, ids.shape[1], dtype=torch.long),
            use_cache=True,
            **{cache_keyword(model.hf_model): past.cache},
        )
    full = model.hf_model(input_ids=ids).logits[0, 3:]
    torch.testing.assert_close(out.logits[0], full, atol=1e-5, rtol=1e-4)
    assert returned_cache(out) is not None


def test_returned_cache_reads_either_name():
    class Old(dict):
        pass

    assert returned_cache(Old(past_key_values="kv")) == "kv"
    assert returned_cache(Old(cache="kv")) == "kv"
    assert returned_cache(Old()) is None
