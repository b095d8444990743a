"""The three probe solvers, small interchangeable classes behind :class:`~.base.Solver`.

==================  ===============================================================================
``SubspaceSolver``  per-site linear probes over resident features: full batch, one product each
                    way per pass and an exact small Newton step in a subspace
                    (:func:`~depthscope.probes.solvers.subspace.fit_softmax`)
``LbfgsSolver``     linear probes over resident features, scalar mixes included: full-batch L-BFGS
                    with per-unit memory, step and stopping (:func:`~.lbfgs.lbfgs`), K-FAC
                    preconditioned (:mod:`~depthscope.probes.solvers.kfac`)
``AdamSolver``      anything else (MLP probes, attention pooling, streamed features): minibatch
                    Adam whose step size halves whenever an epoch's objective stops falling
``auto_batch(n)``   the Adam solver's minibatch size when none is given
==================  ===============================================================================

The full-batch solvers share the stopping rule of :mod:`depthscope.probes.solvers.lbfgs` (a unit
has converged when its largest gradient entry is at most ``gtol`` and its objective's relative
decrease is at most ``tol`` twice in a row); one pass is one objective-and-gradient evaluation over
train, and ``max_epochs`` caps the passes. Both start from the probe's weights (zero, or a warm
start) and reach the optimum of the convex regularised objective, so the result does not depend
on the seed. Adam's unit has converged when its epoch objective changed by at most ``tol``
(relative) twice in a row and the step size has been halved at least three times;
``max_epochs`` caps the epochs and ``min_steps`` floors the steps (tiny training sets).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from depthscope.common.threads import threads_for
from depthscope.probes.solvers.base import Problem, Solver, TrainLog, per_site
from depthscope.probes.solvers.cpu import step_work
from depthscope.probes.solvers.kfac import preconditioner
from depthscope.probes.solvers.lbfgs import Solved, lbfgs
from depthscope.probes.solvers.objective import features_device, objective, on_features_device, trainable
from depthscope.probes.solvers.subspace import fit_softmax

#: auto_batch aims at this many Adam steps per ``ADAM_EPOCHS_HINT`` epochs
TARGET_STEPS = 500
ADAM_EPOCHS_HINT = 12
#: Adam's step size on a scalar mix's logits and attention weights, relative to the classifier's
MIX_LR_SCALE = 3
#: the Adam solver stops once its step size has been halved this many times (and the objective is flat)
MIN_HALVINGS = 3


class SubspaceSolver(Solver):
    """Per-site linear probes: :func:`~depthscope.probes.solvers.subspace.fit_softmax` on the
    resident features (labels put in their row order), from the probe's current weights; the log
    carries a fresh evaluation of the objective (one forward pass), not the solver's carried
    logits'. Over features on a GPU the fit runs there on copies of the weights, the biases and
    the penalties (one copy each way per fit), the result copied back into the probe (on the CPU)."""

    name = "subspace"
    needs_resident = True

    @classmethod
    def fits(cls, probe, feats) -> bool:
        return per_site(probe) and feats.resident is not None

    @classmethod
    def resolve(cls, probe) -> str:
        if per_site(probe):
            return cls.name
        if probe.kind == "linear" and not probe.attn_pool:
            return LbfgsSolver.name  # a scalar mix: the subspace solver's runs leave mixes to L-BFGS
        raise ValueError("the subspace solver fits per-site linear probes (no attention pooling, no MLP)")

    def fit(self, problem: Problem) -> TrainLog:
        probe, feats, s = problem.probe, problem.feats, problem.settings
        y_rows = problem.y[torch.from_numpy(np.asarray(feats.order, dtype=np.int64))]
        dev = features_device(feats)
        W, b = probe.W.data.to(dev), probe.b.data.to(dev)  # CPU: the probe's own (fitted in place)
        with threads_for(step_work(probe, feats, len(feats))):
            sol = fit_softmax(feats.resident, y_rows.to(dev), W, b, probe.l2.to(dev), s, on_pass=problem.tick)
        if dev.type != "cpu":
            probe.W.data.copy_(W)
            probe.b.data.copy_(b)
            sol = _solved_on_cpu(sol)
        f = objective(probe, feats, problem.y)
        return TrainLog.from_solved(self.name, sol, s.max_epochs, objective=f)


def _solved_on_cpu(sol: Solved) -> Solved:
    """``sol`` with its per-unit tensors copied to the CPU (the log reads them as numpy)."""
    tensors = {f.name: getattr(sol, f.name) for f in dataclasses.fields(sol)}
    return dataclasses.replace(sol, **{k: t.cpu() for k, t in tensors.items() if isinstance(t, torch.Tensor)})


class _FlatParams:
    """The trainable parameters of a probe as one flat vector per unit ``[U, P]`` (L-BFGS's
    variables): ``flat`` packs tensors shaped like them, ``load`` writes a vector back."""

    def __init__(self, probe):
        self.params = trainable(probe)
        self.names = [n for n, p in probe.named_parameters() if p.requires_grad]
        self.sizes = [p[0].numel() for p in self.params]
        self.U = probe.U

    def flat(self, tensors) -> torch.Tensor:
        return torch.cat([t.reshape(self.U, -1) for t in tensors], 1)

    @torch.no_grad()
    def load(self, x: torch.Tensor) -> None:
        for p, part in zip(self.params, torch.split(x, self.sizes, 1)):
            p.copy_(part.view_as(p))


class LbfgsSolver(Solver):
    """Linear probes over resident features (per-site or scalar mixes): preconditioned batched
    L-BFGS; each evaluation computes only the units still going and leaves the softmax's
    curvature for the preconditioner's class factor. Over features on a GPU each evaluation
    runs there (:func:`~depthscope.probes.solvers.objective.objective` moves the parameters, not
    the features); L-BFGS's own small vectors and the preconditioner stay on the CPU."""

    name = "lbfgs"
    needs_resident = True

    @classmethod
    def fits(cls, probe, feats) -> bool:
        return probe.kind == "linear" and feats.resident is not None

    def fit(self, problem: Problem) -> TrainLog:
        probe, feats, y, s = problem.probe, problem.feats, problem.y, problem.settings
        flat = _FlatParams(probe)
        curv: dict = {}

        def fg(x, active):
            flat.load(x)
            f = objective(probe, feats, y, grad=True, curvature=curv, units=active)
            return f, flat.flat([p.grad for p in flat.params]).clone()

        with threads_for(step_work(probe, feats, len(feats))):
            M = preconditioner(probe, feats, flat.names, flat.sizes, curv)
            x0 = flat.flat([p.detach() for p in flat.params])
            sol = lbfgs(fg, x0, max_evals=s.max_epochs, ftol=s.tol, gtol=s.gtol, precond=M, on_eval=problem.tick)
            flat.load(sol.x)
        return TrainLog.from_solved(self.name, sol, s.max_epochs)


def auto_batch(n: int, epochs: int = ADAM_EPOCHS_HINT, batch_size: int | None = None) -> int:
    """``batch_size`` if given, else the batch (between 128 and 512, a multiple of 32) that
    gives about ``TARGET_STEPS`` steps over ``epochs`` epochs of ``n`` examples."""
    if batch_size is not None:
        return int(batch_size)
    b = n * max(epochs, 1) / TARGET_STEPS
    return int(min(512, max(128, round(b / 32) * 32)))


class _Plateau:
    """The Adam solver's schedule and stopping state over epochs: the step size halves whenever
    an epoch's summed objective is not below the best so far by a ``tol`` fraction; a unit is
    flat after two epochs in a row whose objective changed by at most ``tol`` (relative)."""

    def __init__(self, U: int, tol: float):
        self.tol = tol
        self.small = np.zeros(U, dtype=int)
        self.halvings, self.best, self.prev, self.epochs = 0, None, None, 0
        self.history: list = []

    def record(self, per_unit: np.ndarray, opt: torch.optim.Optimizer) -> None:
        """Take one epoch's objective per unit; halve ``opt``'s step sizes on a plateau."""
        self.epochs += 1
        self.history.append(float(per_unit.sum()))
        if self.prev is not None:
            rel = np.abs(self.prev - per_unit) / np.maximum(np.abs(per_unit), 1e-12)
            self.small = np.where(rel <= self.tol, self.small + 1, 0)
        if self.best is not None and self.history[-1] > self.best * (1 - self.tol):
            self.halvings += 1
            for group in opt.param_groups:
                group["lr"] *= 0.5
        self.best = self.history[-1] if self.best is None else min(self.best, self.history[-1])
        self.prev = per_unit

    def converged(self) -> np.ndarray:
        return (self.small >= 2) & (self.halvings >= MIN_HALVINGS)

    def log(self, U: int, max_epochs: int) -> TrainLog:
        conv = self.converged()
        return TrainLog(
            AdamSolver.name,
            self.epochs,
            conv,
            self.prev,
            np.full(U, np.nan),
            hit_cap=bool(not conv.all() and self.epochs >= max_epochs),
            history=self.history,
            unit_epochs=np.full(U, self.epochs),
        )


class AdamSolver(Solver):
    """Minibatch Adam with step-halving on plateaus (module docstring); works on any probe and on
    streamed features. Over resident features on a GPU the probe trains there (moved for the fit
    and back to the CPU after it; batches are slices of the features there, no copy per batch)."""

    name = "adam"

    def fit(self, problem: Problem) -> TrainLog:
        probe, feats, s = problem.probe, problem.feats, problem.settings
        n = len(feats)
        batch_size = auto_batch(n, ADAM_EPOCHS_HINT, s.batch_size)
        min_epochs = math.ceil(s.min_steps / math.ceil(n / batch_size))
        max_epochs = max(s.max_epochs, min_epochs)
        with on_features_device(probe, feats) as dev, threads_for(step_work(probe, feats, batch_size)):
            opt = _adam(_param_groups(probe, s.lr))
            rng = np.random.default_rng(s.seed)
            plateau = _Plateau(probe.U, s.tol)
            y = problem.y.to(dev)
            while plateau.epochs < max_epochs:
                per_unit = _adam_epoch(probe, feats, y, opt, rng, batch_size)
                problem.tick()
                plateau.record(per_unit, opt)
                if plateau.epochs >= min_epochs and bool(plateau.converged().all()):
                    break
        return plateau.log(probe.U, max_epochs)


def _param_groups(probe, lr: float) -> list:
    """Adam's parameter groups: the classifier at ``lr``, a scalar mix's logits and attention
    pooling's weights at ``MIX_LR_SCALE * lr``."""
    named = [(name, p) for name, p in probe.named_parameters() if p.requires_grad]
    mix = [p for name, p in named if name in ("mix_logits", "att")]
    main = [p for name, p in named if name not in ("mix_logits", "att")]
    return [{"params": main, "lr": lr}] + ([{"params": mix, "lr": lr * MIX_LR_SCALE}] if mix else [])


def _adam_epoch(probe, feats, y, opt, rng, batch_size) -> np.ndarray:
    """One epoch of minibatch steps; returns each unit's mean objective over the epoch."""
    n = len(feats)
    run = torch.zeros(probe.U, dtype=torch.float64, device=y.device)
    for idx, (x, m) in feats.batches(batch_size, rng):
        logits = probe(x, m)  # [U, B, G, C]
        U, B, G, C = logits.shape
        target = y[torch.as_tensor(idx, device=y.device)].unsqueeze(0).expand(U, B, G)
        ce = F.cross_entropy(logits.reshape(-1, C), target.reshape(-1), reduction="none").view(U, B * G).sum(1) / B
        opt.zero_grad(set_to_none=True)
        ce.sum().backward()
        probe.add_penalty_grad_()  # the L2 term's gradient, added in place
        opt.step()
        run += ce.detach().double() * (B / n)
    with torch.no_grad():
        return (run + probe.penalty_per_unit().double()).cpu().numpy()


def _adam(groups) -> torch.optim.Optimizer:
    """Adam with the fused kernel where this torch has it for CPU tensors (one pass over each
    weight per step instead of several), else the multi-tensor one."""
    try:
        return torch.optim.Adam(groups, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(groups, foreach=True)
