"""IOI dataset patching on the default model: every head's mean over a dozen pairs equals a
plain-transformers reference, through the API and through ``depthscope patch --pairs``.

The dataset is the one ``examples/ioi_dataset.py`` builds (templates of different token lengths,
single-token names, named positions). The reference uses only forward pre-hooks on
``model.hf_model.model.layers[l].self_attn.o_proj``: head ``h``'s slice of the o_proj input at the
last position set to its clean value (the head's write ``z_h W_O^h`` changes exactly when its ``z``
does). Per pair it runs the corrupted prompt's prefix once with transformers' own key/value cache
and then the last token as 271 rows (row ``9 l + h`` patches head ``h`` of layer ``l``, the last
row patches nothing), which is exact because a patch at the last position leaves every earlier
position as in the corrupted run; one layer is also recomputed whole (no cache) as a check of that.
Then the IOI normalisation over pairs: ``(mean patched - mean corrupted) / (mean clean - mean corrupted)``.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from depthscope.analyses.circuits.patching.activation import activation_patching

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
N_PAIRS = 12


def _example():
    spec = importlib.util.spec_from_file_location("ioi_dataset_example", ROOT / "examples" / "ioi_dataset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pairs(default_model):
    return _example().build_pairs(default_model.tokenizer, N_PAIRS)


def _ids(tok, text):
    return tok(text, return_tensors="pt")["input_ids"]


def _put_heads(rows_by_layer: dict, z: dict, d_head: int):
    """A pre-hook factory: in layer ``l``'s o_proj input at the last position, row ``r`` of
    ``rows_by_layer[l]`` (a list of (row, head)) gets head ``head``'s clean slice."""

    def make(layer):
        def pre(module, args):
            x = args[0].clone()
            for row, head in rows_by_layer.get(layer, []):
                sl = slice(head * d_head, (head + 1) * d_head)
                x[row, -1, sl] = z[layer][sl]
            return (x,)

        return pre

    return make


def _with_pre_hooks(hf, make, layers, fn):
    hs = [hf.model.layers[l].self_attn.o_proj.register_forward_pre_hook(make(l)) for l in layers]
    try:
        with torch.no_grad():
            return fn()
    finally:
        for h in hs:
            h.remove()


def _prefix_cache(hf, ids):
    """(forward keyword, key/value cache of ``ids``) in this transformers version (``cache`` in
    recent ones, ``past_key_values`` before)."""
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(input_ids=ids, use_cache=True)
    cache = out.get("cache")
    return kw, cache if cache is not None else out.get("past_key_values")


def reference_pair(model, p, check_layer: int | None = None):
    """(clean, corrupted, patched [layers, heads]) metrics of one pair with plain hooks."""
    hf, tok = model.hf_model, model.tokenizer
    n_layers, n_heads = len(hf.model.layers), hf.config.num_attention_heads
    d_head = hf.config.hidden_size // n_heads
    c, k = _ids(tok, p.clean), _ids(tok, p.corrupted)
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))

    def metric(logits):
        return (logits[:, -1, t] - logits[:, -1, f]).double()

    z = {}

    def grab(layer):
        return lambda m, a: z.__setitem__(layer, a[0][0, -1].clone())

    clean = float(_with_pre_hooks(hf, grab, range(n_layers), lambda: metric(hf(input_ids=c).logits))[0])
    with torch.no_grad():
        corrupted = float(metric(hf(input_ids=k).logits)[0])
        kw, prefix = _prefix_cache(hf, k[:, :-1])
    n_rows = n_layers * n_heads + 1  # the last row patches nothing
    prefix.batch_repeat_interleave(n_rows)
    rows = {l: [(l * n_heads + h, h) for h in range(n_heads)] for l in range(n_layers)}
    make = _put_heads(rows, z, d_head)
    last = k[:, -1:].repeat(n_rows, 1)
    out = _with_pre_hooks(hf, make, range(n_layers), lambda: metric(hf(input_ids=last, **{kw: prefix}).logits))
    out = out.numpy()
    assert out[-1] == pytest.approx(corrupted, abs=1e-4)  # the cached run is the corrupted run
    patched = out[:-1].reshape(n_layers, n_heads)
    if check_layer is not None:  # the cache is exact: one layer's heads recomputed whole
        one = {check_layer: [(h, h) for h in range(n_heads)]}
        whole = _with_pre_hooks(
            hf, _put_heads(one, z, d_head), [check_layer], lambda: metric(hf(input_ids=k.repeat(n_heads, 1)).logits)
        )
        np.testing.assert_allclose(whole.numpy(), patched[check_layer], atol=1e-4)
    return clean, corrupted, patched


@pytest.fixture(scope="module")
def reference(default_model, pairs):
    """Means over pairs: clean, corrupted, patched [layers, heads], and the fractions."""
    got = [reference_pair(default_model, p, check_layer=23 if i == 0 else None) for i, p in enumerate(pairs)]
    clean = np.mean([g[0] for g in got])
    corrupted = np.mean([g[1] for g in got])
    patched = np.mean([g[2] for g in got], axis=0)
    return clean, corrupted, patched, (patched - corrupted) / (clean - corrupted)


def _by_head(df: pd.DataFrame, column: str, shape) -> np.ndarray:
    out = np.full(shape, np.nan)
    out[df["layer"].astype(int), df["head"].astype(int)] = df[column].to_numpy(float)
    return out


def test_the_dataset_has_pairs_of_different_lengths(default_model, pairs):
    tok = default_model.tokenizer
    assert len(pairs) == N_PAIRS
    assert len({len(tok(p.clean)["input_ids"]) for p in pairs}) >= 3
    for p in pairs:  # S2 holds the foil (the subject) in the clean prompt and the target in the corrupted one
        s2 = p.positions["S2"]
        assert tok.decode(tok(p.clean)["input_ids"][s2]) == p.foil
        assert tok.decode(tok(p.corrupted)["input_ids"][s2]) == p.target


def test_every_head_equals_the_plain_reference(default_model, pairs, reference):
    clean, corrupted, patched, fraction = reference
    df = activation_patching(default_model, pairs, sites="heads", positions="last")
    shape = patched.shape
    assert len(df) == shape[0] * shape[1] == 270 and (df["n_pairs"] == N_PAIRS).all()
    np.testing.assert_allclose(df["clean_metric"], clean, atol=1e-3)
    np.testing.assert_allclose(df["corrupted_metric"], corrupted, atol=1e-3)
    np.testing.assert_allclose(_by_head(df, "metric", shape), patched, atol=1e-3)
    np.testing.assert_allclose(_by_head(df, "fraction_recovered", shape), fraction, atol=1e-3)
    lo, hi = _by_head(df, "fraction_low", shape), _by_head(df, "fraction_high", shape)
    assert (lo <= fraction + 1e-3).all() and (fraction <= hi + 1e-3).all()
    assert (hi - lo > 0).any()


def test_cli_pairs_file_writes_the_same_fractions(default_model, pairs, reference, tmp_path, monkeypatch, capsys):
    import sys

    from depthscope.analyses import cli

    path = _example().write_pairs(pairs, tmp_path / "ioi.jsonl")
    out = tmp_path / "out"
    args = ["patch", "--pairs", path, "--sites", "heads", "--no-attribution", "--no-plots", "--threads", "1"]
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "0")
    monkeypatch.setattr(sys, "argv", ["depthscope", *map(str, [*args, "--out", out])])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code or 0
    err = capsys.readouterr().err
    assert code == 0, err
    means = pd.read_parquet(out / "patching.parquet")
    assert set(means["method"]) == {"activation"} and means["head"].notna().all()
    fraction = reference[3]
    np.testing.assert_allclose(_by_head(means, "fraction_recovered", fraction.shape), fraction, atol=1e-3)
    per = pd.read_parquet(out / "patching_pairs.parquet")
    assert set(per["pair"]) == set(range(N_PAIRS)) and len(per) == N_PAIRS * 270


def test_direct_path_to_logits_equals_the_direct_path_reference(default_model, pairs):
    """path_patching(senders="heads", receivers="logits", freeze_mlps=True) on the default model:
    for all 270 heads, the clean-minus-corrupted head write at the last position added to the
    corrupted final residual, through the final norm and the unembedding (plain hooks and the
    transformers modules), then the IOI normalisation over pairs: to 1e-3."""
    from depthscope.analyses.circuits.patching.paths import path_patching

    some = pairs[:4]
    hf, tok = default_model.hf_model, default_model.tokenizer
    n_layers, n_heads = len(hf.model.layers), hf.config.num_attention_heads
    d_head = hf.config.hidden_size // n_heads
    cleans, corrupteds, patched = [], [], []
    writes, final = {}, {}

    def grab(run):
        def make(layer):
            def pre(m, a):
                z = a[0][0, -1].view(n_heads, d_head)
                w = m.weight.view(m.weight.shape[0], n_heads, d_head)
                writes[(run, layer)] = torch.einsum("hk,dhk->hd", z, w)  # each head's write z_h W_O^h

            return pre

        return make

    def last_resid(run):
        return lambda m, a, o: final.__setitem__(run, o[0][0, -1] if isinstance(o, tuple) else o[0, -1])

    for p in some:
        t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))
        for run, text in (("clean", p.clean), ("corrupted", p.corrupted)):
            h = hf.model.layers[-1].register_forward_hook(last_resid(run))
            logits = _with_pre_hooks(
                hf, grab(run), range(n_layers), lambda text=text: hf(input_ids=_ids(tok, text)).logits
            )
            h.remove()
            (cleans if run == "clean" else corrupteds).append(float(logits[0, -1, t] - logits[0, -1, f]))
        with torch.no_grad():
            delta = torch.stack([writes[("clean", l)] - writes[("corrupted", l)] for l in range(n_layers)])  # [L, H, d]
            resid = final["corrupted"] + delta  # [L, H, d]: the direct path of each head alone
            lg = hf.lm_head(hf.model.norm(resid))
            patched.append((lg[..., t] - lg[..., f]).double().numpy())
    clean, corrupted, mean = np.mean(cleans), np.mean(corrupteds), np.mean(patched, axis=0)
    fraction = (mean - corrupted) / (clean - corrupted)
    df = path_patching(default_model, some, senders="heads", receivers="logits", freeze_mlps=True, positions="last")
    assert len(df) == 270 and set(df["receiver"]) == {"logits"}
    np.testing.assert_allclose(_by_head(df, "metric", fraction.shape), mean, atol=1e-3)
    np.testing.assert_allclose(_by_head(df, "fraction_recovered", fraction.shape), fraction, atol=1e-3)
