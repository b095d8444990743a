"""Probe fitting without a model: the batched probe against scikit-learn, metrics, the
Tenney summaries' arithmetic, and MDL on toys."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from depthscope.probes import (
    BatchedProbe,
    Features,
    accuracy,
    deltas,
    expected_layer_delta,
    expected_layer_delta_interval,
    expected_layer_mix,
    macro_f1,
    online_codelength,
    predict,
    train_probe,
)
from depthscope.probes.mdl import block_ends
from depthscope.probes.store.activations import SpanStore
from depthscope.probes.summaries import cumulative_summary


def synthetic(n, S=4, D=16, C=4, seed=0):
    """Sites of decreasing signal: site s carries the class in (S - s) / S of its scale."""
    centers = np.random.default_rng(123).normal(size=(C, D)) * 1.5
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    x = np.empty((n, S, D), dtype=np.float32)
    for s in range(S):
        x[:, s] = rng.normal(size=(n, D)) + centers[y] * (S - s) / S + 5.0 * s  # also a scale/offset per site
    return x, y


def store_of(x):
    n = len(x)
    return SpanStore(None, x, np.arange(n), np.ones(n, dtype=np.int64), list(range(x.shape[1])), "last", {})


def features(x, train=None, resident=True):
    f = Features(store_of(x), np.arange(len(x))[:, None])
    if train is None:
        f.fit_standardiser()
    else:
        f.standardise_like(train)
    if resident:
        assert f.make_resident()
    return f


def test_resident_features_are_feature_major_and_subsets_keep_it():
    """Resident features are the ``[S, N, F]`` view of a feature-major tensor (the examples
    innermost: both products of a linear probe's pass are faster); subsets and site selections
    keep that layout and hold exactly the standardised rows the store gives."""
    x, _ = synthetic(50, S=3, D=8)
    f = features(x)
    X = f.resident
    assert X.shape == (3, 50, 8) and X.stride(1) == 1 and X.transpose(1, 2).is_contiguous()
    ref = (torch.from_numpy(x).permute(1, 0, 2)[:, f.order] - f.mean[:, None]) / f.std[:, None]
    assert torch.equal(X, ref)
    idx = np.array([4, 0, 17, 33])
    sub = f.subset(idx)
    assert sorted(sub.order) == [0, 1, 2, 3]  # rows shuffled (hessian_rows samples a contiguous part)
    assert sub.resident.stride(1) == 1 and torch.equal(sub.resident, ref[:, np.argsort(f.order)[idx[sub.order]]])
    two = f.with_sites([0, 2])
    assert two.resident.stride(1) == 1 and torch.equal(two.resident, ref[[0, 2]])


@pytest.mark.parametrize("resident", [True, False])
def test_batched_linear_probe_matches_sklearn_per_site(resident):
    from sklearn.linear_model import LogisticRegression

    x, y = synthetic(3000)
    xt, yt = synthetic(1000, seed=1)
    ftr = features(x, resident=resident)
    fte = features(xt, ftr, resident=resident)
    l2 = 1e-3
    p = BatchedProbe(n_sites=4, d=16, n_spans=1, n_classes=4, l2=l2)
    log = train_probe(p, ftr, torch.from_numpy(y))
    assert log.solver == ("subspace" if resident else "adam") and log.all_converged and not log.hit_cap
    preds, _ = predict(p, fte)
    ours = accuracy(preds[:, :, 0], torch.from_numpy(yt)).numpy()
    mu, sd = ftr.mean.numpy(), ftr.std.numpy()
    for s in range(4):
        clf = LogisticRegression(C=1 / (2 * l2 * len(y)), max_iter=2000).fit((x[:, s] - mu[s]) / sd[s], y)
        ref = (clf.predict((xt[:, s] - mu[s]) / sd[s]) == yt).mean()
        assert abs(ours[s] - ref) <= 0.01, (s, ours[s], ref)
    assert ours[0] > ours[-1] + 0.1  # the sites really differ


@pytest.mark.parametrize("l2", [1e-4, 1e-3, 1e-2])
def test_converged_objective_matches_sklearn(l2):
    """The batched L-BFGS reaches the optimum of the regularised objective: per site, within 1e-3
    (relative) of scikit-learn's LogisticRegression (lbfgs, tight tolerance) with the same
    penalty (C = 1 / (2 l2 n)), evaluated by the same formula; one site near-separable (small
    objective), one noisy, one with correlated dimensions."""
    from sklearn.linear_model import LogisticRegression

    from depthscope.probes.solvers.training import objective

    x, y = synthetic(2000, S=3, D=24, C=5)
    x[:, 2] = x[:, 2] @ np.random.default_rng(7).normal(size=(24, 24)).astype(np.float32)  # correlated dims
    f = features(x)
    p = BatchedProbe(n_sites=3, d=24, n_spans=1, n_classes=5, l2=l2)
    log = train_probe(p, f, torch.from_numpy(y))
    assert log.all_converged and log.solver == "subspace"
    ours = objective(p, f, torch.from_numpy(y)).numpy()
    assert np.allclose(ours, log.objective, rtol=1e-6)
    X = f.resident.numpy()[:, np.argsort(f.order)]  # standardised, original example order
    for s in range(3):
        clf = LogisticRegression(C=1 / (2 * l2 * len(y)), tol=1e-10, max_iter=10000).fit(X[s], y)
        logp = clf.predict_log_proba(X[s])
        ref = -logp[np.arange(len(y)), y].mean() + l2 * (clf.coef_**2).sum()
        assert abs(ours[s] - ref) <= 1e-3 * ref, (s, ours[s], ref)


def _subspace_case():
    """Three sites, two heads (the task with a class absent from train, and random labels) with
    different penalties: the subspace solver's hard cases."""
    x, y = synthetic(1500, S=3, D=20, C=5)
    y = np.where(y == 4, 0, y)  # class 4 never occurs: its bias' optimum is -inf
    y2 = np.random.default_rng(3).integers(0, 5, len(y))
    return features(x), torch.from_numpy(np.stack([y, y2], 1)), [1e-3, 1e-2]


def test_subspace_solver_reaches_the_lbfgs_and_sklearn_optimum():
    """The subspace solver (the default for per-site linear probes) and the batched L-BFGS
    reach the same optimum per site and head, tightly; scikit-learn (which drops a class absent
    from train) agrees up to the absent class' share, which the solver leaves at
    ABSENT_TOL * gtol (its probability is not driven to 0: MDL code lengths stay finite)."""
    from sklearn.linear_model import LogisticRegression

    from depthscope.probes.solvers.subspace import ABSENT_TOL
    from depthscope.probes.solvers.training import log_probs, objective

    f, y, l2 = _subspace_case()
    tight = dict(tol=1e-9, gtol=1e-5, max_epochs=3000)
    fits = {}
    for solver in ("subspace", "lbfgs"):
        p = BatchedProbe(n_sites=3, d=20, n_spans=1, n_classes=5, n_heads=2, l2=l2)
        log = train_probe(p, f, y, solver=solver, **tight)
        assert log.solver == solver
        fits[solver] = (p, log)
    ps, ls = fits["subspace"]
    pl, ll = fits["lbfgs"]  # at gtol 1e-5 L-BFGS stalls on the absent class of a site: a reference only
    assert ls.all_converged and ls.epochs < ll.epochs  # and fewer passes over train
    f_sub, f_lb = objective(ps, f, y).numpy(), objective(pl, f, y).numpy()
    assert np.allclose(f_sub, f_lb, rtol=1e-6, atol=0), (f_sub, f_lb)
    assert np.allclose(ls.objective, objective(ps, f, y).numpy(), rtol=1e-6)
    p_absent = log_probs(ps, f)[:, :, 0, 4].exp().mean(1)  # [sites]: the absent class, head 0
    assert (p_absent <= ABSENT_TOL * 1e-5 * 1.01).all() and (p_absent > 1e-10).all(), p_absent
    X = f.resident.numpy()[:, np.argsort(f.order)]
    for s in range(3):
        for g in range(2):
            yg = y[:, g].numpy()
            clf = LogisticRegression(C=1 / (2 * l2[g] * len(yg)), tol=1e-10, max_iter=10000).fit(X[s], yg)
            logp = clf.predict_log_proba(X[s])
            ref = -logp[np.arange(len(yg)), np.searchsorted(clf.classes_, yg)].mean() + l2[g] * (clf.coef_**2).sum()
            W = ps.W.detach()[s].reshape(20, 2, 5)[:, g].double().numpy()
            b = ps.b.detach()[s, 0].reshape(2, 5)[g].double().numpy()
            z = X[s].astype(np.float64) @ W + b
            z -= z.max(1, keepdims=True)
            ours = -(z[np.arange(len(yg)), yg] - np.log(np.exp(z).sum(1))).mean() + l2[g] * (W**2).sum()
            assert abs(ours - ref) <= 1e-5 * ref + 1.01 * ABSENT_TOL * 1e-5, (s, g, ours, ref)


def test_subspace_solver_blocks_give_the_same_fit(monkeypatch):
    """Units solved in several blocks (a small state budget) fit exactly as in one block, and the
    progress bar counts passes over every unit: each block's pass is its share of one, so three
    one-unit blocks tick about a third of their summed passes, never more than the longest."""
    from depthscope.probes.solvers import subspace, training

    f, y, l2 = _subspace_case()
    out = []
    for budget in (subspace.STATE_BYTES, 1.0):
        monkeypatch.setattr(subspace, "STATE_BYTES", budget)
        assert len(subspace.unit_blocks(3, len(f), 20, 2, 5)) == (1 if budget > 1 else 3)
        p = BatchedProbe(n_sites=3, d=20, n_spans=1, n_classes=5, n_heads=2, l2=l2)
        ticks = []
        monkeypatch.setattr(training, "progress_bar", lambda *a, ticks=ticks, **k: _Bar(ticks))
        log = train_probe(p, f, y, progress=True)
        out.append((p.W.detach().clone(), p.b.detach().clone(), log.unit_epochs, len(ticks)))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5) and torch.allclose(out[0][1], out[1][1], atol=1e-5)
    assert (out[0][2] == out[1][2]).all()
    passes = np.asarray(out[1][2])
    assert out[0][3] == passes.max()  # one block: one tick per pass
    assert out[1][3] == int(passes.sum() / 3 + 1e-9) <= passes.max()


class _Bar:
    """A progress bar that records its updates."""

    def __init__(self, ticks: list):
        self.ticks = ticks

    def update(self, n=1):
        self.ticks.append(n)

    def close(self):
        pass


def test_solver_choice():
    """auto: the subspace solver for per-site linear probes, L-BFGS for scalar mixes, Adam for
    streamed features; an explicit subspace run leaves its mixes to L-BFGS; MLPs refuse both."""
    from depthscope.probes.solvers.training import pick_solver

    x, _ = synthetic(200, S=3)
    f, streamed = features(x), features(x, resident=False)
    site = BatchedProbe(n_sites=3, d=16, n_spans=1, n_classes=4)
    mix = BatchedProbe(n_sites=3, d=16, n_spans=1, n_classes=4, mix_mask=torch.ones(2, 3, dtype=torch.bool))
    mlp = BatchedProbe(n_sites=3, d=16, n_spans=1, n_classes=4, kind="mlp")
    assert [pick_solver(p, f) for p in (site, mix, mlp)] == ["subspace", "lbfgs", "adam"]
    assert pick_solver(site, streamed) == "adam"
    assert [pick_solver(p, f, "subspace") for p in (site, mix)] == ["subspace", "lbfgs"]
    assert pick_solver(site, f, "lbfgs") == "lbfgs"
    with pytest.raises(ValueError, match="per-site linear"):
        pick_solver(mlp, f, "subspace")
    with pytest.raises(ValueError, match="resident"):
        pick_solver(site, streamed, "subspace")


def test_max_epochs_is_a_cap_that_warns(caplog):
    x, y = synthetic(1000, S=2)
    f = features(x)
    p = BatchedProbe(n_sites=2, d=16, n_spans=1, n_classes=4, l2=1e-4)
    with caplog.at_level("WARNING", logger="depthscope.probes"):
        log = train_probe(p, f, torch.from_numpy(y), max_epochs=3)
    assert log.hit_cap and log.epochs == 3 and not log.all_converged
    assert "max_epochs=3" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="depthscope.probes"):
        log = train_probe(p, f, torch.from_numpy(y))
    assert log.all_converged and not log.hit_cap and log.epochs < 200 and caplog.text == ""


def test_bf16_features_agree_and_env_forces_a_type(monkeypatch):
    """bfloat16 features (chosen by the CPU-flag rule where bf16 is native) give the float32
    probe's predictions; DEPTHSCOPE_PROBE_DTYPE forces a type under "auto" and rejects others."""
    from depthscope.probes.solvers.cpu import compute_dtype

    x, y = synthetic(2000, S=3)
    xt, yt = synthetic(600, S=3, seed=1)
    accs = {}
    for dt in (torch.float32, torch.bfloat16):
        ftr = Features(store_of(x), np.arange(len(x))[:, None]).fit_standardiser()
        fte = Features(store_of(xt), np.arange(len(xt))[:, None]).standardise_like(ftr)
        assert ftr.make_resident(dtype=dt) and fte.make_resident(dtype=dt)
        assert ftr.resident.dtype == dt
        # standardised before rounding: means ~0, stds ~1 at every site
        assert ftr.resident.float().mean((1, 2)).abs().max() < 0.02
        p = BatchedProbe(n_sites=3, d=16, n_spans=1, n_classes=4, l2=1e-3)
        train_probe(p, ftr, torch.from_numpy(y))
        preds, _ = predict(p, fte)
        accs[dt] = accuracy(preds[:, :, 0], torch.from_numpy(yt)).numpy()
    assert np.abs(accs[torch.float32] - accs[torch.bfloat16]).max() <= 0.01, accs
    for name, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        monkeypatch.setenv("DEPTHSCOPE_PROBE_DTYPE", name)
        assert compute_dtype() == want
    monkeypatch.setenv("DEPTHSCOPE_PROBE_DTYPE", "float16")
    with pytest.raises(ValueError):
        compute_dtype()


def test_precision_rule_is_deterministic(monkeypatch):
    """ "auto" follows CPU flags, never a timing: bf16 only with native bf16 flags AND AVX512/AMX
    kernels; float32 on anything uncertain; explicit precisions and the env variable win."""
    from depthscope.probes.solvers import cpu
    from depthscope.probes.solvers.cpu import precision_rule, resolve_precision

    assert precision_rule({"avx2", "avx512_bf16"}, "AVX512")[0] == torch.bfloat16
    assert precision_rule({"amx_bf16", "amx_tile"}, "AMX")[0] == torch.bfloat16
    assert precision_rule({"avx2", "fma"}, "AVX2")[0] == torch.float32
    assert precision_rule({"avx512_bf16"}, "AVX2")[0] == torch.float32  # torch's kernels do not use it
    assert precision_rule(set(), "AVX512")[0] == torch.float32
    assert precision_rule(set(), "unknown")[0] == torch.float32
    monkeypatch.delenv("DEPTHSCOPE_PROBE_DTYPE", raising=False)
    here = precision_rule()[0]
    assert all(resolve_precision("auto") == here for _ in range(5))  # same answer every call
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(cpu, "torch_capability", lambda: "AVX512")
    assert resolve_precision("auto") == torch.bfloat16
    assert resolve_precision("float32") == torch.float32
    monkeypatch.setenv("DEPTHSCOPE_PROBE_DTYPE", "float32")
    assert resolve_precision("auto") == torch.float32 and resolve_precision("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_precision("half")


def test_cpu_flags_and_capability_can_be_stood_in_for(monkeypatch):
    """DEPTHSCOPE_CPU_FLAGS / DEPTHSCOPE_CPU_CAPABILITY replace /proc/cpuinfo and torch's
    capability for the rule (``pytest --fake-cpu amx`` sets them): an AMX CPU resolves "auto" to
    bfloat16, an AVX2 one to float32, and unset they are this machine's again."""
    from depthscope.probes.solvers import cpu

    monkeypatch.delenv("DEPTHSCOPE_PROBE_DTYPE", raising=False)
    monkeypatch.setenv("DEPTHSCOPE_CPU_FLAGS", "amx_bf16,amx_tile avx512_bf16")
    monkeypatch.setenv("DEPTHSCOPE_CPU_CAPABILITY", "AMX")
    assert cpu.cpu_flags() == {"amx_bf16", "amx_tile", "avx512_bf16"} and cpu.torch_capability() == "AMX"
    assert cpu.resolve_precision("auto") == torch.bfloat16
    monkeypatch.setenv("DEPTHSCOPE_CPU_FLAGS", "avx2 fma")
    monkeypatch.setenv("DEPTHSCOPE_CPU_CAPABILITY", "AVX2")
    assert cpu.resolve_precision("auto") == torch.float32
    monkeypatch.delenv("DEPTHSCOPE_CPU_FLAGS")
    monkeypatch.delenv("DEPTHSCOPE_CPU_CAPABILITY")
    assert cpu.cpu_flags() == cpu._proc_flags() and cpu.torch_capability() == str(
        torch.backends.cpu.get_cpu_capability()
    )


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_penalty_gradient_added_in_place_equals_autograd(kind):
    """The L2 gradient train_probe adds in place is the gradient of penalty()."""
    p = BatchedProbe(n_sites=3, d=8, n_spans=2, n_classes=4, n_heads=2, kind=kind, hidden=5, l2=[1e-3, 3e-2])
    with torch.no_grad():
        for w in p.parameters():
            w.normal_()
    p.penalty().backward()
    want = {n: w.grad.clone() for n, w in p.named_parameters() if w.grad is not None}
    for w in p.parameters():
        w.grad = torch.zeros_like(w)
    p.add_penalty_grad_()
    for n, g in want.items():
        assert torch.allclose(dict(p.named_parameters())[n].grad, g, rtol=1e-5, atol=1e-7), n


def test_heads_train_independently():
    """Heads (and units) are separate problems: trained together or apart, the same optimum."""
    x, y = synthetic(800, S=2)
    f = features(x)
    y2 = np.random.default_rng(5).integers(0, 4, len(y))
    from depthscope.probes.solvers.training import objective

    tight = dict(tol=1e-8, gtol=1e-5, max_epochs=2000)
    both = BatchedProbe(n_sites=2, d=16, n_spans=1, n_classes=4, n_heads=2, l2=[1e-3, 1e-2])
    train_probe(both, f, torch.from_numpy(np.stack([y, y2], 1)), **tight)
    one = BatchedProbe(n_sites=2, d=16, n_spans=1, n_classes=4, n_heads=1, l2=1e-3)
    train_probe(one, f, torch.from_numpy(y), **tight)
    head0 = BatchedProbe(n_sites=2, d=16, n_spans=1, n_classes=4, n_heads=1, l2=1e-3)
    with torch.no_grad():
        head0.W.copy_(both.W.reshape(2, 16, 2, 4)[:, :, 0])
        head0.b.copy_(both.b.reshape(2, 1, 2, 4)[:, :, 0])
    f_one, f_head0 = objective(one, f, torch.from_numpy(y)), objective(head0, f, torch.from_numpy(y))
    assert torch.allclose(f_head0, f_one, rtol=1e-4)
    assert torch.allclose(head0.W, one.W.detach(), atol=2e-2)


def test_mlp_probe_learns_xor():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2000, 1, 2)).astype(np.float32)
    y = ((a[:, 0, 0] > 0) ^ (a[:, 0, 1] > 0)).astype(np.int64)
    f = features(a)
    lin = BatchedProbe(n_sites=1, d=2, n_spans=1, n_classes=2, kind="linear")
    mlp = BatchedProbe(n_sites=1, d=2, n_spans=1, n_classes=2, kind="mlp", hidden=32, l2=1e-5)
    train_probe(lin, f, torch.from_numpy(y))
    train_probe(mlp, f, torch.from_numpy(y), max_epochs=60, batch_size=128)
    acc_lin = accuracy(predict(lin, f)[0][:, :, 0], torch.from_numpy(y))[0]
    acc_mlp = accuracy(predict(mlp, f)[0][:, :, 0], torch.from_numpy(y))[0]
    assert acc_lin < 0.7 and acc_mlp > 0.9


def test_macro_f1_matches_sklearn():
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 500)  # classes 5 = "unseen in train": never predicted
    preds = rng.integers(0, 5, (3, 500))
    preds[1] = np.where(rng.random(500) < 0.7, np.minimum(y, 4), preds[1])
    ours = macro_f1(torch.from_numpy(preds), torch.from_numpy(y), 6).numpy()
    for u in range(3):
        assert ours[u] == pytest.approx(f1_score(y, preds[u], average="macro"), abs=1e-6)
    assert accuracy(torch.from_numpy(preds), torch.from_numpy(y))[1] == pytest.approx((preds[1] == y).mean())


def test_expected_layer_arithmetic():
    depths = [0, 0.5, 1.0, 1.5, 2.0]
    scores = [0.50, 0.70, 0.70, 0.90, 0.85]
    assert np.allclose(deltas(scores), [0.5, 0.2, 0.0, 0.2, -0.05])
    # sum d*Delta over s>=1 = 0.5*0.2 + 1.5*0.2 + 2*(-0.05) = 0.3; sum Delta = 0.35
    assert expected_layer_delta(depths, scores) == pytest.approx(0.3 / 0.35)
    assert expected_layer_mix(depths, [0, 0, 0.5, 0.5, 0]) == pytest.approx(1.25)
    assert expected_layer_mix(depths, [0.2] * 5) == pytest.approx(1.0)
    assert np.isnan(expected_layer_delta(depths, [0.5] * 5))


def test_cumulative_mix_finds_the_informative_site():
    """Only site 2 of 4 carries the label: the prefix scores jump at s = 2, E_Delta = depth(2),
    and the all-sites mix puts most weight on site 2."""
    from depthscope.probes import fit_cumulative

    rng = np.random.default_rng(0)
    n, S, D = 3000, 4, 8
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, S, D)).astype(np.float32)
    x[:, 2, :3] += 3 * np.eye(3, dtype=np.float32)[y]
    ftr = features(x[:2000])
    fte = features(x[2000:], ftr)
    cum = fit_cumulative(ftr, y[:2000], fte, y[2000:], n_classes=3, n_eval_classes=3)
    assert cum.log.all_converged and cum.mix_log.all_converged
    assert np.allclose(cum.gamma, 1)  # no trainable scale: the converged objective has an optimum
    assert cum.accuracy[0] < 0.45 and cum.accuracy[1] < 0.45
    assert cum.accuracy[2] > 0.85 and cum.accuracy[3] > 0.85
    depths = [0, 0.5, 1.0, 1.5]
    assert expected_layer_delta(depths, cum.accuracy) == pytest.approx(1.0, abs=0.1)
    assert cum.mix_weights.argmax() == 2 and cum.mix_weights[2] > 0.5
    assert np.allclose(np.triu(cum.weights, 1), 0)  # P(s) reads sites 0..s only
    assert np.abs(cum.weights[2:, 2]).min() > 0.5  # every prefix from 2 on leans on site 2
    # the bootstrap interval: the jump at site 2 is clear, so it is tight around depth 1
    assert cum.correct.shape == (2, 4, 1000)  # the default 2 fold draws, each scored on test
    assert np.allclose(cum.correct.mean((0, 2)), cum.accuracy)
    lo, hi = expected_layer_delta_interval(depths, cum.correct)
    assert lo <= expected_layer_delta(depths, cum.accuracy) <= hi and 0.8 < lo and hi < 1.2
    # the soft score (E_Delta's): each draw's probability of the gold label, recomputed by hand
    assert cum.soft.shape == (2, 4, 1000) and cum.soft.dtype == np.float32
    assert ((cum.soft >= 0) & (cum.soft <= 1)).all()
    assert np.allclose(cum.score, cum.soft.mean((0, 2))) and np.allclose(cum.delta, np.diff(cum.score, prepend=0))
    assert (cum.soft_accuracy[:2] < 0.4).all() and (cum.soft_accuracy[2:] > 0.8).all()
    assert expected_layer_delta(depths, cum.score) == pytest.approx(1.0, abs=0.05)
    summ = cumulative_summary(depths, cum, seed=0)
    assert summ["expected_layer_delta"] == expected_layer_delta(depths, cum.soft_accuracy)
    assert summ["expected_layer_delta_hard"] == expected_layer_delta(depths, cum.accuracy)
    assert summ["total_delta"] == pytest.approx(cum.soft_accuracy[-1] - cum.soft_accuracy[0])
    for k in ("expected_layer_delta", "expected_layer_delta_hard"):
        assert summ[f"{k}_lo"] <= summ[k] <= summ[f"{k}_hi"]
    # the intervals name their n and method; E_s's is a range over the mix's refits
    assert summ["ci_n"] == 1000 and summ["ci_unit"] == "test examples" and summ["ci_note"] == ""
    assert (
        summ["ci_method"].startswith("two-level percentile bootstrap over test examples")
        and "2 fold" in summ["ci_method"]
    )
    k = 0 if cum.mix_draws is None else len(cum.mix_draws)
    assert summ["expected_layer_mix_ci_n"] == k and summ["expected_layer_mix_ci_unit"] == "fold refits"
    # nine test examples: the interval is withheld (NaN) and the note says why
    few = replace(cum, correct=cum.correct[:, :, :9], soft=cum.soft[:, :, :9])
    summ9 = cumulative_summary(depths, few, seed=0)
    assert np.isfinite(summ9["expected_layer_delta"]) and summ9["ci_n"] == 9
    assert all(np.isnan(summ9[c]) for c in ("expected_layer_delta_lo", "expected_layer_delta_hard_hi"))
    assert "9 test examples, fewer than 10" in summ9["ci_note"]


def test_gold_probability_against_softmax():
    """The soft score is softmax(logits)[y]; a test label the probe has no class for scores 0."""
    from depthscope.probes.mixing import gold_probability

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 4, generator=g) * 5
    y = torch.tensor([0, 3, 1, 2, 4])  # 4: unseen in train (no class)
    p = gold_probability(logits, y)
    ref = torch.softmax(logits.double(), -1)
    assert p.shape == (3, 5) and p.dtype == torch.float32
    for i, c in enumerate(y.tolist()[:4]):
        assert torch.allclose(p[:, i].double(), ref[:, i, c], atol=1e-7)
    assert (p[:, 4] == 0).all()


def test_out_of_fold_uses_the_configured_folds(monkeypatch):
    """``stack_folds`` sets how many fold probes predict train out of fold: each example is
    predicted by a probe that never saw it (its fold's), and fewer examples than folds is an
    input error, not an empty fold."""
    from depthscope.common.errors import InputError
    from depthscope.probes import ProbeConfig, mixing

    x, y = synthetic(300, S=2, D=8, C=3)
    f = features(x)
    seen = []
    real = mixing.train_probe

    def spy(p, feats, yy, **kw):
        seen.append(len(feats))
        return real(p, feats, yy, **kw)

    monkeypatch.setattr(mixing, "train_probe", spy)
    cfg = ProbeConfig(l2=1e-2, stack_folds=3)
    z = mixing.out_of_fold(f, y, n_classes=3, cfg=cfg)
    assert len(seen) == 3 and sum(seen) == 2 * 300  # three fold probes, each on two thirds of train
    assert z.shape == (2, 300, 3) and torch.isfinite(z).all()
    assert torch.allclose(z.exp().sum(-1), torch.ones(2, 300))
    fold = np.random.default_rng([cfg.seed, 1729, 0]).permutation(300) % 3
    for k in range(3):  # the fold probe that predicts fold k never trained on it: refit it and compare
        ftr = f.subset(np.flatnonzero(fold != k))
        p = mixing.site_probe(f, 3, cfg)
        real(p, ftr, torch.as_tensor(y[fold != k])[:, None], **mixing.train_kwargs(cfg))
        ho = np.flatnonzero(fold == k)
        assert torch.allclose(mixing.log_probs(p, f.subset(ho))[:, :, 0], z[:, torch.from_numpy(ho)], atol=1e-5)
    with pytest.raises(InputError, match="stack_folds=5"):
        mixing.out_of_fold(features(x[:4]), y[:4], n_classes=3, cfg=ProbeConfig(stack_folds=5))


def test_stack_l2_is_the_stacking_ridge(monkeypatch):
    """``ProbeConfig.stack_l2`` is the ridge every fold draw's stacking is solved with (not the
    module default), and a stronger ridge gives smaller stacking weights."""
    from depthscope.probes import ProbeConfig, mixing

    x, y = synthetic(400, S=3, D=8, C=3)
    ftr = features(x[:300])
    fte = features(x[300:], ftr)
    used = []
    real = mixing.stack

    def spy(z, yy, **kw):
        used.append(kw["l2"])
        return real(z, yy, **kw)

    monkeypatch.setattr(mixing, "stack", spy)
    norms = {}
    for ridge in (1e-3, 1.0):
        cfg = ProbeConfig(l2=1e-2, stack_l2=ridge, stack_draws=2, control=False)
        cum = mixing.fit_cumulative(ftr, y[:300], fte, y[300:], n_classes=3, n_eval_classes=3, config=cfg)
        assert cum.log.all_converged
        norms[ridge] = np.abs(cum.weights).sum()
    assert used == [1e-3, 1e-3, 1.0, 1.0]
    assert norms[1.0] < 0.5 * norms[1e-3]


def test_expected_layer_delta_interval_widens_with_noise():
    """Exact values on a hand-built case, and a wide interval when the gains are noise."""
    depths = [0, 1, 2]
    # every resample has acc(0) = 0, acc(1) = 0, acc(2) = 1: E_Delta = 2 exactly
    correct = np.array([[0] * 50, [0] * 50, [1] * 50], dtype=bool)
    assert expected_layer_delta_interval(depths, correct) == (2.0, 2.0)
    rng = np.random.default_rng(0)
    noisy = rng.random((3, 200)) < np.array([[0.5], [0.52], [0.53]])
    lo, hi = expected_layer_delta_interval(depths, noisy, seed=1)
    assert hi - lo > 1.0
    assert np.isnan(expected_layer_delta_interval(depths, correct[:, :0])[0])


def test_expected_layer_delta_interval_resamples_fold_draws():
    """With fold draws ``[R, S, N]``: identical draws give the one-draw interval exactly; draws
    that disagree widen it beyond the test-sample interval of their mean, and it covers each
    draw's own E_Delta."""
    depths = [0, 1, 2]
    rng = np.random.default_rng(0)
    one = rng.random((3, 400)) < np.array([[0.3], [0.6], [0.7]])
    same = expected_layer_delta_interval(depths, np.stack([one] * 5))
    assert same == pytest.approx(expected_layer_delta_interval(depths, one), rel=1e-6)  # float32 sums
    # draws differ in where the gain comes: site 1 (E = 1) or site 2 (E = 2)
    early = rng.random((3, 400)) < np.array([[0.3], [0.7], [0.7]])
    late = rng.random((3, 400)) < np.array([[0.3], [0.3], [0.7]])
    draws = np.stack([early, late] * 3)
    lo, hi = expected_layer_delta_interval(depths, draws)
    mean_only = expected_layer_delta_interval(depths, draws.mean(0))
    assert hi - lo > 1.5 * (mean_only[1] - mean_only[0])
    assert lo <= expected_layer_delta(depths, draws.mean((0, 2))) <= hi


def test_mdl_online_codelength_on_toys():
    assert block_ends(1000) == [1, 2, 4, 8, 16, 32, 62, 125, 250, 500, 1000]
    rng = np.random.default_rng(0)
    n = 2000
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, 2, 8)).astype(np.float32)
    x[:, 0, :4] += 4 * np.eye(4, dtype=np.float32)[y]  # site 0 separable, site 1 noise
    f = features(x)
    res = online_codelength(f, y, n_classes=4, l2=1e-3)
    assert res.uniform_bits == pytest.approx(n * 2.0)
    assert res.compression[0] > 5.0
    assert 0.85 < res.compression[1] < 1.05  # noise cannot be compressed (small overhead allowed)


def test_stacking_is_the_optimum_and_never_worse_with_more_sites():
    """The cumulative probes' stacking weights solve their convex problem (scipy's L-BFGS-B on
    one prefix reaches the same objective to 1e-6), and the train objective of P(s) never rises
    with s (a longer prefix can always give its new site weight 0)."""
    import torch
    from scipy.optimize import minimize

    from depthscope.probes.mixing import STACK_L2, stack

    rng = np.random.default_rng(1)
    S, n, C = 5, 400, 4
    y = rng.integers(0, C, n)
    z = torch.log_softmax(
        torch.from_numpy(rng.normal(size=(S, n, C))).float()
        + torch.linspace(0, 2, S)[:, None, None] * torch.nn.functional.one_hot(torch.from_numpy(y), C),
        -1,
    )
    w, b, log = stack(z, y)
    assert log.all_converged
    f = log.objective
    assert np.all(np.diff(f) <= 1e-6)

    u = 3
    zz = z[: u + 1].double().numpy()

    def obj(p):
        wv, bv = p[: u + 1], p[u + 1 :]
        logits = np.einsum("t,tnc->nc", wv, zz) + bv
        m = logits.max(1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(1))
        return float((lse - logits[np.arange(n), y]).mean() + STACK_L2 * (wv**2).sum())

    ref = minimize(obj, np.r_[np.eye(u + 1)[u], np.zeros(C)], method="L-BFGS-B", options={"ftol": 1e-14, "gtol": 1e-10})
    assert f[u] == pytest.approx(ref.fun, rel=1e-6, abs=1e-7)


def test_stacking_hessian_is_the_exact_hessian():
    """The Newton steps of the stacking use ``_stack_hessian``: it equals autograd's Hessian of
    the stacking objective for every prefix (masked sites: identity rows)."""
    import torch
    import torch.nn.functional as F

    from depthscope.probes.mixing import _stack_hessian

    g = torch.Generator().manual_seed(0)
    S, n, C, l2 = 3, 50, 4, 1e-2
    z = torch.log_softmax(torch.randn(S, n, C, generator=g, dtype=torch.float64), -1)
    y = torch.randint(0, C, (n,), generator=g)
    x = torch.randn(S, S + C, generator=g, dtype=torch.float64) * 0.5
    H = _stack_hessian(z, x, l2)
    for s in range(S):

        def f(v, s=s):
            w, b = v[: s + 1], v[S:]
            logits = torch.einsum("t,tnc->nc", w, z[: s + 1]) + b
            return F.cross_entropy(logits, y) + l2 * (w * w).sum()

        keep = list(range(s + 1)) + list(range(S, S + C))
        ref = torch.autograd.functional.hessian(f, x[s])[keep][:, keep]
        assert torch.allclose(H[s][keep][:, keep].double(), ref, atol=1e-5)
        masked = [t for t in range(S) if t > s]
        assert torch.equal(H[s][masked][:, masked], torch.eye(len(masked)))
    # the Newton loop asks only for the prefixes still going: the same rows
    some = torch.tensor([0, 2])
    assert torch.allclose(_stack_hessian(z, x, l2, units=some), H[some], atol=1e-6)
    # summed over chunks of examples (the last one short): the same Hessian
    assert torch.allclose(_stack_hessian(z, x, l2, chunk=7), H, atol=1e-6)


def test_stacking_objective_in_chunks_is_autograds():
    """The stacking objective sums its examples in chunks (bounded memory): with chunks of 7 of
    50 examples its values and gradients equal autograd's on the whole batch, for every
    prefix, and for a subset of active prefixes the others stay zero."""
    import torch
    import torch.nn.functional as F

    from depthscope.probes.mixing import _stack_objective

    g = torch.Generator().manual_seed(3)
    S, n, C, l2 = 4, 50, 3, 1e-2
    z = torch.log_softmax(torch.randn(S, n, C, generator=g), -1)
    y = torch.randint(0, C, (n,), generator=g)
    x = torch.randn(S, S + C, generator=g, dtype=torch.float64) * 0.5
    mask = torch.tril(torch.ones(S, S, dtype=torch.float64))
    f, grad = _stack_objective(z, y.numpy(), mask, l2, chunk=7)(x, torch.ones(S, dtype=torch.bool))
    for s in range(S):
        v = x[s].clone().requires_grad_(True)
        w = v[:S] * mask[s]
        ref = F.cross_entropy(torch.einsum("t,tnc->nc", w, z.double()) + v[S:], y) + l2 * (w * w).sum()
        (gref,) = torch.autograd.grad(ref, v)
        assert float(f[s]) == pytest.approx(ref.item(), rel=1e-12)
        assert torch.allclose(grad[s], gref * torch.cat([mask[s], torch.ones(C, dtype=torch.float64)]), atol=1e-12)
    active = torch.tensor([False, True, False, True])
    f2, g2 = _stack_objective(z, y.numpy(), mask, l2, chunk=7)(x, active)
    assert torch.allclose(f2[active], f[active], rtol=1e-14) and not f2[~active].any() and not g2[~active].any()


def _all_units(objective, *a, units=None, **k):
    return objective(*a, **k)


def _full_preconditioner(make, *a, **k):
    M = make(*a, **k)
    return lambda q, units=None: M(q)


def test_fitting_only_the_active_units_does_not_change_the_fit(monkeypatch):
    """L-BFGS evaluates only the units still going (and, in a line search, only those whose
    step is not yet accepted) and preconditions only the units still going; the fit equals the
    one that evaluates and preconditions every unit at every pass, and the per-unit pass counts
    differ between sites (so the skipping is exercised)."""
    from depthscope.probes.solvers import methods

    x, y = synthetic(1500, S=6, D=12)
    f = features(x)
    fits = []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(methods, "objective", functools.partial(_all_units, methods.objective))
            monkeypatch.setattr(
                methods, "preconditioner", functools.partial(_full_preconditioner, methods.preconditioner)
            )
        p = BatchedProbe(n_sites=6, d=12, n_spans=1, n_classes=4, l2=1e-3)
        log = train_probe(p, f, torch.from_numpy(y))
        fits.append((p.W.detach().clone(), log))
    (w1, l1), (w2, l2_) = fits
    assert l1.all_converged and l1.epochs == l2_.epochs
    assert np.array_equal(l1.unit_epochs, l2_.unit_epochs) and len(set(l1.unit_epochs.tolist())) > 1
    assert torch.allclose(w1, w2, atol=1e-6)


@pytest.mark.parametrize("peak, chosen", [(0.3, 0.3), (1e-5, 1e-4), (0.02, 0.03)])
def test_l2_choice_grows_the_grid_while_the_best_is_at_its_end(monkeypatch, peak, chosen):
    """choose_l2 starts from L2_GRID and, while the best held-out accuracy is at an end of the
    values tried, tries the next L2_LADDER value beyond it (stopping at the ladder's ends), each
    warm-started from that end's optimum; inside the grid nothing is added."""
    from depthscope.probes import L2_GRID, L2_LADDER, fitting
    from depthscope.probes.config import ProbeConfig

    calls = []

    def fake_path(td, cfg, train, y_train, values, start, progress):
        calls.append((list(values), start))
        return {v: {"at": v} for v in values}, 1

    def fake_accuracy(td, cfg, held, y_held, states):
        return {v: 0.9 - 0.05 * abs(np.log10(st["at"]) - np.log10(peak)) for v, st in states.items()}

    monkeypatch.setattr(fitting, "_path", fake_path)
    monkeypatch.setattr(fitting, "_heldout_accuracy", fake_accuracy)
    held = range(10**9)  # so large a held-out set that the one-SE rule picks the best itself
    monkeypatch.setattr(
        fitting, "_splits", lambda td, cfg, rb: ("dev", [lambda: fitting.HeldOut(None, None, lambda: None, held)])
    )
    choice = fitting.choose_l2(None, ProbeConfig())
    assert choice.l2 == chosen and choice.on == "dev" and choice.not_converged == len(calls)
    assert calls[0] == (sorted(L2_GRID, reverse=True), None)
    tried = sorted(choice.heldout)
    assert set(L2_GRID) <= set(tried) <= set(L2_LADDER)
    if chosen in L2_GRID and chosen not in (min(L2_GRID), max(L2_GRID)):
        assert len(calls) == 1  # an interior best: the grid alone
    else:
        for values, start in calls[1:]:  # one step beyond an end, from that end's optimum
            assert len(values) == 1 and start is not None
        assert chosen == min(tried) or chosen < max(tried)  # the peak is bracketed unless at the ladder's end


def test_l2_choice_takes_the_strongest_penalty_within_one_standard_error():
    """pick_l2 (values ascending): the strongest penalty whose held-out accuracy is within one
    standard error of the best; with an unresolvable difference the stronger one wins."""
    from depthscope.probes.fitting import pick_l2

    acc = [0.80, 0.805, 0.795]  # se at 0.805: 0.0125 with 1000 held-out examples, 0.0004 with 1e6
    assert pick_l2(acc, 1000) == 2
    assert pick_l2(acc, 10**6) == 1
    assert pick_l2(acc) == 1 and pick_l2([0.8, 0.8, 0.7]) == 1  # no n: the best, ties to the stronger


def test_streamed_predictions_come_in_bounded_batches(monkeypatch):
    """Predicting on features read from the store takes batches of at most EVAL_BYTES (a batch
    of edge features at every site would be hundreds of MB), and gives the resident features'
    predictions and log-probabilities."""
    import torch

    from depthscope.probes.config import ProbeConfig
    from depthscope.probes.solvers import training
    from depthscope.probes.solvers.classifiers import site_probe

    x, y = synthetic(300, S=3, D=8)
    xt, _ = synthetic(90, S=3, D=8, seed=1)
    tr = features(x)
    p = site_probe(tr, 4, ProbeConfig(), l2=1e-2)
    training.train_probe(p, tr, torch.from_numpy(y)[:, None])
    resident, streamed = features(xt, tr), features(xt, tr, resident=False)
    monkeypatch.setattr(training, "EVAL_BYTES", 7 * 3 * 8 * 4)  # 7 rows of 3 sites x 8 floats
    assert training.eval_rows(streamed, 1024) == 7 and training.eval_rows(resident, 1024) == 1024
    sizes = []
    batches = streamed.batches
    monkeypatch.setattr(streamed, "batches", lambda b, rng=None: sizes.append(b) or batches(b, rng))
    lp, lp_res = training.log_probs(p, streamed), training.log_probs(p, resident)
    pred, pred_res = training.predict(p, streamed)[0], training.predict(p, resident)[0]
    assert sizes == [7, 7]
    assert torch.allclose(lp, lp_res, atol=1e-5) and torch.equal(pred, pred_res)
    assert not lp.requires_grad and not lp_res.requires_grad  # predictions carry no autograd graph


def test_penalty_search_counts_probes_left_at_the_cap():
    """The penalty search's fits report their probes that stopped at the epoch cap (the summary's
    l2_search_not_converged): all of them at a 2-pass cap, none at the default cap."""
    from types import SimpleNamespace

    from depthscope.probes import fitting
    from depthscope.probes.config import ProbeConfig

    x, y = synthetic(600, S=3, D=8)
    xt, yt = synthetic(200, S=3, D=8, seed=1)
    tr = features(x)
    ho = features(xt, tr)
    td = SimpleNamespace(task="toy", n_classes=4)
    for cap, stuck in ((2, 3 * 2), (ProbeConfig().max_epochs, 0)):
        cfg = ProbeConfig(max_epochs=cap)
        states, n = fitting._path(td, cfg, tr, y, [0.1, 0.01], None, False)
        acc = fitting._heldout_accuracy(td, cfg, ho, yt, states)
        assert n == stuck and set(acc) == set(states) == {0.1, 0.01}
        assert all(0.25 < a <= 1 for a in acc.values())  # above chance (4 classes) on held-out data


def test_subspace_newton_system_is_the_exact_hessian():
    """The subspace solver's Newton step uses ``newton_system``: it equals autograd's Hessian of
    the objective restricted to the per-class subspace (biases, and one coefficient per class
    column of each direction), penalties included."""
    import torch
    import torch.nn.functional as F

    from depthscope.probes.solvers.subspace import newton_system

    g = torch.Generator().manual_seed(0)
    B, J, C, n, D = 2, 2, 4, 30, 5
    l2 = torch.tensor([0.01, 0.3], dtype=torch.float64)
    Z0 = torch.randn(B, C, n, generator=g)
    VZ = torch.randn(B, J, C, n, generator=g)
    VW = torch.randn(B, C, J, D, generator=g, dtype=torch.float64)
    W = torch.randn(B, C, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (n,), generator=g)
    A = torch.cat([torch.ones(B, 1, C, n), VZ], 1).transpose(1, 2).contiguous()  # [B, C, 1 + J, n]
    H = newton_system(torch.softmax(Z0, 1), A, VW @ VW.transpose(2, 3), l2)
    assert H.shape == (B, (1 + J) * C, (1 + J) * C) and H.dtype == torch.float64
    for b in range(B):

        def f(theta, b=b):
            beta, alpha = theta.view(C, 1 + J)[:, 0], theta.view(C, 1 + J)[:, 1:].T  # [C], [J, C]
            Z = Z0[b].double() + beta[:, None] + (alpha[..., None] * VZ[b].double()).sum(0)
            Wt = W[b] + (alpha.T[..., None] * VW[b]).sum(1)
            return F.cross_entropy(Z.T, y) + l2[b] * (Wt * Wt).sum()

        ref = torch.autograd.functional.hessian(f, torch.zeros((1 + J) * C, dtype=torch.float64))
        assert torch.allclose(H[b], ref, atol=1e-5), (H[b] - ref).abs().max()
    work = torch.full((B, C, 1 + J, n), float("nan"))  # the caller's workspace: overwritten, same system
    assert torch.equal(newton_system(torch.softmax(Z0, 1), A, VW @ VW.transpose(2, 3), l2, work=work), H)


@pytest.mark.parametrize("skip", [True, False])
def test_subspace_gradient_and_direction_image_with_one_product_column_less(skip, monkeypatch):
    """The solver's products skip each head's last class (its column is minus the sum of the
    others') on large problems: the gradient equals autograd's either way, and the new
    direction's logit image equals ``X d``, with two heads of different penalties and weights
    that do not sum to zero."""
    import torch.nn.functional as F

    from depthscope.probes.solvers import subspace
    from depthscope.probes.solvers.subspace import _Block

    monkeypatch.setattr(subspace, "SKIP_LAST_MIN", 0 if skip else 10**9)

    g = torch.Generator().manual_seed(0)
    u, n, D, G, C = 2, 40, 6, 2, 5
    X = torch.randn(u, D, n, generator=g).transpose(1, 2)  # feature-major, as resident features
    y = torch.randint(0, C, (n, G), generator=g)
    W, b = torch.randn(u, D, G * C, generator=g), torch.randn(u, 1, G * C, generator=g)
    l2 = torch.tensor([0.01, 0.3])
    blk = _Block(X, y, W.clone(), b.clone(), l2, C, 2, 1e-4)
    assert blk.k == (C - 1 if skip else C)
    blk.gradient(slice(0, u))
    blk.direction(slice(0, u))
    Wd = W.double().requires_grad_(True)
    Z = (X.double() @ Wd + b.double()).view(u, n, G, C)
    f = sum(F.cross_entropy(Z[k, :, h], y[:, h]) for k in range(u) for h in range(G))
    f = f + (l2.double().repeat_interleave(C) * Wd.pow(2).sum(1)).sum()
    (gref,) = torch.autograd.grad(f, Wd)
    assert torch.allclose(blk.gW.double(), gref, atol=1e-5), (blk.gW - gref).abs().max()
    img = (X.double() @ -blk.gW.double()).view(u, n, G, C).permute(0, 2, 3, 1)  # [u, G, C, n]
    assert torch.allclose(blk.A[:, :, :, 1].double(), img, atol=1e-4), (blk.A[:, :, :, 1] - img).abs().max()


def test_hessian_rows_cycle_through_equal_parts():
    """The Newton system's rows: all of them below ``2 HESSIAN_ROWS``; above, contiguous parts
    that cover every row once per cycle (the last one takes the remainder)."""
    from depthscope.probes.solvers.subspace import HESSIAN_ROWS, hessian_rows

    assert hessian_rows(2 * HESSIAN_ROWS - 1, 5) == slice(0, 2 * HESSIAN_ROWS - 1)
    n = 3 * HESSIAN_ROWS + 7
    parts = [hessian_rows(n, c) for c in range(3)]
    assert [p.stop - p.start for p in parts] == [n // 3, n // 3, n - 2 * (n // 3)]
    assert parts[0].start == 0 and parts[2].stop == n and all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert hessian_rows(n, 3) == parts[0]


def test_per_site_probes_warm_started_from_the_penalty_search_reach_the_cold_optimum():
    """fit_sites started from the penalty search's probes (at 16 of 20 sites, the others from the
    nearest) reaches the optimum of a cold two-head fit (labels and control labels), and a
    warm-started probe of the labels alone needs fewer passes than a cold one."""
    from types import SimpleNamespace

    from depthscope.probes import fitting
    from depthscope.probes.config import ProbeConfig
    from depthscope.probes.solvers.classifiers import site_probe
    from depthscope.probes.solvers.training import objective

    x, y = synthetic(1200, S=20, D=12)
    xt, yt = synthetic(400, S=20, D=12, seed=1)
    tr = features(x)
    te = features(xt, tr)
    ctrl = {"train": np.random.default_rng(5).integers(0, 4, len(y)), "test": np.zeros(len(yt), dtype=np.int64)}
    td = SimpleNamespace(
        task="toy", n_classes=4, feats={"train": tr, "test": te}, y={"train": y, "test": yt}, ctrl=ctrl
    )
    choice = fitting.choose_l2(td, ProbeConfig())
    assert choice.start is not None and choice.start["W"].shape[0] == 16
    tight = dict(tol=1e-9, gtol=1e-5, max_epochs=2000)
    cfg = ProbeConfig(l2=choice.l2, **tight)
    warm = fitting.fit_sites(td, cfg, choice.l2, start=choice.start)
    heads = torch.from_numpy(np.stack([y, ctrl["train"]], 1))
    cold = BatchedProbe(n_sites=20, d=12, n_spans=1, n_classes=4, n_heads=2, l2=choice.l2)
    train_probe(cold, tr, heads, solver="subspace", **tight)
    assert warm.log.all_converged
    ref = objective(cold, tr, heads).numpy()
    assert np.allclose(warm.log.objective, ref, rtol=1e-6), (warm.log.objective, ref)
    W = warm.state["W"]
    assert torch.allclose(W, cold.W.detach()[:, :, :4], atol=1e-3 * float(W.abs().max()))
    pred, _ = predict(cold, te)
    assert (warm.test == pred[:, :, 0]).float().mean() > 0.995
    assert (warm.control_test == pred[:, :, 1]).float().mean() > 0.99
    passes = []
    for start in (None, choice.start):
        p = site_probe(tr, 4, cfg, l2=choice.l2)
        assert fitting.warm_start(p, start) == (start is not None)
        passes.append(train_probe(p, tr, torch.from_numpy(y)[:, None], **tight).unit_epochs.sum())
    assert passes[1] < passes[0], passes


def test_streamed_test_features_predict_as_resident_ones_and_a_released_store_reads_back(tmp_path):
    """Test features read from the store batch by batch (encode_task's ``stream``) give the
    log-probabilities the resident copy gives; a store whose pages were released reads the
    same rows again."""
    from depthscope.probes.solvers.training import log_probs

    x, y = synthetic(800, S=3, D=8)
    xt, _ = synthetic(300, S=3, D=8, seed=1)
    path = tmp_path / "feats.bin"
    xt.tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=xt.shape)
    tr = features(x)
    p = BatchedProbe(n_sites=3, d=8, n_spans=1, n_classes=4)
    train_probe(p, tr, torch.from_numpy(y)[:, None])
    streamed = Features(store_of(mm), np.arange(len(xt))[:, None]).standardise_like(tr)
    assert streamed.resident is None
    resident = features(xt, tr)
    a, b = log_probs(p, streamed), log_probs(p, resident)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    streamed.store.release()
    assert np.array_equal(np.asarray(mm[:50]), xt[:50])
    assert torch.allclose(log_probs(p, streamed), b, atol=1e-5)
