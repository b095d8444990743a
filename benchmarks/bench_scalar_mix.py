"""Is the one-hot scalar mix (E_s) a real optimum or the penalty's artefact? On the bundled UD
EWT sample (train -> test) with the default model, per task: the scalar mix fitted four ways and
its E_s, the spread of its weights (``exp(entropy)`` in sites) and the mix probe's test accuracy.

===================  =========================================================================
``solver``           depthscope's previous mix: trained jointly with its probe by the probe
                     solvers, ``gamma = 1``, L2 on the probe's weights (today's ``depthscope run``)
``gamma1``           the same objective by :func:`~depthscope.probes.mixing.fit_mix`
                     (``normalise=False``): checks that the optimum, not the solver, is one-hot
``normalised``       :func:`~depthscope.probes.mixing.fit_mix`: gamma keeps the mix at unit scale
                     (the new default), with the E_s range of the fold refits
                     (:func:`~depthscope.probes.mixing.mix_draws`)
``jiant``            Tenney's recipe, written out here: AllenNLP/jiant ``ScalarMix`` (softmax
                     weights from zeros, trainable ``gamma`` from 1), dropout on the mixed
                     features, Adam, minibatches of 32, no weight penalty, early stopping on a
                     dev split (a fifth of train), one row per seed
===================  =========================================================================

    python -m benchmarks.bench_scalar_mix [--tasks upos,deprel,feats:Number] [--seeds 0,1,2]
        [--methods solver,gamma1,normalised,jiant]

The penalty is the task's (``l2="auto"``, as the main job chooses it). Features are the main
job's (standardised per site and dimension). Prints one row per task and method.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from depthscope.hooks import load_model
from depthscope.hooks.sites import site_frame
from depthscope.probes import ProbeConfig, prepare_task, sample_data
from depthscope.probes.fitting import choose_l2
from depthscope.probes.mixing import _penalised_mix, expected_layer_mix, fit_mix, mix_draws, mix_spread
from depthscope.probes.store.span_rows import dense

METHODS = ("solver", "gamma1", "normalised", "jiant")


def _accuracy(weights, gamma, state, X, y) -> float:
    """Test accuracy of a mix probe ``(a, W, b)`` with fixed ``weights`` and ``gamma``."""
    _, W, b = state
    S, N, F_ = X.shape
    m = (torch.as_tensor(weights, dtype=torch.float32) @ X.transpose(1, 2).reshape(S, F_ * N).float()).view(F_, N)
    return float(((m.T * gamma @ W + b).argmax(-1).numpy() == y).mean())


def jiant_mix(X, y, Xte, yte, *, n_classes: int, seed: int, dropout: float = 0.2, lr: float = 1e-3, patience: int = 5):
    """Tenney's scalar mix trained as jiant does (see the module docstring): ``(weights, gamma, test
    accuracy, epochs)``; the dev split is a seeded fifth of train, the best dev-loss epoch is kept."""
    g = torch.Generator().manual_seed(seed)
    S, N, F_ = X.shape
    perm = torch.randperm(N, generator=g)
    dev, tr = perm[: N // 5], perm[N // 5 :]
    a, gamma = torch.zeros(S, requires_grad=True), torch.ones((), requires_grad=True)
    lin = torch.nn.Linear(F_, n_classes)
    opt = torch.optim.Adam([a, gamma, *lin.parameters()], lr=lr)
    yt = torch.as_tensor(y)

    def logits(idx, train: bool, XX=X):
        m = gamma * torch.einsum("s,snf->nf", torch.softmax(a, 0), XX[:, idx].float())
        return lin(torch.nn.functional.dropout(m, dropout, train))

    best, best_state, bad = float("inf"), None, 0
    for epoch in range(1, 201):  # noqa: B007  (the epoch reached is returned)
        for i in range(0, len(tr), 32):
            idx = tr[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(logits(idx, True), yt[idx]).backward()
            opt.step()
        tr = tr[torch.randperm(len(tr), generator=g)]
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(logits(dev, False), yt[dev]))
        if loss < best - 1e-4:
            best, bad = loss, 0
            best_state = (
                a.detach().clone(),
                gamma.detach().clone(),
                {k: v.clone() for k, v in lin.state_dict().items()},
            )
        else:
            bad += 1
            if bad >= patience:
                break
    a.data, gamma.data = best_state[0], best_state[1]
    lin.load_state_dict(best_state[2])
    with torch.no_grad():
        acc = float((logits(torch.arange(Xte.shape[1]), False, Xte).argmax(-1).numpy() == yte).mean())
    return torch.softmax(a.detach(), 0).double().numpy(), float(gamma.detach()), acc, epoch


def _row(task, method, depths, w, acc, seconds, extra=""):
    top = int(np.argmax(w))
    print(
        f"{task:14s} {method:11s} E_s {expected_layer_mix(depths, w):6.2f}  spread {mix_spread(w):5.2f} sites  "
        f"max weight {w.max():.3f} at site {top:2d}  test acc {acc:.3f}  {seconds:6.1f} s  {extra}",
        flush=True,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="upos,deprel,feats:Number")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=",".join(METHODS), help="a comma-separated subset of " + ", ".join(METHODS))
    args = ap.parse_args(argv)
    methods = set(args.methods.split(","))
    if methods - set(METHODS):
        ap.error(f"unknown method(s) {sorted(methods - set(METHODS))}; choose from {', '.join(METHODS)}")
    torch.manual_seed(0)
    model, data, cfg = load_model(), sample_data(), ProbeConfig()
    depths = site_frame(range(model.n_sites), model.n_layers)["depth"].to_numpy()
    for task in args.tasks.split(","):
        td = prepare_task(model, task, data["ewt_train"], data["ewt_test"], progress=False)
        l2 = choose_l2(td, cfg).l2
        X, Xte = td.feats["train"].resident, td.feats["test"].resident
        print(f"{task}: {X.shape[1]} train, {Xte.shape[1]} test examples, {X.shape[0]} sites, l2 {l2:g}", flush=True)
        _fit_methods(task, td, l2, depths, methods, [int(x) for x in args.seeds.split(",")])


def _fit_methods(task, td, l2, depths, methods, seeds) -> None:
    """One task's rows: each of ``methods`` fitted on the task's features."""
    tr, te = td.feats["train"], td.feats["test"]
    X, y = tr.resident, td.y["train"][tr.order]  # span rows for an edge task: the mix reads them as the job does
    Xte, yte = dense(te.resident), td.y["test"][te.order]
    if "solver" in methods:
        run_cfg = ProbeConfig(l2=l2)
        t = time.perf_counter()
        w, _ = _penalised_mix(tr, td.y["train"], n_classes=td.n_classes, cfg=run_cfg, progress=False, desc="mix")
        _row(task, "solver", depths, w, float("nan"), time.perf_counter() - t)
    for normalise in [n for n, m in ((False, "gamma1"), (True, "normalised")) if m in methods]:
        t = time.perf_counter()
        fit = fit_mix(X, y, n_classes=td.n_classes, l2=l2, normalise=normalise)
        secs = time.perf_counter() - t
        extra = f"gamma {fit.gamma:.2f} obj {fit.objective:.4f} conv {fit.converged} iters {fit.iterations}"
        if normalise:
            t = time.perf_counter()
            draws = mix_draws(X, y, n_classes=td.n_classes, l2=l2, folds=2, seed=0, init=fit.state)
            e = expected_layer_mix(depths, draws)
            extra += f"  fold refits E_s {e.round(2).tolist()} ({time.perf_counter() - t:.1f} s)"
        acc = _accuracy(fit.weights, fit.gamma, fit.state, Xte, yte)
        _row(task, "normalised" if normalise else "gamma1", depths, fit.weights, acc, secs, extra)
    for seed in seeds if "jiant" in methods else ():
        t = time.perf_counter()
        w, gamma, acc, epochs = jiant_mix(dense(X), y, Xte, yte, n_classes=td.n_classes, seed=seed)
        _row(task, f"jiant s{seed}", depths, w, acc, time.perf_counter() - t, f"gamma {gamma:.2f} epochs {epochs}")


if __name__ == "__main__":
    main()
