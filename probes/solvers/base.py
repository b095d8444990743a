"""The one interface every probe solver implements: a fitting problem in, a training log out.

=============================  ==================================================================
``TrainSettings``              how a probe is trained (solver, tolerances, the pass cap, Adam's
                               step size, batch and step floor, seed): one object, not a list
``Problem``                    what a solver fits: the probe, its features, labels ``[N, G]``,
                               the settings and a per-pass callback (progress)
``TrainLog``                   what a solver reports: passes, convergence and objective per unit
``Solver``                     the interface: ``fits(probe, feats)`` (may ``solver="auto"`` pick
                               it), ``resolve(probe)`` (the solver an explicit request runs) and
                               ``fit(problem) -> TrainLog``
=============================  ==================================================================

The solvers themselves (:mod:`depthscope.probes.solvers.methods`) are small interchangeable
classes behind this interface; :func:`~depthscope.probes.solvers.training.pick_solver` chooses one
from a table and :func:`~depthscope.probes.solvers.training.train_probe` runs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from depthscope.probes.config import ProbeConfig

_DEFAULTS = ProbeConfig()


@dataclass(frozen=True)
class TrainSettings:
    """How a probe is trained; the defaults are :class:`~depthscope.probes.config.ProbeConfig`'s.
    ``max_epochs`` caps the passes over train (a cap that warns, not a schedule); ``tol`` and
    ``gtol`` are the stopping rule's; ``batch_size``, ``lr``, ``min_steps`` and ``seed`` are the
    Adam solver's (minibatches, step size, step floor, shuffling)."""

    max_epochs: int = _DEFAULTS.max_epochs
    tol: float = _DEFAULTS.tol
    gtol: float = _DEFAULTS.gtol
    solver: str = _DEFAULTS.solver
    batch_size: int | None = _DEFAULTS.batch_size
    lr: float = _DEFAULTS.lr
    min_steps: int = _DEFAULTS.min_steps
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: ProbeConfig) -> TrainSettings:
        """The training settings of ``cfg``."""
        return cls(
            max_epochs=cfg.max_epochs,
            tol=cfg.tol,
            gtol=cfg.gtol,
            solver=cfg.solver,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            min_steps=cfg.min_steps,
            seed=cfg.seed,
        )


@dataclass
class Problem:
    """One fit: ``probe`` (a :class:`~depthscope.probes.solvers.classifiers.BatchedProbe`, fitted in
    place), ``feats`` (its :class:`~depthscope.probes.store.features.Features`), labels ``y [N, G]``
    (long, one column per head), the ``settings`` and ``on_pass`` (called after each pass over
    train, or None)."""

    probe: object
    feats: object
    y: torch.Tensor
    settings: TrainSettings
    on_pass: Callable[[], None] | None = None

    def tick(self) -> None:
        """Report one pass over train."""
        if self.on_pass is not None:
            self.on_pass()


@dataclass
class TrainLog:
    """What a training run did: ``solver``; ``epochs`` (passes over train); ``converged [U]``
    (bool per unit); ``objective [U]`` (final regularised objective per unit); ``grad_max [U]``
    (largest gradient entry, full-batch solvers; NaN for Adam); ``hit_cap`` (stopped by
    ``max_epochs`` with some unit not converged); ``history`` (summed objective per pass);
    ``unit_epochs [U]`` (the passes each unit took; ``epochs`` for every unit with Adam);
    ``note``: what the solver found that the numbers do not show (e.g. two scalar-mix optima
    within tolerance), else empty."""

    solver: str
    epochs: int
    converged: np.ndarray
    objective: np.ndarray
    grad_max: np.ndarray
    hit_cap: bool
    history: list = field(default_factory=list)
    unit_epochs: np.ndarray | None = None
    note: str = ""

    @classmethod
    def from_solved(cls, solver: str, sol, max_epochs: int, objective=None) -> TrainLog:
        """The log of a full-batch run (a :class:`~depthscope.probes.solvers.lbfgs.Solved`);
        ``objective`` replaces the solver's own values."""
        conv = sol.converged.numpy()
        return cls(
            solver,
            sol.evals,
            conv,
            (sol.f if objective is None else objective).numpy(),
            sol.grad_max.numpy(),
            hit_cap=bool(not conv.all() and sol.evals >= max_epochs),
            history=sol.history,
            unit_epochs=sol.unit_evals.numpy(),
        )

    @property
    def all_converged(self) -> bool:
        return bool(np.all(self.converged))


def per_site(probe) -> bool:
    """Whether ``probe`` is one linear classifier per site (no scalar mix, no attention pooling):
    the problems the subspace solver fits."""
    return probe.kind == "linear" and probe.mix_mask is None and not probe.attn_pool


class Solver(ABC):
    """A way to fit a probe to the optimum of its objective. ``name`` is the
    :class:`~depthscope.probes.config.ProbeConfig` ``solver`` value; ``needs_resident``: it reads the
    whole training set each pass, so the features must be held in memory."""

    name: ClassVar[str]
    needs_resident: ClassVar[bool] = False

    @classmethod
    def fits(cls, probe, feats) -> bool:
        """Whether ``solver="auto"`` may choose this solver for ``probe`` over ``feats``."""
        return True

    @classmethod
    def resolve(cls, probe) -> str:
        """The solver an explicit request for this one runs on ``probe`` (itself by default);
        raises ValueError for a probe it cannot fit."""
        return cls.name

    @abstractmethod
    def fit(self, problem: Problem) -> TrainLog:
        """Fit ``problem.probe`` in place; its log."""
