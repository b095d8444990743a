"""Patching SAE features: ``activation_patching(..., sites="1.mlp.sae.features", saes=...)`` against a
plain-PyTorch reference (the clean feature value written into the corrupted run is the decoder row
times the feature's change added to the block's output, features encoded by hand), attribution per
feature against ``(f_clean - f_corrupted) * grad`` with the gradient taken at the model's own point
through the decoder, unchanged features at exactly the corrupted metric, ``features="top:N"`` and
bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IOI_PAIRS
from test_sae import hand_encode, random_sae

from depthscope.analyses.circuits.pairs import PromptPair
from depthscope.analyses.circuits.patching.activation import activation_patching, attribution_patching, patch_pairs
from depthscope.common.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [PromptPair(*p) for p in IOI_PAIRS[:2]]
SITE = "1.mlp.sae.features"


@pytest.fixture(scope="module")
def llama(tiny_factory):
    return tiny_factory("llama")


@pytest.fixture(scope="module")
def sae(llama):
    return random_sae(llama.d_model, 48, "standard", seed=3)


def _ids(model, text):
    return model.tokenizer(text, return_tensors="pt")["input_ids"]


def _metric(model, pair):
    t, f = (model.tokenizer(x, add_special_tokens=False)["input_ids"][0] for x in (pair.target, pair.foil))
    return lambda logits: float(logits[0, -1, t] - logits[0, -1, f])


def _block1(model, ids, fn=None):
    """(logits, block 1's output hidden states) of a plain forward, ``fn`` editing that output."""
    seen = {}

    def hook(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = fn(h) if fn is not None else h
        seen["h"] = h.detach()
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = model.hf_model.model.layers[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model.hf_model(input_ids=ids).logits
    finally:
        handle.remove()
    return logits, seen["h"][0]


def test_feature_patches_equal_plain_hooks(llama, sae):
    """Setting feature j at the position where the prompts differ (named S2) to its clean value
    changes the SAE's reconstruction by (f_clean - f_corrupted) W_dec[j] and nothing else (the error
    term is the model's tensor minus the unedited reconstruction): the reference adds that to block
    1's output with a plain hook."""
    c, k = _ids(llama, PAIRS[0].clean), _ids(llama, PAIRS[0].corrupted)
    s2 = int((c != k).nonzero()[0, 1])
    p = PromptPair(*IOI_PAIRS[0], positions={"S2": s2})
    metric = _metric(llama, p)
    f_clean = hand_encode(sae, _block1(llama, c)[1])[s2]
    corrupted_logits, hk = _block1(llama, k)
    f_corrupted = hand_encode(sae, hk)[s2]
    delta = f_clean - f_corrupted
    moved = [int(j) for j in delta.abs().argsort(descending=True)[:4]]
    still = [j for j in range(48) if f_clean[j] == 0 and f_corrupted[j] == 0][:2]
    assert len(still) == 2 and delta[moved[0]].abs() > 0.05
    df = patch_pairs(llama, [p], sites=SITE, positions="S2", saes={"1.mlp": sae}, features=moved + still)
    assert df["feature"].tolist() == moved + still and df["head"].isna().all() and (df["position"] == s2).all()
    assert (
        (df["kind"] == "sae.features").all()
        and (df["point"] == SITE).all()
        and (df["label"] == "1.mlp").all()
        and (df["site"] == 4).all()
    )
    for j in moved:

        def add(h, j=j):
            h = h.clone()
            h[0, s2] += delta[j] * sae.W_dec[j]
            return h

        ref = metric(_block1(llama, k, add)[0])
        row = df[df["feature"] == j].iloc[0]
        assert row.metric == pytest.approx(ref, abs=1e-5)
        assert row.corrupted_metric == pytest.approx(metric(corrupted_logits), abs=1e-5)
    unchanged = df[df["feature"].isin(still)]
    assert (unchanged["metric"] == unchanged["corrupted_metric"]).all() and (unchanged["fraction_recovered"] == 0).all()


def test_feature_patches_per_position_equal_a_features_hook(llama, sae):
    """positions="each": each (feature, position) equals a run whose features hook writes that
    feature's clean value at that position (clean features cached with model.run)."""
    p = PAIRS[0]
    saes, metric = {"1.mlp": sae}, _metric(llama, p)
    f_clean = llama.run([p.clean], saes=saes, cache=[SITE])[SITE][0]
    features = [5, 17]
    df = activation_patching(
        llama, p.clean, p.corrupted, (p.target, p.foil), sites=SITE, positions="each", saes=saes, features=features
    )
    n_pos = _ids(llama, p.corrupted).shape[1]
    assert len(df) == n_pos * len(features)
    for row in df.itertuples():

        def put(f, ctx, j=int(row.feature), q=int(row.position)):
            f = f.clone()
            f[0, q, j] = f_clean[q, j]
            return f

        ref = metric(llama.run([p.corrupted], saes=saes, hooks={SITE: put}).logits)
        assert row.metric == pytest.approx(ref, abs=1e-5)


def test_attribution_per_feature(llama, sae):
    """AtP per feature: (f_clean - f_corrupted) * d metric / d f at the last position, the gradient
    taken at block 1's output of a plain run (no SAE) and carried through the decoder."""
    p = PAIRS[0]
    metric = _metric(llama, p)
    df = attribution_patching(llama, p.clean, p.corrupted, (p.target, p.foil), sites=SITE, saes={"1.mlp": sae})
    assert df["feature"].tolist() == list(range(48)) and (df["method"] == "attribution").all()
    run = llama.run([p.corrupted], cache=["1.mlp"], grad=True)
    t, f = (llama.tokenizer(x, add_special_tokens=False)["input_ids"][0] for x in (p.target, p.foil))
    (run.logits[0, -1, t] - run.logits[0, -1, f]).backward()
    grad = run.grad("1.mlp")[0, -1] @ sae.W_dec.T
    delta = (
        hand_encode(sae, _block1(llama, _ids(llama, p.clean))[1])[-1] - hand_encode(sae, run["1.mlp"][0].detach())[-1]
    )
    np.testing.assert_allclose(df["metric"] - df["corrupted_metric"], (delta * grad).numpy(), atol=1e-5)
    assert df["corrupted_metric"].iloc[0] == pytest.approx(metric(run.logits.detach()), abs=1e-5)
    zero = (delta == 0).numpy()
    assert zero.any() and (df["metric"][zero] == df["corrupted_metric"][zero]).all()


def test_top_features_over_pairs_and_mixed_sites(llama, sae):
    saes = {"1.mlp": sae}
    est = patch_pairs(llama, PAIRS, sites=SITE, method="attribution", saes=saes)
    score = (est["metric"] - est["corrupted_metric"]).abs().groupby(est["feature"]).sum()
    top = score.sort_values(ascending=False, kind="stable").index[:3].tolist()
    means = activation_patching(llama, PAIRS, sites=SITE, saes=saes, features="top:3")
    assert means["feature"].tolist() == top and (means["n_pairs"] == 2).all()
    per = patch_pairs(llama, PAIRS, sites=SITE, saes=saes, features=top)
    np.testing.assert_allclose(means["metric"], per.groupby("feature", sort=False)["metric"].mean(), atol=1e-9)
    # other sites patched beside the features are unchanged by the splice
    mixed = activation_patching(llama, PAIRS, sites=f"1.attn,{SITE}", saes=saes, features=top[:1])
    plain = activation_patching(llama, PAIRS, sites="1.attn")
    assert mixed["point"].tolist() == ["1.attn", SITE] and mixed["feature"].isna().tolist() == [True, False]
    assert mixed["metric"].iloc[0] == pytest.approx(plain["metric"].iloc[0], abs=1e-6)


def test_bad_feature_arguments(llama, sae):
    p = PAIRS[0]
    args = (llama, p.clean, p.corrupted, (p.target, p.foil))
    with pytest.raises(InputError, match="no SAE is attached at 1.mlp"):
        activation_patching(*args, sites=SITE)
    with pytest.raises(InputError, match="name a site such as"):
        activation_patching(*args, sites="1.attn", saes={"1.mlp": sae}, features=[1])
    with pytest.raises(InputError, match=r"indices 0\.\.47"):
        activation_patching(*args, sites=SITE, saes={"1.mlp": sae}, features=[48])
    with pytest.raises(InputError, match="top:N"):
        attribution_patching(*args, sites=SITE, saes={"1.mlp": sae}, features="top:x")
    with pytest.raises(InputError, match="unexpected keyword"):
        activation_patching(*args, sites=SITE, sae={"1.mlp": sae})


def test_reconstruction_and_error_patch_whole(llama, sae):
    """The SAE's reconstruction and error are sites patched whole: the reconstruction's clean value
    at the last position moves block 1's output there by recon_clean - recon_corrupted."""
    p = PAIRS[0]
    c, k, metric = _ids(llama, p.clean), _ids(llama, p.corrupted), _metric(llama, p)
    subs = "1.mlp.sae.reconstruction,1.mlp.sae.error"
    df = activation_patching(llama, p.clean, p.corrupted, (p.target, p.foil), sites=subs, saes={"1.mlp": sae})
    assert df["kind"].tolist() == ["sae.reconstruction", "sae.error"] and "feature" not in df.columns
    recon = [hand_encode(sae, _block1(llama, ids)[1])[-1] @ sae.W_dec + sae.b_dec for ids in (c, k)]

    def add(h):
        h = h.clone()
        h[0, -1] += recon[0] - recon[1]
        return h

    assert df["metric"].iloc[0] == pytest.approx(metric(_block1(llama, k, add)[0]), abs=1e-5)
    assert df["metric"].iloc[0] != pytest.approx(df["corrupted_metric"].iloc[0], abs=1e-5)
