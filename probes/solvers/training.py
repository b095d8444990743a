"""Fitting and applying a BatchedProbe: training to the optimum of its objective, and batched prediction.

================================  =============================================================
``train_probe(probe, feats, y)``  fit to convergence (``max_epochs`` a cap that warns); returns a
                                  :class:`TrainLog`
``pick_solver(probe, feats)``     the solver a probe is fitted with (``SOLVERS``, ``AUTO``)
``predict(probe, feats, y)``      predicted classes ``[U, N, G]`` (and code lengths given ``y``)
``log_probs(probe, feats)``       log-probabilities of every class ``[U, N, G, C]``
``eval_rows(feats, batch_size)``  rows per prediction batch (bounded bytes for streamed features)
``objective(probe, feats, y)``    the regularised objective per unit ``[U]`` (mean cross-entropy
                                  summed over heads + the L2 term), full batch
``auto_batch(n, epochs)``         the minibatch size of the Adam solver when none is given
``train_kwargs(config)``          the training settings of a ProbeConfig, as train_probe's keywords
================================  =============================================================

Solvers (:mod:`depthscope.probes.solvers.methods`, one class each behind
:class:`~depthscope.probes.solvers.base.Solver`): ``subspace`` (per-site linear probes over resident
features), ``lbfgs`` (scalar mixes over resident features; per-site probes on request) and
``adam`` (MLP probes, attention pooling, streamed features). ``solver="auto"`` takes the first
of ``AUTO`` that fits the probe and its features.

A run that stops at the cap before every unit has converged logs a warning and says so in its
:class:`TrainLog` (the probe tables carry it as ``converged`` / ``epochs``). Because the loss is
a sum of per-unit, per-head losses, training units and heads together equals training them
apart. Defaults are those of :class:`~depthscope.probes.config.ProbeConfig`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace

import numpy as np
import torch

from depthscope.common.progress import progress_bar
from depthscope.common.threads import threads_for
from depthscope.probes.config import ProbeConfig
from depthscope.probes.solvers.base import Problem, Solver, TrainLog, TrainSettings
from depthscope.probes.solvers.classifiers import BatchedProbe
from depthscope.probes.solvers.cpu import step_work
from depthscope.probes.solvers.methods import AdamSolver, LbfgsSolver, SubspaceSolver, auto_batch
from depthscope.probes.solvers.objective import label_matrix, objective, on_features_device
from depthscope.probes.store.features import Features
from depthscope.probes.store.span_rows import DENSE_BYTES, SpanRows

__all__ = [
    "AUTO",
    "SOLVERS",
    "TrainLog",
    "TrainSettings",
    "auto_batch",
    "fit_probe",
    "log_probs",
    "objective",
    "pick_solver",
    "predict",
    "train_kwargs",
    "train_probe",
]

log = logging.getLogger("depthscope.probes")

#: the solvers by their ProbeConfig ``solver`` name
SOLVERS: dict[str, type[Solver]] = {s.name: s for s in (SubspaceSolver, LbfgsSolver, AdamSolver)}
#: ``solver="auto"``: the first of these whose ``fits`` accepts the probe and its features
AUTO = ("subspace", "lbfgs", "adam")
#: bytes of one float32 copy of a streamed prediction batch (:func:`eval_rows`)
EVAL_BYTES = 64 * 2**20


def train_kwargs(cfg: ProbeConfig) -> dict:
    """The settings ``train_probe``-based building blocks take, from ``cfg``."""
    return asdict(TrainSettings.from_config(cfg))


def pick_solver(probe: BatchedProbe, feats: Features, solver: str = "auto") -> str:
    """``subspace`` for per-site linear probes over resident features, ``lbfgs`` for linear
    scalar mixes over resident features, ``adam`` otherwise (``solver`` other than ``auto`` is
    taken as given where it applies: the full-batch solvers need resident features; ``subspace``
    fits per-site linear probes and leaves scalar mixes to ``lbfgs``)."""
    if solver == "auto":
        return next(name for name in AUTO if SOLVERS[name].fits(probe, feats))
    chosen = SOLVERS.get(solver)
    if chosen is None:
        raise ValueError(f"solver must be auto or one of {tuple(SOLVERS)}, got {solver!r}")
    if chosen.needs_resident and feats.resident is None:
        raise ValueError(f"the {solver} solver needs resident features (Features.make_resident)")
    return chosen.resolve(probe)


def train_probe(
    probe: BatchedProbe,
    feats: Features,
    y: torch.Tensor,
    settings: TrainSettings | None = None,
    *,
    progress: bool = False,
    desc: str = "probe",
    **overrides,
) -> TrainLog:
    """Fit ``probe`` on ``feats`` with labels ``y [N, G]`` (class indices) to convergence;
    see the module docstring. ``settings`` (:class:`TrainSettings`: ``max_epochs``, ``tol``,
    ``gtol``, ``solver``, ``batch_size``, ``lr``, ``min_steps``, ``seed``; default
    ``ProbeConfig``'s) with any of its fields overridden by keyword, e.g.
    ``train_probe(p, f, y, solver="lbfgs", max_epochs=50)``. Returns a :class:`TrainLog`; warns
    when ``max_epochs`` stops it."""
    settings = replace(settings or TrainSettings(), **overrides)
    return fit_probe(probe, feats, y, settings, progress=progress, desc=desc)


def fit_probe(
    probe: BatchedProbe, feats: Features, y, settings: TrainSettings, *, progress: bool = False, desc: str = "probe"
) -> TrainLog:
    """:func:`train_probe` with its settings in one :class:`TrainSettings`."""
    if len(feats) == 0:
        raise ValueError("no training examples")
    name = pick_solver(probe, feats, settings.solver)
    bar = progress_bar(settings.max_epochs, desc=desc, unit="pass") if progress else None
    problem = Problem(probe, feats, label_matrix(y), settings, None if bar is None else lambda: bar.update(1))
    probe.train()
    out = SOLVERS[name]().fit(problem)
    if bar is not None:
        bar.close()
    probe.eval()
    if out.hit_cap:
        log.warning(
            "%s: %d of %d probes had not converged when max_epochs=%d stopped training (%s); raise max_epochs",
            desc,
            int((~out.converged).sum()),
            len(out.converged),
            settings.max_epochs,
            name,
        )
    return out


def eval_rows(feats: Features, batch_size: int) -> int:
    """Rows per batch when predicting: ``batch_size``, or for features read from the store (not
    resident) as many as fit :data:`EVAL_BYTES` (a streamed batch is gathered, standardised and
    pooled, about three float32 copies of ``rows x spans x sites x d``; for an edge task at 61
    sites, 1024 rows would be 0.9 GB). Predictions do not depend on the batch size."""
    if isinstance(feats.resident, SpanRows):  # each batch is a dense copy of its examples
        return min(batch_size, feats.resident.rows_within(DENSE_BYTES))
    if feats.resident is not None:
        return batch_size
    row = 4 * feats.n_spans * feats.max_len * feats.n_sites * feats.d
    return max(1, min(batch_size, int(EVAL_BYTES // max(row, 1))))


@torch.no_grad()
def log_probs(probe: BatchedProbe, feats: Features, *, batch_size: int = 1024) -> torch.Tensor:
    """Log-probabilities ``[U, N, G, C]`` of every class, examples in ``feats``' order (on the
    CPU; computed where the features are)."""
    probe.eval()
    batch_size = eval_rows(feats, batch_size)
    out = torch.empty(probe.U, len(feats), probe.G, probe.C)
    with on_features_device(probe, feats), threads_for(step_work(probe, feats, batch_size)):
        for idx, (x, m) in feats.batches(batch_size):
            out[:, torch.from_numpy(np.asarray(idx, dtype=np.int64))] = torch.log_softmax(probe(x, m), -1).cpu()
    return out


@torch.no_grad()
def predict(probe: BatchedProbe, feats: Features, y: torch.Tensor | None = None, *, batch_size: int = 1024):
    """Predicted classes ``[U, N, G]`` and, with labels ``y [N, G]`` (indices < C), the
    code length ``-log2 p(y)`` of each example ``[U, N, G]`` (else None)."""
    probe.eval()
    batch_size = eval_rows(feats, batch_size)
    n = len(feats)
    preds = torch.empty(probe.U, n, probe.G, dtype=torch.long)
    bits = torch.empty(probe.U, n, probe.G) if y is not None else None
    if y is not None:
        y = label_matrix(y)
    with on_features_device(probe, feats), threads_for(step_work(probe, feats, batch_size)):
        _predict_loop(probe, feats, y, batch_size, preds, bits)
    return preds, bits


def _predict_loop(probe, feats, y, batch_size, preds, bits) -> None:
    """Fill ``preds`` (and ``bits``, given ``y``) batch by batch."""
    for idx, (x, m) in feats.batches(batch_size):
        ti = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        logits = probe(x, m).cpu()  # [U, B, G, C]: small beside the batch's features
        preds[:, ti] = logits.argmax(-1)
        if y is not None:
            logp = torch.log_softmax(logits, -1)
            t = y[ti].unsqueeze(0).expand(logits.shape[0], -1, -1)
            bits[:, ti] = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1) / math.log(2)
