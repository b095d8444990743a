"""Tenney et al. (2019)'s two summaries: scalar mixing weights and cumulative scoring.

Scalar mix: a probe reads ``gamma * sum_s softmax(a)_s x_s`` over all sites and is trained
jointly with the weights; the *expected layer* of the mix is ``E_s = sum_s depth(s) * s_s``.

Cumulative scoring: probe ``P(s)`` reads a scalar mix of sites ``0..s``;
``Delta(s) = score(P(s)) - score(P(s-1))`` is what site ``s`` adds, and the *expected layer*
of the gains is ``E_Delta = sum_{s>=1} depth(s) * Delta(s) / sum_{s>=1} Delta(s)``.

Both are fitted in ONE batched training, to convergence: the units of a :class:`BatchedProbe` are the
``S`` prefix mixes (a lower-triangular ``[S, S]`` mask on the mixing logits); the last unit
reads every site, so its weights are the scalar mix that gives ``E_s``. Depth is in block
units (embed 0, ``l.attn`` l + 0.5, ``l.mlp`` l + 1), so the numbers compare with Tenney's
layer numbers; relative depth = E / n_layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .classifiers import BatchedProbe, numeric_l2
from .config import ProbeConfig, override
from .features import Features
from .metrics import accuracy, macro_f1
from .training import predict, train_probe


def deltas(scores) -> np.ndarray:
    """``Delta(s) = score(s) - score(s-1)``, with ``Delta(0) = score(0)`` (along the first axis:
    ``scores`` is ``[S]`` or ``[S, k]``, k score profiles side by side)."""
    s = np.asarray(scores, dtype=np.float64)
    return np.diff(s, axis=0, prepend=np.zeros((1,) + s.shape[1:]))


def expected_layer_delta(depths: Sequence[float], scores):
    """Tenney's ``E_Delta``: the Delta-weighted mean depth over sites ``s >= 1`` (NaN when
    the gains sum to zero). ``scores [S]`` gives a float; ``scores [S, k]`` an array of k."""
    d = np.asarray(depths, dtype=np.float64)[1:]
    g = deltas(scores)[1:]
    if len(g) == 0:
        return float("nan")
    tot = g.sum(0)
    ok = np.abs(tot) >= 1e-12
    e = np.where(ok, (d.reshape((-1,) + (1,) * (g.ndim - 1)) * g).sum(0) / np.where(ok, tot, 1.0), np.nan)
    return float(e) if g.ndim == 1 else e


def expected_layer_mix(depths: Sequence[float], weights: Sequence[float]) -> float:
    """``E_s = sum depth * s`` for softmax mixing weights ``s`` (renormalised)."""
    w = np.asarray(weights, dtype=np.float64)
    return float((np.asarray(depths, dtype=np.float64) * w).sum() / w.sum())


def expected_layer_delta_interval(
    depths: Sequence[float], correct, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> tuple:
    """A bootstrap interval for ``E_Delta`` over the test examples: ``correct [S, N]`` says
    whether prefix probe ``P(s)`` got example ``n`` right; each resample reweights the
    examples (Poisson(1) weights, all prefixes at once as one matrix product) and recomputes
    the cumulative accuracies and ``E_Delta``. Returns ``(low, high)``; NaN when undefined.

    It measures how much ``E_Delta`` depends on which test examples were drawn, not the
    variation from retraining: when the total gain ``sum Delta`` is small against the noise
    of the individual ``Delta(s)``, the interval is wide and ``E_Delta`` should not be read
    as a depth."""
    c = torch.as_tensor(np.asarray(correct), dtype=torch.float32)  # [S, N]
    S, N = c.shape
    if N == 0 or S < 2:
        return float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    vals = []
    for a in range(0, n_boot, 250):
        k = min(250, n_boot - a)
        w = torch.poisson(torch.ones(k, N), generator=g)  # [k, N]
        acc = (c @ w.T) / w.sum(1).clamp_min(1)  # [S, k] cumulative accuracies per resample
        vals.append(expected_layer_delta(depths, acc.double().numpy()))
    v = np.concatenate(vals)
    v = v[np.isfinite(v)]
    if len(v) < n_boot // 2:
        return float("nan"), float("nan")
    q = (1 - level) / 2
    return float(np.quantile(v, q)), float(np.quantile(v, 1 - q))


@dataclass
class CumulativeFit:
    accuracy: np.ndarray  # [S] test accuracy of P(s)
    macro_f1: np.ndarray  # [S]
    weights: np.ndarray  # [S, S] mixing weights of P(s) (row s: sites 0..s)
    gamma: np.ndarray  # [S]
    correct: np.ndarray = None  # [S, N] bool: P(s) right on test example n (for intervals)
    log: object = None  # the TrainLog of the fit (convergence per prefix)

    @property
    def delta(self) -> np.ndarray:
        return deltas(self.accuracy)

    @property
    def mix_weights(self) -> np.ndarray:
        """The all-sites scalar mix (the last prefix)."""
        return self.weights[-1]


def fit_cumulative(
    train: Features,
    y_train,
    test: Features,
    y_test,
    *,
    n_classes: int,
    n_eval_classes: int,
    config: ProbeConfig | None = None,
    progress: bool = False,
    desc: str = "cumulative",
    **overrides,
) -> CumulativeFit:
    """All prefix mixes ``P(0) .. P(S-1)`` trained together; scored on ``test``. ``config``
    (None: the defaults) sets kind, l2, solver, tolerances, the
    epoch cap, Adam's settings, hidden units and seed;
    ``overrides`` any of its fields by name."""
    (cfg,) = override([config or ProbeConfig()], overrides)
    S = train.n_sites
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool))
    probe = BatchedProbe(
        n_sites=S,
        d=train.d,
        n_spans=train.n_spans,
        n_classes=n_classes,
        n_heads=1,
        kind=cfg.probe,
        hidden=cfg.hidden,
        mix_mask=mask,
        attn_pool=train.tokens,
        l2=numeric_l2(cfg.l2),
        seed=cfg.seed,
    )
    log = train_probe(
        probe,
        train,
        torch.as_tensor(y_train)[:, None],
        max_epochs=cfg.max_epochs,
        tol=cfg.tol,
        gtol=cfg.gtol,
        solver=cfg.solver,
        min_steps=cfg.min_steps,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        progress=progress,
        desc=desc,
    )
    preds, _ = predict(probe, test)
    yt = torch.as_tensor(y_test)
    acc = accuracy(preds[:, :, 0], yt).numpy()
    f1 = macro_f1(preds[:, :, 0], yt, n_eval_classes).numpy()
    with torch.no_grad():
        w = probe.mix_weights().numpy()
        gamma = probe.gamma.detach().numpy()
    correct = (preds[:, :, 0] == yt[None]).numpy()
    return CumulativeFit(
        acc.astype(np.float64), f1.astype(np.float64), w.astype(np.float64), gamma.astype(np.float64), correct, log
    )
