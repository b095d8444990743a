"""What keeps an attribution graph's memory down changes no number: the packed patterns are the
recorded ones, the pattern mixing's own backward is einsum's under batched gradients, and the
rows (writes rebuilt in position chunks or kept, activations sparse) equal a straightforward dense
computation: one plain backward per target through the frozen model with the model's own
recorded patterns, dotted with dense activations times decoder rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthscope.analyses.circuits.features import (
    AttributionConfig,
    attribute,
    attribution_graph_of,
    patterns,
    replacement,
    replacement_model,
)
from depthscope.analyses.circuits.features.patterns import Patterns, mix
from depthscope.hooks import load_model
from tests.test_attribution import PROMPT, make_model, random_transcoder, rel

pytestmark = pytest.mark.usefixtures("one_thread")


def causal_pattern(heads: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, heads, n, n, generator=g, dtype=torch.float64)
    return torch.softmax(scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1)


def test_packed_patterns_are_the_recorded_ones_bit_for_bit():
    causal = causal_pattern(3, 7, 0)
    full = torch.softmax(torch.randn(1, 3, 7, 7, dtype=torch.float64), -1)  # not causal: kept dense
    p = Patterns(7, "cpu")
    p.append(causal)
    p.append(full)
    assert torch.equal(p[0], causal) and torch.equal(p[1], full) and torch.equal(p.layer(0), causal[0])
    assert p.nbytes() == 3 * 28 * 8 + full.numel() * 8  # the lower triangle: 28 of 49 entries


@pytest.mark.parametrize("small", [2**20, 0])  # one batched matmul, or one head at a time
def test_mix_and_its_batched_backward_are_einsums(small, monkeypatch):
    monkeypatch.setattr(patterns, "SMALL_PATTERN_BYTES", small)
    pattern = causal_pattern(4, 6, 1)
    p = Patterns(6, "cpu")
    p.append(pattern)
    v = torch.randn(1, 6, 4, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.einsum("hqk,bkhd->bqhd", pattern[0], v)
    out = mix(p, 0, v)
    assert torch.equal(out, ref)
    grads = torch.randn(3, 1, 6, 4, 5, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, v, grads, is_grads_batched=True)
    want = torch.stack([torch.autograd.grad(ref, v, g, retain_graph=True)[0] for g in grads])
    assert rel(got, want) < 1e-14


def dense_rows(model, rm, graph, targets: np.ndarray, monkeypatch) -> np.ndarray:
    """The rows of ``targets`` computed the plain way (see the module doc)."""
    L, n = rm.n_layers, rm.n_pos
    run = model.run(PROMPT, cache=[f"{layer}.pattern" for layer in range(L)])
    recorded = [run[f"{layer}.pattern"][0] for layer in range(L)]
    dense_mix = lambda patterns, layer, v: torch.einsum("hqk,bkhd->bqhd", recorded[layer].to(v.dtype), v)  # noqa: E731
    monkeypatch.setattr(replacement, "mix", dense_mix)
    src = rm.clean_sources(1)
    leaves = [src.embed.requires_grad_(True)] + [m.requires_grad_(True) for m in src.mlp_out]
    with torch.enable_grad():
        out = rm.run(src)
    kinds = graph.kind_slices()
    rows = np.zeros((len(targets), graph.n_nodes))
    for i, t in enumerate(targets):
        if t >= kinds["logit"].start:
            logits = rm.logits_of(out.final[0, -1])
            scalar = logits[graph.logit_tokens[t - kinds["logit"].start]] - logits.mean()
        else:
            layer, pos, f = (int(x) for x in graph.features[t])
            scalar = out.mlp_in[layer][0, pos] @ rm.transcoders[layer].W_enc[:, f]
        grads = torch.autograd.grad(scalar, leaves, retain_graph=True, allow_unused=True)
        g = [torch.zeros_like(leaf[0]) if x is None else x[0] for x, leaf in zip(grads, leaves)]
        for j, (layer, pos, f) in enumerate(graph.features):
            acts = rm.acts[layer].to_dense()
            write = acts[pos, f] * rm.decoder_rows(layer, torch.tensor([f]))[0]
            rows[i, j] = float(g[1 + layer][pos] @ write)
        for layer in range(L):
            rows[i, kinds["error"].start + layer * n : kinds["error"].start + (layer + 1) * n] = (
                (g[1 + layer] * rm.errors[layer]).sum(-1).detach().numpy()
            )
        rows[i, kinds["token"]] = (g[0] * rm.embed).sum(-1).detach().numpy()
    return rows


def test_rows_equal_a_dense_computation_kept_or_rebuilt_in_chunks(tiny_tokenizer, monkeypatch):
    model = load_model(make_model("llama", len(tiny_tokenizer)), tokenizer=tiny_tokenizer)
    tcs = {layer: random_transcoder(model.d_model, layer, n=40) for layer in range(model.n_layers)}
    rm = replacement_model(model, tcs, PROMPT)
    cfg = AttributionConfig(max_feature_nodes=12, batch_size=5, update_interval=1, progress=False)
    kept = attribution_graph_of(rm, cfg)
    with monkeypatch.context() as m:  # the writes rebuilt at every pass, two or three positions at a time
        m.setattr(attribute, "WRITES_BYTES", 0)
        m.setattr(attribute, "CHUNK_BYTES", 2 * 12 * model.d_model * 8 + 1)
        chunked = attribution_graph_of(rm, cfg)
    targets = np.flatnonzero(np.isfinite(kept.inputs))
    assert len(targets) == 12 + kept.n_logits
    A, B = kept.dense()[targets], chunked.dense()[targets]
    ref = dense_rows(model, rm, kept, targets, monkeypatch)
    assert np.abs(ref).sum(1).min() > 0
    assert rel(A, ref) < 1e-10 and rel(B, ref) < 1e-10
