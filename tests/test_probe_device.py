"""The probe solvers and the scalar mix follow the features' device: they allocate where the
features are (whatever default device is set outside), resident features and their subsets stay
on the device they were made on, and ``ProbeConfig.device`` is checked before any work. On a
machine with a CUDA GPU the CUDA tests fit the same probes and mixes there and on the CPU."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from depthscope.hooks.devices import DeviceError
from depthscope.probes import BatchedProbe, Features, ProbeConfig, train_probe
from depthscope.probes.solvers.base import TrainSettings
from depthscope.probes.solvers.subspace import fit_softmax
from depthscope.probes.store.activations import SpanStore

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")


def _problem(n=600, S=3, D=12, C=4, G=2):
    """Features ``[S, n, D]`` (float32, the class in their mean), labels ``[n, G]``, zero
    weights and biases, penalties ``[G]``."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, C, (n, G))
    centers = rng.normal(size=(C, D))
    X = torch.from_numpy((rng.normal(size=(S, n, D)) + centers[y[:, 0]]).astype(np.float32))
    W, b = torch.zeros(S, D, G * C), torch.zeros(S, 1, G * C)
    return X, torch.from_numpy(y), W, b, torch.tensor([1e-3, 1e-2])


def _features(n=200, S=4, D=8):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, S, D)).astype(np.float32) + np.arange(S, dtype=np.float32)[None, :, None]
    store = SpanStore(None, x, np.arange(n), np.ones(n, dtype=np.int64), list(range(S)), "last", {})
    f = Features(store, np.arange(n)[:, None])
    return f.fit_standardiser()


def test_fit_softmax_allocates_on_the_features_device_whatever_the_default():
    """Under an outer ``torch.device("meta")`` context the solver's state still lands on the
    features' device (the CPU here): the fit is bit-identical to one without that context."""
    settings = TrainSettings(max_epochs=40, tol=1e-7, gtol=1e-5)
    X, y, W0, b0, l2 = _problem()
    fits = []
    for outer in (None, "meta"):
        W, b = W0.clone(), b0.clone()
        if outer is None:
            sol = fit_softmax(X, y, W, b, l2, settings)
        else:
            with torch.device(outer):
                sol = fit_softmax(X, y, W, b, l2, settings)
        assert sol.f.device.type == "cpu" and sol.converged.device.type == "cpu"
        fits.append((W, b, sol))
    (W1, b1, s1), (W2, b2, s2) = fits
    assert torch.equal(W1, W2) and torch.equal(b1, b2) and torch.equal(s1.f, s2.f)
    assert torch.equal(s1.unit_evals, s2.unit_evals) and s1.history == s2.history
    assert bool(W1.abs().sum() > 0)  # it did fit


def test_fit_softmax_refuses_weights_off_the_features_device():
    X, y, W, b, l2 = _problem(n=50)
    with pytest.raises(ValueError, match="features' device"):
        fit_softmax(X, y, W.to("meta"), b, l2, TrainSettings(max_epochs=2))


def test_resident_features_subsets_and_sites_keep_their_device():
    """``make_resident(device=)`` puts the features there once; subsets and site selections
    (views and gathers, index tensors moved to the features' device) stay there. The meta device
    stands in for a GPU (shapes only); on the CPU ``device="cpu"`` is the default's tensor."""
    cpu, same = _features(), _features()
    assert cpu.make_resident() and same.make_resident(device="cpu")
    assert torch.equal(cpu.resident, same.resident) and cpu.resident.stride() == same.resident.stride()
    meta = _features()
    assert meta.make_resident(device="meta")
    assert meta.resident.device.type == "meta" and meta.resident.shape == cpu.resident.shape
    assert meta.resident.stride() == cpu.resident.stride()  # feature-major there too
    idx = np.arange(0, 200, 3)
    for f in (
        meta.subset(idx),
        meta.with_sites([0, 2]),
        meta.with_sites([0, 1, 3]),
        meta.with_sites([1, 3]).subset(idx),
    ):
        assert f.resident.device.type == "meta", f.resident.device
    # the CPU's subsets are unchanged by the device handling: the rows the store gives
    sub = cpu.subset(idx)
    rows = cpu.resident[:, np.argsort(cpu.order)][:, idx[sub.order]]
    assert torch.equal(sub.resident, rows)
    _, (x, _m) = next(iter(meta.batches(64)))
    assert x.device.type == "meta"


def test_features_too_large_for_the_device_are_a_clear_error(monkeypatch):
    """Features that would not fit the device's free memory (with the solvers' copies) are
    refused before any copy, naming the sizes and the way out; the CPU is not checked."""
    import depthscope.hooks.devices as devices

    monkeypatch.setattr(devices, "free_bytes", lambda device: 10_000)
    f = _features(n=400)
    with pytest.raises(DeviceError, match=r"--probe-device meta: .* GiB .* free; use --probe-device cpu"):
        f.make_resident(device="meta")
    assert f.resident is None
    assert _features(n=400).make_resident(device="cpu")


def test_probe_device_setting_is_checked_before_any_work():
    assert ProbeConfig().device == "cpu" and ProbeConfig().validate().device == "cpu"
    assert ProbeConfig(device="auto").validate().device == "auto"
    with pytest.raises(DeviceError, match="--probe-device mps"):  # no MPS here, or float64 there
        ProbeConfig(device="mps").validate()
    with pytest.raises(DeviceError, match="--probe-device tpu0: unknown device"):
        ProbeConfig(device="tpu0").validate()
    if torch.cuda.is_available():
        return
    for name in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match=f"--probe-device {name}: torch sees no CUDA GPU.*--probe-device cpu"):
            ProbeConfig(device=name).validate()
    from depthscope.analyses.commands.probe import job_config
    from depthscope.probes import run_probes

    with pytest.raises(DeviceError, match="--probe-device"):  # the command line's config, before the model loads
        job_config({"probe_device": "cuda"})
    with pytest.raises(DeviceError, match="--probe-device"):  # run_probes: before any data is read
        run_probes(None, "upos", "no-such-train.conllu", "no-such-test.conllu", device="cuda")


def test_probe_device_refuses_devices_without_float64(monkeypatch):
    from depthscope.hooks import devices
    from depthscope.probes.config import probe_device

    monkeypatch.setattr(devices, "resolve_device", lambda name: torch.device("mps"))  # as on a Mac with MPS
    with pytest.raises(DeviceError, match="--probe-device mps: the probe solvers run on cpu or cuda"):
        probe_device("mps")


def test_probe_device_is_a_probe_command_option():
    import typer

    from depthscope.analyses.cli import app

    params = {p.name: p for p in typer.main.get_command(app).commands["probe"].params}
    assert params["probe_device"].opts == ["--probe-device"] and params["probe_device"].default == "cpu"
    assert params["device"].default == "cpu"  # the model's device: a separate option


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("solver", ["subspace", "lbfgs"])
def test_probes_fit_on_a_gpu_as_on_the_cpu(solver):
    """Features resident on the GPU: the probe is fitted there and comes back to the CPU with the
    CPU fit's weights and objective (float32 products in another order: to a tolerance)."""
    from depthscope.probes.solvers.training import objective, predict

    fits = {}
    for device in ("cpu", "cuda"):
        f = _features(n=400)
        assert f.make_resident(device=device)
        assert f.resident.device.type == device
        y = torch.from_numpy(np.random.default_rng(2).integers(0, 3, (400, 1)))
        p = BatchedProbe(n_sites=4, d=8, n_spans=1, n_classes=3, n_heads=1, l2=[1e-2])
        log = train_probe(p, f, y, solver=solver, tol=1e-9, gtol=1e-4, max_epochs=500)
        assert p.W.device.type == "cpu" and log.all_converged
        fits[device] = (p.W.detach().clone(), objective(p, f, y), predict(p, f)[0])
    (Wc, fc, pc), (Wg, fg, pg) = fits["cpu"], fits["cuda"]
    # both stop within gtol of the optimum (the two CPU solvers' weights differ by 3e-4 here)
    assert torch.allclose(Wc, Wg, atol=3e-3), (Wc - Wg).abs().max()
    assert torch.allclose(fc, fg, rtol=1e-5) and fc.device.type == fg.device.type == "cpu"
    assert (pc == pg).float().mean() > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mlp_probe_trains_on_a_gpu_as_on_the_cpu():
    """An MLP probe (the Adam solver) over features on the GPU trains there, batches sliced on the
    card, and comes back to the CPU with about the CPU run's objective and predictions (the same
    seed and batches; float32 sums in another order)."""
    from depthscope.probes.solvers.training import objective, predict

    fits = {}
    for device in ("cpu", "cuda"):
        f = _features(n=400)
        assert f.make_resident(device=device)
        y = torch.from_numpy(np.random.default_rng(2).integers(0, 3, (400, 1)))
        p = BatchedProbe(n_sites=4, d=8, n_spans=1, n_classes=3, kind="mlp", hidden=16, l2=[1e-3])
        train_probe(p, f, y, solver="adam", max_epochs=60)
        assert all(q.device.type == "cpu" for q in p.parameters())  # back on the CPU after the fit
        fits[device] = (objective(p, f, y), predict(p, f)[0])
    (fc, pc), (fg, pg) = fits["cpu"], fits["cuda"]
    assert torch.allclose(fc, fg, rtol=1e-2), (fc, fg)
    assert (pc == pg).float().mean() > 0.95


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_run_probes_on_a_gpu_matches_the_cpu(tiny_factory, tmp_path):
    """The whole probe run (the penalty search on some sites, per-site probes, out-of-fold
    refits, cumulative scoring and the scalar mix with its fold refits) with ``device="cuda"``
    gives the CPU run's scores up to the solvers' tolerance."""
    from depthscope.probes import run_probes

    m = tiny_factory("llama", n_layers=2, d_model=32)
    train, test = os.path.join(UD, "ewt_tiny_train.conllu"), os.path.join(UD, "ewt_tiny_test.conllu")
    cfg = ProbeConfig(max_epochs=100, mix_folds=2)
    runs = {}
    for device in ("cpu", "cuda"):
        c = replace(cfg, device=device)
        runs[device] = run_probes(m, "upos", train, test, config=c, store_dir=str(tmp_path), progress=False)
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert cpu.info["probe_device"] == "cpu" and gpu.info["probe_device"].startswith("cuda")
    assert np.allclose(cpu.by_site["accuracy"], gpu.by_site["accuracy"], atol=0.02)
    assert (cpu.summary["l2"] == gpu.summary["l2"]).all()
    assert np.allclose(cpu.summary["expected_layer_mix"], gpu.summary["expected_layer_mix"], atol=0.05)


def test_scalar_mix_runs_on_the_features_device_whatever_the_default():
    """The scalar mix computes where its features are (on a GPU for features held there): every
    buffer it makes names that device, so under an outer ``torch.device("meta")`` context a fit
    over CPU features is bit-identical to one without it, for dense features and span rows."""
    from depthscope.probes.mixing import fit_mix, mix_draws
    from depthscope.probes.store.span_rows import SpanRows

    X, y, *_ = _problem(n=300, S=4, D=10)
    rows = SpanRows(X.transpose(1, 2).contiguous(), torch.stack([torch.arange(300), torch.arange(300).flip(0)]))
    for feats, labels in ((X, y[:, 0]), (rows, y[:, 0])):
        fits = []
        for outer in (None, "meta"):
            if outer is None:
                fits.append(fit_mix(feats, labels.numpy(), n_classes=4, l2=1e-2, starts=1))
            else:
                with torch.device(outer):
                    fits.append(fit_mix(feats, labels.numpy(), n_classes=4, l2=1e-2, starts=1))
        plain, under_meta = fits
        assert np.array_equal(plain.weights, under_meta.weights) and plain.objective == under_meta.objective
        assert all(t.device.type == "cpu" for t in under_meta.state)
        assert plain.iterations > 1  # it did fit
        kw = dict(n_classes=4, l2=1e-2, folds=2, seed=0, init=plain.state)  # the refits without each fold
        draws = mix_draws(feats, labels.numpy(), **kw)
        with torch.device("meta"):
            assert np.array_equal(mix_draws(feats, labels.numpy(), **kw), draws)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scalar_mix_fits_on_a_gpu_as_on_the_cpu():
    """The scalar mix over features held on the GPU (dense, and span rows) fits there, no copy to
    the CPU, with the CPU fit's weights and objective up to float32 sums in another order."""
    from depthscope.probes.mixing import fit_mix
    from depthscope.probes.store.span_rows import SpanRows

    X, y, *_ = _problem(n=300, S=4, D=10)
    idx = torch.stack([torch.arange(300), torch.arange(300).flip(0)])
    for make in (lambda d: X.to(d), lambda d: SpanRows(X.transpose(1, 2).contiguous(), idx).to(d)):
        cpu, gpu = (fit_mix(make(d), y[:, 0].numpy(), n_classes=4, l2=1e-2) for d in ("cpu", "cuda"))
        assert gpu.state[0].device.type == "cuda" and cpu.converged and gpu.converged
        assert np.allclose(cpu.weights, gpu.weights, atol=1e-3), np.abs(cpu.weights - gpu.weights).max()
        assert abs(cpu.objective - gpu.objective) <= 1e-5 * abs(cpu.objective)
