"""The one decoding object (hooks/unembed.py), the one weight digest (common/digest.py) and the
lens objects (analyses/lens/lenses.py): Unembed reproduces the Hugging Face model's own logits, the
frozen-norm variant splits a logit exactly into per-site parts, LogitLens and an identity
TunedLens give the same table, and every weight digest comes from one function."""

from __future__ import annotations

import pytest
import torch

from depthscope.analyses import logit_lens
from depthscope.analyses.lens.lenses import LogitLens, TunedLens
from depthscope.hooks import UnsupportedArchitecture

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread

TEXTS = ["The capital of France is Paris.", "Hello world, this is a longer second sentence."]


def _hf_logits(model, texts):
    ids, mask = model.tokenize(texts)
    with torch.no_grad():
        out = model.hf_model(input_ids=ids, attention_mask=mask.long())
    return ids, mask, out.logits


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_unembed_equals_the_models_logits_at_the_last_site(tiny_factory, family):
    m = tiny_factory(family, seed=11)
    _, mask, want = _hf_logits(m, TEXTS)
    rs = m.residual_stream(TEXTS)
    with torch.no_grad():
        got = m.unembed(rs.resid[-1])
        normed = m.unembed.norm(rs.resid[-1])
        buf = torch.empty(int(mask.sum()), m.vocab_size)
        m.unembed.project_into(normed[mask], buf)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf, want[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(m.decode(rs.resid[-1]), got)  # decode is the same call


def test_unembed_real_model_and_check(default_model, tiny_factory):
    m = default_model
    _, mask, want = _hf_logits(m, TEXTS[:1])
    rs = m.residual_stream(TEXTS[:1])
    with torch.no_grad():
        assert torch.equal(m.unembed(rs.resid[-1]), want)
    assert m.unembed.decodes_stream and m.unembed.is_plain_linear
    m.unembed.check()
    bert = tiny_factory("bert")
    assert not bert.unembed.decodes_stream
    with pytest.raises(UnsupportedArchitecture, match="encoder"):
        bert.unembed.check()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_frozen_parts_sum_to_the_dla_logit(tiny_factory, family):
    """Per-site contributions through the frozen norm plus the constant are the logit (exact
    identity in float64), and the frozen map at the reference stream is the model's decoding."""
    from depthscope.analyses.norms import direct_logit_attribution

    m = tiny_factory(family, seed=5)
    if family == "gpt2":  # non-trivial LayerNorm gain and bias, so the constant matters
        with torch.no_grad():
            m.arch.final_norm.weight.uniform_(0.5, 1.5)
            m.arch.final_norm.bias.normal_()
    rs = m.residual_stream(TEXTS[:1])
    h = rs.resid[:, 0, -1].double()  # [S, D] after every site at the last token
    parts = torch.cat([h[:1], h[1:] - h[:-1]], 0)
    frozen = m.unembed.frozen(h[-1])
    t, c = 42, 7
    total = float(frozen.contributions(parts, t, c).sum()) + frozen.constant(t, c)
    full = frozen.logits(h[-1:])[0]
    # the frozen map of the reference stream itself: the same logit difference, biases included
    ref = float(full[t] - full[c]) + frozen.constant(t, c)
    assert total == pytest.approx(ref, rel=1e-10, abs=1e-10)
    with torch.no_grad():
        want = m.unembed(rs.resid[-1, 0, -1]).double()
    assert total == pytest.approx(float(want[t] - want[c]), rel=1e-5, abs=1e-5)
    # and direct_logit_attribution reports exactly these parts
    dla = direct_logit_attribution(m, TEXTS[:1], t, c)
    assert dla["contribution"].sum() == pytest.approx(total, rel=1e-9, abs=1e-9)
    torch.testing.assert_close(
        torch.tensor(dla["contribution"].to_numpy()[:-1]), frozen.contributions(parts, t, c), rtol=1e-12, atol=1e-12
    )


def test_frozen_refuses_softcap(tiny_factory):
    m = tiny_factory("llama", seed=6)
    m.arch.softcap = 30.0
    with pytest.raises(UnsupportedArchitecture, match="soft-caps"):
        m.unembed.frozen(torch.zeros(m.d_model))


def test_logit_lens_and_identity_tuned_lens_give_the_same_table(tiny_llama):
    a = logit_lens(tiny_llama, TEXTS, lens=LogitLens())
    b = logit_lens(tiny_llama, TEXTS, lens=TunedLens.identity(tiny_llama))
    assert set(a["lens"]) == {"logit"} and set(b["lens"]) == {"tuned"}
    assert list(a.columns) == list(b.columns) and a["label"].equals(b["label"])
    num = [c for c in a.columns if c not in ("lens", "label", "sublayer", "ci_unit", "ci_method")]
    torch.testing.assert_close(
        torch.tensor(a[num].to_numpy(float)),
        torch.tensor(b[num].to_numpy(float)),
        rtol=1e-6,
        atol=1e-6,
        equal_nan=True,  # intervals withheld below 10 documents
    )
    assert logit_lens(tiny_llama, TEXTS).equals(a)  # the default lens is the logit lens
    rs = tiny_llama.residual_stream(TEXTS[:1])
    with torch.no_grad():
        z = LogitLens().logits(tiny_llama, rs.resid, rs.sites)
        assert torch.equal(z, tiny_llama.decode(rs.resid))
        torch.testing.assert_close(TunedLens.identity(tiny_llama).logits(tiny_llama, rs.resid[:, 0], rs.sites), z[:, 0])


def test_one_digest_function(tiny_factory):
    import depthscope.analyses.lens.lenses as lenses
    import depthscope.probes.store.activations as activations
    from depthscope.common import digest
    from depthscope.hooks import stream_identity

    # one store digest: the full one in memory (a streamed model's: tests/test_stream_digests.py)
    assert activations.store_digest is stream_identity.store_digest and lenses.store_digest is activations.store_digest
    assert lenses.model_digest is digest.model_digest
    a, a2, b = tiny_factory("llama", seed=1), tiny_factory("llama", seed=1), tiny_factory("llama", seed=2)
    assert digest.model_digest(a) == digest.model_digest(a2) != digest.model_digest(b)
    assert activations.store_digest(a) == digest.model_digest(a)
    assert a.unembed.digest() == a2.unembed.digest() != b.unembed.digest()
    assert TunedLens.identity(a).model_info["digest"] == digest.model_digest(a)
    before = a.unembed.digest()
    with torch.no_grad():
        a.arch.final_norm.weight[0] += 1.0  # the first value is always in the sample
    assert a.unembed.digest() != before


def test_lens_with_an_older_digest_is_refused_clearly(tiny_llama, tmp_path):
    import json

    from depthscope.analyses.lens.lenses import LensMismatchError

    folder = TunedLens.identity(tiny_llama).save(tmp_path / "lens")
    meta = json.loads((folder / "tuned_lens.json").read_text())
    meta["model"]["digest"] = "0123456789abcdef"  # another algorithm's value
    del meta["model"]["digest_algorithm"]
    (folder / "tuned_lens.json").write_text(json.dumps(meta))
    with pytest.raises(LensMismatchError, match="older depthscope"):
        TunedLens.load(folder, tiny_llama)
    TunedLens.load(folder, tiny_llama, strict=False)
