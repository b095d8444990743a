"""Per-head analyses on sandwich-norm families (OLMo-2, Gemma-2/3), where ``l.attn_out`` is taken
after the post-attention norm: the heads sum to the output projection's output, and
``norm_weighted_attention`` checks them against that, not against the normed write."""

from __future__ import annotations

import pytest
from test_points import make_family

from depthscope.analyses.norms.heads import norm_weighted_attention
from depthscope.hooks import load_model


@pytest.mark.parametrize("family", ["olmo2", "gemma2"])
def test_norm_weighted_attention_on_sandwich_norm_families(tiny_tokenizer, family):
    model = load_model(make_family(family, len(tiny_tokenizer)), tokenizer=tiny_tokenizer)
    text = "The cat sat on the mat."
    df = norm_weighted_attention(model, text)
    P = len(model.tokenize([text])[0][0])
    assert len(df) == model.n_layers * 4 * P * (P + 1) // 2
    # the attention weights of each query sum to one over its keys, per head
    sums = df.groupby(["layer", "head", "query"])["weight"].sum()
    assert (sums - 1).abs().max() < 1e-5
    assert (df["norm_weighted"] - df["weight"] * df["value_norm"]).abs().max() < 1e-6
