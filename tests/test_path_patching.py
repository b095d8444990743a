"""Path patching against references written with plain PyTorch hooks on the transformers modules:
the direct path to the logits (the corrupted final residual plus one sender's clean-minus-corrupted
write, through the final norm and the unembedding), the path to later queries, keys and MLPs
(step 2: every head's o_proj input frozen at its corrupted value but the sender's; step 3: the
receiver's output replaced), rows that no path connects, chunking, the means over pairs, the
figure, and bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import IOI_PAIRS, run_cli

from depthscope.analyses.circuits.pairs import PromptPair, mean_over_pairs
from depthscope.analyses.circuits.patching.path_plots import plot_path_patching
from depthscope.analyses.circuits.patching.paths import PATH_KEYS, path_patch_pairs, path_patching
from depthscope.common.errors import InputError
from depthscope.hooks import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [PromptPair(*p) for p in IOI_PAIRS[:3]]


@pytest.fixture(scope="module")
def sharp_llama(tiny_tokenizer):
    """A tiny llama in float64 with sharper attention (queries and keys x8) and larger writes (x4),
    so that paths through queries, keys and MLPs move the metric well above rounding."""
    from conftest import make_tiny

    hf = make_tiny("llama", vocab_size=len(tiny_tokenizer))
    with torch.no_grad():
        for layer in hf.model.layers:
            a = layer.self_attn
            for proj, scale in ((a.q_proj, 8), (a.k_proj, 8), (a.v_proj, 4), (a.o_proj, 4), (layer.mlp.down_proj, 4)):
                proj.weight.mul_(scale)
    return load_model(hf.double(), tokenizer=tiny_tokenizer)


# ----------------------------------------------------------------------------- plain references
def _out(o):
    return o[0] if isinstance(o, tuple) else o


def _forward(hf, ids, pre=(), post=()):
    """Logits ``[pos, vocab]`` of one plain forward with (module, fn) pre-hooks and hooks, in order."""
    handles = [m.register_forward_pre_hook(f) for m, f in pre] + [m.register_forward_hook(f) for m, f in post]
    try:
        with torch.no_grad():
            return hf(input_ids=ids).logits[0]
    finally:
        for h in handles:
            h.remove()


def _record(hf, ids):
    """One plain forward's tensors (batch dropped): ``embed``, per layer ``z`` (o_proj input),
    ``attn`` (self-attention output), ``mlp`` (MLP output), ``block`` (block output); the logits."""
    rec, post, pre = {}, [], []

    def keep(key):
        return lambda m, a, o: rec.__setitem__(key, _out(o)[0].clone())

    post.append((hf.model.embed_tokens, keep("embed")))
    for i, layer in enumerate(hf.model.layers):
        pre.append((layer.self_attn.o_proj, lambda m, a, i=i: rec.__setitem__(("z", i), a[0][0].clone())))
        post += [(layer.self_attn, keep(("attn", i))), (layer.mlp, keep(("mlp", i))), (layer, keep(("block", i)))]
    rec["logits"] = _forward(hf, ids, pre, post)
    return rec


def _setup(model, p):
    hf, tok = model.hf_model, model.tokenizer
    ids = [tok(x, return_tensors="pt")["input_ids"] for x in (p.clean, p.corrupted)]
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))
    return hf, ids, lambda lg: float(lg[-1, t] - lg[-1, f])


def _head_write(hf, rec, layer, head):
    """Head ``head``'s write ``z_h W_O^h`` ``[pos, d_model]`` from the o_proj input and weight."""
    W = hf.model.layers[layer].self_attn.o_proj.weight
    dh = W.shape[1] // hf.config.num_attention_heads
    cols = slice(head * dh, (head + 1) * dh)
    return rec[("z", layer)][:, cols] @ W[:, cols].T


def _sender_value(hf, rec, sender):
    """A sender's value ``[pos, d_model]``: a head's write, a sublayer write or the stream at a site."""
    kind, layer, head = sender
    if kind == "heads":
        return _head_write(hf, rec, layer, head)
    if kind == "embed":
        return rec["embed"]
    if kind in ("attn_out", "mlp_out"):
        return rec[(kind[:-4], layer)]
    if kind == "mlp":
        return rec[("block", layer)]
    before = rec["embed"] if layer == 0 else rec[("block", layer - 1)]  # kind "attn": resid_mid
    return before + rec[("attn", layer)]


def direct_reference(model, pairs, senders):
    """Per pair: (clean, corrupted, [patched per sender]) with the direct path to the logits: the
    corrupted final residual plus the sender's (clean - corrupted) value at the last position."""
    out = []
    for p in pairs:
        hf, (c, k), metric = _setup(model, p)
        rc, rk = _record(hf, c), _record(hf, k)
        final = rk[("block", len(hf.model.layers) - 1)][-1]
        patched = []
        for s in senders:
            delta = _sender_value(hf, rc, s)[-1] - _sender_value(hf, rk, s)[-1]
            with torch.no_grad():
                patched.append(metric(hf.lm_head(hf.model.norm(final + delta))[None]))
        out.append((metric(rc["logits"]), metric(rk["logits"]), patched))
    return out


def _receiver_modules(hf, spec):
    """(module, output columns or None) of each receiver ``<l>.q|k|v[.<h>]`` or ``<l>.mlp_in``."""
    out = []
    for name in spec.split(","):
        parts = name.split(".")
        layer = hf.model.layers[int(parts[0])]
        if parts[1] == "mlp_in":  # the MLP's input, replaced as its output (a function of the input alone)
            out.append((layer.mlp, None))
            continue
        proj = getattr(layer.self_attn, f"{parts[1]}_proj")
        dh = hf.config.hidden_size // hf.config.num_attention_heads
        out.append((proj, None if len(parts) == 2 else slice(int(parts[2]) * dh, (int(parts[2]) + 1) * dh)))
    return out


def _step2(hf, k, rc, rk, sender, freeze, last, receivers):
    """The receivers' outputs with every o_proj input frozen at the corrupted z but the sender head's
    (clean z, at the last position or every one), MLP outputs frozen too with ``freeze``."""
    (layer_s, head_s), pre, post, got = sender, [], [], {}
    dh = hf.config.hidden_size // hf.config.num_attention_heads
    cols, rows = slice(head_s * dh, (head_s + 1) * dh), -1 if last else slice(None)

    def frozen_z(i):
        def fn(m, a):
            x = rk[("z", i)][None].clone()
            if i == layer_s:
                x[0, rows, cols] = rc[("z", i)][rows, cols]
            return (x,)

        return fn

    for i, layer in enumerate(hf.model.layers):
        pre.append((layer.self_attn.o_proj, frozen_z(i)))
    for j, (module, _) in enumerate(receivers):  # read before any freezing hook on the same module
        post.append((module, lambda m, a, o, j=j: got.__setitem__(j, _out(o).clone())))
    if freeze:
        post += [(layer.mlp, lambda m, a, o, i=i: rk[("mlp", i)][None]) for i, layer in enumerate(hf.model.layers)]
    _forward(hf, k, pre, post)
    return got


def _put(value, cols):
    """A hook setting a module's output (at some columns) to ``value``."""

    def fn(m, a, o):
        new = _out(o).clone()
        part = slice(None) if cols is None else cols
        new[..., part] = value[..., part]
        return new

    return fn


def path_reference(model, pairs, senders, receivers, freeze, last):
    """Per pair: (clean, corrupted, [patched per head sender (layer, head)]) by steps 2 and 3 with
    plain hooks; step 3 is the corrupted run with the receivers' outputs set to their step-2 values."""
    out = []
    for p in pairs:
        hf, (c, k), metric = _setup(model, p)
        rc, rk = _record(hf, c), _record(hf, k)
        mods = _receiver_modules(hf, receivers)
        patched = []
        for sender in senders:
            got = _step2(hf, k, rc, rk, sender, freeze, last, mods)
            hooks = [(m, _put(got[j], cols)) for j, (m, cols) in enumerate(mods)]
            patched.append(metric(_forward(hf, k, post=hooks)))
        out.append((metric(rc["logits"]), metric(rk["logits"]), patched))
    return out


def _check_means(df, ref, rows, atol=1e-4, noise=False):
    """The table's rows ``rows`` (one per reference sender, in order) against the reference means;
    ``noise``: the reference ran on the flipped pairs (its first value is the corrupted metric)."""
    clean, corrupted = np.mean([r[0] for r in ref]), np.mean([r[1] for r in ref])
    if noise:
        clean, corrupted = corrupted, clean
    np.testing.assert_allclose(df["clean_metric"], clean, atol=1e-5)
    np.testing.assert_allclose(df["corrupted_metric"], corrupted, atol=1e-5)
    want = np.mean([r[2] for r in ref], axis=0)
    got = df.loc[rows]
    np.testing.assert_allclose(got["metric"], want, atol=atol)
    np.testing.assert_allclose(got["fraction_recovered"], (want - corrupted) / (clean - corrupted), atol=atol)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("positions", ["last", "all"])
def test_heads_to_logits_with_frozen_mlps_is_the_direct_path(tiny_llama, positions):
    df = path_patching(tiny_llama, PAIRS, "heads", "logits", freeze_mlps=True, positions=positions)
    heads = [(layer, h) for layer in range(tiny_llama.n_layers) for h in range(4)]
    ref = direct_reference(tiny_llama, PAIRS, [("heads", layer, h) for layer, h in heads])
    assert list(zip(df["layer"], df["head"])) == heads
    assert (df["receiver"] == "logits").all() and (df["method"] == "path").all() and (df["n_pairs"] == 3).all()
    assert (df["position_name"] == positions).all() and (df["direction"] == "denoise").all()
    assert (df["label"] == [f"{layer}.attn" for layer, _ in heads]).all() and (df["point"] != df["label"]).all()
    _check_means(df, ref, df.index)
    assert (df["fraction_recovered"].abs() > 1e-3).all()  # every head has some effect here


def test_sublayer_and_residual_senders_to_logits(tiny_llama):
    senders = ["embed", "0.attn", "0.mlp_out", "1.attn_out", "1.mlp", "2.attn"]
    df = path_patching(tiny_llama, PAIRS, ",".join(senders), "logits", freeze_mlps=True, positions="all")
    assert df["point"].tolist() == senders
    assert df["kind"].tolist() == ["resid", "resid", "mlp_out", "attn_out", "resid", "resid"]
    ref_senders = [("embed", -1, None), ("attn", 0, None), ("mlp_out", 0, None), ("attn_out", 1, None)]
    ref_senders += [("mlp", 1, None), ("attn", 2, None)]
    _check_means(df, direct_reference(tiny_llama, PAIRS, ref_senders), df.index)
    # the embedding differs at the swapped name only, which has no direct path to the last logits
    assert df["fraction_recovered"].iloc[0] == 0 and (df["fraction_recovered"].iloc[1:].abs() > 1e-3).all()
    # the stream's TransformerLens words name the same sites (0.resid_post and 1.resid_pre are one)
    words = path_patching(tiny_llama, PAIRS, "0.resid_pre,0.resid_mid,0.resid_post,1.resid_pre,2.resid_mid", "logits")
    assert words["point"].tolist() == ["embed", "0.attn", "0.mlp", "2.attn"]


@pytest.mark.parametrize(
    ("receivers", "freeze", "positions"),
    [("2.q", False, "all"), ("2.q.1,2.k.1", True, "last"), ("2.mlp_in", False, "all"), ("2.mlp_in", True, "last")],
)
def test_heads_to_queries_keys_and_mlps_equal_the_plain_reference(sharp_llama, receivers, freeze, positions):
    kw = dict(freeze_mlps=freeze, positions=positions)
    df = path_patching(sharp_llama, PAIRS, "heads", receivers, **kw)
    mlp = receivers.endswith("mlp_in")
    reach = df["layer"] < 2 if not mlp else df["layer"] <= 2
    senders = [(int(r.layer), int(r.head)) for r in df[reach].itertuples()]
    ref = path_reference(sharp_llama, PAIRS, senders, receivers, freeze, positions == "last")
    assert (df["receiver"] == receivers).all() and len(df) == 12
    _check_means(df, ref, df.index[reach])
    # per pair, each sender's effect (patched - corrupted), to the float32 rounding of the metric
    per = path_patch_pairs(sharp_llama, PAIRS, "heads", receivers, **kw)
    for i, (_, corrupted, patched) in enumerate(ref):
        rows = per[(per["pair"] == i) & per["layer"].isin([layer for layer, _ in senders])]
        effect = (rows["metric"] - rows["corrupted_metric"]).to_numpy()
        np.testing.assert_allclose(effect, np.array(patched) - corrupted, rtol=1e-4, atol=1e-7)
        assert np.median(np.abs(effect)) > 1e-5  # well above the tolerance
    # heads at or after the receivers reach none of them: not measured (NaN), and the notes say so
    late = df[~reach]
    assert len(late) == (4 if not mlp else 0)
    assert late[["metric", "fraction_recovered", "fraction_low", "fraction_high"]].isna().all().all()
    assert any("not measured" in n for n in df.attrs["notes"]) == (not mlp)
    assert df.loc[reach, "metric"].notna().all()


def _flipped(pairs):
    """The pairs with their prompts exchanged: the plain references run the noise direction on them."""
    return [PromptPair(p.corrupted, p.clean, p.target, p.foil) for p in pairs]


@pytest.mark.parametrize(
    ("receivers", "freeze", "positions"), [("logits", True, "last"), ("2.q", False, "all"), ("2.mlp_in", True, "last")]
)
def test_noise_direction_equals_the_plain_reference(sharp_llama, receivers, freeze, positions):
    """direction="noise" (Wang et al.): the clean run with every head frozen at its clean value except
    the sender, set to its corrupted value; the plain references run the same steps on the clean
    prompt, i.e. on the pairs with their prompts exchanged."""
    kw = dict(freeze_mlps=freeze, positions=positions)
    df = path_patching(sharp_llama, PAIRS, "heads", receivers, direction="noise", **kw)
    assert (df["direction"] == "noise").all() and len(df) == 12
    if receivers == "logits":  # with frozen MLPs: the direct path, the clean final residual plus the delta
        reach = df["layer"] >= 0
        ref = direct_reference(
            sharp_llama, _flipped(PAIRS), [("heads", int(r.layer), int(r.head)) for r in df.itertuples()]
        )
    else:
        reach = df["layer"] < 2 if receivers == "2.q" else df["layer"] <= 2
        senders = [(int(r.layer), int(r.head)) for r in df[reach].itertuples()]
        ref = path_reference(sharp_llama, _flipped(PAIRS), senders, receivers, freeze, positions == "last")
    _check_means(df, ref, df.index[reach], noise=True)
    effect = df.loc[reach, "metric"] - df.loc[reach, "clean_metric"]
    assert np.median(np.abs(effect)) > 1e-4  # noising moves the clean metric, well above the tolerance
    assert df.loc[~reach, "metric"].isna().all()
    # a different question from denoising: other values
    denoise = path_patching(sharp_llama, PAIRS, "heads", receivers, **kw)
    assert not np.allclose(denoise.loc[reach, "metric"], df.loc[reach, "metric"])


def test_per_pair_rows_means_and_chunks(tiny_llama):
    kw = dict(senders="0.heads,1.mlp_out", receivers="2.v,2.mlp_in", positions="all")
    per = path_patch_pairs(tiny_llama, PAIRS, **kw)
    assert per["pair"].tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert (per["receiver"] == "2.v,2.mlp_in").all() and per.attrs["receivers"] == "2.v,2.mlp_in"
    means = path_patching(tiny_llama, PAIRS, **kw)
    pd.testing.assert_frame_equal(means, mean_over_pairs(per, PATH_KEYS), check_exact=False, atol=1e-9)
    one_row = path_patch_pairs(tiny_llama, PAIRS, batch_tokens=1, **kw)  # every sender its own forward
    np.testing.assert_allclose(one_row["metric"], per["metric"], atol=1e-5)
    # the same receivers in another order and spelling are the same spec
    again = path_patching(tiny_llama, PAIRS[:1], "0.heads.2", ["2.mlp_in", " 2.v", "2.v.1"])
    assert again["receiver"].tolist() == ["2.v,2.mlp_in"]


def test_same_last_token_embedding_gives_exactly_the_corrupted_value(tiny_llama):
    df = path_patching(tiny_llama, PAIRS, "embed,0.heads.0", "logits", positions="last")
    emb = df[df["point"] == "embed"].iloc[0]
    assert emb["metric"] == emb["corrupted_metric"] and emb["fraction_recovered"] == 0
    assert df[df["point"] == "0.heads"]["fraction_recovered"].iloc[0] != 0


def test_plot(tiny_llama, tmp_path):
    a = path_patching(tiny_llama, PAIRS[:2], "heads", "logits", freeze_mlps=True)
    b = path_patching(tiny_llama, PAIRS[:2], "0.heads,1.heads", "2.q")
    path = plot_path_patching(pd.concat([a, b], ignore_index=True), tmp_path / "path.png")
    assert path.is_file() and path.stat().st_size > 1000
    resid = path_patching(tiny_llama, PAIRS[:2], "embed,0.mlp_out", "logits")
    with pytest.raises(InputError, match="no head senders"):
        plot_path_patching(resid, tmp_path / "resid.png")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(senders="2.heads.0", receivers="1.q"), r"sender\(s\) 2\.heads\.0 come at or after every receiver"),
        (dict(senders="0.heads,2.mlp_out", receivers="2.mlp_in"), r"2\.mlp_out come at or after"),
        (dict(receivers="2.mlp"), r"receiver '2\.mlp' is the residual stream after block 2.*'2\.mlp_in'"),
        (dict(receivers="2.resid_post"), r"residual stream after block 2.*'2\.mlp_in'"),
        (dict(senders="1.mlp_in"), r"'1\.mlp_in' \(mlp_in\) cannot be a sender"),
        (dict(direction="backwards"), "direction must be one of denoise, noise"),
        (dict(batch_token=10), r"unexpected keyword argument\(s\) \['batch_token'\]: path patching takes"),
        (dict(senders="heads", receivers="0.q"), "no sender comes before the receivers"),
        (dict(senders="3.heads"), r"unknown sender '3\.heads': layer 3 out of range"),
        (dict(senders="1.pattern"), r"'1\.pattern' \(pattern\) cannot be a sender"),
        (dict(senders="0.heads.9"), r"sender '0\.heads\.9': head 9 out of range 0\.\.3"),
        (dict(senders="0.heads,,1.heads"), "empty name"),
        (dict(receivers="2.z"), r"'2\.z' \(z\) cannot be a receiver"),
        (dict(receivers="2.k.2"), r"head 2 out of range 0\.\.1"),
        (dict(receivers="logits,2.q"), "'logits' stands alone"),
        (dict(receivers="2.qq"), r"unknown receiver '2\.qq'"),
        (dict(positions="each"), "positions must be one of all, last"),
        (dict(batch_tokens=0), "batch_tokens must be an integer >= 1"),
    ],
)
def test_bad_specs(tiny_llama, kw, match):
    with pytest.raises(InputError, match=match):
        path_patching(tiny_llama, PAIRS[:1], **kw)


def test_all_positions_need_pairs_of_one_length(tiny_llama):
    text = "When Mary and John went to the big store, Mary gave a drink to"
    longer = PromptPair(PAIRS[0].clean, text, " Mary", " John")
    with pytest.raises(InputError, match=r"pair 1: positions='all' needs clean and corrupted prompts of the same"):
        path_patching(tiny_llama, [PAIRS[0], longer], "0.heads", "logits", positions="all")
    df = path_patching(tiny_llama, [PAIRS[0], longer], "0.heads", "logits", positions="last")  # last: aligned
    assert len(df) == 4 and df["position"].isna().all() and (df["token"] == " to").all()


def test_cli_path_method_writes_means_pairs_and_heatmap(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """depthscope patch --method path over a pairs file: both tables and the heatmap, the means
    equal path_patching's."""
    import json

    path = tmp_path / "pairs.jsonl"
    rows = [{"clean": p.clean, "corrupted": p.corrupted, "target": p.target, "foil": p.foil} for p in PAIRS]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    out = tmp_path / "o"
    args = ["patch", "--model", tiny_llama_dir, "--pairs", path, "--method", "path", "--receivers", "2.q"]
    code, _, err = run_cli([*args, "--out", out, "--threads", "1"], monkeypatch, capsys)
    assert code == 0, err
    means = pd.read_parquet(out / "path_patching.parquet")
    per = pd.read_parquet(out / "path_patching_pairs.parquet")
    assert (out / "path_patching_heads.png").is_file() and set(per["pair"]) == set(range(len(PAIRS)))
    api = path_patching(load_model(str(tiny_llama_dir)), PAIRS, "heads", "2.q", positions="all")
    np.testing.assert_allclose(means["fraction_recovered"], api["fraction_recovered"], atol=1e-6, equal_nan=True)
    assert set(means["receiver"]) == {"2.q"} and set(means["direction"]) == {"denoise"}
    # --direction noise, to the MLP's input (the new word): the same as the API's noise direction
    noise = ["--receivers", "2.mlp_in", "--direction", "noise", "--no-plots", "--out", tmp_path / "n", "--threads", "1"]
    code, _, err = run_cli([*args[:-2], *noise], monkeypatch, capsys)
    assert code == 0, err
    got = pd.read_parquet(tmp_path / "n" / "path_patching.parquet")
    api = path_patching(load_model(str(tiny_llama_dir)), PAIRS, "heads", "2.mlp_in", direction="noise")
    assert set(got["direction"]) == {"noise"} and set(got["receiver"]) == {"2.mlp_in"}
    np.testing.assert_allclose(got["metric"], api["metric"], atol=1e-6, equal_nan=True)
    # the old spelling of the MLP receiver: a clear error with the new word, no traceback
    old = ["--receivers", "2.mlp", "--out", tmp_path / "old", "--threads", "1"]
    code, _, err = run_cli([*args[:-2], *old], monkeypatch, capsys)
    assert code == 2 and "'2.mlp_in'" in err and "Traceback" not in err
