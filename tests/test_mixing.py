"""The scalar mix behind E_s (probes/mixing.py: fit_mix, mix_draws, scalar_mix): exact cases
(identical sites: the mix stays uniform and its probe is scikit-learn's penalised logistic
regression; gamma recomputed by hand; E_s and the spread on hand-computed weights), the penalty's
pull to one site reproduced on synthetic features and shown gone with the scale-neutral gamma,
and the fold refits that give E_s an interval."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from depthscope.probes.mixing import expected_layer_mix, fit_cumulative, fit_mix, mix_draws, mix_spread
from tests.test_probes_fit import features, synthetic


def _standardise(X: torch.Tensor) -> torch.Tensor:
    return (X - X.mean(1, keepdim=True)) / X.std(1, keepdim=True, unbiased=False)


def test_expected_layer_and_spread_by_hand():
    depths = [0, 0.5, 1.0, 1.5]
    w = [0.1, 0.2, 0.3, 0.4]  # 0.2 * 0.5 + 0.3 * 1 + 0.4 * 1.5 = 1.0
    assert expected_layer_mix(depths, w) == pytest.approx(1.0)
    rows = expected_layer_mix(depths, [w, [0, 0, 0, 2.0], [1, 1, 1, 1]])  # rows renormalised
    assert np.allclose(rows, [1.0, 1.5, 0.75])
    assert mix_spread([0, 1, 0, 0]) == pytest.approx(1.0)
    assert mix_spread([0.25] * 4) == pytest.approx(4.0)
    assert mix_spread([0.5, 0.5, 0, 0]) == pytest.approx(2.0)


@pytest.mark.parametrize("normalise", [False, True])
def test_identical_sites_give_the_uniform_mix_and_sklearns_probe(normalise):
    """Every site the same standardised features: the uniform start is a stationary point in the
    mixing logits (the mix stays uniform exactly), gamma is 1 (the mix is one unit-scale site) and
    the probe is scikit-learn's multinomial logistic regression with C = 1 / (2 l2 N)."""
    g = torch.Generator().manual_seed(0)
    N, F, C, l2 = 400, 5, 3, 1e-2
    y = torch.randint(C, (N,), generator=g).numpy()
    x = torch.randn(N, F, generator=g) + torch.eye(C, F)[y] * 1.5
    X = _standardise(x[None].repeat(3, 1, 1))
    fit = fit_mix(X, y, n_classes=C, l2=l2, normalise=normalise)
    assert fit.converged
    np.testing.assert_allclose(fit.weights, 1 / 3, atol=1e-7)
    assert fit.gamma == pytest.approx(1.0, abs=1e-5)
    ref = LogisticRegression(C=1 / (2 * l2 * N), tol=1e-10, max_iter=10_000).fit(X[0].numpy(), y)
    _, W, b = fit.state
    ours = torch.softmax(X[0] @ W + b, -1).numpy()
    np.testing.assert_allclose(ours, ref.predict_proba(X[0].numpy()), atol=2e-4)


@pytest.mark.parametrize("normalise", [False, True])
def test_projected_mix_gradient_is_autograds(normalise):
    """The mix objective's hand-written gradient in the weights (df/dm through the probe and
    gamma, then the sites) equals autograd's on the same solved probe, and the objective and the
    probe's largest gradient entry are autograd's too."""
    from depthscope.probes.mixing import _FlatSites, _ProjectedMix

    g = torch.Generator().manual_seed(3)
    S, N, F, C, l2 = 5, 300, 7, 4, 1e-2
    X = torch.randn(S, F, N, generator=g).mul_(torch.linspace(0.5, 2.0, S)[:, None, None]).transpose(1, 2)
    y = torch.randint(C, (N,), generator=g)
    Xf, n, f_ = X.transpose(1, 2).reshape(S, F * N), N, F
    p = torch.softmax(torch.randn(S, generator=g), 0)
    W0, b0 = 0.1 * torch.randn(F, C, generator=g), torch.zeros(C)
    obj = _ProjectedMix(_FlatSites(X), y, l2, normalise, (W0, b0))
    f, gp, gprobe = obj(p)
    W, b = obj.W.clone().requires_grad_(True), obj.b.clone().requires_grad_(True)  # the solved probe
    pr = p.clone().requires_grad_(True)
    m = (pr @ Xf).view(f_, n)
    gamma = torch.rsqrt(m.var(1, unbiased=False).mean()) if normalise else 1.0
    fr = torch.nn.functional.cross_entropy(torch.addmm(b, (gamma * m).T, W), y) + l2 * (W * W).sum()
    gp_ref, gW, gb = torch.autograd.grad(fr, (pr, W, b))
    assert float(f) == pytest.approx(float(fr.detach()), rel=1e-6)
    torch.testing.assert_close(gp, gp_ref, rtol=1e-4, atol=1e-7)
    assert gprobe == pytest.approx(max(float(gW.abs().max()), float(gb.abs().max())), rel=1e-3, abs=1e-8)


def test_gamma_is_the_unit_scale_of_the_fitted_mix():
    x, y = synthetic(300, S=4, D=6, C=3)
    X = _standardise(torch.from_numpy(x).permute(1, 0, 2).contiguous())
    fit = fit_mix(X, y, n_classes=3, l2=3e-2)
    m = np.einsum("s,snf->nf", fit.weights, X.double().numpy())
    assert fit.gamma == pytest.approx(1 / np.sqrt(m.var(0).mean()), rel=1e-4)
    assert fit.gamma > 1  # the sites are not perfectly correlated: the mix is smaller than a site


def _equally_informative(seed: int = 1, S: int = 6, n: int = 1000, rho: float = 0.9):
    """Six sites with the same class signal and noise that is shared to ``rho`` and independent for
    the rest, standardised per site and dimension as the pipeline does: averaging sites cancels
    the independent part (a spread mix is at least as informative as one site), but the average
    has a smaller variance than one site, which the penalty charges for at ``gamma = 1``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(2, (n,), generator=g)
    mu = torch.randn(2, 4, generator=g)
    shared = torch.randn(n, 4, generator=g)
    X = torch.stack(
        [0.5 * mu[y] + rho**0.5 * shared + (1 - rho) ** 0.5 * torch.randn(n, 4, generator=g) for _ in range(S)]
    )
    return _standardise(X), y.numpy()


def test_the_penalty_pulls_a_gamma_one_mix_to_one_site_and_the_neutral_gamma_does_not():
    X, y = _equally_informative()
    l2 = 1.0
    fit1 = fit_mix(X, y, n_classes=2, l2=l2, normalise=False)  # the previous objective: one site (artefact)
    assert fit1.weights.max() > 0.99 and mix_spread(fit1.weights) < 1.05  # a vertex: softmax logits at infinity
    fitn = fit_mix(X, y, n_classes=2, l2=l2, normalise=True)  # scale-neutral gamma: spread over the sites
    assert fitn.weights.max() < 0.7 and mix_spread(fitn.weights) > 3
    assert fitn.gamma > 1  # the average is smaller than one site: gamma puts it back at unit scale
    # the spread mix is the better probe of the data: at the same scale it fits train better
    m1 = np.einsum("s,snf->nf", fit1.weights, X.double().numpy())
    mn = np.einsum("s,snf->nf", fitn.weights, X.double().numpy())
    ref = [LogisticRegression(C=10.0).fit(m / m.std(0), y).score(m / m.std(0), y) for m in (m1, mn)]
    assert ref[1] >= ref[0]


#: the scale-neutral mix of ``_equally_informative()`` at l2 = 1, solved in float64 to 1e-12 by
#: scipy's L-BFGS-B over the simplex from four starts (all ended here, objective 0.66611948801)
OPTIMUM = np.array([0.19703, 0.0, 0.08247, 0.61442, 0.03727, 0.06879])
#: the vertex a fresh clone's CI reported on a CPU with avx512_bf16 and AMX (issue 59)
AMX_VERTEX = np.array([4.5e-04, 2.7e-06, 1.1e-04, 0.99927, 6.8e-05, 1.1e-04])


def _warm(weights, F: int = 4, C: int = 2) -> tuple:
    return torch.tensor(np.log(weights), dtype=torch.float32), torch.zeros(F, C), torch.zeros(C)


def test_the_vertex_another_cpu_stopped_at_is_no_optimum_and_every_start_reaches_the_optimum():
    """The vertex that an AMX CPU reported has a higher objective than the spread optimum and a
    simplex gap that the softmax-logit gradient hid (it vanishes at a vertex); the fit from that
    vertex, from the uniform mix, from every vertex and from seeded random mixes ends at the float64
    optimum, as do fits on the same examples in other orders (float32 sums in other orders, as
    another CPU's kernels round)."""
    from depthscope.probes.mixing import _FlatSites, _ProjectedMix, simplex_gap

    X, y = _equally_informative()
    g = _ProjectedMix(_FlatSites(X), torch.as_tensor(y), 1.0, True, (torch.zeros(4, 2), torch.zeros(2)))
    f_vertex, gp, _ = g(torch.tensor(AMX_VERTEX, dtype=torch.float32))
    p = torch.tensor(AMX_VERTEX, dtype=torch.float32)
    assert float((p * (gp - (p * gp).sum())).abs().max()) < 1e-4  # the old test called this converged
    assert simplex_gap(AMX_VERTEX, gp.numpy()) > 1e-3  # but moving weight off site 3 lowers the objective
    fit = fit_mix(X, y, n_classes=2, l2=1.0, normalise=True)
    assert fit.converged and fit.objective < float(f_vertex) - 3e-4
    assert fit.objective == pytest.approx(0.66611948801, abs=2e-9)
    np.testing.assert_allclose(fit.weights, OPTIMUM, atol=2e-3)
    starts = [AMX_VERTEX, *np.clip(np.eye(6), 1e-6, None), *np.random.default_rng(5).dirichlet(np.ones(6), 3)]
    for w in starts:
        other = fit_mix(X, y, n_classes=2, l2=1.0, init=_warm(w / w.sum()))
        assert other.converged, w
        np.testing.assert_allclose(other.weights, OPTIMUM, atol=2e-3, err_msg=str(w))
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(X.shape[1])
        other = fit_mix(X[:, torch.from_numpy(perm)], y[perm], n_classes=2, l2=1.0)
        np.testing.assert_allclose(other.weights, OPTIMUM, atol=2e-3)


def test_an_end_flat_to_the_objectives_resolution_counts_as_converged_and_a_vertex_does_not(monkeypatch):
    """A GPU's float32 rounding left one fit's simplex gap at 1.1e-4, above the mark of 1e-4, at
    the CPU's optimum (objectives 4e-8 apart): the end passes as converged when no step along the
    gap's direction lowers the objective beyond its resolution. The AMX vertex fails that check,
    and a fit stopped after one iteration does not pass by it."""
    import depthscope.probes.mixing as mixing

    X, y = _equally_informative()
    g = mixing._ProjectedMix(mixing._FlatSites(X), torch.as_tensor(y), 1.0, True, (torch.zeros(4, 2), torch.zeros(2)))
    f_vertex, gp, _ = g(torch.tensor(AMX_VERTEX, dtype=torch.float32))
    assert not mixing._flat_end(g, AMX_VERTEX, gp.double().numpy(), float(f_vertex))
    monkeypatch.setattr(mixing, "MIX_GAP", 1e-12)  # a mark no float32 end reaches: only the flat check can pass
    fit = fit_mix(X, y, n_classes=2, l2=1.0, normalise=True)
    assert fit.converged and fit.grad_max > 1e-12
    assert fit.objective == pytest.approx(0.66611948801, abs=2e-9)
    monkeypatch.setattr(mixing, "MIX_MAX_ITERS", 1)
    assert not fit_mix(X, y, n_classes=2, l2=1.0, normalise=True).converged


def test_two_starts_that_tie_are_noted_and_the_first_start_is_kept():
    """Two copies of one site: every split of the weight between them is the same mix, so the
    starts end at different weights with the same objective; the fit keeps the first start's (the
    uniform mix's: the copies share equally) and says that E_s is not determined."""
    x, y = synthetic(300, S=3, D=6, C=3)
    X = _standardise(torch.from_numpy(x).permute(1, 0, 2).contiguous())
    X = torch.cat([X, X[2:]])  # site 3 is site 2 again
    fit = fit_mix(X, y, n_classes=3, l2=3e-2, starts=5)
    assert fit.converged and len(fit.optima) == 5
    assert fit.weights[2] == pytest.approx(fit.weights[3], abs=1e-6)
    assert "two scalar-mix optima" in fit.note
    once = fit_mix(X, y, n_classes=3, l2=3e-2, starts=1)
    assert once.note == "" and np.allclose(once.weights, fit.weights)
    plain = fit_mix(X[:3], y, n_classes=3, l2=3e-2, starts=3)
    assert plain.note == ""  # distinct sites: one optimum, whatever the start


def test_fold_refits_give_an_interval_and_fit_cumulative_keeps_them():
    x, y = synthetic(600, S=4, D=8, C=3)
    ftr, fte = features(x[:400]), None
    fte = features(x[400:], ftr)
    X, yr = ftr.resident, y[:400][ftr.order]
    fit = fit_mix(X, yr, n_classes=3, l2=1e-2)
    draws = mix_draws(X, yr, n_classes=3, l2=1e-2, folds=3, seed=0, init=fit.state)
    assert draws.shape == (3, 4) and np.allclose(draws.sum(1), 1)
    cum = fit_cumulative(ftr, y[:400], fte, y[400:], n_classes=3, n_eval_classes=3, l2=1e-2, mix_folds=2)
    np.testing.assert_allclose(cum.mix_weights, fit.weights, atol=1e-4)  # the same fit as above
    assert cum.mix_draws.shape == (2, 4)
    depths = [0, 0.5, 1.0, 1.5]
    lo, hi = cum.mix_range(depths)
    assert lo <= hi and np.isfinite([lo, hi]).all()
    assert lo == pytest.approx(expected_layer_mix(depths, cum.mix_draws).min())


def test_out_of_fold_in_runs_of_sites_equals_one_run(monkeypatch):
    """The out-of-fold refits fitted a few sites at a time (a small ``OOF_BYTES``: a fold's copy
    of one site at a time) give the same predictions as all sites at once: each site's probe is
    its own convex problem, and the runs start from the same full-train probes."""
    from depthscope.probes import mixing
    from depthscope.probes.config import ProbeConfig
    from depthscope.probes.solvers.classifiers import site_probe
    from depthscope.probes.solvers.training import train_kwargs, train_probe

    x, y = synthetic(400, S=4, D=8, C=3)
    f = features(x)
    cfg = ProbeConfig(l2=1e-2)
    p = site_probe(f, 3, cfg)
    train_probe(p, f, torch.as_tensor(y)[:, None], **train_kwargs(cfg))
    init = p.state_dict()
    whole = mixing.out_of_fold(f, y, n_classes=3, cfg=cfg, init=init)
    monkeypatch.setattr(mixing, "OOF_BYTES", 1.0)
    assert len(mixing._site_blocks(f, 200, cfg)) == 4
    runs = mixing.out_of_fold(f, y, n_classes=3, cfg=cfg, init=init)
    torch.testing.assert_close(runs, whole, atol=1e-5, rtol=1e-5)
