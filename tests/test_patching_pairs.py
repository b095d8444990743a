"""Patching over datasets of prompt pairs: per-head means equal a plain-PyTorch reference (every
patch one forward with hooks on the transformers modules, then the IOI normalisation over pairs),
named positions, JSONL input, the bootstrap interval, unchanged patches at exactly 0, the points
patched newly (``l.neurons``, ``l.pattern``) against plain hooks, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import IOI_PAIRS, run_cli

from depthscope.analyses.circuits.pairs import PromptPair, mean_over_pairs, read_pairs
from depthscope.analyses.circuits.patching.activation import (
    PAIR_KEYS,
    activation_patching,
    attribution_patching,
    patch_pairs,
)
from depthscope.common.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [PromptPair(*p) for p in IOI_PAIRS[:4]]


def _ids(tok, text):
    return tok(text, return_tensors="pt")["input_ids"]


def _z_patched(hf, ids, layer, head, d_head, clean_z, metric):
    """The metric with head ``head``'s input to layer ``layer``'s o_proj at the last position set
    to the clean value (a plain forward pre-hook on the transformers module)."""

    def pre(m, args):
        x = args[0].clone()
        x[0, -1, head * d_head : (head + 1) * d_head] = clean_z[head * d_head : (head + 1) * d_head]
        return (x,)

    h = hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return float(metric(hf(input_ids=ids).logits))
    finally:
        h.remove()


def reference_heads(model, pairs):
    """Per pair: (clean metric, corrupted metric, {(layer, head): patched metric}) with every
    head's write at the last position patched in its own forward (z at the o_proj input: the
    head's write z_h W_O^h changes exactly when its z does)."""
    hf, tok = model.hf_model, model.tokenizer
    H = hf.config.num_attention_heads
    d_head = hf.config.hidden_size // H
    out = []
    for p in pairs:
        c, k = _ids(tok, p.clean), _ids(tok, p.corrupted)
        t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))

        def metric(lg, t=t, f=f):
            return lg[0, -1, t] - lg[0, -1, f]

        zs, hs = {}, []
        for layer, block in enumerate(hf.model.layers):
            hs.append(
                block.self_attn.o_proj.register_forward_pre_hook(
                    lambda m, a, layer=layer, zs=zs: zs.__setitem__(layer, a[0][0, -1].clone())
                )
            )
        try:
            with torch.no_grad():
                clean = float(metric(hf(input_ids=c).logits))
        finally:
            for h in hs:
                h.remove()
        with torch.no_grad():
            corrupted = float(metric(hf(input_ids=k).logits))
        patched = {
            (layer, h): _z_patched(hf, k, layer, h, d_head, zs[layer], metric)
            for layer in range(len(hf.model.layers))
            for h in range(H)
        }
        out.append((clean, corrupted, patched))
    return out


def test_dataset_means_equal_the_plain_reference(tiny_llama):
    df = activation_patching(tiny_llama, PAIRS, sites="heads", positions="last")
    ref = reference_heads(tiny_llama, PAIRS)
    clean, corrupted = np.mean([r[0] for r in ref]), np.mean([r[1] for r in ref])
    assert len(df) == tiny_llama.n_layers * 4 and (df["n_pairs"] == len(PAIRS)).all()
    np.testing.assert_allclose(df["clean_metric"], clean, atol=1e-5)
    np.testing.assert_allclose(df["corrupted_metric"], corrupted, atol=1e-5)
    for row in df.itertuples():
        mean = np.mean([r[2][(int(row.layer), int(row.head))] for r in ref])
        assert row.metric == pytest.approx(mean, abs=1e-5)
        assert row.fraction_recovered == pytest.approx((mean - corrupted) / (clean - corrupted), abs=1e-4)
    # four pairs are too few for an interval: NaN, with its provenance and a note that says why
    assert df[["fraction_low", "fraction_high"]].isna().all().all()
    assert (
        (df["ci_n"] == 4).all()
        and (df["ci_unit"] == "pairs").all()
        and (df["ci_method"].str.contains("bootstrap")).all()
    )
    assert any("rests on 4 pairs, fewer than 10" in n for n in df.attrs["notes"])
    # the prompts differ in length: the position index is not shared, its name is
    assert df["position"].isna().all() and (df["position_name"] == "last").all()
    assert (df["token"] == " to").all()  # every pair's last token is " to"


def test_per_pair_table_and_means(tiny_llama):
    per = patch_pairs(tiny_llama, PAIRS[:3], sites="2.heads,embed,1.mlp")
    assert per["pair"].tolist() == sorted(per["pair"]) and set(per["pair"]) == {0, 1, 2}
    for i, p in enumerate(PAIRS[:3]):  # each pair's rows equal the single-pair call
        one = activation_patching(tiny_llama, p.clean, p.corrupted, (p.target, p.foil), sites="2.heads,embed,1.mlp")
        got = per[per["pair"] == i].drop(columns="pair").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, one, check_exact=False, atol=1e-6)
    means = mean_over_pairs(per, PAIR_KEYS)
    assert np.allclose(means["metric"], per.groupby(["point", "head"], dropna=False, sort=False)["metric"].mean())
    # the embedding of the last token is the same in every pair: exactly the corrupted value
    emb = per[per["point"] == "embed"]
    assert (emb["metric"] == emb["corrupted_metric"]).all() and (emb["fraction_recovered"] == 0).all()


def test_bootstrap_interval(tiny_llama):
    # the same pair ten times: every resample is the same dataset, so the interval is a point
    same = activation_patching(tiny_llama, [PAIRS[0]] * 10, sites="1.attn")
    row = same.iloc[0]
    assert row.fraction_low == pytest.approx(row.fraction_recovered, abs=1e-9)
    assert row.fraction_high == pytest.approx(row.fraction_recovered, abs=1e-9)
    assert (row.ci_n, row.ci_unit) == (10, "pairs") and same.attrs["notes"] == []
    one = activation_patching(tiny_llama, PAIRS[:1], sites="1.attn")  # one pair: no interval
    assert np.isnan(one["fraction_low"]).all() and np.isnan(one["fraction_high"]).all()
    # ten pairs (the four distinct ones, repeated): an interval of some width around the estimate
    ten = (PAIRS * 3)[:10]
    many = activation_patching(tiny_llama, ten, sites="resid")
    assert (many["fraction_high"] - many["fraction_low"] > 0).any() and (many["n_pairs"] == 10).all()
    ok = many["fraction_low"].notna()
    assert (many.loc[ok, "fraction_low"] <= many.loc[ok, "fraction_recovered"] + 1e-9).all()
    assert (many.loc[ok, "fraction_recovered"] <= many.loc[ok, "fraction_high"] + 1e-9).all()
    # nine are too few: the same means, no interval, and a note
    nine = activation_patching(tiny_llama, ten[:9], sites="resid")
    assert nine[["fraction_low", "fraction_high"]].isna().all().all() and len(nine.attrs["notes"]) == 1


def test_named_positions_align_pairs_of_different_lengths(tiny_llama):
    tok = tiny_llama.tokenizer
    pairs = []
    for p in PAIRS[:3]:
        ids = tok(p.corrupted)["input_ids"]
        s2 = len(ids) - 1 - ids[::-1].index(tok(" Mary" if " Mary" in p.corrupted else " John")["input_ids"][0])
        pairs.append(PromptPair(p.clean, p.corrupted, p.target, p.foil, {"S2": s2, "END": -1}))
    df = activation_patching(tiny_llama, pairs, sites="resid", positions="each")
    assert set(df["position_name"]) == {"S2", "END"}
    per = patch_pairs(tiny_llama, pairs, sites="resid", positions="S2")
    assert set(per["position_name"]) == {"S2"}
    for i, p in enumerate(pairs):  # the named position equals patching that index of the pair alone
        one = activation_patching(tiny_llama, p.clean, p.corrupted, (p.target, p.foil), sites="resid", positions="each")
        one = one[one["position"] == p.positions["S2"]].reset_index(drop=True)
        got = per[per["pair"] == i].reset_index(drop=True)
        np.testing.assert_allclose(got["metric"], one["metric"], atol=1e-6)
    with pytest.raises(InputError, match="different token lengths"):
        activation_patching(tiny_llama, PAIRS[:3], sites="resid", positions="each")
    with pytest.raises(InputError, match="names of positions every pair gives"):
        activation_patching(tiny_llama, pairs, sites="resid", positions="S3")


def test_jsonl_input_and_its_errors(tiny_llama, tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"clean": p.clean, "corrupted": p.corrupted, "target": p.target, "foil": p.foil} for p in PAIRS[:2]]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert read_pairs(path) == PAIRS[:2]
    a = activation_patching(tiny_llama, str(path), sites="2.mlp")
    b = activation_patching(tiny_llama, PAIRS[:2], sites="2.mlp")
    pd.testing.assert_frame_equal(a, b)
    bad = tmp_path / "bad.jsonl"
    for text, match in [
        ('{"clean": "a b", "corrupted": "a c", "target": " Mary"}\n{"clean": 3}\n', r"bad\.jsonl:2: 'clean'"),
        ("not json\n", r"bad\.jsonl:1: not a JSON object"),
        ('{"clean": "a", "corrupted": "b", "tagret": " Mary"}\n', r"bad\.jsonl:1: unknown field\(s\) \['tagret'\]"),
        ("\n\n", "no pairs"),
    ]:
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(InputError, match=match):
            read_pairs(bad)
    bad.write_bytes(b'{"clean": "\xff"}\n')
    with pytest.raises(InputError, match="not UTF-8"):
        read_pairs(bad)
    with pytest.raises(InputError, match="no target token and no metric"):
        activation_patching(tiny_llama, [("When Mary and John", "When John and Mary")], sites="embed")
    with pytest.raises(InputError, match="outside the clean prompt's"):
        activation_patching(tiny_llama, [PromptPair("a b", "a c", " Mary", " John", {"X": 40})], positions="each")


def test_attribution_over_pairs(tiny_llama):
    est = attribution_patching(tiny_llama, PAIRS, sites="resid")
    per = patch_pairs(tiny_llama, PAIRS, sites="resid", method="attribution")
    assert (est["method"] == "attribution").all() and len(est) == tiny_llama.n_sites
    np.testing.assert_allclose(est["metric"], per.groupby("point", sort=False)["metric"].mean(), atol=1e-9)
    # the first-order estimate of patching the last residual site equals the exact patch (the
    # metric is linear in the final stream up to the final norm: close, not equal) -- at least
    # its sign and rough size agree with exact patching
    exact = activation_patching(tiny_llama, PAIRS, sites="resid")
    last = exact["point"] == f"{tiny_llama.n_layers - 1}.mlp"
    assert exact.loc[last, "fraction_recovered"].iloc[0] == pytest.approx(1.0, abs=1e-4)


def test_neurons_and_pattern_patches_equal_plain_hooks(tiny_llama):
    hf, tok = tiny_llama.hf_model, tiny_llama.tokenizer
    p = PAIRS[0]
    c, k = _ids(tok, p.clean), _ids(tok, p.corrupted)
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))
    df = activation_patching(tiny_llama, p.clean, p.corrupted, (p.target, p.foil), sites="1.neurons,1.pattern")
    # neurons: the down projection's input at the last position
    seen = {}
    h = hf.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0][0, -1]))
    with torch.no_grad():
        hf(input_ids=c)
    h.remove()

    def put(m, a):
        x = a[0].clone()
        x[0, -1] = seen["x"]
        return (x,)

    h = hf.model.layers[1].mlp.down_proj.register_forward_pre_hook(put)
    with torch.no_grad():
        lg = hf(input_ids=k).logits
    h.remove()
    row = df[df["point"] == "1.neurons"].iloc[0]
    assert row.metric == pytest.approx(float(lg[0, -1, t] - lg[0, -1, f]), abs=1e-5)
    # pattern: each head's last query row, through the eager attention of the modeling file
    import transformers.models.llama.modeling_llama as ml

    original, rows, implementation = ml.eager_attention_forward, {}, hf.config._attn_implementation
    hf.config._attn_implementation = "eager"
    try:

        def grab(module, q, key, v, mask, **kw):
            out, w = original(module, q, key, v, mask, **kw)
            if module.layer_idx == 1:
                rows["w"] = w[0, :, -1].clone()
            return out, w

        ml.eager_attention_forward = grab
        with torch.no_grad():
            hf(input_ids=c)
        for head in range(hf.config.num_attention_heads):

            def put_row(module, q, key, v, mask, head=head, **kw):
                out, w = original(module, q, key, v, mask, **kw)
                if module.layer_idx != 1:
                    return out, w
                w = w.clone()
                w[0, head, -1] = rows["w"][head]
                vv = ml.repeat_kv(v, module.num_key_value_groups)
                return torch.matmul(w, vv).transpose(1, 2).contiguous(), w

            ml.eager_attention_forward = put_row
            with torch.no_grad():
                lg = hf(input_ids=k).logits
            got = df[(df["point"] == "1.pattern") & (df["head"] == head)].iloc[0]
            assert got.metric == pytest.approx(float(lg[0, -1, t] - lg[0, -1, f]), abs=1e-5)
    finally:
        ml.eager_attention_forward = original
        hf.config._attn_implementation = implementation


def test_dataset_arguments_are_checked(tiny_llama):
    with pytest.raises(InputError, match="give no corrupted prompt"):
        activation_patching(tiny_llama, PAIRS, "x")
    with pytest.raises(InputError, match="method must be"):
        patch_pairs(tiny_llama, PAIRS, method="exact")
    with pytest.raises(InputError, match="does not exist"):
        activation_patching(tiny_llama, "missing.jsonl")
    with pytest.raises(InputError, match="give a corrupted prompt"):
        activation_patching(tiny_llama, PAIRS[0].clean)
    for empty in ([], ()):
        with pytest.raises(InputError, match="the pair list is empty"):
            activation_patching(tiny_llama, empty)
        with pytest.raises(InputError, match="the pair list is empty"):
            attribution_patching(tiny_llama, empty)
    with pytest.raises(InputError, match="unexpected keyword argument.*batch_tokens"):
        attribution_patching(tiny_llama, PAIRS, batch_tokens=10)  # no batched forwards to bound
    with pytest.raises(InputError, match="direction must be one of denoise, noise"):
        activation_patching(tiny_llama, PAIRS, direction="both")


def test_a_missing_named_position_names_the_pair_and_its_line(tiny_llama, tmp_path):
    rows = [
        {"clean": p.clean, "corrupted": p.corrupted, "target": p.target, "foil": p.foil, "positions": {"END": -1}}
        for p in PAIRS[:3]
    ]
    del rows[1]["positions"]
    rows[2]["positions"] = {"S2": 9, "END": -1}
    path = tmp_path / "named.jsonl"
    path.write_text("\n" + "\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")  # a blank first line
    with pytest.raises(InputError, match=r"pair 1 \(named\.jsonl:3\) has no position 'END' \(it names no positions\)"):
        activation_patching(tiny_llama, path, sites="embed", positions="END")
    with pytest.raises(InputError, match=r"pair 0 \(named\.jsonl:2\) has no position 'S2' \(it names \['END'\]\)"):
        patch_pairs(tiny_llama, path, sites="embed", positions="S2,END")
    with pytest.raises(InputError, match=r"pair 1 has no position 'END'"):  # from a list: its index
        activation_patching(tiny_llama, read_pairs(path)[:1] + [PAIRS[1]], sites="embed", positions="END")


def test_cli_pairs_writes_means_and_per_pair_tables(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from depthscope.hooks import load_model

    path = tmp_path / "ioi.jsonl"
    rows = [{"clean": p.clean, "corrupted": p.corrupted, "target": p.target, "foil": p.foil} for p in PAIRS]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    out = tmp_path / "o"
    base = ["patch", "--model", tiny_llama_dir, "--threads", "1"]
    code, so, se = run_cli([*base, "--pairs", path, "--out", out], monkeypatch, capsys)
    assert code == 0, se
    means, per = pd.read_parquet(out / "patching.parquet"), pd.read_parquet(out / "patching_pairs.parquet")
    assert {"fraction_low", "fraction_high", "n_pairs"} <= set(means.columns) and set(per["pair"]) == {0, 1, 2, 3}
    assert set(means["method"]) == {"activation", "attribution"}
    assert (out / "patching_heads.png").is_file() and (out / "patching_sites.png").is_file()
    assert "means over 4 pairs" in so and "Traceback" not in se
    model = load_model(str(tiny_llama_dir))
    api = activation_patching(model, PAIRS, sites="heads")
    got = means[(means["method"] == "activation") & means["head"].notna()].reset_index(drop=True)
    np.testing.assert_allclose(got["fraction_recovered"], api["fraction_recovered"], atol=1e-6)
    # options that would be ignored, and a missing file, are refused before any compute
    for extra, msg in [
        (["--pairs", path, "--clean", "When John"], "leave out --clean"),
        (["--pairs", tmp_path / "none.jsonl"], "does not exist"),
        (["--pairs", path, "--senders", "3.heads"], "--senders do not apply to --method activation"),
        (["--pairs", path, "--method", "path", "--sites", "resid"], "--sites do not apply to --method path"),
    ]:
        code, so, se = run_cli([*base, *extra, "--out", tmp_path / "bad"], monkeypatch, capsys)
        assert code == 2 and msg in se and "Traceback" not in se, (extra, se)


def test_attention_points_patch_with_and_without_a_shared_prefix(tiny_llama):
    """q/k/v, rotated q/k and scores patch per head; the shared key/value prefix (queries shifted,
    keys of rot_k absolute) gives what full recomputation gives, and l.q equals a plain hook."""
    p = PAIRS[0]
    sites = "1.q,1.k,1.v,1.rot_q,1.rot_k,1.scores"
    for positions in ("last", "each"):
        fast = activation_patching(tiny_llama, p.clean, p.corrupted, (p.target, p.foil), sites, positions)
        full = activation_patching(
            tiny_llama, p.clean, p.corrupted, (p.target, p.foil), sites, positions, reuse_prefix=False
        )
        assert set(fast["kind"]) == {"q", "k", "v", "rot_q", "rot_k", "scores"}
        np.testing.assert_allclose(fast["metric"], full["metric"], atol=1e-5)
    # k and v have the key/value heads (2 in the tiny Llama), q and scores the query heads (4)
    last = activation_patching(tiny_llama, p.clean, p.corrupted, (p.target, p.foil), sites)
    assert last.groupby("kind")["head"].nunique().to_dict() == {
        "q": 4,
        "k": 2,
        "v": 2,
        "rot_q": 4,
        "rot_k": 2,
        "scores": 4,
    }
    hf, tok = tiny_llama.hf_model, tiny_llama.tokenizer
    c, k = _ids(tok, p.clean), _ids(tok, p.corrupted)
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))
    q_proj, seen = hf.model.layers[1].self_attn.q_proj, {}
    h = q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o[0, -1].clone()))
    with torch.no_grad():
        hf(input_ids=c)
    h.remove()
    d = hf.config.hidden_size // hf.config.num_attention_heads
    for head in range(4):

        def put(m, i, o, head=head):
            o = o.clone()
            o[0, -1, head * d : (head + 1) * d] = seen["q"][head * d : (head + 1) * d]
            return o

        h = q_proj.register_forward_hook(put)
        with torch.no_grad():
            lg = hf(input_ids=k).logits
        h.remove()
        got = last[(last["kind"] == "q") & (last["head"] == head)].iloc[0]
        assert got.metric == pytest.approx(float(lg[0, -1, t] - lg[0, -1, f]), abs=1e-5)


def test_a_failed_call_leaves_no_progress_thread(tiny_llama, monkeypatch):
    """An error inside the loop over pairs closes the progress reporter (no heartbeat thread
    writing "0 patch, ... elapsed" for the rest of the process)."""
    import threading

    monkeypatch.delenv("DEPTHSCOPE_PROGRESS", raising=False)  # not a terminal: log lines, a heartbeat thread
    longer = PromptPair(PAIRS[0].clean, PAIRS[2].corrupted, " Mary", " John")  # pattern keys of two lengths
    with pytest.raises(InputError, match="same token length"):
        patch_pairs(tiny_llama, [PAIRS[0], longer], sites="1.pattern")
    alive = [t.name for t in threading.enumerate() if t.name.startswith("progress activation patching")]
    for _ in range(50):  # a closed reporter's thread ends at its next wake-up
        if not alive:
            break
        threading.Event().wait(0.1)
        alive = [t.name for t in threading.enumerate() if t.name.startswith("progress activation patching")]
    assert not alive
