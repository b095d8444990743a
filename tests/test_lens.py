"""The logit lens at every sublayer: the last site reproduces the model (checked against the
Hugging Face model's own logits with torch's cross-entropy), every metric equals an independent
float64 reference, streaming does not change results, the CLI writes tables and plots, and bad
input is refused clearly."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli

from depthscope.analyses import TextWindows, logit_lens, logit_lens_tokens
from depthscope.analyses.lens.logit import METRICS
from depthscope.analyses.text import read_documents
from depthscope.hooks import InputError, UnsupportedArchitecture, load_model
from depthscope.probes.corpora.spans import bos_id

HERE = os.path.dirname(__file__)
SAMPLE = os.path.join(HERE, "fixtures", "lens", "ewt_sample.txt")  # UD English EWT, CC BY-SA 4.0
TEXTS = ["The capital of France is Paris.", "Hello world, this is a longer second sentence with more words."]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# ----------------------------------------------------------------------------- reference
def with_bos(tok, text: str) -> list[int]:
    """The token ids the lens reads a document as: the BOS token (the tokenizers here add none), then the text's."""
    return [bos_id(tok), *tok(text)["input_ids"]]


def reference(model, texts, first_position=True):
    """Every metric per site from model.decode on each site's stream, in float64, one text at a
    time (no padding, the BOS token first), and the model's own logits as the final distribution."""
    per_site = {}
    for t in texts:
        rs = model.residual_stream(torch.tensor([with_bos(model.tokenizer, t)]))
        ids = rs.input_ids[0]
        logits = rs.logits[0].double()
        lp = logits.log_softmax(-1)
        p = lp.exp()
        start = 0 if first_position else 1
        with torch.no_grad():
            for i, s in enumerate(rs.sites):
                z = model.decode(rs.resid[i, 0]).double()
                lq = z.log_softmax(-1)
                kl = (p * (lp - lq)).sum(-1)
                ent = -(lq.exp() * lq).sum(-1)
                agree = (z.argmax(-1) == logits.argmax(-1)).double()
                tgt = ids[1:]
                ce = -lq[:-1].gather(1, tgt[:, None])[:, 0]
                rank = (z[:-1] > z[:-1].gather(1, tgt[:, None])).sum(-1).double()
                d = per_site.setdefault(s, {k: [] for k in METRICS})
                d["kl_to_final"].append(kl[start:])
                d["entropy"].append(ent[start:])
                d["top1_agreement"].append(agree[start:])
                d["cross_entropy"].append(ce[start:])
                d["target_rank"].append(rank[start:])
                d["target_log_rank"].append(torch.log10(1 + rank[start:]))
                d["top1_accuracy"].append((rank[start:] == 0).double())
    return {s: {k: torch.cat(v) for k, v in d.items()} for s, d in per_site.items()}


# ----------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def real(default_model):
    docs = read_documents(SAMPLE)[:2]
    return docs, logit_lens(default_model, docs)


def test_last_site_reproduces_the_model(default_model, real):
    """Last site: KL 0, agreement 1, and the cross-entropy, entropy and ranks of the Hugging Face
    model's own logits (computed here independently, one document at a time)."""
    docs, df = real
    hf, tok = default_model.hf_model, default_model.tokenizer
    ce, ent, ranks, n_tok = [], [], [], 0
    for d in docs:
        ids = torch.tensor([with_bos(tok, d)])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0]
        n_tok += ids.shape[1]
        ce.append(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none").double())
        lp = logits.double().log_softmax(-1)
        ent.append(-(lp.exp() * lp).sum(-1))
        ranks.append((logits[:-1] > logits[:-1].gather(1, ids[0, 1:, None])).sum(-1).double())
    last = df.iloc[-1]
    assert last["label"] == "29.mlp" and len(df) == 61
    assert abs(last["kl_to_final"]) < 1e-6
    assert last["top1_agreement"] == 1.0
    assert last["cross_entropy"] == pytest.approx(torch.cat(ce).mean().item(), rel=1e-5)
    assert last["entropy"] == pytest.approx(torch.cat(ent).mean().item(), rel=1e-5)
    assert last["target_rank"] == pytest.approx(torch.cat(ranks).mean().item(), abs=0.05)
    assert last["n_positions"] == n_tok and last["n_next"] == n_tok - len(docs)
    assert 2.0 < last["cross_entropy"] < 6.0  # SmolLM2 on English: a few nats per token


def test_early_sites_far_from_final(real):
    _, df = real
    kl = df["kl_to_final"].to_numpy()
    assert kl[0] > 20  # the embedding decodes to (nearly) the input token itself
    assert df["top1_agreement"].iloc[0] < 0.1
    third = len(kl) // 3
    assert kl[-third:].mean() < 0.5 * kl[:third].mean()
    assert (kl[:-1] > kl[-1]).all()
    assert kl[-2] < 5  # 29.attn is close, but not equal
    assert (df["entropy"] >= 0).all() and (df["kl_to_final"] >= -1e-6).all()


def test_tokens_capital_of_france(default_model):
    tk = logit_lens_tokens(default_model, "The capital of France is", sites=["embed", "14.mlp", "29.mlp"], k=3)
    assert set(tk["label"]) == {"embed", "14.mlp", "29.mlp"}
    last_pos = tk["position"].max()
    row = tk[(tk["label"] == "29.mlp") & (tk["position"] == last_pos)].iloc[0]
    assert row["top1_token"] == " Paris"
    assert row["target_kind"] == "model_top1" and row["target_token"] == " Paris" and row["target_rank"] == 0
    last = tk[tk["label"] == "29.mlp"]
    assert (last["kl_to_final"].abs() < 1e-6).all() and last["top1_agreement"].all()
    # target log-probs at the last site are the model's own log-probs of the next tokens
    ids = default_model.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        lp = default_model.hf_model(input_ids=ids).logits[0].double().log_softmax(-1)
    nxt = last[last["target_kind"] == "next"].sort_values("position")
    want = lp[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()
    # (the reference forward runs without an attention mask: float noise ~1e-5)
    np.testing.assert_allclose(nxt["target_logprob"].to_numpy(), want, rtol=1e-4, atol=1e-4)
    probs = tk[["top1_prob", "top2_prob", "top3_prob"]].to_numpy()
    assert (np.diff(probs, axis=1) <= 1e-9).all() and (probs.sum(1) <= 1 + 1e-6).all()
    fixed = logit_lens_tokens(default_model, "The capital of France is", sites=["29.mlp"], target=" Paris")
    assert fixed["target_kind"].eq("fixed").all()
    assert int(fixed.loc[fixed["position"] == last_pos, "target_rank"].iloc[0]) == 0


# ----------------------------------------------------------------------------- tiny models
def test_every_metric_matches_float64_reference(tiny_llama):
    df = logit_lens(tiny_llama, TEXTS, batch_size=2)
    ref = reference(tiny_llama, TEXTS)
    for row in df.itertuples():
        r = ref[row.site]
        for k in METRICS:
            want = r[k].mean().item()
            assert getattr(row, k) == pytest.approx(want, rel=2e-5, abs=2e-6), (row.label, k)
            assert getattr(row, k + "_std") == pytest.approx(r[k].std(unbiased=False).item(), rel=1e-3, abs=1e-5)
    n = sum(len(tiny_llama.tokenizer(t)["input_ids"]) for t in TEXTS)  # each text's tokens, predicted once
    assert (df["n_positions"] == n + len(TEXTS)).all() and (df["n_next"] == n).all()
    assert df["kl_to_final"].iloc[-1] == pytest.approx(0, abs=1e-6)


def test_first_position_excluded(tiny_llama):
    df = logit_lens(tiny_llama, TEXTS, first_position=False)
    ref = reference(tiny_llama, TEXTS, first_position=False)
    n = sum(len(tiny_llama.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert (df["n_positions"] == n).all() and (df["n_next"] == n - 2).all()
    for row in df.itertuples():
        assert row.kl_to_final == pytest.approx(ref[row.site]["kl_to_final"].mean().item(), rel=2e-5, abs=2e-6)
        assert row.cross_entropy == pytest.approx(ref[row.site]["cross_entropy"].mean().item(), rel=2e-5)


def test_tokens_table_matches_reference(tiny_llama):
    tk = logit_lens_tokens(tiny_llama, TEXTS[:1], k=4)
    rs = tiny_llama.residual_stream(TEXTS[:1])
    assert len(tk) == rs.input_ids.shape[1] * tiny_llama.n_sites
    for s in (0, 3, 6):
        part = tk[tk["site"] == s].sort_values("position")
        z = tiny_llama.decode(rs.resid[s, 0]).double().detach()
        lq = z.log_softmax(-1)
        top = lq.topk(4, dim=-1)
        np.testing.assert_array_equal(part["top1_id"].to_numpy(), top.indices[:, 0].numpy())
        np.testing.assert_allclose(part["top2_prob"].to_numpy(), top.values[:, 1].exp().numpy(), rtol=1e-4)
        tgt = torch.tensor(part["target_id"].to_numpy())
        np.testing.assert_allclose(
            part["target_logprob"].to_numpy(), lq.gather(1, tgt[:, None])[:, 0].numpy(), rtol=1e-5, atol=1e-6
        )
    assert tk["token"].iloc[0] == tiny_llama.tokenizer.decode(rs.input_ids[0, :1])
    # the per-token rows (the prompt as the tokenizer tokenizes it) aggregate to the dataset-level table
    df = logit_lens(tiny_llama, TEXTS[:1], text=TextWindows(bos=False))
    agg = tk.groupby("site")[["kl_to_final", "entropy"]].mean()
    np.testing.assert_allclose(agg["kl_to_final"].to_numpy(), df["kl_to_final"].to_numpy(), rtol=1e-6, atol=1e-9)


def test_streaming_does_not_change_results(tiny_llama, monkeypatch):
    docs = read_documents(SAMPLE)[:3]
    small = logit_lens(tiny_llama, docs, batch_size=1, token_chunk=2, max_batch_tokens=16)
    big = logit_lens(tiny_llama, docs, batch_size=16, token_chunk=64)
    cols = [c for c in small.columns if c not in ("label", "sublayer", "lens", "ci_unit", "ci_method")]
    np.testing.assert_allclose(small[cols].to_numpy(float), big[cols].to_numpy(float), rtol=1e-5, atol=1e-6)
    # long document lists are tokenized in groups: same numbers, same document numbering
    import depthscope.analyses.lens.logit as L

    monkeypatch.setattr(L, "DOC_GROUP", 2)
    grouped = logit_lens(tiny_llama, ["", *docs], batch_size=16, token_chunk=64)
    np.testing.assert_allclose(grouped[cols].to_numpy(float), big[cols].to_numpy(float), rtol=1e-5, atol=1e-6)
    tk = logit_lens_tokens(tiny_llama, ["", *docs], sites=["embed"])
    assert sorted(tk["doc"].unique()) == [0, 1, 2]
    monkeypatch.undo()
    sub = logit_lens(tiny_llama, docs, sites=["embed", "1.attn", "blocks.2.hook_resid_post"])
    assert sub["label"].tolist() == ["embed", "1.attn", "2.mlp"]
    full = big.set_index("site").loc[sub["site"]]
    np.testing.assert_allclose(sub["kl_to_final"].to_numpy(), full["kl_to_final"].to_numpy(), rtol=1e-5, atol=1e-6)


def test_max_tokens(tiny_llama):
    docs = read_documents(SAMPLE)
    df = logit_lens(tiny_llama, docs, max_tokens=15, batch_size=2)
    assert (df["n_positions"] == 15).all()  # cut inside the first document
    ids = with_bos(tiny_llama.tokenizer, docs[0])
    assert len(ids) >= 15
    ref = logit_lens(tiny_llama, torch.tensor([ids[:15]]))
    np.testing.assert_allclose(df["kl_to_final"].to_numpy(), ref["kl_to_final"].to_numpy(), rtol=1e-5, atol=1e-6)


def test_line_longer_than_context_is_split_into_windows(tiny_llama):
    ctx = tiny_llama.max_context  # 256 for the tiny models
    ids = torch.randint(0, tiny_llama.vocab_size, (1, 2 * ctx + 88))
    df = logit_lens(tiny_llama, ids, sites=["embed", "2.mlp"])
    assert (df["n_positions"] == ids.shape[1]).all()
    assert (df["n_next"] == ids.shape[1] - 3).all()  # three windows, each ends without a target


# ----------------------------------------------------------------------------- intervals
def clustered_se(per_token: pd.DataFrame, value: str, cluster: str = "doc") -> pd.Series:
    """Per site: the CR1 standard error of the mean of ``value`` over tokens, documents as
    clusters, computed the plain way from a per-token table."""
    out = {}
    for site, d in per_token.groupby("site"):
        g = d.groupby(cluster)[value].agg(["sum", "count"])
        m = g["sum"].sum() / g["count"].sum()
        G, N = len(g), g["count"].sum()
        out[site] = np.sqrt(G / (G - 1) * ((g["sum"] - m * g["count"]) ** 2).sum() / N**2)
    return pd.Series(out)


def token_values(tk: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each metric's per-token values (and the positions it is defined at) from logit_lens_tokens."""
    nxt = tk[tk["target_kind"] == "next"].copy()
    nxt["cross_entropy"] = -nxt["target_logprob"]
    nxt["top1_accuracy"] = (nxt["target_rank"] == 0).astype(float)
    nxt["target_log_rank"] = np.log10(1 + nxt["target_rank"])
    nxt["target_rank"] = nxt["target_rank"].astype(float)
    allp = tk.assign(top1_agreement=tk["top1_agreement"].astype(float))
    return {k: (allp if k in ("kl_to_final", "entropy", "top1_agreement") else nxt) for k in METRICS}


def test_intervals_match_an_independent_clustered_se(tiny_llama):
    """``<metric>_se`` is the document-clustered SE of the mean, recomputed here from the per-token
    table; with six documents (fewer than MIN_UNITS) the interval itself is withheld: NaN, its
    n and method named, and a note that says why."""
    docs = read_documents(SAMPLE)
    kw = dict(window=16, batch_size=3)  # documents split into several windows each
    full = logit_lens(tiny_llama, docs, text=TextWindows(bos=False), **kw)
    df = full.set_index("site")
    tk = logit_lens_tokens(tiny_llama, docs, k=1, **kw)
    assert (df["n_docs"] == len(docs)).all() and (df["n_windows"] > len(docs)).all()
    vals = token_values(tk)
    for k in METRICS:
        want = clustered_se(vals[k], k)
        np.testing.assert_allclose(df[k + "_se"].to_numpy(), want.loc[df.index].to_numpy(), rtol=1e-4, atol=1e-9)
        assert df[k + "_lo"].isna().all() and df[k + "_hi"].isna().all(), k
    assert (df["ci_n"] == 6).all() and set(df["ci_unit"]) == {"documents"} and "CR1" in df["ci_method"].iloc[0]
    assert len(full.attrs["notes"]) == 1 and "6 documents, fewer than 10" in full.attrs["notes"][0]
    # windows as clusters differ from documents as clusters (the windows of a text are correlated)
    win = clustered_se(vals["kl_to_final"].assign(w=lambda d: d["doc"] * 1000 + d["window"]), "kl_to_final", "w")
    assert not np.allclose(win.loc[df.index].to_numpy(), df["kl_to_final_se"].to_numpy(), rtol=1e-3)


def test_intervals_equal_documents_and_shrinking(tiny_llama):
    """With documents of equal length the SE is the std of the documents' own means over sqrt(G)
    (each document run on its own); repeating the corpus k times shrinks it by the exact CR1
    factor; a single document falls back on its windows as clusters."""
    from scipy.stats import t

    torch.manual_seed(1)
    ids = torch.randint(0, tiny_llama.vocab_size, (12, 12))
    df = logit_lens(tiny_llama, ids)
    assert (df["ci_n"] == 12).all() and not df.attrs.get("notes")
    per_doc = pd.concat([logit_lens(tiny_llama, ids[i : i + 1]).assign(doc=i) for i in range(len(ids))])
    for k in METRICS:
        means = per_doc.pivot(index="site", columns="doc", values=k)
        want = means.std(axis=1, ddof=1) / np.sqrt(len(ids))
        np.testing.assert_allclose(df[k + "_se"].to_numpy(), want.to_numpy(), rtol=1e-5, atol=1e-9)
        # the interval: mean -+ t(0.975, G-1) SE, cut to the metric's range
        half = t.ppf(0.975, len(ids) - 1) * df[k + "_se"]
        lo, hi = df[k] - half, df[k] + half
        if k in ("top1_agreement", "top1_accuracy"):
            lo, hi = lo.clip(lower=0), hi.clip(upper=1)
        else:
            lo = lo.clip(lower=0)
        np.testing.assert_allclose(df[k + "_lo"], lo, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(df[k + "_hi"], hi, rtol=1e-12, atol=1e-12)
        assert (df[k + "_lo"] <= df[k]).all() and (df[k] <= df[k + "_hi"]).all(), k
    assert per_doc["n_docs"].eq(1).all()  # one document of one window: no interval
    assert per_doc["kl_to_final_se"].isna().all() and per_doc["kl_to_final_lo"].isna().all()
    G, rep = len(ids), 4
    big = logit_lens(tiny_llama, ids.repeat(rep, 1))
    factor = np.sqrt((rep * G / (rep * G - 1)) / (G / (G - 1)) / rep)
    for k in METRICS:
        np.testing.assert_allclose(big[k].to_numpy(), df[k].to_numpy(), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(big[k + "_se"].to_numpy(), factor * df[k + "_se"].to_numpy(), rtol=1e-5)
        some = df[k + "_se"] > 0
        assert ((big[k + "_hi"] - big[k + "_lo"])[some] < (df[k + "_hi"] - df[k + "_lo"])[some]).all(), k
    # one document cut into windows: the windows are the clusters (as if each were a document)
    one = logit_lens(tiny_llama, ids.reshape(1, -1), window=12)
    assert one["n_docs"].eq(1).all() and one["n_windows"].eq(G).all()
    np.testing.assert_allclose(one["kl_to_final_se"], df["kl_to_final_se"], rtol=1e-5)
    assert one["ci_n"].eq(G).all() and set(one["ci_unit"]) == {"windows of one document"}


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_last_site_identity_other_families(tiny_factory, family):
    m = tiny_factory(family)
    df = logit_lens(m, TEXTS)
    assert abs(df["kl_to_final"].iloc[-1]) < 1e-6 and df["top1_agreement"].iloc[-1] == 1.0
    ref = reference(m, TEXTS)
    assert df["cross_entropy"].iloc[-1] == pytest.approx(ref[m.n_sites - 1]["cross_entropy"].mean().item(), rel=1e-5)


def test_project_into_matches_project(tiny_factory):
    """Bias, logit scale and soft-capping are applied into the reused buffer as Unembed.project applies them."""
    m = tiny_factory("llama")
    lin = m.arch.unembed
    biased = torch.nn.Linear(lin.in_features, lin.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(lin.weight)
        biased.bias.normal_()
    m.arch.unembed = biased
    m.arch.logit_scale = 0.7
    m.arch.softcap = 3.0
    x = torch.randn(5, m.d_model)
    out = torch.empty(5, m.vocab_size)
    with torch.no_grad():
        want = m.unembed.project(x)
        m.unembed.project_into(x, out)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert want.abs().max() <= 3.0


# ----------------------------------------------------------------------------- bad input
def test_encoder_and_headless_models_refused(tiny_factory, tokenizer):
    import transformers as tf

    with pytest.raises(UnsupportedArchitecture, match="not final norm -> unembedding"):
        logit_lens(tiny_factory("bert"), TEXTS)
    cfg = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
    )
    base = load_model(tf.LlamaModel(cfg).eval(), tokenizer=tokenizer)  # no LM head
    with pytest.raises(UnsupportedArchitecture, match="not final norm -> unembedding"):
        logit_lens_tokens(base, "Hello")


def test_bad_inputs_refused(tiny_llama):
    with pytest.raises(InputError, match="empty"):
        logit_lens(tiny_llama, [])
    with pytest.raises(InputError, match="empty"):
        logit_lens(tiny_llama, "")
    with pytest.raises(InputError, match="empty"):
        logit_lens(tiny_llama, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InputError, match="unknown site"):
        logit_lens(tiny_llama, TEXTS, sites=["7.attn.x"])
    with pytest.raises(InputError, match="no positions"):
        logit_lens(tiny_llama, torch.tensor([[5], [7]]), first_position=False)
    with pytest.raises(InputError, match="not one"):
        logit_lens_tokens(tiny_llama, "Hello", target="Paris and London")
    with pytest.raises(InputError, match="out of range"):
        logit_lens_tokens(tiny_llama, "Hello", target=10**7)
    with pytest.raises(InputError):
        logit_lens_tokens(tiny_llama, "Hello", k=0)
    with pytest.raises(InputError):
        logit_lens(tiny_llama, TEXTS, token_chunk=0)


# ----------------------------------------------------------------------------- CLI and plots
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    from conftest import make_tiny

    d = tmp_path_factory.mktemp("tiny_llama")
    make_tiny("llama", vocab_size=len(tokenizer)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_cli_writes_tables_and_plots(tiny_dir, tmp_path, monkeypatch, capsys, tokenizer):
    text = tmp_path / "text.txt"
    lines = read_documents(SAMPLE)[:3] + [" ".join(["word"] * 700)]  # the last line exceeds the context
    text.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    code, so, se = run_cli(
        ["lens", "--text", text, "--model", tiny_dir, "--out", out, "--prompt", "The capital of France is"],
        monkeypatch,
        capsys,
    )
    assert code == 0, se
    assert "1 document(s) longer than the 256-token window were split into 3 windows" in se
    for name in (
        "lens_by_site.parquet",
        "lens_by_site.csv",
        "lens_tokens.parquet",
        "lens_tokens.csv",
        "lens_metrics.png",
        "lens_top1_heatmap.png",
        "lens_rank_trajectory.png",
    ):
        assert (out / name).is_file(), name
        assert f"wrote {out / name}" in so
    df = pd.read_parquet(out / "lens_by_site.parquet")
    assert list(df.columns[:5]) == ["site", "label", "layer", "sublayer", "depth"]
    assert len(df) == 7 and abs(df["kl_to_final"].iloc[-1]) < 1e-6
    n = sum(len(tokenizer(t)["input_ids"]) for t in lines)  # every token predicted once, after a BOS
    assert (df["n_positions"] == n + 3 + 3).all() and (df["n_next"] == n).all()
    assert pd.read_csv(out / "lens_by_site.csv")["kl_to_final"].to_numpy() == pytest.approx(
        df["kl_to_final"].to_numpy()
    )
    tk = pd.read_parquet(out / "lens_tokens.parquet")
    assert tk["doc"].nunique() == 1 and len(tk) == 7 * tk["position"].nunique()
    for name in ("lens_metrics.png", "lens_top1_heatmap.png", "lens_rank_trajectory.png"):
        assert (out / name).stat().st_size > 10_000


def test_cli_bad_inputs(tiny_dir, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, _, err = run_cli(["lens", "--text", empty, "--model", tiny_dir, "--out", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and "holds no text" in err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n\xff\xfe broken\n")
    code, _, err = run_cli(["lens", "--text", bad, "--model", tiny_dir, "--out", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and "not valid UTF-8" in err and "line 2" in err
    code, _, err = run_cli(["lens", "--text", tmp_path / "missing.txt", "--model", tiny_dir], monkeypatch, capsys)
    assert code == 2 and "no such text file" in err
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_show_token():
    from depthscope.analyses.lens.plots import show_token

    assert show_token(" Paris") == "␣Paris" and show_token("\n") == "\\n" and show_token("") == "∅"
    assert show_token("abcdefghijklmnopq", 8) == "abcdefg…"
