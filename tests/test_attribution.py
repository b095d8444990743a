"""Attribution graphs (analyses/circuits/features): the replacement model against the model itself,
the completeness identity on every target with a bias from an independent forward, one edge
against the frozen model with that source removed, and the split of an edge by head, on tiny
random models of five families (float64, so identities hold to rounding) with random
transcoders of three architectures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthscope.analyses import attribution_graph
from depthscope.analyses.circuits.features import (
    AttributionConfig,
    attribution_graph_of,
    edge_by_head,
    replacement_model,
)
from depthscope.analyses.circuits.features.attribute import salient_logits
from depthscope.analyses.circuits.features.replacement import Sources
from depthscope.common.errors import InputError
from depthscope.hooks import load_model
from depthscope.hooks.sae import SAE
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "gpt2", "gpt_neox", "qwen2", "gemma2"]
PROMPT = "The cat sat on the mat and the dog"
ARCHS = ("transcoder", "jumprelu_transcoder", "topk")
#: Llama, Qwen2 and Gemma-2 compute their RMSNorm in float32 even in a float64 model: the model's
#: own numbers carry that rounding; GPT-2 and GPT-NeoX (LayerNorm) are float64 throughout
TOL = {"llama": 1e-6, "qwen2": 1e-6, "gemma2": 1e-6, "gpt2": 1e-12, "gpt_neox": 1e-12}


def make_model(family: str, vocab: int):
    """A tiny float64 model; Qwen2 (biased q/k/v) and Gemma-2 (sandwich norms with 1 + weight,
    embedding scale, soft-capping) built here, their norm weights perturbed so they matter."""
    import transformers as tf

    if family in ("llama", "gpt2", "gpt_neox"):
        return make_tiny(family, vocab_size=vocab).double()
    torch.manual_seed(1)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    else:
        cfg = tf.Gemma2Config(
            head_dim=16, sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common
        )
        model = tf.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or (name.endswith("bias") and "proj" in name):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval().double()


def random_transcoder(d: int, layer: int, n: int = 160) -> SAE:
    """A random transcoder of one of three architectures (by layer), biases included."""
    g = torch.Generator().manual_seed(100 + layer)
    arch = ARCHS[layer % 3]
    W_enc = torch.randn(d, n, generator=g, dtype=torch.float64) / d**0.5
    kw = dict(
        W_enc=W_enc,
        b_enc=0.1 * torch.randn(n, generator=g, dtype=torch.float64),
        W_dec=torch.randn(n, d, generator=g, dtype=torch.float64) / n**0.5,
        b_dec=0.1 * torch.randn(d, generator=g, dtype=torch.float64),
        architecture=arch,
        hook_name=f"blocks.{layer}.ln2.hook_normalized",
        hook_name_out=f"blocks.{layer}.hook_mlp_out",
    )
    if arch == "jumprelu_transcoder":
        kw["threshold"] = torch.full((n,), 0.2, dtype=torch.float64)
    if arch == "topk":
        kw["k"] = 12
    return SAE(**kw)


@pytest.fixture(scope="module")
def built(tiny_tokenizer):
    """family -> (model, transcoders, replacement model, graph), built once."""
    made = {}

    def get(family):
        if family not in made:
            model = load_model(make_model(family, len(tiny_tokenizer)), tokenizer=tiny_tokenizer)
            tcs = {layer: random_transcoder(model.d_model, layer) for layer in range(model.n_layers)}
            rm = replacement_model(model, tcs, PROMPT)
            cfg = AttributionConfig(max_feature_nodes=150, batch_size=32, update_interval=2, progress=False)
            made[family] = (model, tcs, rm, attribution_graph_of(rm, cfg))
        return made[family]

    return get


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


# ----------------------------------------------------------------------------- replacement model
@pytest.mark.parametrize("family", FAMILIES)
def test_replacement_model_reproduces_the_model(built, family):
    """With the error nodes in, the frozen model's logits are the model's at every position; the
    activations are the transcoders' on the model's own MLP input; features + b_dec + error is
    the MLP's true output."""
    model, tcs, rm, _ = built(family)
    # "0.pattern" runs every layer's attention through the family's eager function, as the
    # recording forward does (sdpa differs from it by rounding, 1e-8 here)
    names = [f"{layer}.{k}" for layer in range(model.n_layers) for k in ("mlp_in", "mlp_out")]
    run = model.run(PROMPT, cache=[*names, "0.pattern"])
    with torch.no_grad():
        out = rm.run(rm.clean_sources(2))
        logits = model.unembed.post(rm.logits_of(out.final))
    assert rel(logits[1], run.logits[0]) < TOL[family]
    assert rel(rm.logits, run.logits[0, -1]) < TOL[family]
    for layer, sae in tcs.items():
        acts = sae.encode(run[f"{layer}.mlp_in"][0])
        assert rel(rm.acts[layer].to_dense(), acts) < TOL[family] and int((acts > 0).sum()) > 0
        rebuilt = rm.feature_writes(layer) + sae.b_dec + rm.errors[layer]
        assert rel(rebuilt, run[f"{layer}.mlp_out"][0]) < 1e-12
        # the transcoder's own decode (its TopK rescaling included) is what the error completes
        assert rel(sae.decode(acts, run[f"{layer}.mlp_in"][0]) + rm.errors[layer], run[f"{layer}.mlp_out"][0]) < 1e-12


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_frozen_model_is_affine_in_its_sources(built, family):
    """Frozen patterns and norm scales make the model affine in its sources (the model itself,
    whose norms rescale, is not): f(2x - z) = 2 f(x) - f(z) with z the all-zero sources."""
    _, _, rm, _ = built(family)
    x, z = rm.clean_sources(1), rm.bias_sources(1)
    g = torch.Generator().manual_seed(0)
    y = Sources(x.embed + torch.randn(x.embed.shape, generator=g, dtype=x.embed.dtype), x.mlp_out)
    combo = Sources(2 * y.embed - z.embed, [2 * a - b for a, b in zip(y.mlp_out, z.mlp_out)])
    with torch.no_grad():
        fy, fz, fc = rm.run(y), rm.run(z), rm.run(combo)
    assert rel(fc.final, 2 * fy.final - fz.final) < 1e-10
    for layer in range(rm.n_layers):
        assert rel(fc.mlp_in[layer], 2 * fy.mlp_in[layer] - fz.mlp_in[layer]) < 1e-10


# ----------------------------------------------------------------------------- the graph
@pytest.mark.parametrize("family", FAMILIES)
def test_completeness_on_every_target(built, family):
    """inputs (the model's own forward) == row sum (backward passes) + bias (a frozen forward with
    every source zeroed), on every feature row and every logit; the rows asked for were computed."""
    _, _, rm, graph = built(family)
    A = graph.dense()
    targets = np.flatnonzero(np.isfinite(graph.inputs))
    kinds = graph.kind_slices()
    n_rows = graph.settings["n_feature_rows"]
    assert n_rows == min(150, graph.n_features) and len(targets) == n_rows + graph.n_logits
    assert set(targets) >= set(range(kinds["logit"].start, kinds["logit"].stop))
    sums = A[targets].sum(1) + graph.bias[targets]
    assert rel(sums, graph.inputs[targets]) < TOL[family]
    assert np.abs(A[targets]).sum(1).min() > 0  # no empty row: the identity is not 0 = 0
    # rows of features never visited are empty; errors and tokens are never targets
    rest = np.setdiff1d(np.arange(graph.n_nodes), targets)
    assert not A[rest].any()
    assert not A[:, kinds["logit"]].any()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_one_feature_edge_is_the_change_when_it_alone_is_removed(built, family):
    """adjacency[logit, feature] == the demeaned logit's change when that feature's write alone
    is taken out of the frozen model, every other source held; likewise a feature -> feature edge."""
    _, _, rm, graph = built(family)
    A = graph.dense()
    kinds = graph.kind_slices()
    logit = kinds["logit"].start
    f = int(np.argmax(np.abs(A[logit, kinds["feature"]])))
    layer, pos, feat = (int(x) for x in graph.features[f])
    write = rm.activation(layer, pos, feat) * rm.decoder_rows(layer, torch.tensor([feat]))[0]
    src = rm.clean_sources(2)
    src.mlp_out[layer][1, pos] -= write
    with torch.no_grad():
        out = rm.run(src)
    lg = rm.logits_of(out.final[:, -1])
    lg = lg - lg.mean(-1, keepdim=True)
    token = graph.logit_tokens[0]
    change = float(lg[0, token] - lg[1, token])
    assert abs(A[logit, f]) > 1e-3
    assert change == pytest.approx(A[logit, f], rel=1e-9, abs=1e-12)
    # a feature target: its pre-activation's change
    t = next(i for i in np.flatnonzero(np.isfinite(graph.inputs[: graph.n_features])) if graph.features[i][0] > layer)
    tl, tp, tf_ = (int(x) for x in graph.features[t])
    pre = rm.transcoders[tl].pre_activations(out.mlp_in[tl][:, tp])[:, tf_]
    assert float(pre[0] - pre[1]) == pytest.approx(A[t, f], rel=1e-9, abs=1e-12)


def test_feature_rows_follow_influence_and_all_features_when_unbounded(built, tiny_tokenizer):
    """max_feature_nodes=None computes every active feature's row; a bound computes that many,
    and the most influential feature of the full graph (by direct |edge| to the top logit,
    weighted as the first influence pass weighs it) is among the first visited."""
    model, tcs, rm, graph = built("llama")
    full = attribution_graph_of(rm, AttributionConfig(batch_size=64, progress=False))
    assert np.isfinite(full.inputs).sum() == full.n_features + full.n_logits
    assert rel(full.dense()[graph.kind_slices()["logit"]], graph.dense()[graph.kind_slices()["logit"]]) < 1e-12
    A = full.dense()
    logit_rows = A[full.kind_slices()["logit"]]
    first = np.abs(logit_rows) / np.abs(logit_rows).sum(1, keepdims=True)
    top = int(np.argmax(full.logit_probabilities @ first[:, : full.n_features]))
    assert np.isfinite(graph.inputs[top])
    small = attribution_graph_of(rm, AttributionConfig(max_feature_nodes=5, batch_size=4, progress=False))
    assert small.settings["n_feature_rows"] == 5


# ----------------------------------------------------------------------------- targets
def test_salient_logits_by_hand():
    """Top tokens until the cumulative probability reaches the threshold (binary fractions: exact)."""
    probs = torch.tensor([0.0625, 0.5, 0.25, 0.125, 0.0625])
    assert salient_logits(probs, 0.5, 10).tolist() == [1]  # 0.5 reaches 0.5
    assert salient_logits(probs, 0.75, 10).tolist() == [1, 2]
    top = salient_logits(probs, 0.9, 10).tolist()  # 0.875 < 0.9 <= 0.9375
    assert top[:3] == [1, 2, 3] and len(top) == 4 and top[3] in (0, 4)
    assert salient_logits(probs, 0.99, 2).tolist() == [1, 2]  # at most max_n_logits


def test_named_targets_and_the_exported_entry_point(built, tiny_tokenizer):
    model, tcs, rm, _ = built("gpt2")
    graph = attribution_graph(model, tcs, PROMPT, targets=[" the", 5], max_feature_nodes=10, batch_size=8)
    the = model.token_id(" the")
    assert graph.logit_tokens == [the, 5]
    probs = torch.softmax(rm.logits, -1)
    assert np.allclose(graph.logit_probabilities, probs[[the, 5]].numpy())
    t = np.flatnonzero(np.isfinite(graph.inputs))
    assert rel(graph.dense()[t].sum(1) + graph.bias[t], graph.inputs[t]) < 1e-12
    assert graph.n_nodes == graph.n_features + model.n_layers * graph.n_pos + graph.n_pos + 2


def test_refuses_transcoders_it_cannot_linearise(built):
    model, tcs, _, _ = built("llama")
    wrong = dict(tcs)
    wrong[1] = SAE(**{**tcs[1].__dict__, "hook_name": "blocks.1.hook_resid_mid"})
    with pytest.raises(InputError, match="reads"):
        replacement_model(model, wrong, PROMPT)
    normed = dict(tcs)
    normed[0] = SAE(**{**tcs[0].__dict__, "normalize_activations": "layer_norm"})
    with pytest.raises(InputError, match="normalises"):
        replacement_model(model, normed, PROMPT)
    with pytest.raises(InputError, match="no layer"):
        replacement_model(model, {7: tcs[0]}, PROMPT)


def test_layers_without_transcoders_have_error_nodes_only(built, tiny_tokenizer):
    model, tcs, _, _ = built("gpt_neox")
    rm = replacement_model(model, {1: tcs[1]}, PROMPT)
    graph = attribution_graph_of(rm, AttributionConfig(progress=False))
    assert set(graph.features[:, 0]) == {1}
    t = np.flatnonzero(np.isfinite(graph.inputs))
    assert rel(graph.dense()[t].sum(1) + graph.bias[t], graph.inputs[t]) < 1e-12


# ----------------------------------------------------------------------------- heads
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma2"])
def test_edge_by_head_sums_to_the_edge(built, family):
    """An edge from an earlier position reaches its target only through heads (residual 0); one at
    the same position has a residual part too; either way the parts sum to the adjacency entry."""
    _, _, rm, graph = built(family)
    A = graph.dense()
    kinds = graph.kind_slices()
    logit = kinds["logit"].start
    tokens = np.arange(kinds["token"].start, kinds["token"].stop)
    earlier = int(tokens[np.argmax(np.abs(A[logit, tokens[:-1]]))])
    df = edge_by_head(rm, graph, logit, earlier)
    assert df["contribution"].sum() == pytest.approx(A[logit, earlier], rel=1e-9)
    assert df.loc[df.path == "residual", "contribution"].item() == 0
    heads = df[df.path == "head"]
    assert len(heads) == rm.n_layers * rm.model.arch.n_heads and heads["contribution"].abs().max() > 0
    assert list(heads["site"].unique()) == [2 * m + 1 for m in range(rm.n_layers)]
    # a feature -> feature edge at one position
    rows = np.flatnonzero(np.isfinite(graph.inputs[: graph.n_features]))
    t = next(i for i in rows if graph.features[i][0] == rm.n_layers - 1)
    same = [s for s in range(graph.n_features) if graph.features[s][1] == graph.features[t][1] and A[t, s] != 0]
    s = same[0]
    df = edge_by_head(rm, graph, int(t), int(s))
    assert df["contribution"].sum() == pytest.approx(A[t, s], rel=1e-8)
    assert df.loc[df.path == "residual", "contribution"].item() != 0
    with pytest.raises(InputError, match="not a target"):
        edge_by_head(rm, graph, int(kinds["token"].start), int(s))


def test_visited_columns_fold_the_other_features_into_their_error_nodes(built):
    """columns="visited": only the visited features are nodes; each other feature's edges are in
    its error node's column, so every edge between kept nodes is unchanged, the error columns
    gain the folded ones, and completeness still holds exactly."""
    _, _, rm, full = built("gpt2")
    cfg = AttributionConfig(max_feature_nodes=150, batch_size=32, update_interval=2, columns="visited", progress=False)
    small = attribution_graph_of(rm, cfg)
    visited = np.isfinite(full.inputs[: full.n_features])
    assert small.n_features == visited.sum() == 150
    assert (small.features == full.features[visited]).all()
    keep = np.concatenate([np.flatnonzero(visited), np.arange(full.n_features, full.n_nodes)])
    A, S = full.dense(), small.dense()
    kinds = small.kind_slices()
    assert np.allclose(S[:, kinds["feature"]], A[keep][:, np.flatnonzero(visited)], rtol=0, atol=1e-12)
    folded = A[keep][:, full.kind_slices()["error"]].copy()
    for j in np.flatnonzero(~visited):
        layer, pos, _ = full.features[j]
        folded[:, layer * full.n_pos + pos] += A[keep, j]
    assert np.allclose(S[:, kinds["error"]], folded, rtol=0, atol=1e-12)
    t = np.flatnonzero(np.isfinite(small.inputs))
    assert len(t) == 150 + small.n_logits
    assert rel(S[t].sum(1) + small.bias[t], small.inputs[t]) < 1e-12
    with pytest.raises(InputError, match="columns"):
        AttributionConfig(columns="some")


def test_a_family_read_wrongly_is_refused(built):
    """The frozen model must give back the clean MLP inputs: with block 1's ln2 mapped to its ln1
    (whose weights differ) the replacement model is refused, not built wrong."""
    from depthscope.common.errors import UnsupportedArchitecture

    model, tcs, _, _ = built("qwen2")
    ln2 = model.arch.ln2[1]
    model.arch.ln2[1] = model.arch.ln1[1]
    try:
        with pytest.raises(UnsupportedArchitecture, match="block 1's MLP input"):
            replacement_model(model, tcs, PROMPT)
    finally:
        model.arch.ln2[1] = ln2


def test_writes_rebuilt_per_pass_give_the_same_graph(built, monkeypatch):
    """Feature writes too large to keep are rebuilt at each backward pass: the same adjacency."""
    from depthscope.analyses.circuits.features import attribute as attribute_module

    _, _, rm, graph = built("gpt_neox")
    monkeypatch.setattr(attribute_module, "WRITES_BYTES", 0)
    again = attribution_graph_of(rm, AttributionConfig(max_feature_nodes=150, batch_size=32, update_interval=2))
    assert (again.adjacency != graph.adjacency).nnz == 0
