"""Activation and attribution patching: the batched table against the same patches made one at a
time with plain PyTorch forward hooks on the transformers model, the fraction recovered at its
fixed points, attribution against exact patching on IOI, the metric helpers, the CLI and bad input."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_cli

from depthscope.analyses.circuits.patching.activation import (
    PATCH_COLUMNS,
    activation_patching,
    attribution_patching,
    last_position,
    logit,
    logit_diff,
    logprob,
    prob,
)
from depthscope.common.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
LONGER = "When Mary and John went to the big store, Mary gave a drink to"  # one token more


# ----------------------------------------------------------------------------- the reference
def _first(o):
    return o[0] if isinstance(o, (tuple, list)) else o


def _with_first(o, new):
    return (new, *o[1:]) if isinstance(o, tuple) else new


def _blocks(hf):
    """(blocks, name of the attention module) read straight from the transformers model."""
    if hasattr(hf, "transformer"):
        return hf.transformer.h, "attn"
    return hf.model.layers, "self_attn"


def _pre(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def ref_sites(hf, ids):
    """Every residual site of one prompt ([pos, d] each), from plain hooks: block inputs, attention
    outputs (resid_mid = input + attention output) and block outputs."""
    blocks, attn = _blocks(hf)
    pre, att, post, handles = {}, {}, {}, []
    for l, b in enumerate(blocks):
        handles.append(
            b.register_forward_pre_hook(
                lambda m, a, k, l=l: pre.__setitem__(l, _pre(a, k)[0].clone()), with_kwargs=True
            )
        )
        handles.append(
            getattr(b, attn).register_forward_hook(lambda m, i, o, l=l: att.__setitem__(l, _first(o)[0].clone()))
        )
        handles.append(b.register_forward_hook(lambda m, i, o, l=l: post.__setitem__(l, _first(o)[0].clone())))
    try:
        with torch.no_grad():
            hf(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    out = [pre[0]]
    for l in range(len(blocks)):
        out += [pre[l] + att[l], post[l]]
    return out


def ref_patched(hf, ids, site: int, value, pos, cpos, metric):
    """The metric of one forward of ``ids`` with the residual site's stream set to the clean
    ``value`` at position ``pos`` (None: all), through plain forward hooks."""
    blocks, attn = _blocks(hf)
    pos = slice(None) if pos is None else pos
    cpos = slice(None) if cpos is None else cpos
    handles, seen = [], {}
    if site == 0:

        def embed(m, a, k):
            h = _pre(a, k).clone()
            h[0, pos] = value[cpos]
            return ((h, *a[1:]), k) if a else (a, {**k, "hidden_states": h})

        handles.append(blocks[0].register_forward_pre_hook(embed, with_kwargs=True))
    elif site % 2 == 1:
        layer = (site - 1) // 2
        handles.append(
            blocks[layer].register_forward_pre_hook(
                lambda m, a, k: seen.__setitem__("pre", _pre(a, k)), with_kwargs=True
            )
        )

        def attn_out(m, i, o):
            new = _first(o).clone()
            new[0, pos] = value[cpos] - seen["pre"][0, pos]
            return _with_first(o, new)

        handles.append(getattr(blocks[layer], attn).register_forward_hook(attn_out))
    else:

        def block_out(m, i, o):
            new = _first(o).clone()
            new[0, pos] = value[cpos]
            return _with_first(o, new)

        handles.append(blocks[(site - 2) // 2].register_forward_hook(block_out))
    try:
        with torch.no_grad():
            return float(metric(hf(input_ids=ids).logits)[0])
    finally:
        for h in handles:
            h.remove()


def ref_table(model, clean, corrupted, tokens, sites, positions, metric_at=None):
    """The patched metric of every (site, position) patch, one forward each: the logit difference
    of ``tokens`` at the last position, or the logit at ``metric_at`` = (position, token)."""
    hf, tok = model.hf_model, model.tokenizer
    c = tok(clean, return_tensors="pt")["input_ids"]
    k = tok(corrupted, return_tensors="pt")["input_ids"]
    if metric_at is None:
        t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in tokens)

    def metric(lg):
        return lg[:, -1, t] - lg[:, -1, f] if metric_at is None else lg[:, metric_at[0], metric_at[1]]

    clean_sites = ref_sites(hf, c)
    if positions == "last":
        pairs = [(k.shape[1] - 1, c.shape[1] - 1)]
    elif positions == "all":
        pairs = [(None, None)]
    else:
        pairs = [(p, p) for p in range(k.shape[1])]
    rows = []
    for s in sites:
        for p, cp in pairs:
            rows.append(ref_patched(hf, k, s, clean_sites[s], p, cp, metric))
    with torch.no_grad():
        clean_value = float(metric(hf(input_ids=c).logits)[0])
        corrupted_value = float(metric(hf(input_ids=k).logits)[0])
    return np.array(rows), clean_value, corrupted_value


def _modules(hf, layer):
    """(attention module, its output projection, MLP module) of one block, from transformers' names."""
    blocks, attn = _blocks(hf)
    b = blocks[layer]
    a = getattr(b, attn)
    return a, (a.c_proj if hasattr(a, "c_proj") else a.o_proj), b.mlp


def ref_points(hf, ids):
    """Per layer: attention output, MLP output and the output projection's input z ([pos, H * dh])."""
    found, handles = {}, []
    for layer in range(len(_blocks(hf)[0])):
        a, proj, mlp = _modules(hf, layer)
        handles += [
            a.register_forward_hook(lambda m, i, o, l=layer: found.__setitem__(f"{l}.attn_out", _first(o)[0].clone())),
            mlp.register_forward_hook(lambda m, i, o, l=layer: found.__setitem__(f"{l}.mlp_out", _first(o)[0].clone())),
            proj.register_forward_pre_hook(lambda m, i, l=layer: found.__setitem__(f"{l}.z", i[0][0].clone())),
        ]
    try:
        with torch.no_grad():
            hf(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return found


def ref_patched_point(hf, ids, kind, layer, head, value, pos, cpos, metric, d_head):
    """The metric with one write (attn_out / mlp_out) or one head's z (``heads`` too: a head's write
    is linear in its z) set to the clean value, through a plain forward (pre-)hook."""
    a, proj, mlp = _modules(hf, layer)
    pos = slice(None) if pos is None else pos
    cpos = slice(None) if cpos is None else cpos
    if kind in ("z", "heads"):
        cols = slice(head * d_head, (head + 1) * d_head)

        def fn(m, i):
            z = i[0].clone()
            z[0, pos, cols] = value[cpos, cols]
            return (z, *i[1:])

        handle = proj.register_forward_pre_hook(fn)
    else:

        def fn(m, i, o):
            new = _first(o).clone()
            new[0, pos] = value[cpos]
            return _with_first(o, new)

        handle = (a if kind == "attn_out" else mlp).register_forward_hook(fn)
    try:
        with torch.no_grad():
            return float(metric(hf(input_ids=ids).logits)[0])
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "positions,corrupted", [("last", CORRUPTED), ("last", LONGER), ("each", CORRUPTED), ("all", CORRUPTED)]
)
def test_batched_table_equals_plain_hooks_one_at_a_time(tiny_factory, family, positions, corrupted):
    model = tiny_factory(family)
    n_pos = len(model.tokenizer(corrupted)["input_ids"])
    # a small token budget: several forwards, so rows are split across chunks too
    df = activation_patching(model, CLEAN, corrupted, (" Mary", " John"), positions=positions, batch_tokens=5 * n_pos)
    assert list(df.columns) == PATCH_COLUMNS
    sites = list(range(model.n_sites))
    ref, clean_value, corrupted_value = ref_table(model, CLEAN, corrupted, (" Mary", " John"), sites, positions)
    assert len(df) == len(ref)
    scale = max(1.0, np.abs(ref).max())  # measured on CPU: <= 1.2e-7 (0.0 with reuse_prefix=False)
    np.testing.assert_allclose(df["metric"].to_numpy(), ref, rtol=0, atol=2e-6 * scale)
    assert df["clean_metric"].iloc[0] == pytest.approx(clean_value, abs=2e-6 * scale)
    assert df["corrupted_metric"].iloc[0] == pytest.approx(corrupted_value, abs=2e-6 * scale)
    expected = (df["metric"] - corrupted_value) / (clean_value - corrupted_value)
    np.testing.assert_allclose(df["fraction_recovered"], expected, atol=1e-4)
    assert df["label"].unique().tolist() == model.labels
    assert len(df) == model.n_sites * (n_pos if positions == "each" else 1)


@pytest.mark.parametrize("family,positions,corrupted", [("llama", "each", CORRUPTED), ("gpt2", "last", LONGER)])
def test_noise_direction_equals_plain_hooks_one_at_a_time(tiny_factory, family, positions, corrupted):
    """direction="noise": the corrupted run's values patched into the clean run; the reference is the
    plain-hook patching of ``ref_table`` with the clean prompt as the run patched."""
    model = tiny_factory(family)
    kw = dict(positions=positions, batch_tokens=40, direction="noise")
    df = activation_patching(model, CLEAN, corrupted, (" Mary", " John"), **kw)
    sites = list(range(model.n_sites))
    ref, corrupted_value, clean_value = ref_table(model, corrupted, CLEAN, (" Mary", " John"), sites, positions)
    assert list(df.columns) == PATCH_COLUMNS and (df["direction"] == "noise").all() and len(df) == len(ref)
    scale = max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(df["metric"].to_numpy(), ref, rtol=0, atol=2e-6 * scale)
    assert df["clean_metric"].iloc[0] == pytest.approx(clean_value, abs=2e-6 * scale)
    assert df["corrupted_metric"].iloc[0] == pytest.approx(corrupted_value, abs=2e-6 * scale)
    expected = (df["metric"] - corrupted_value) / (clean_value - corrupted_value)
    np.testing.assert_allclose(df["fraction_recovered"], expected, atol=1e-4)
    n_clean, n_corrupted = (len(model.tokenizer(x)["input_ids"]) for x in (CLEAN, corrupted))
    if positions == "last":  # the table names the corrupted and the clean index whatever the direction
        assert (df["position"] == n_corrupted - 1).all() and (df["clean_position"] == n_clean - 1).all()
    else:  # before the prompts differ nothing changes: exactly the clean value, fraction 1
        first = next(
            i for i, (a, b) in enumerate(zip(*(model.tokenizer(x)["input_ids"] for x in (CLEAN, corrupted)))) if a != b
        )
        before = df[df["position"] < first]
        assert len(before) and (before["metric"] == before["clean_metric"]).all()
        assert (before["fraction_recovered"] == 1).all()
    denoise = activation_patching(model, CLEAN, corrupted, (" Mary", " John"), positions=positions)
    assert not np.allclose(denoise["metric"], df["metric"])  # a different question, other values


def test_default_model_some_sites_equal_plain_hooks(default_model):
    sites = ["embed", "5.attn", "17.mlp", "21.attn", "29.mlp"]
    df = activation_patching(default_model, CLEAN, CORRUPTED, (" Mary", " John"), sites=sites)
    idx = [default_model.site_index(s) for s in sites]
    ref, clean_value, corrupted_value = ref_table(default_model, CLEAN, CORRUPTED, (" Mary", " John"), idx, "last")
    assert df["label"].tolist() == sites
    np.testing.assert_allclose(df["metric"].to_numpy(), ref, rtol=0, atol=1e-4)
    assert clean_value == pytest.approx(df["clean_metric"].iloc[0], abs=1e-4)
    assert (clean_value, corrupted_value) == pytest.approx((6.12, -5.49), abs=0.01)  # IOI: clean prefers ' Mary'


@pytest.mark.parametrize("family,positions", [("llama", "last"), ("llama", "each"), ("gpt2", "all"), ("gpt2", "last")])
def test_points_below_the_stream_equal_plain_hooks(tiny_factory, family, positions):
    """attn_out, mlp_out, and every head of l.heads and l.z (tiny Llama with grouped-query attention)."""
    model = tiny_factory(family)
    hf, tok = model.hf_model, model.tokenizer
    df = activation_patching(
        model,
        CLEAN,
        CORRUPTED,
        (" Mary", " John"),
        sites="attn_out,mlp_out,heads,z",
        positions=positions,
        batch_tokens=700,
    )
    c, k = (tok(x, return_tensors="pt")["input_ids"] for x in (CLEAN, CORRUPTED))
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" Mary", " John"))
    clean = ref_points(hf, c)
    n_pos = k.shape[1]
    n_heads = hf.config.num_attention_heads if family == "llama" else hf.config.n_head
    d_head = model.d_model // n_heads
    ref = []
    for r in df.itertuples():
        point = f"{r.layer}.z" if r.kind in ("z", "heads") else r.point
        pos = None if pd.isna(r.position) else int(r.position)
        head = None if pd.isna(r.head) else int(r.head)
        ref.append(
            ref_patched_point(
                hf, k, r.kind, r.layer, head, clean[point], pos, pos, lambda lg: lg[:, -1, t] - lg[:, -1, f], d_head
            )
        )
    per_layer = 2 + 2 * n_heads
    assert len(df) == model.n_layers * per_layer * (n_pos if positions == "each" else 1)
    assert df.groupby("kind")["head"].nunique().to_dict() == {
        "attn_out": 0,
        "mlp_out": 0,
        "heads": n_heads,
        "z": n_heads,
    }
    assert (df.loc[df["kind"] == "mlp_out", "sublayer"] == "mlp").all()
    assert (df.loc[df["kind"] == "z", "sublayer"] == "attn").all()
    # label is the site the write lands in, as in every table; the hook point is in point
    assert (df["label"] == df["layer"].astype(str) + "." + df["sublayer"]).all()
    assert (df["point"] == df["layer"].astype(str) + "." + df["kind"]).all()
    scale = max(1.0, np.abs(ref).max())
    # z and the writes: bit-identical on CPU; heads go through heads.sum() + bias instead of the projection
    np.testing.assert_allclose(df["metric"].to_numpy(), ref, rtol=0, atol=2e-6 * scale)
    assert np.ptp(ref) > 1e-3  # the patches do differ


def test_default_model_heads_equal_plain_hooks(default_model):
    hf, tok = default_model.hf_model, default_model.tokenizer
    df = activation_patching(
        default_model, CLEAN, CORRUPTED, (" Mary", " John"), sites=["23.heads", "29.z", "24.attn_out"]
    )
    c, k = (tok(x, return_tensors="pt")["input_ids"] for x in (CLEAN, CORRUPTED))
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" Mary", " John"))
    clean = ref_points(hf, c)
    ref = [
        ref_patched_point(
            hf,
            k,
            r.kind,
            r.layer,
            None if pd.isna(r.head) else int(r.head),
            clean[f"{r.layer}.z" if r.kind != "attn_out" else r.point],
            int(r.position),
            int(r.position),
            lambda lg: lg[:, -1, t] - lg[:, -1, f],
            64,
        )
        for r in df.itertuples()
    ]
    assert len(df) == 9 + 9 + 1
    np.testing.assert_allclose(df["metric"].to_numpy(), ref, rtol=0, atol=1e-4)
    top = df.loc[df["fraction_recovered"].idxmax()]
    assert (top["point"], int(top["head"])) == ("23.heads", 3)  # measured: recovers 0.55 of the IOI gap alone


def test_prefix_reuse_computes_only_from_the_patched_position(tiny_factory):
    """A patch at position p leaves positions < p as in the corrupted run: with reuse_prefix the
    rows recompute only positions p.. (counted at the embedding) and give the same table."""
    model = tiny_factory("gpt2")
    seen = []
    emb = model.hf_model.transformer.wte
    h = emb.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        fast = activation_patching(model, CLEAN, CORRUPTED, (" Mary", " John"), positions="last")
        n_fast = sum(seen)
        seen.clear()
        full = activation_patching(model, CLEAN, CORRUPTED, (" Mary", " John"), positions="last", reuse_prefix=False)
        n_full = sum(seen)
    finally:
        h.remove()
    T = len(model.tokenize(CLEAN)[0][0])  # the prompt's tokens
    # the embedding of the last token (" to" in both prompts) is unchanged: no row for it
    rows = model.n_sites - 1 + 1  # the other residual sites, plus the unpatched row
    embed = full.loc[full["point"] == "embed", "fraction_recovered"]
    assert len(embed) == 1 and float(embed.iloc[0]) == 0
    assert n_full == 2 * T + rows * T  # the clean and corrupted runs, then every row in full
    assert n_fast == 2 * T + (T - 1) + rows  # the two runs, the shared prefix, one position per row
    np.testing.assert_allclose(fast["metric"], full["metric"], rtol=0, atol=1e-6)
    each = activation_patching(model, CLEAN, CORRUPTED, (" Mary", " John"), positions="each", sites="resid,heads")
    each_full = activation_patching(
        model, CLEAN, CORRUPTED, (" Mary", " John"), positions="each", sites="resid,heads", reuse_prefix=False
    )
    assert each[["point", "head", "position"]].equals(each_full[["point", "head", "position"]])
    np.testing.assert_allclose(each["metric"], each_full["metric"], rtol=0, atol=1e-6)


def test_fraction_recovered_fixed_points(tiny_llama):
    each = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), positions="each")
    ids_c, ids_x = tiny_llama.tokenize(CLEAN)[0][0], tiny_llama.tokenize(CORRUPTED)[0][0]
    first_diff = int((ids_c != ids_x).nonzero()[0])  # ' John' / ' Mary' as the giver
    assert (ids_c != ids_x).sum() == 1
    assert (each["token"] != each["clean_token"]).sum() == tiny_llama.n_sites
    assert set(each.loc[each["token"] != each["clean_token"], "position"]) == {first_diff}
    # causal model: before the first differing token clean == corrupted, so patching changes nothing
    before = each[each["position"] < first_diff]
    # (float noise of the batched rows over the tiny model's small clean-corrupted gap: ~1e-5)
    assert len(before) == first_diff * tiny_llama.n_sites and (before["fraction_recovered"].abs() < 1e-4).all()
    every = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), positions="all")
    last = every[every["label"] == tiny_llama.labels[-1]]["fraction_recovered"]
    assert float(last.iloc[0]) == pytest.approx(1.0, abs=1e-5)
    assert every["position"].isna().all() and (every["token"] == "").all()
    same = activation_patching(tiny_llama, CLEAN, CLEAN, (" Mary", " John"))
    assert same["fraction_recovered"].isna().all() and any("undefined" in n for n in same.attrs["notes"])


# ----------------------------------------------------------------------------- attribution
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_attribution_gradient_equals_autograd_through_transformers(tiny_llama, direction):
    """(clean - corrupted) . grad at embed, a block output, an attention write and each head's z
    (positions 'all'), with the gradients from autograd through the plain transformers model; a
    head's write is linear in its z, so the l.heads estimate equals the l.z one. Noising, the
    roles swap: (corrupted - clean) . grad at the clean run."""
    hf, tok = tiny_llama.hf_model, tiny_llama.tokenizer
    c, k = (tok(x, return_tensors="pt")["input_ids"] for x in (CLEAN, CORRUPTED))
    if direction == "noise":  # the reference below patches c's values into k's run
        c, k = k, c
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" Mary", " John"))
    sites = ["embed", "1.mlp", "2.attn_out", "1.z", "1.heads"]
    est = attribution_patching(tiny_llama, CLEAN, CORRUPTED, (t, f), sites=sites, positions="all", direction=direction)
    clean_sites, corr_sites = ref_sites(hf, c), ref_sites(hf, k)
    clean_pts, corr_pts = ref_points(hf, c), ref_points(hf, k)
    emb = hf.model.embed_tokens(k).detach().requires_grad_(True)
    kept = {}

    def keep(name, x):
        kept[name] = x
        x.retain_grad()

    layer1, attn2 = hf.model.layers[1], hf.model.layers[2].self_attn
    handles = [
        layer1.register_forward_hook(lambda m, i, o: keep("1.mlp", _first(o))),
        attn2.register_forward_hook(lambda m, i, o: keep("2.attn_out", _first(o))),
        layer1.self_attn.o_proj.register_forward_pre_hook(lambda m, i: keep("1.z", i[0])),
    ]
    try:
        with torch.enable_grad():
            lg = hf(inputs_embeds=emb).logits
            (lg[0, -1, t] - lg[0, -1, f]).backward()
    finally:
        for h in handles:
            h.remove()
    dz = (clean_pts["1.z"] - corr_pts["1.z"]) * kept["1.z"].grad[0]  # [pos, H * dh]
    per_head = dz.reshape(dz.shape[0], 4, -1).sum((0, 2))
    want = [
        float(((clean_sites[0] - corr_sites[0]) * emb.grad[0]).sum()),
        float(((clean_sites[4] - corr_sites[4]) * kept["1.mlp"].grad[0]).sum()),
        float(((clean_pts["2.attn_out"] - corr_pts["2.attn_out"]) * kept["2.attn_out"].grad[0]).sum()),
        *per_head.tolist(),
        *per_head.tolist(),
    ]
    assert est["point"].tolist() == ["embed", *["1.z"] * 4, *["1.heads"] * 4, "1.mlp", "2.attn_out"]  # forward order
    got = (est["metric"] - est["corrupted_metric" if direction == "denoise" else "clean_metric"]).to_numpy()
    order = {p: i for i, p in enumerate(["embed", "1.mlp", "2.attn_out"])}
    lookup = [
        order[p] if p in order else (3 + int(h) if p == "1.z" else 7 + int(h))
        for p, h in zip(est["point"], est["head"].fillna(-1))
    ]
    np.testing.assert_allclose(got, np.array(want)[lookup], rtol=1e-4, atol=1e-7)
    assert np.abs(got).min() > 1e-6  # none of them is trivially zero
    assert (est["method"] == "attribution").all() and list(est.columns) == PATCH_COLUMNS
    assert (est["direction"] == direction).all()


def test_attribution_agrees_with_exact_on_ioi(default_model):
    """Measured on SmolLM2-135M (last position, 61 residual sites): Spearman 0.989; every patch
    recovering more than 5% in either direction has the same sign. (positions='each', 854 patches:
    Spearman 0.948, signs agree on all 75 patches above 5%.)"""
    from scipy.stats import spearmanr

    exact = activation_patching(default_model, CLEAN, CORRUPTED, (" Mary", " John"))
    est = attribution_patching(default_model, CLEAN, CORRUPTED, (" Mary", " John"))
    assert exact["label"].tolist() == est["label"].tolist() == default_model.labels
    assert est["corrupted_metric"].iloc[0] == pytest.approx(exact["corrupted_metric"].iloc[0], abs=1e-4)
    rho = spearmanr(exact["fraction_recovered"], est["fraction_recovered"]).statistic
    assert rho > 0.97, rho
    big = exact["fraction_recovered"].abs() > 0.05
    assert big.sum() >= 10
    assert (np.sign(exact["fraction_recovered"][big]) == np.sign(est["fraction_recovered"][big])).all()


# ----------------------------------------------------------------------------- metrics
def test_metric_helpers_and_callables(tiny_llama):
    tok = tiny_llama.tokenizer
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" Mary", " John"))
    ids = tok(CLEAN, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        last = tiny_llama.hf_model(input_ids=ids).logits[0, -1]
    want = {
        "logit_diff": float(last[t] - last[f]),
        "logit": float(last[t]),
        "prob": float(torch.softmax(last, -1)[t]),
        "logprob": float(torch.log_softmax(last, -1)[t]),
    }
    metrics = {
        "logit_diff": logit_diff(" Mary", " John"),
        "logit": logit(" Mary"),
        "prob": prob(t),
        "logprob": logprob(" Mary"),
    }
    for name, m in metrics.items():
        df = activation_patching(tiny_llama, CLEAN, CORRUPTED, m, sites="embed")
        assert df["clean_metric"].iloc[0] == pytest.approx(want[name], rel=1e-5), name
    # a function of the logits gets every position (no shared prefix) unless marked as reading the last one
    seen = []

    def diff(lg):
        seen.append(lg.shape[1])
        return lg[:, -1, t] - lg[:, -1, f]

    kw = dict(sites="resid", positions="each")
    by_fn = activation_patching(tiny_llama, CLEAN, CORRUPTED, diff, **kw)
    n_pos = ids.shape[1]
    assert set(seen) == {n_pos}
    full = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), reuse_prefix=False, **kw)
    np.testing.assert_allclose(by_fn["metric"], full["metric"], rtol=0, atol=0)
    seen.clear()
    marked = activation_patching(tiny_llama, CLEAN, CORRUPTED, last_position(diff), **kw)
    by_pair = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), **kw)
    assert min(seen) < n_pos  # the shared prefix: the recomputed positions only
    np.testing.assert_allclose(marked["metric"], by_pair["metric"], rtol=0, atol=0)
    with pytest.raises(InputError, match="marks a metric function"):
        last_position(" Mary")


def test_a_metric_of_an_earlier_position_reads_that_position(tiny_llama):
    """A metric that reads position 3 sees the patched run there (full logits), as a plain forward
    with the patch does: patches at position 3 and before move it, later ones leave it exactly."""
    tok = tiny_llama.tokenizer
    t = tok(" Mary", add_special_tokens=False)["input_ids"][0]
    df = activation_patching(
        tiny_llama, CLEAN, CORRUPTED, lambda lg: lg[:, 3, t], sites="embed,1.mlp", positions="each"
    )
    ref, _, corrupted = ref_table(tiny_llama, CLEAN, CORRUPTED, None, [0, 4], "each", metric_at=(3, t))
    np.testing.assert_allclose(df["metric"], ref, rtol=0, atol=2e-6)
    assert (df.loc[df["position"] > 3, "metric"] == corrupted).all()


def test_bad_input(tiny_llama):
    m = tiny_llama
    with pytest.raises(InputError, match=r"' Mary Ann' is \d+ tokens"):
        activation_patching(m, CLEAN, CORRUPTED, (" Mary Ann", " John"))
    with pytest.raises(InputError, match="not one"):
        attribution_patching(m, CLEAN, CORRUPTED, prob(" Maryanne-Louise"))
    for positions in ("each", "all"):
        with pytest.raises(InputError, match=r"same token length, got \d+ and \d+"):
            activation_patching(m, CLEAN, LONGER, (" Mary", " John"), positions=positions)
        with pytest.raises(InputError, match="same token length"):
            attribution_patching(m, CLEAN, LONGER, (" Mary", " John"), positions=positions)
    with pytest.raises(InputError, match="positions must be one of"):
        activation_patching(m, CLEAN, CORRUPTED, (" Mary", " John"), positions="first")
    with pytest.raises(InputError, match=r"unknown hook point '3\.bogus'.*attn_out"):
        activation_patching(m, CLEAN, CORRUPTED, (" Mary", " John"), sites=["embed", "3.bogus"])
    with pytest.raises(InputError, match="layer 7 out of range"):
        activation_patching(m, CLEAN, CORRUPTED, (" Mary", " John"), sites=["7.attn"])
    with pytest.raises(InputError, match="one number per batch row"):
        activation_patching(m, CLEAN, CORRUPTED, lambda lg: lg[:, -1, :3])
    with pytest.raises(InputError, match="metric must be"):
        activation_patching(m, CLEAN, CORRUPTED, " Mary")
    with pytest.raises(InputError, match="empty"):
        activation_patching(m, "", CORRUPTED, (" Mary", " John"))
    with pytest.raises(InputError, match="batch_tokens"):
        activation_patching(m, CLEAN, CORRUPTED, (" Mary", " John"), batch_tokens=0)
    with pytest.raises(InputError, match=r"1\.pattern.*same token length"):  # its key axis follows the length
        activation_patching(m, CLEAN, LONGER, (" Mary", " John"), sites="1.pattern")


def test_aliases_name_the_same_points(tiny_llama):
    a = activation_patching(
        tiny_llama,
        CLEAN,
        CORRUPTED,
        (" Mary", " John"),
        sites=["blocks.1.attn.hook_z", "blocks.2.hook_mlp_out", "blocks.0.hook_resid_mid"],
    )
    b = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="1.z,2.mlp_out,0.attn")
    assert a["point"].tolist() == b["point"].tolist() == ["0.attn", *["1.z"] * 4, "2.mlp_out"]
    np.testing.assert_array_equal(a["metric"], b["metric"])
    # the stream's words: resid_pre of block l is the site before it, resid_mid l.attn, resid_post l.mlp
    words = activation_patching(
        tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="0.resid_pre,1.resid_pre,1.resid_mid,2.resid_post"
    )
    assert words["point"].tolist() == words["label"].tolist() == ["embed", "0.mlp", "1.attn", "2.mlp"]
    with pytest.raises(InputError, match="'hook_embed' is TransformerLens's token embedding alone"):
        activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="hook_embed")


# ----------------------------------------------------------------------------- plots and CLI
def test_plots_from_tables(tiny_llama, tmp_path):
    from depthscope.analyses.circuits.patching import plots

    each = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), positions="each")
    assert plots.plot_patching_sites(each, tmp_path / "sites.png").stat().st_size > 10_000
    # a per-head table in the patching schema (the layer x head figure reads only the table)
    heads = pd.DataFrame(
        {
            "layer": np.repeat(np.arange(3), 4),
            "head": pd.array(np.tile(np.arange(4), 3), dtype="Int64"),
            "kind": "heads",
            "position": pd.array([13] * 12, dtype="Int64"),
            "fraction_recovered": np.linspace(-0.5, 1, 12),
            "method": "activation",
        }
    )
    assert plots.plot_patching_heads(heads, tmp_path / "heads.png").stat().st_size > 10_000
    for fn in (plots.plot_patching_sites, plots.plot_patching_heads, plots.plot_attribution_vs_exact):
        with pytest.raises(InputError):
            fn(pd.DataFrame(), tmp_path / "x.png")
    with pytest.raises(InputError, match="no per-head rows"):
        plots.plot_patching_heads(each, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    from conftest import make_tiny

    d = tmp_path_factory.mktemp("tiny_llama_patch")
    make_tiny("llama", vocab_size=len(tokenizer)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_cli_writes_table_and_figures(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, so, se = run_cli(
        [
            "patch",
            "--clean",
            CLEAN,
            "--corrupted",
            CORRUPTED,
            "--target",
            " Mary",
            "--foil",
            " John",
            "--positions",
            "each",
            "--sites",
            "resid,heads",
            "--model",
            tiny_dir,
            "--out",
            out,
            "--threads",
            "1",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, se
    for name in (
        "patching_by_site.parquet",
        "patching_by_site.csv",
        "patching_by_head.parquet",
        "patching_by_head.csv",
        "patching_sites.png",
        "patching_heads.png",
        "patching_attribution.png",
    ):
        assert (out / name).is_file() and f"wrote {out / name}" in so, name
    sites = pd.read_parquet(out / "patching_by_site.parquet")
    heads = pd.read_parquet(out / "patching_by_head.parquet")
    for df in (sites, heads):
        assert list(df.columns) == PATCH_COLUMNS and set(df["method"]) == {"activation", "attribution"}
    assert len(sites) == 2 * 7 * 14 and sites["head"].isna().all()
    assert len(heads) == 2 * 3 * 4 * 14 and heads["head"].notna().all()
    assert pd.read_csv(out / "patching_by_site.csv")["metric"].to_numpy() == pytest.approx(sites["metric"].to_numpy())
    assert "Traceback" not in se and "Spearman" in so
    # --direction noise: the corrupted values into the clean run, as the API computes them
    noise = ["patch", "--sites", "resid", "--direction", "noise", "--no-plots", "--no-attribution", "--model", tiny_dir]
    code, so, se = run_cli([*noise, "--out", tmp_path / "noise", "--threads", "1"], monkeypatch, capsys)
    assert code == 0, se
    got = pd.read_parquet(tmp_path / "noise" / "patching_by_site.parquet")
    from depthscope.hooks import load_model

    api = activation_patching(
        load_model(str(tiny_dir)), CLEAN, CORRUPTED, (" Mary", " John"), sites="resid", direction="noise"
    )
    assert set(got["direction"]) == {"noise"} and len(got) == len(api) == 7
    np.testing.assert_allclose(got["metric"], api["metric"], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_dir_fast(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama folder with the tiny tokenizer (no real model needed)."""
    from conftest import make_tiny

    d = tmp_path_factory.mktemp("tiny_llama_patch_fast")
    make_tiny("llama", vocab_size=len(tiny_tokenizer)).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def test_cli_default_writes_the_site_and_head_tables_and_heatmaps(
    tiny_dir_fast, tiny_tokenizer, tmp_path, monkeypatch, capsys
):
    """The README's command (no --sites, no --positions): every residual site at each position
    and every head at the last position, two tables and two heatmaps, each file announced."""
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "0")
    out = tmp_path / "ioi"
    args = ["patch", "--clean", CLEAN, "--corrupted", CORRUPTED, "--target", " Mary", "--foil", " John"]
    code, so, se = run_cli([*args, "--out", out, "--model", tiny_dir_fast, "--threads", "1"], monkeypatch, capsys)
    assert code == 0, se
    written = [ln[len("wrote ") :] for ln in so.splitlines() if ln.startswith("wrote ")]
    files = {"patching_by_site.parquet", "patching_by_site.csv", "patching_sites.png"}
    files |= {"patching_by_head.parquet", "patching_by_head.csv", "patching_heads.png", "patching_attribution.png"}
    assert files <= {p.rsplit("/", 1)[-1] for p in written}
    for p in written:
        assert os.path.isfile(p), p
    sites = pd.read_parquet(out / "patching_by_site.parquet")
    heads = pd.read_parquet(out / "patching_by_head.parquet")
    n_pos = len(tiny_tokenizer(CLEAN)["input_ids"])
    assert sorted(sites["position"].unique()) == list(range(n_pos))
    exact = sites[sites["method"] == "activation"]
    assert len(exact) == 7 * n_pos and exact["head"].isna().all() and set(exact["kind"]) == {"resid"}
    h = heads[heads["method"] == "activation"]
    assert len(h) == 3 * 4 and (h["position"] == n_pos - 1).all() and set(h["kind"]) == {"heads"}
    assert "Spearman" in so and "Traceback" not in se
    # the help says what is written
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    help_text = CliRunner().invoke(app, ["patch", "--help"], env={"COLUMNS": "200"}).output
    for name in ("patching_by_site", "patching_sites.png", "patching_by_head", "patching_heads.png"):
        assert name in help_text


def test_explicit_sites_and_prompts_of_different_lengths(tiny_llama):
    """--sites keeps to the points named (no heads table); by default prompts of different token
    lengths patch the residual sites at the last position, with a note."""
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.configs import PatchConfig
    from depthscope.analyses.jobs.patch import patch_job

    res = patch_job(tiny_llama, PatchConfig(sites="resid", plots=False), Output(None))
    assert list(res.tables) == ["patching_by_site"] and res.summary["positions"] == {"sites": "last"}
    res = patch_job(tiny_llama, PatchConfig(corrupted=LONGER, attribution=False, plots=False), Output(None))
    assert res.summary["positions"] == {"sites": "last", "heads": "last"}
    assert "same token length" in res.summary["notes"]
    assert len(res.tables["patching_by_head"]) == 3 * 4


def test_cli_rejects_bad_input_without_traceback(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    base = ["patch", "--model", tiny_dir, "--out", out, "--clean", CLEAN]
    for extra, msg in [
        (["--corrupted", CORRUPTED, "--target", " Mary Ann"], "is 2 tokens"),
        (["--corrupted", LONGER, "--positions", "each"], "same token length"),
        (["--corrupted", CORRUPTED, "--positions", "middle"], "positions must be"),
        (["--corrupted", CORRUPTED, "--sites", "embed,99.mlp"], "out of range"),
    ]:
        code, so, se = run_cli(base + extra, monkeypatch, capsys)
        assert code == 2 and msg in se and "Traceback" not in se, (extra, se)
    # nothing half-written: the folder is claimed before compute, but holds no table or figure
    assert not out.exists() or not [p for p in out.iterdir() if p.suffix in (".csv", ".parquet", ".png")]
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    help_text = CliRunner().invoke(app, ["patch", "--help"]).output
    for opt in ("--clean", "--corrupted", "--target", "--foil", "--positions", "--sites", "--out", "--model"):
        assert opt in help_text
