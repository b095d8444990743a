"""Edge features held once per span (:class:`SpanRows`) against the concatenated features they
stand for: the same values, the same per-site probes, the same scalar mix, half the memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthscope.probes import Features, train_probe
from depthscope.probes.config import ProbeConfig
from depthscope.probes.mixing import _FlatSites, _ProjectedMix, fit_mix, mix_draws
from depthscope.probes.solvers.classifiers import site_probe
from depthscope.probes.solvers.training import log_probs
from depthscope.probes.store import features as features_module
from depthscope.probes.store.activations import SpanStore
from depthscope.probes.store.span_rows import SpanRows, dense


def _arcs(n_words=240, S=4, D=6, C=3, seed=0):
    """A store of ``n_words`` word rows and one arc per word (the word and a head), labelled by
    a function of both ends, so a probe needs both halves of the concatenation."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_words, S, D)).astype(np.float32) + np.arange(S, dtype=np.float32)[None, :, None]
    head = rng.integers(0, n_words, n_words)
    span_ids = np.stack([np.arange(n_words), head], 1)
    score = x[:, :, 0].sum(1) + 0.7 * x[head, :, 1].sum(1)
    y = np.digitize(score, np.quantile(score, np.linspace(0, 1, C + 1)[1:-1]))
    store = SpanStore(None, x, np.arange(n_words), np.ones(n_words, dtype=np.int64), list(range(S)), "last", {})
    return store, span_ids, y


def _pair(monkeypatch, store, span_ids, train=None):
    """The same examples made resident twice: as span rows, and (factoring refused) concatenated."""
    out = []
    for factor in (True, False):
        f = Features(store, span_ids)
        f.fit_standardiser() if train is None else f.standardise_like(train)
        with monkeypatch.context() as m:
            if not factor:
                m.setattr(features_module, "worth_factoring", lambda *a: False)
            assert f.make_resident(seed=3)
        out.append(f)
    return out


def test_edge_features_are_held_once_per_span_and_read_as_their_concatenation(monkeypatch):
    store, span_ids, _ = _arcs()
    rows, cat = _pair(monkeypatch, store, span_ids)
    assert isinstance(rows.resident, SpanRows) and isinstance(cat.resident, torch.Tensor)
    assert rows.resident.shape == cat.resident.shape and rows.resident.dtype == cat.resident.dtype
    assert np.array_equal(rows.order, cat.order)
    X = dense(rows.resident)
    assert torch.equal(X, cat.resident) and X.stride() == cat.resident.stride()  # feature-major too
    assert 2 * rows.resident.words.numel() == cat.resident.numel()  # every word once, not twice
    idx = np.array([5, 0, 17, 33, 200])
    assert torch.equal(dense(rows.subset(idx).resident), cat.subset(idx).resident)
    for sites in ([0, 2], [3, 1], [1, 2, 3]):  # evenly spaced (a view) or not (a copy)
        assert torch.equal(dense(rows.with_sites(sites).resident), cat.with_sites(sites).resident)
    for rng in (None, np.random.default_rng(0)):  # evaluation (in span order) and training batches
        seen = np.zeros(len(span_ids), dtype=int)
        pos = np.argsort(rows.order)  # example -> its row in the resident order
        for i, (x, _) in rows.batches(50, rng):
            assert x.shape == (4, len(i), 12) and torch.equal(x, cat.resident[:, pos[i]])
            seen[i] += 1
        assert (seen == 1).all()
    first = np.concatenate([store.row_start[span_ids[i, 0]] for i, _ in rows.batches(50)])
    assert (np.diff(first) >= 0).all()  # evaluation batches go in the order of the first span's row
    # evaluation batches are gathered into one reused block, not a new allocation per batch
    assert len({x.untyped_storage().data_ptr() for _, (x, _) in rows.batches(50)}) == 1


def test_unique_spans_are_not_factored():
    """One span per example, or pairs that share no span: the concatenated features (no saving)."""
    store, span_ids, _ = _arcs()
    f = Features(store, span_ids[:, :1]).fit_standardiser()
    assert f.make_resident() and isinstance(f.resident, torch.Tensor)
    pairs = np.arange(240).reshape(120, 2)
    g = Features(store, pairs).fit_standardiser()
    assert g.make_resident() and isinstance(g.resident, torch.Tensor)


def test_per_site_probes_on_span_rows_are_those_on_the_concatenation(monkeypatch):
    """The subspace solver reads a dense copy of each block of sites: the same products on the
    same values, so the same probes; predictions are batched dense copies too."""
    store, span_ids, y = _arcs()
    (rows, cat), yt = _pair(monkeypatch, store, span_ids), torch.from_numpy(y)
    cfg = ProbeConfig(l2=1e-2)
    probes = []
    for f in (rows, cat):
        p = site_probe(f, 3, cfg, l2=1e-2)
        log = train_probe(p, f, yt, solver="subspace", tol=1e-7, gtol=1e-5, max_epochs=300)
        assert log.all_converged and log.solver == "subspace"
        probes.append((p, log_probs(p, f)))
    (p1, lp1), (p2, lp2) = probes
    torch.testing.assert_close(p1.W, p2.W, rtol=0, atol=1e-6)
    torch.testing.assert_close(lp1, lp2, rtol=0, atol=1e-5)
    assert (lp1[:, :, 0].argmax(-1) == yt).float().mean() > 0.5  # a real fit, not two zero probes


def test_scalar_mix_on_span_rows_is_the_concatenations(monkeypatch):
    """The mix of span rows gathered equals the mix of the concatenation, and its gradient
    (summed onto the span rows) too: the same weights, draws and objective."""
    store, span_ids, y = _arcs(S=5)
    rows, cat = _pair(monkeypatch, store, span_ids)
    yr = y[rows.order]
    a = torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4])
    D = torch.randn(rows.resident.shape[2], len(yr), generator=torch.Generator().manual_seed(1))
    flat = _FlatSites(cat.resident)
    torch.testing.assert_close(rows.resident.mix(torch.softmax(a, 0)), flat.mix(torch.softmax(a, 0)))
    torch.testing.assert_close(rows.resident.mix_grad(D), flat.mix_grad(D), rtol=1e-5, atol=1e-4)
    objs = [
        _ProjectedMix(s, torch.from_numpy(yr), 1e-2, True, (torch.zeros(12, 3), torch.zeros(3)))
        for s in (rows.resident, flat)
    ]
    (f1, g1, _), (f2, g2, _) = (o(torch.softmax(a, 0)) for o in objs)
    assert float(f1) == pytest.approx(float(f2), rel=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    fits = [fit_mix(X, yr, n_classes=3, l2=1e-2) for X in (rows.resident, cat.resident)]
    # the same optimum, to the mix's stopping test (a gradient entry of 1e-4): the two gradients
    # sum in different orders, so the iterates part in the last digits
    assert fits[0].objective == pytest.approx(fits[1].objective, rel=1e-6)
    np.testing.assert_allclose(fits[0].weights, fits[1].weights, atol=5e-4)
    draws = [
        mix_draws(X, yr, n_classes=3, l2=1e-2, folds=2, seed=0, init=fits[0].state)
        for X in (rows.resident, cat.resident)
    ]
    np.testing.assert_allclose(draws[0], draws[1], atol=5e-4)


def test_span_rows_keep_their_device():
    """Made resident on a device (meta stands in for a GPU), the span rows and their indices
    are there, and so are subsets, site selections and dense copies."""
    store, span_ids, _ = _arcs()
    f = Features(store, span_ids).fit_standardiser()
    assert f.make_resident(device="meta") and isinstance(f.resident, SpanRows)
    for g in (f, f.subset(np.arange(0, 240, 3)), f.with_sites([0, 2]), f.with_sites([1, 3, 0])):
        assert g.resident.words.device.type == "meta" and g.resident.idx.device.type == "meta"
        assert g.resident.dense(sites=slice(0, 2)).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_span_rows_fit_on_a_gpu_as_on_the_cpu():
    store, span_ids, y = _arcs()
    yt, fits = torch.from_numpy(y), {}
    for device in ("cpu", "cuda"):
        f = Features(store, span_ids).fit_standardiser()
        assert f.make_resident(device=device) and isinstance(f.resident, SpanRows)
        p = site_probe(f, 3, ProbeConfig(l2=1e-2), l2=1e-2)
        train_probe(p, f, yt, solver="subspace", tol=1e-7, gtol=1e-5, max_epochs=300)
        fits[device] = (p.W.detach().cpu(), log_probs(p, f))
        assert list(f.batches(64))[0][1][0].device.type == device
    torch.testing.assert_close(fits["cpu"][0], fits["cuda"][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(fits["cpu"][1], fits["cuda"][1], rtol=0, atol=1e-3)
