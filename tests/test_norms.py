"""Contribution norms and direct logit attribution: every metric against an independent
computation from transformers' own hidden states and sublayer outputs (plain forward hooks,
numpy float64), exact identities, streaming invariance, layouts and bad input."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from depthscope.analyses import TextWindows, contribution_norms, direct_logit_attribution
from depthscope.analyses.norms import NORM_METRICS, fit_growth_rate, norms_by_position, norms_summary
from depthscope.analyses.text import read_documents
from depthscope.hooks import InputError, NonFiniteActivationError, UnsupportedArchitecture
from depthscope.probes.corpora.spans import bos_id

#: the texts read as the tokenizer tokenizes them (the references here tokenize with ``hm.tokenize``)
PLAIN = TextWindows(bos=False)

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "norms", "ewt_sample.txt")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


@pytest.fixture(scope="module")
def docs():
    return read_documents(FIX)


@pytest.fixture(scope="module")
def short_docs(docs):
    """The shortest fixture sentences: real text at the lowest cost of the real model."""
    return sorted(docs, key=len)[:8]


# ----------------------------------------------------------------------------- the reference
def reference_streams(hm, ids, mask):
    """Every site's stream from transformers: hidden_states for block inputs, module outputs of
    attention and MLP (plain forward hooks) for the sublayer writes. Returns float64 numpy
    [S, B, P, D] and the model output."""
    arch = hm.arch
    attn_out, mlp_out = {}, {}
    hs = []
    for l, (a, m) in enumerate(zip(arch.attn, arch.mlp)):
        hs.append(
            a.register_forward_hook(lambda mod, i, o, l=l: attn_out.__setitem__(l, o[0] if isinstance(o, tuple) else o))
        )
        hs.append(
            m.register_forward_hook(lambda mod, i, o, l=l: mlp_out.__setitem__(l, o[0] if isinstance(o, tuple) else o))
        )
    try:
        with torch.no_grad():
            out = hm.hf_model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
    finally:
        for h in hs:
            h.remove()
    hid = out.hidden_states
    sites = [hid[0]]
    for l in range(hm.n_layers):
        pre = hid[l]
        mid = attn_out[l] if arch.layout == "post_norm" else pre + attn_out[l]
        if arch.layout == "post_norm":
            post = hid[l + 1]
        elif arch.layout == "parallel":
            post = pre + attn_out[l] + mlp_out[l]
        else:
            post = mid + mlp_out[l]
        sites += [mid, post]
    return torch.stack(sites).double().numpy(), out


def module_sigma(norm, h):
    """The scale a norm module divides a stream by, read off the module's own output:
    N(h) - bias = g * centre(h) / sigma  ->  sigma = ||g * centre(h)|| / ||N(h) - bias||."""
    x = torch.tensor(h, dtype=torch.float32)
    with torch.no_grad():
        y = norm(x).double().numpy()
    if getattr(norm, "bias", None) is not None:
        y = y - norm.bias.detach().double().numpy()
    g = norm.weight.detach().double().numpy()
    hc = h - h.mean(-1, keepdims=True) if "rms" not in type(norm).__name__.lower() else h
    return np.linalg.norm(g * hc, axis=-1) / np.linalg.norm(y, axis=-1), g


def reference_metrics(hm, H, reader_of):
    """Per-token metrics in plain numpy from streams H [S, B, P, D] (float64).

    reader_of(s) -> (norm module, stream index it reads) or None."""
    S = H.shape[0]
    n = np.linalg.norm(H, axis=-1)
    U = H[1:] - H[:-1]
    un = np.linalg.norm(U, axis=-1)
    nan = np.full_like(n[:1], np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = un / n[:-1]
        cos = (U * H[:-1]).sum(-1) / (un * n[:-1])
        growth = n[1:] / n[:-1]
        bi = 1 - (H[:-1] * H[1:]).sum(-1) / (n[:-1] * n[1:])
    ua, um = un[0::2], un[1::2]
    share = np.repeat(ua / (ua + um), 2, axis=0)
    eff = np.full_like(un, np.nan)
    effrel = np.full_like(un, np.nan)
    for s in range(1, S):
        r = reader_of(s)
        if r is None:
            continue
        norm, idx = r
        sigma, g = module_sigma(norm, H[idx])
        u = U[s - 1]
        hr = H[idx]
        if "rms" not in type(norm).__name__.lower():
            u = u - u.mean(-1, keepdims=True)
            hr = hr - hr.mean(-1, keepdims=True)
        eff[s - 1] = np.linalg.norm(g * u, axis=-1) / sigma
        effrel[s - 1] = np.linalg.norm(g * u, axis=-1) / np.linalg.norm(g * hr, axis=-1)
    D = H.shape[-1]
    a = np.abs(H)
    return {
        "stream_norm": n,
        "update_norm": np.concatenate([nan, un]),
        "relative_update": np.concatenate([nan, rel]),
        "cos_update_stream": np.concatenate([nan, cos]),
        "growth": np.concatenate([nan, growth]),
        "block_influence": np.concatenate([nan, bi]),
        "attn_share": np.concatenate([nan, share]),
        "effective_write": np.concatenate([nan, eff]),
        "effective_relative": np.concatenate([nan, effrel]),
        # lower median (the (D-1)//2-th smallest |h|), the documented convention
        "median_abs": np.sort(a, axis=-1)[..., (D - 1) // 2],
        "max_abs": a.max(-1),
    }


def sequential_reader(hm):
    L = hm.n_layers

    def reader(s):
        if s % 2 == 1:
            return hm.arch.ln2[s // 2], s
        layer = s // 2  # after block layer-1's MLP
        return (hm.arch.ln1[layer] if layer < L else hm.arch.final_norm), s

    return reader


def compare_aggregates(df, ref, mask, metrics=NORM_METRICS, rtol=1e-4, atol=1e-7):
    P = mask.shape[1]
    pos = np.arange(P)[None, :]
    groups = {"rest": mask & (pos >= 1), "first": mask & (pos == 0)}
    for g, sel in groups.items():
        part = df[df["positions"] == g].sort_values("site")
        assert (part["n_tokens"] == sel.sum()).all()
        for k in metrics:
            want = np.array(
                [np.nanmean(np.where(sel, v, np.nan)) if np.isfinite(v[sel]).any() else np.nan for v in ref[k]]
            )
            got = part[k].to_numpy(float)
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{k} ({g})")
        mx = np.array([v[sel].max() for v in ref["max_abs"]])
        np.testing.assert_allclose(part["max_abs"].to_numpy(float), mx, rtol=1e-6, err_msg=f"max_abs ({g})")


# ----------------------------------------------------------------------------- real model
def test_real_model_matches_independent_reference(default_model, docs):
    hm = default_model
    texts = docs[:6]
    df = contribution_norms(hm, texts, batch_size=6, text=PLAIN)
    ids, mask = hm.tokenize(texts)
    H, _ = reference_streams(hm, ids, mask)
    ref = reference_metrics(hm, H, sequential_reader(hm))
    compare_aggregates(df, ref, mask.numpy())
    # the massive activation's location: recomputed by brute force
    rest = df[df["positions"] == "rest"].set_index("site")
    a = np.abs(H) * (mask.numpy() & (np.arange(mask.shape[1]) >= 1))[None, :, :, None]
    for s in (4, 30, 60):
        b, p, d = np.unravel_index(a[s].argmax(), a[s].shape)
        row = rest.loc[s]
        assert (row["max_abs_doc"], row["max_abs_position"], row["max_abs_dim"]) == (b, p, d)
        assert row["max_abs_token_id"] == int(ids[b, p])
    # the shared columns and the documented layout of the table
    assert list(df.columns[:7]) == ["site", "label", "layer", "sublayer", "depth", "positions", "n_tokens"]
    assert len(df) == 2 * hm.n_sites
    embed = df[df["label"] == "embed"]
    assert embed[[c for c in NORM_METRICS if c not in ("stream_norm", "median_abs")]].isna().all().all()
    # the sink position: its stream is far larger than the rest's after the first blocks
    s = norms_summary(df)
    assert s["sink_ratio"] > 10
    assert 1.0 < s["growth_rate"] < 1.3
    assert 0.0 < s["attn_share"] < 1.0


def test_per_token_identity_and_consistency(default_model, short_docs):
    hm = default_model
    texts = short_docs[4:7]
    pos = norms_by_position(hm, texts)
    d = pos[pos["site"] > 0]
    g2 = d["growth"] ** 2
    rhs = 1 + d["relative_update"] ** 2 + 2 * d["relative_update"] * d["cos_update_stream"]
    err = ((g2 - rhs).abs() / g2.clip(lower=1)).max()
    assert err < 1e-5, err
    # block influence agrees with the growth/relative-update/cosine triple too:
    # cos(h_{s-1}, h_s) = (1 + rel cos_u) / growth
    bi = 1 - (1 + d["relative_update"] * d["cos_update_stream"]) / d["growth"]
    assert np.allclose(bi, d["block_influence"], atol=1e-5)
    # the dataset table is the mean of the per-token one, position 0 apart
    agg = contribution_norms(hm, texts, text=PLAIN)
    first = pos["position"] == 0
    for g, sel in (("rest", ~first), ("first", first)):
        want = pos[sel].groupby("site")[NORM_METRICS].mean()
        got = agg[agg["positions"] == g].set_index("site")[NORM_METRICS]
        np.testing.assert_allclose(got.to_numpy(float), want.to_numpy(float), rtol=1e-9, equal_nan=True)
    assert list(pos.groupby("sequence")["token"].first().index) == list(range(len(texts)))
    assert set(pos.columns) >= {"sequence", "doc", "position", "token", "site", "label", "depth", "max_abs_dim"}


def test_dla_sums_to_the_models_logit_real_model(default_model):
    hm = default_model
    prompt = "The capital of France is"
    dla = direct_logit_attribution(hm, prompt, " Paris")
    ids, mask = hm.tokenize([prompt])
    H, out = reference_streams(hm, ids, mask)
    paris = hm.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    logit = float(out.logits[0, -1, paris])
    assert dla["logit"].iloc[0] == pytest.approx(logit, rel=1e-6)
    assert dla["contribution"].sum() == pytest.approx(logit, rel=1e-4)
    assert len(dla) == hm.n_sites + 1 and dla["label"].iloc[-1] == "const"
    # each part, independently: W_U[:, t] . N_frozen(component), N's scale read off the module
    h = H[:, 0, -1]
    comps = np.concatenate([h[:1], h[1:] - h[:-1]])
    sigma, g = module_sigma(hm.arch.final_norm, h[-1:])
    w = hm.unembed.W_U[:, paris].detach().double().numpy()
    want = comps @ (g * w) / sigma[0]
    np.testing.assert_allclose(dla["contribution"].to_numpy()[:-1], want, rtol=1e-4, atol=1e-4)
    # a logit difference against a contrast token
    diff = direct_logit_attribution(hm, [prompt, "The capital of Italy is"], " Paris", " Rome")
    for _ex, part in diff.groupby("example"):
        assert part["contribution"].sum() == pytest.approx(part["logit"].iloc[0], rel=1e-4, abs=1e-4)
    assert diff["contrast"].iloc[0] == " Rome"
    top = direct_logit_attribution(hm, prompt, None)  # None: the model's own top-1 prediction
    assert top["target"].iloc[0] == " Paris" and top["logit"].iloc[0] == pytest.approx(logit, rel=1e-6)
    assert diff.groupby("example")["logit"].first().iloc[0] > 0 > diff.groupby("example")["logit"].first().iloc[1]


# ----------------------------------------------------------------------------- tiny models
def test_streaming_is_batch_and_padding_invariant(tiny_llama, docs):
    a = contribution_norms(tiny_llama, docs[:7], batch_size=1)
    b = contribution_norms(tiny_llama, docs[:7], batch_size=3)
    cols = NORM_METRICS + ["max_abs", "max_abs_doc", "max_abs_position", "max_abs_dim", "n_tokens"]
    pd.testing.assert_frame_equal(a[cols], b[cols], rtol=1e-6)


def test_token_id_inputs_with_mask(tiny_llama, docs):
    ids, mask = tiny_llama.tokenize(docs[:3])
    a = contribution_norms(tiny_llama, docs[:3], text=PLAIN)
    b = contribution_norms(tiny_llama, ids, mask=mask)
    pd.testing.assert_frame_equal(a[NORM_METRICS + ["n_tokens"]], b[NORM_METRICS + ["n_tokens"]], rtol=1e-6)
    # by default every document is read after the BOS token, as every free-text analysis reads it
    rows = [[bos_id(tiny_llama.tokenizer), *tiny_llama.tokenizer(d)["input_ids"]] for d in docs[:3]]
    with_bos = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        with_bos[i, : len(r)] = torch.tensor(r)
    c = contribution_norms(tiny_llama, docs[:3])
    real = torch.arange(with_bos.shape[1])[None] < torch.tensor([len(r) for r in rows])[:, None]
    e = contribution_norms(tiny_llama, with_bos, mask=real)
    pd.testing.assert_frame_equal(c[NORM_METRICS + ["n_tokens"]], e[NORM_METRICS + ["n_tokens"]], rtol=1e-6)
    d1 = direct_logit_attribution(tiny_llama, docs[:3], " the")
    d2 = direct_logit_attribution(tiny_llama, ids, " the", mask=mask)
    np.testing.assert_allclose(d1["contribution"], d2["contribution"], rtol=1e-5, atol=1e-6)
    assert (d1["position"] == d2["position"]).all()


def test_windows_and_max_tokens(tiny_llama, docs):
    text = " ".join(docs[:3])
    n = len(tiny_llama.tokenizer(text)["input_ids"])
    df = contribution_norms(tiny_llama, [text], window=16)
    first = df[df["positions"] == "first"]["n_tokens"].iloc[0]
    rest = df[df["positions"] == "rest"]["n_tokens"].iloc[0]
    assert first == -(-n // 15) and rest == n  # every window starts a fresh context with the BOS token
    plain = contribution_norms(tiny_llama, [text], window=16, text=PLAIN)
    first = plain[plain["positions"] == "first"]["n_tokens"].iloc[0]
    assert first == -(-n // 16) and first + plain[plain["positions"] == "rest"]["n_tokens"].iloc[0] == n
    cut = contribution_norms(tiny_llama, docs, max_tokens=50, batch_size=2)
    assert cut.groupby("positions")["n_tokens"].first().sum() == 50


# ----------------------------------------------------------------------------- intervals
def clustered_se(tokens: pd.DataFrame, value: str, cluster: str = "doc") -> float:
    """The CR1 standard error of the mean of ``value`` over the tokens (NaN skipped), clusters
    holding the value at least once, computed the plain way."""
    g = tokens.groupby(cluster)[value].agg(["sum", "count"])
    g = g[g["count"] > 0]
    if len(g) < 2:
        return np.nan
    m, G, N = g["sum"].sum() / g["count"].sum(), len(g), g["count"].sum()
    return float(np.sqrt(G / (G - 1) * ((g["sum"] - m * g["count"]) ** 2).sum() / N**2))


BOUNDS = {"cos_update_stream": (-1, 1), "attn_share": (0, 1), "block_influence": (0, 2)}  # others: >= 0


def test_intervals_match_an_independent_clustered_se(tiny_llama, docs):
    """``<metric>_se`` per (site, positions) is the document-clustered SE recomputed from the
    per-token table; ``_lo <= mean <= _hi`` with the t(0.975, G-1) half-width; more documents of
    the same kind shrink it."""
    from scipy.stats import t

    texts = docs[:12]
    kw = dict(window=12, batch_size=3)  # the documents split into windows: clusters != windows
    df = contribution_norms(tiny_llama, texts, text=PLAIN, **kw)
    pos = norms_by_position(tiny_llama, texts, max_tokens=None, **kw)
    assert (df["n_docs"] == len(texts)).all() and (df["n_windows"] > len(texts)).all()
    assert (df["ci_n"] == len(texts)).all() and set(df["ci_unit"]) == {"documents"}
    groups = {"rest": pos[pos["position"] >= 1], "first": pos[pos["position"] == 0]}
    checked = 0
    for r in df.itertuples():
        tok = groups[r.positions]
        tok = tok[tok["site"] == r.site]
        for k in NORM_METRICS:
            want = clustered_se(tok, k)
            got = getattr(r, k + "_se")
            if np.isnan(want):
                assert np.isnan(got), (r.label, r.positions, k)
                continue
            assert got == pytest.approx(want, rel=1e-6, abs=1e-12), (r.label, r.positions, k)
            mean, lo, hi = getattr(r, k), getattr(r, k + "_lo"), getattr(r, k + "_hi")
            G = tok.dropna(subset=[k])["doc"].nunique()
            half = t.ppf(0.975, G - 1) * got
            lo_b, hi_b = BOUNDS.get(k, (0, None))
            assert lo == pytest.approx(max(mean - half, lo_b), rel=1e-12, abs=1e-15)
            assert hi == pytest.approx(mean + half if hi_b is None else min(mean + half, hi_b), rel=1e-12, abs=1e-15)
            assert lo <= mean <= hi
            checked += 1
    assert checked > 2 * tiny_llama.n_sites * 8
    # the embedding has no update: NaN mean and NaN interval
    emb = df[df["site"] == 0]
    assert emb["update_norm"].isna().all() and emb["update_norm_lo"].isna().all()
    # the same documents three times: the exact CR1 shrinkage
    big = contribution_norms(tiny_llama, texts * 3, text=PLAIN, **kw)
    G = len(texts)
    factor = np.sqrt((3 * G / (3 * G - 1)) / (G / (G - 1)) / 3)
    for k in ("stream_norm", "relative_update", "attn_share"):
        np.testing.assert_allclose(big[k + "_se"], factor * df[k + "_se"], rtol=1e-6)
        w_small, w_big = (df[k + "_hi"] - df[k + "_lo"]).dropna(), (big[k + "_hi"] - big[k + "_lo"]).dropna()
        assert (w_big < w_small).all()


def test_intervals_single_document_uses_windows(tiny_llama, docs):
    """One document split into windows: the windows are the clusters, as if each were a document."""
    ids = tiny_llama.tokenize(" ".join(docs[:4]))[0][:, :60]
    one = contribution_norms(tiny_llama, ids, window=12)
    split = contribution_norms(tiny_llama, ids.reshape(5, 12))
    assert one["n_docs"].eq(1).all() and one["n_windows"].eq(5).all() and split["n_docs"].eq(5).all()
    for k in NORM_METRICS:
        np.testing.assert_allclose(one[k + "_se"], split[k + "_se"], rtol=1e-6)
    assert one.loc[one["positions"] == "rest", "stream_norm_se"].gt(0).all()
    # five clusters: the SE is given, the interval withheld, and the notes say why
    assert one["ci_n"].eq(5).all() and set(one["ci_unit"]) == {"windows of one document"}
    assert one["stream_norm_lo"].isna().all() and one["stream_norm_hi"].isna().all()
    assert "5 windows of one document, fewer than 10" in one.attrs["notes"]


def _randomise_norms(hm, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in hm.hf_model.modules():
            if "norm" in type(mod).__name__.lower():
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g))
                if getattr(mod, "bias", None) is not None:
                    mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=g))


def test_layernorm_gpt2_matches_reference(tiny_factory, docs):
    hm = tiny_factory("gpt2", seed=1)
    _randomise_norms(hm)
    texts = docs[:3]
    df = contribution_norms(hm, texts, text=PLAIN)
    ids, mask = hm.tokenize(texts)
    H, _ = reference_streams(hm, ids, mask)
    compare_aggregates(df, reference_metrics(hm, H, sequential_reader(hm)), mask.numpy())


def test_parallel_neox_effective_write_reads_block_output(tiny_factory, docs):
    hm = tiny_factory("gpt_neox", seed=2)
    _randomise_norms(hm)
    texts = docs[:3]
    df = contribution_norms(hm, texts, text=PLAIN)
    ids, mask = hm.tokenize(texts)
    H, _ = reference_streams(hm, ids, mask)
    L = hm.n_layers

    def reader(s):  # attention writes are first read by the next block's ln1 on the block output
        layer = (s + 1) // 2
        return (hm.arch.ln1[layer] if layer < L else hm.arch.final_norm), 2 * layer

    compare_aggregates(df, reference_metrics(hm, H, reader), mask.numpy())
    assert "parallel" in df.attrs["notes"]


def test_post_norm_bert_documented(tiny_factory, docs):
    hm = tiny_factory("bert")
    df = contribution_norms(hm, docs[:2])
    assert df["effective_write"].isna().all()
    assert df[df["site"] > 0]["relative_update"].notna().all()
    assert "post-norm" in df.attrs["notes"]
    with pytest.raises(UnsupportedArchitecture, match="decoder"):
        direct_logit_attribution(hm, "The capital of France is", " Paris")


def test_dla_layernorm_gpt2_sums_to_logit(tiny_factory):
    hm = tiny_factory("gpt2", seed=3)
    _randomise_norms(hm, seed=3)
    prompts = ["The capital of France is", "Hello world, this is"]
    dla = direct_logit_attribution(hm, prompts, [" Paris", 42], " the")
    for ex, part in dla.groupby("example"):
        ids, mask = hm.tokenize([prompts[ex]])
        with torch.no_grad():
            lg = hm.hf_model(input_ids=ids).logits[0, -1].double()
        t = part["target_id"].iloc[0]
        c = part["contrast_id"].iloc[0]
        want = float(lg[t] - lg[c])
        assert part["contribution"].sum() == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert part.loc[part["label"] == "const", "contribution"].iloc[0] != 0  # LayerNorm bias projected


def test_zero_norm_stream_no_division(tiny_llama, docs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = contribution_norms(tiny_llama, docs[:3], hooks={"0.mlp": lambda h, lab: torch.zeros_like(h)})
    rest = df[df["positions"] == "rest"].set_index("label")
    n = rest.loc["0.mlp", "n_tokens"]
    assert rest.loc["0.mlp", "stream_norm"] == 0
    assert rest.loc["0.mlp", "growth"] == 0  # defined: previous stream is non-zero
    assert np.isnan(rest.loc["0.mlp", "block_influence"])  # cos with a zero vector: undefined
    later = rest.loc["1.attn":]
    assert later[["relative_update", "growth", "cos_update_stream"]].isna().all().all()
    assert (later["n_undefined"] == n).all() and rest.loc["0.attn", "n_undefined"] == 0
    assert np.isfinite(df.loc[df["site"] > 0, "effective_write"]).all()  # eps keeps the norm's scale positive
    assert np.isfinite(rest.loc["0.attn", NORM_METRICS].astype(float)).all()


def test_nan_activations_are_refused(tiny_llama, docs):
    def poison(h, lab):
        h = h.clone()
        h[0, 1, 3] = float("nan")
        return h

    with pytest.raises(NonFiniteActivationError, match="1.attn"):
        contribution_norms(tiny_llama, docs[:2], hooks={"1.attn": poison})


def test_bad_input(tiny_llama, tmp_path):
    for bad in ([], [""], ""):
        with pytest.raises(InputError, match="empty"):
            contribution_norms(tiny_llama, bad)
    with pytest.raises(InputError, match="empty"):
        contribution_norms(tiny_llama, torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(InputError):
        contribution_norms(tiny_llama, ["fine"], max_tokens=0)
    with pytest.raises(InputError):
        contribution_norms(tiny_llama, ["fine"], batch_size=0)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(InputError, match="no text"):
        read_documents(empty)
    with pytest.raises(InputError, match="2 tokens|tokens"):
        direct_logit_attribution(tiny_llama, "The capital of France is", " Parisianism")
    with pytest.raises(InputError, match="out of range"):
        direct_logit_attribution(tiny_llama, "The capital of France is", 10**7)
    with pytest.raises(InputError, match="one per example"):
        direct_logit_attribution(tiny_llama, ["a b", "c d"], [" Paris", " Rome", " x"])
    with pytest.raises(InputError, match="empty"):
        direct_logit_attribution(tiny_llama, [], " Paris")


def test_softcap_refused(tiny_factory):
    hm = tiny_factory("llama", seed=5)
    hm.arch.softcap = 30.0
    with pytest.raises(UnsupportedArchitecture, match="soft-caps"):
        direct_logit_attribution(hm, "The capital of France is", " Paris")


def test_growth_fit_recovers_a_known_rate():
    depth = np.arange(1, 11, dtype=float)
    df = pd.DataFrame({"sublayer": "mlp", "depth": depth, "stream_norm": 3.0 * 1.25**depth})
    fit = fit_growth_rate(df)
    assert (
        fit["rate"] == pytest.approx(1.25)
        and fit["intercept"] == pytest.approx(3.0)
        and fit["r2"] == pytest.approx(1.0)
    )


# ----------------------------------------------------------------------------- per-head writes
def _explicit_head_writes(hm, texts):
    """Per-head writes materialised the plain way: o_proj input split by head times W_O's columns."""
    ids, mask = hm.tokenize(texts)
    z, out = {}, {}
    hs = []
    for l, proj in enumerate(hm.arch.o_proj):
        hs.append(proj.register_forward_pre_hook(lambda m, a, l=l: z.__setitem__(l, a[0].detach().double())))
        hs.append(proj.register_forward_hook(lambda m, a, o, l=l: out.__setitem__(l, o.detach().double())))
    try:
        with torch.no_grad():
            hm.hf_model(input_ids=ids, attention_mask=mask.long())
    finally:
        for h in hs:
            h.remove()
    H = hm.hf_model.config.num_attention_heads
    writes = []
    for l, proj in enumerate(hm.arch.o_proj):
        W = proj.weight.detach().double()
        W = W.T if type(proj).__name__ == "Conv1D" else W  # [D, H*dh]
        dh = W.shape[1] // H
        per = torch.stack([z[l][..., h * dh : (h + 1) * dh] @ W[:, h * dh : (h + 1) * dh].T for h in range(H)], -2)
        writes.append(per)  # [B, P, H, D]
    return writes, out, mask.numpy()


def _explicit_values(hm, texts):
    """Value vectors per query head [B, P, H, dh], read off each family's value projection."""
    ids, mask = hm.tokenize(texts)
    cfg = hm.hf_model.config
    H = cfg.num_attention_heads
    vals, hs = {}, []

    def keep(l, fn):
        return lambda m, a, o: vals.__setitem__(l, fn(o.detach().double()))

    for l, attn in enumerate(hm.arch.attn):
        if hm.arch.family == "llama":
            kv = cfg.num_key_value_heads
            hs.append(
                attn.v_proj.register_forward_hook(
                    keep(l, lambda o, kv=kv: o.reshape(*o.shape[:2], kv, -1).repeat_interleave(H // kv, 2))
                )
            )
        elif hm.arch.family == "gpt2":
            hs.append(
                attn.c_attn.register_forward_hook(
                    keep(l, lambda o: o[..., 2 * o.shape[-1] // 3 :].reshape(*o.shape[:2], H, -1))
                )
            )
        else:
            hs.append(
                attn.query_key_value.register_forward_hook(
                    keep(l, lambda o: o.reshape(*o.shape[:2], H, -1)[..., 2 * o.shape[-1] // (3 * H) :])
                )
            )
    try:
        with torch.no_grad():
            hm.hf_model(input_ids=ids, attention_mask=mask.long())
    finally:
        for h in hs:
            h.remove()
    return vals


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_head_write_norms_match_explicit_heads(tiny_factory, docs, family):
    from depthscope.analyses.norms.heads import head_write_norms

    hm = tiny_factory(family, seed=7)
    texts = docs[:3]
    df = head_write_norms(hm, texts, text=PLAIN)
    writes, out, mask = _explicit_head_writes(hm, texts)
    rest = mask & (np.arange(mask.shape[1]) >= 1)
    got = df[df["positions"] == "rest"].sort_values(["layer", "head"])
    for l, w in enumerate(writes):
        norms = w.norm(dim=-1).numpy()  # [B, P, H]
        part = got[got["layer"] == l]
        np.testing.assert_allclose(part["write_norm"], norms[rest].mean(0), rtol=1e-4)
        share = norms / norms.sum(-1, keepdims=True)
        np.testing.assert_allclose(part["write_share"], share[rest].mean(0), rtol=1e-4)
        coh = w.sum(-2).norm(dim=-1).numpy() / norms.sum(-1)
        np.testing.assert_allclose(part["heads_coherence"], coh[rest].mean(), rtol=1e-4)
        np.testing.assert_allclose(part["attn_write_norm"], out[l].norm(dim=-1).numpy()[rest].mean(), rtol=1e-4)
    assert (df["label"].str.endswith(".attn")).all() and set(df["positions"]) == {"rest", "first"}


def test_head_writes_real_model(default_model, short_docs):
    from depthscope.analyses.norms.heads import head_write_norms

    df = head_write_norms(default_model, short_docs[:2])
    assert len(df) == 2 * 30 * 9
    rest = df[df["positions"] == "rest"]
    # triangle inequality: the sublayer's write is at most the sum of its heads' writes
    per_layer = rest.groupby("layer").agg(
        s=("write_norm", "sum"), a=("attn_write_norm", "first"), c=("heads_coherence", "first")
    )
    assert (per_layer["a"] <= per_layer["s"] * (1 + 1e-6)).all()
    assert ((per_layer["c"] > 0) & (per_layer["c"] <= 1 + 1e-6)).all()
    shares = rest.groupby("layer")["write_share"].sum()
    np.testing.assert_allclose(shares, 1.0, rtol=1e-9)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_norm_weighted_attention(tiny_factory, family):
    from depthscope.analyses.norms.heads import norm_weighted_attention

    hm = tiny_factory(family, seed=8)
    before = hm.hf_model.config._attn_implementation
    text = "The capital of France is Paris."
    df = norm_weighted_attention(hm, text)
    assert hm.hf_model.config._attn_implementation == before  # restored
    P = hm.tokenize([text])[0].shape[1]
    H = hm.hf_model.config.num_attention_heads
    assert len(df) == hm.n_layers * H * P * (P + 1) // 2
    sums = df.groupby(["layer", "head", "query"])["weight"].sum()
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)  # causal softmax over keys j <= i
    np.testing.assert_allclose(df["norm_weighted"], df["weight"] * df["value_norm"], rtol=1e-12)
    # sum_j a_ij f(x_j), rebuilt from the table's weights and values read off the value projection,
    # equals each head's write computed from the output projection's input
    writes, _, _ = _explicit_head_writes(hm, [text])
    vals = _explicit_values(hm, [text])
    for l, proj in enumerate(hm.arch.o_proj):
        W = proj.weight.detach().double()
        W = W.T if type(proj).__name__ == "Conv1D" else W
        dh = W.shape[1] // H
        f = torch.stack([vals[l][0, :, h] @ W[:, h * dh : (h + 1) * dh].T for h in range(H)], 1)  # [P, H, D]
        part = df[df["layer"] == l]
        np.testing.assert_allclose(part["value_norm"], f.norm(dim=-1).numpy()[part["key"], part["head"]], rtol=1e-4)
        a = torch.zeros(H, P, P, dtype=torch.float64)
        idx = [torch.from_numpy(part[c].to_numpy().copy()) for c in ("head", "query", "key")]
        a[idx[0], idx[1], idx[2]] = torch.from_numpy(part["weight"].to_numpy(dtype=np.float64, copy=True))
        rebuilt = torch.einsum("hij,jhd->ihd", a, f)
        assert torch.allclose(rebuilt, writes[l][0], rtol=1e-4, atol=1e-5 * writes[l].abs().max())
    with pytest.raises(InputError):
        norm_weighted_attention(hm, "")


def test_heads_refuse_post_norm(tiny_factory):
    from depthscope.analyses.norms.heads import head_write_norms

    with pytest.raises(UnsupportedArchitecture, match="post-norm"):
        head_write_norms(tiny_factory("bert"), ["some text"])


# ----------------------------------------------------------------------------- CLI and plots
def test_cli_writes_tables_and_plots(default_model, tmp_path):
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app
    from depthscope.analyses.tables import read_table

    out = tmp_path / "out"
    res = CliRunner().invoke(
        app, ["norms", "--text", FIX, "--out", str(out), "--max-tokens", "40", "--target", " Paris", "--heads"]
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    for name in ("norms_by_site", "norms_by_position", "dla", "head_writes"):
        assert (out / f"{name}.parquet").is_file() and (out / f"{name}.csv").is_file()
    for png in (
        "norms_stream_growth",
        "norms_update_norms",
        "norms_relative_update",
        "norms_position_heatmap",
        "norms_dla",
        "norms_head_writes",
    ):
        assert (out / f"{png}.png").stat().st_size > 10_000
    df = read_table(out / "norms_by_site.parquet")
    assert df.groupby("positions")["n_tokens"].first().sum() == 40
    dla = read_table(out / "dla.csv")
    assert dla["target"].iloc[0] == " Paris"
    assert dla["contribution"].sum() == pytest.approx(dla["logit"].iloc[0], rel=1e-4)
    import json

    summary = json.loads((out / "norms_summary.json").read_text())
    assert summary["dla_top"][0][0] == "29.mlp" and summary["growth_rate"] > 1
    help_text = CliRunner().invoke(app, ["norms", "--help"]).output
    assert "--max-tokens" in help_text and "--target" in help_text


def test_plots_refuse_empty_tables(tmp_path):
    from depthscope.analyses.norms import plots

    for fn in (
        plots.plot_stream_growth,
        plots.plot_update_norms,
        plots.plot_relative_update,
        plots.plot_position_heatmap,
        plots.plot_dla,
        plots.plot_head_writes,
    ):
        with pytest.raises(InputError):
            fn(pd.DataFrame(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dla_check_holds_in_half_precision(tiny_llama, dtype):
    """In bfloat16/float16 the model's own logit is a few rounding units from the exact sum of
    the parts: the check allows that much and no more (a wrong final norm is still caught)."""
    import copy

    half = copy.deepcopy(tiny_llama)
    half.hf_model.to(dtype)
    texts = ["The capital of France is", "Hello world, this is"]
    df = direct_logit_attribution(half, texts)
    parts = df.groupby("example")["contribution"].sum()
    logit = df.groupby("example")["logit"].first()
    eps = torch.finfo(dtype).eps
    scale = df.groupby("example")["contribution"].apply(lambda c: c.abs().sum())
    assert ((parts - logit).abs() <= 4 * eps * scale).all()
    # a model whose logits are not its final norm and unembedding (here: scaled after lm_head)
    h = half.hf_model.lm_head.register_forward_hook(lambda m, i, o: o * 1.5)
    try:
        with pytest.raises(RuntimeError, match="does not reproduce the model's logit"):
            direct_logit_attribution(half, texts)
    finally:
        h.remove()
