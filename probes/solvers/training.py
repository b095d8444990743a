"""Fitting and applying a BatchedProbe: training to the optimum of its objective, and batched prediction.

================================  =============================================================
``train_probe(probe, feats, y)``  fit to convergence (``max_epochs`` a cap that warns); returns a
                                  :class:`TrainLog`
``predict(probe, feats, y)``      predicted classes ``[U, N, G]`` (and code lengths given ``y``)
``log_probs(probe, feats)``         log-probabilities of every class ``[U, N, G, C]``
``objective(probe, feats, y)``    the regularised objective per unit ``[U]`` (mean cross-entropy
                                  summed over heads + the L2 term), full batch
``auto_batch(n, epochs)``         the minibatch size of the Adam solver when none is given
``train_kwargs(config)``          the training settings of a ProbeConfig, as train_probe's keywords
================================  =============================================================

Three solvers, one stopping rule (:mod:`depthscope.probes.solvers.lbfgs`: a unit has converged when
its largest gradient entry is at most ``gtol`` and its objective's relative decrease is at most
``tol`` twice in a row):

* ``subspace`` (per-site linear probes over resident features; ``solver="auto"``): full batch,
  one product each way per pass and an exact small Newton step in a subspace
  (:mod:`depthscope.probes.solvers.subspace`), from the probe's weights (zero, or a warm start), so the
  result is the optimum of the regularised objective (convex) and does not depend on the seed.
* ``lbfgs`` (scalar mixes over resident features; ``solver="auto"``; per-site probes on
  request): full-batch L-BFGS with per-unit memory, step and stopping, K-FAC preconditioned.
  For both, one objective-and-gradient evaluation is one pass over train: ``max_epochs`` caps
  the passes.
* ``adam`` (MLP probes, attention pooling, streamed features): minibatch Adam whose step size
  halves whenever an epoch's objective stops falling by ``tol``-relative steps; a unit has
  converged when its epoch objective changed by at most ``tol`` (relative) twice in a row and
  the step size has been halved at least three times; ``max_epochs`` caps the epochs (and
  ``min_steps`` floors the steps, for tiny training sets).

A run that stops at the cap before every unit has converged logs a warning and says so in its
:class:`TrainLog` (the probe tables carry it as ``converged`` / ``epochs``). Because the loss is
a sum of per-unit, per-head losses, training units and heads together equals training them
apart. Defaults are those of :class:`~depthscope.probes.config.ProbeConfig`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from depthscope.probes.config import ProbeConfig
from depthscope.probes.solvers.classifiers import BatchedProbe
from depthscope.probes.solvers.cpu import step_work, threads_for
from depthscope.probes.solvers.lbfgs import lbfgs
from depthscope.probes.solvers.lbfgs import unit_runs as _runs
from depthscope.probes.solvers.subspace import fit_softmax
from depthscope.probes.store.features import Features

log = logging.getLogger("depthscope.probes")
_DEFAULTS = ProbeConfig()
#: auto_batch aims at this many Adam steps per ``ADAM_EPOCHS_HINT`` epochs
TARGET_STEPS = 500
ADAM_EPOCHS_HINT = 12
#: memory for one full-batch chunk's activations (logits, mixed features)
CHUNK_BYTES = 2.5e8
#: the preconditioner's scale on a scalar mix's logits, against the identity (see _preconditioner)
MIX_LOGIT_STEP = 1e3


@dataclass
class TrainLog:
    """What a training run did: ``solver``; ``epochs`` (passes over train); ``converged [U]``
    (bool per unit); ``objective [U]`` (final regularised objective per unit); ``grad_max [U]``
    (largest gradient entry, L-BFGS; NaN for Adam); ``hit_cap`` (stopped by ``max_epochs``
    with some unit not converged); ``history`` (summed objective per pass); ``unit_epochs [U]``
    (the passes each unit took, L-BFGS; ``epochs`` for every unit with Adam)."""

    solver: str
    epochs: int
    converged: np.ndarray
    objective: np.ndarray
    grad_max: np.ndarray
    hit_cap: bool
    history: list = field(default_factory=list)
    unit_epochs: np.ndarray | None = None  # [U] passes after which each unit stopped (L-BFGS)

    @classmethod
    def from_solved(cls, solver: str, sol, max_epochs: int, objective=None) -> TrainLog:
        """The log of a full-batch run (a :class:`~depthscope.probes.solvers.lbfgs.Solved`); ``objective``
        replaces the solver's own values."""
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


def train_kwargs(cfg: ProbeConfig) -> dict:
    """The settings ``train_probe``-based building blocks take, from ``cfg``."""
    return dict(
        max_epochs=cfg.max_epochs,
        tol=cfg.tol,
        gtol=cfg.gtol,
        solver=cfg.solver,
        min_steps=cfg.min_steps,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
    )


def auto_batch(n: int, epochs: int = ADAM_EPOCHS_HINT, batch_size: int | None = None) -> int:
    """``batch_size`` if given, else the batch (between 128 and 512, a multiple of 32) that
    gives about ``TARGET_STEPS`` steps over ``epochs`` epochs of ``n`` examples."""
    if batch_size is not None:
        return int(batch_size)
    b = n * max(epochs, 1) / TARGET_STEPS
    return int(min(512, max(128, round(b / 32) * 32)))


def pick_solver(probe: BatchedProbe, feats: Features, solver: str = "auto") -> str:
    """``subspace`` for per-site linear probes over resident features, ``lbfgs`` for linear
    scalar mixes over resident features, ``adam`` otherwise (``solver`` other than ``auto`` is
    taken as given where it applies: the full-batch solvers need resident features; ``subspace``
    fits per-site linear probes and leaves scalar mixes to ``lbfgs``)."""
    per_site = probe.kind == "linear" and probe.mix_mask is None and not probe.attn_pool
    if solver == "auto":
        if probe.kind == "linear" and feats.resident is not None:
            return "subspace" if per_site else "lbfgs"
        return "adam"
    if solver in ("lbfgs", "subspace") and feats.resident is None:
        raise ValueError(f"the {solver} solver needs resident features (Features.make_resident)")
    if solver == "subspace" and not per_site:
        if probe.kind == "linear" and not probe.attn_pool:
            return "lbfgs"  # a scalar mix: the subspace solver's runs take L-BFGS for them (ProbeConfig)
        raise ValueError("the subspace solver fits per-site linear probes (no attention pooling, no MLP)")
    return solver


def train_probe(
    probe: BatchedProbe,
    feats: Features,
    y: torch.Tensor,
    *,
    max_epochs: int = _DEFAULTS.max_epochs,
    tol: float = _DEFAULTS.tol,
    gtol: float = _DEFAULTS.gtol,
    solver: str = _DEFAULTS.solver,
    batch_size: int | None = _DEFAULTS.batch_size,
    lr: float = _DEFAULTS.lr,
    min_steps: int = _DEFAULTS.min_steps,
    seed: int = 0,
    progress: bool = False,
    desc: str = "probe",
) -> TrainLog:
    """Fit ``probe`` on ``feats`` with labels ``y [N, G]`` (class indices) to convergence;
    see the module docstring. Returns a :class:`TrainLog`; warns when ``max_epochs`` stops it."""
    n = len(feats)
    if n == 0:
        raise ValueError("no training examples")
    y = torch.as_tensor(y, dtype=torch.long)
    if y.dim() == 1:
        y = y[:, None]
    solver = pick_solver(probe, feats, solver)
    bar = None
    if progress:
        from depthscope.common.progress import progress_bar

        bar = progress_bar(max_epochs, desc=desc, unit="pass")
    probe.train()
    if solver == "subspace":
        out = _train_subspace(probe, feats, y, max_epochs, tol, gtol, bar)
    elif solver == "lbfgs":
        out = _train_lbfgs(probe, feats, y, max_epochs, tol, gtol, bar)
    else:
        out = _train_adam(probe, feats, y, max_epochs, tol, lr, min_steps, batch_size, seed, bar)
    if bar is not None:
        bar.close()
    probe.eval()
    if out.hit_cap:
        log.warning(
            "%s: %d of %d probes had not converged when max_epochs=%d stopped training (%s); raise max_epochs",
            desc,
            int((~out.converged).sum()),
            len(out.converged),
            max_epochs,
            solver,
        )
    return out


def _params(probe: BatchedProbe) -> list:
    return [p for p in probe.parameters() if p.requires_grad]


def _chunk(probe: BatchedProbe, feats: Features) -> int:
    width = probe.G * probe.C + (feats.n_spans * feats.d if probe.mix_mask is not None else 0)
    return int(max(64, min(len(feats), CHUNK_BYTES // (4 * probe.U * max(width, 1)))))


def objective(
    probe: BatchedProbe,
    feats: Features,
    y: torch.Tensor,
    *,
    grad: bool = False,
    curvature: dict | None = None,
    units: torch.Tensor | None = None,
) -> torch.Tensor:
    """The regularised objective per unit ``[U]`` (float64): mean cross-entropy over
    ``feats`` summed over heads, plus the L2 term; with ``grad`` its gradient is left in the
    parameters' ``.grad`` (one full pass, in chunks). With ``curvature`` (a dict), its ``"A"``
    is set to the softmax's mean curvature ``E[diag(p) - p p^T]`` per unit and head
    ``[U, G, C, C]`` at this point (the class factor of the preconditioner). ``units`` (bool
    ``[U]``): only these units are needed; per-site linear probes over resident features then
    compute only them (contiguous runs of units, each one batched product), the others' values
    (objective, gradient, curvature) are left stale."""
    y = torch.as_tensor(y, dtype=torch.long)
    if y.dim() == 1:
        y = y[:, None]
    n, U = len(feats), probe.U
    runs = [(0, U)]
    if units is not None and probe.kind == "linear" and probe.mix_mask is None and feats.resident is not None:
        runs = _runs(units)
    total = torch.zeros(U, dtype=torch.float64)
    A = torch.zeros(U, probe.G, probe.C, probe.C) if curvature is not None else None
    if grad:
        for p in _params(probe):
            p.grad = None
    with torch.set_grad_enabled(grad):
        for idx, (x, m) in feats.batches(_chunk(probe, feats)):
            yb = y[torch.from_numpy(np.asarray(idx, dtype=np.int64))]
            for a, b in runs:
                logits = probe(x, m) if (a, b) == (0, U) else probe.unit_logits(x, a, b)  # [u, B, G, C]
                u, B, G, C = logits.shape
                target = yb.unsqueeze(0).expand(u, B, G).reshape(-1)
                ce = F.cross_entropy(logits.reshape(-1, C), target, reduction="none")
                per_unit = ce.view(u, B * G).sum(1) / n
                if A is not None:
                    with torch.no_grad():
                        p = torch.softmax(logits.detach(), -1).transpose(1, 2)  # [u, G, B, C]
                        A[a:b] -= torch.einsum("ugbc,ugbd->ugcd", p, p)
                        A[a:b].diagonal(dim1=2, dim2=3).add_(p.sum(2))
                if grad:
                    per_unit.sum().backward()
                total[a:b] += per_unit.detach().double()
    if A is not None:
        A /= n
        if runs != [(0, U)] and curvature.get("A") is not None:  # the other units keep their last curvature
            A = torch.where(units[:, None, None, None], A, curvature["A"])
        curvature["A"] = A
    if grad:
        for p in _params(probe):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        probe.add_penalty_grad_()
    with torch.no_grad():
        return total + probe.penalty_per_unit().double()


def _train_subspace(probe, feats, y, max_epochs, tol, gtol, bar) -> TrainLog:
    """Per-site linear probes: :func:`depthscope.probes.solvers.subspace.fit_softmax` on the resident
    features (labels put in their row order), from the probe's current weights."""
    y_rows = y[torch.from_numpy(np.asarray(feats.order, dtype=np.int64))]

    def tick():
        if bar is not None:
            bar.update(1)

    with threads_for(step_work(probe, feats, len(feats))):
        sol = fit_softmax(
            feats.resident,
            y_rows,
            probe.W.data,
            probe.b.data,
            probe.l2,
            probe.C,
            max_passes=max_epochs,
            ftol=tol,
            gtol=gtol,
            on_pass=tick,
        )
    f = objective(probe, feats, y)  # a fresh evaluation (one forward pass), not the carried logits'
    return TrainLog.from_solved("subspace", sol, max_epochs, objective=f)


def _train_lbfgs(probe, feats, y, max_epochs, tol, gtol, bar) -> TrainLog:
    params = _params(probe)
    U = probe.U
    sizes = [p[0].numel() for p in params]
    curv: dict = {}

    def flat(ts):
        return torch.cat([t.reshape(U, -1) for t in ts], 1)

    def fg(x, active):
        with torch.no_grad():
            for p, part in zip(params, torch.split(x, sizes, 1)):
                p.copy_(part.view_as(p))
        f = objective(probe, feats, y, grad=True, curvature=curv, units=active)
        return f, flat([p.grad for p in params]).clone()

    def tick(_evals):
        if bar is not None:
            bar.update(1)

    with threads_for(step_work(probe, feats, len(feats))):
        M = _preconditioner(probe, feats, [n for n, p in probe.named_parameters() if p.requires_grad], sizes, curv)
        sol = lbfgs(
            fg,
            flat([p.detach() for p in params]),
            max_evals=max_epochs,
            ftol=tol,
            gtol=gtol,
            precond=M,
            on_eval=tick,
            partial=True,
        )
        with torch.no_grad():
            for p, part in zip(params, torch.split(sol.x, sizes, 1)):
                p.copy_(part.view_as(p))
    return TrainLog.from_solved("lbfgs", sol, max_epochs)


@torch.no_grad()
def _preconditioner(probe: BatchedProbe, feats: Features, names: list, sizes: list, curv: dict):
    """``M(q)``: an approximate inverse Hessian per unit, Kronecker-factored as in K-FAC (Martens
    and Grosse 2015). The softmax loss's Hessian in a linear probe's weights is
    ``E[(diag(p) - p p^T) (x) x x^T] + 2 * l2 * I``, approximated by ``A (x) Sigma``: the
    features' second moments ``Sigma_u = X_u^T X_u / n`` (for a mix unit, those of its prefix's
    mean; computed once per feature set and reused across fits) and the softmax's mean
    curvature ``A = E[diag(p) - p p^T]`` per unit and head, taken from the latest objective
    evaluation (``curv["A"]``, so it follows the fit). ``M`` applies ``(Sigma + 8 l2 I)^-1`` on
    the feature side and ``(A + 2 l2 I)^-1`` on the class side of the weight gradient, and
    ``(A + 1e-3 I)^-1`` to the biases and ``MIX_LOGIT_STEP`` times the identity to a scalar
    mix's logits (their curvature is small against the weights'; on GUM upos, default model,
    the identity left the mix unconverged after 400 passes, its weights still moving, and
    ``1e3`` converges in 94 passes to a lower objective). The feature factor removes
    the correlation between residual-stream dimensions, the class factor the spread of
    curvature between frequent and rare classes: on EWT upos (default model) plain L-BFGS
    needs hundreds of passes, the feature factor alone 105 and both 53 (``l2 = 1e-2``). Any
    fixed symmetric positive definite ``M`` changes only the path, not the optimum."""
    U, n = probe.U, len(feats)
    Fd = feats.n_spans * feats.d
    G, C = probe.G, probe.C
    mix = probe.mix_mask
    gram = getattr(feats, "_gram", None) if mix is None else None  # per-site second moments, reused across fits
    if gram is None:
        gram = torch.zeros(U, Fd, Fd)
        for _, (x, _m) in feats.batches(_chunk(probe, feats)):
            x = x.float()
            if mix is not None:
                w = mix.float() / mix.float().sum(1, keepdim=True)  # uniform weights over each prefix
                x = (w @ x.reshape(x.shape[0], -1)).reshape(U, -1, Fd)
            gram.baddbmm_(x.transpose(1, 2), x)
        gram.div_(n)
        if mix is None:
            feats._gram = gram
    l2 = probe.l2.clamp_min(1e-6)  # [G]
    reg = gram.clone()
    reg.diagonal(dim1=1, dim2=2).add_(8.0 * float(l2.min()))
    inv = torch.cholesky_inverse(torch.linalg.cholesky(reg))  # applied as one batched GEMM per call
    del reg
    eye = torch.eye(C)
    wi, bi = names.index("W"), names.index("b") if "b" in names else None
    start = [sum(sizes[:i]) for i in range(len(sizes))]
    cls = {"A": None}

    def class_inverses():
        A = curv.get("A")
        if A is None:
            return None
        if cls["A"] is not A:  # a new evaluation since the last call: refactor (C x C per unit and head)
            cls["A"] = A
            cls["W"] = torch.linalg.inv(A + 2.0 * l2[None, :, None, None] * eye)
            cls["b"] = torch.linalg.inv(A + 1e-3 * eye)
        return cls["W"], cls["b"]

    def M(q, units=None):
        """``units`` (bool ``[U]``, optional): only these units' rows are needed (the others are
        returned as given; each unit's result is the same either way), computed as contiguous
        runs of units (views of the factors, as :func:`objective` does: no gather of the
        ``[U, F, F]`` inverses)."""
        out = q.clone()
        for u0, u1 in [(0, U)] if units is None else _runs(units):
            qs = q[u0:u1]
            a, k = start[wi], sizes[wi]
            v = torch.bmm(inv[u0:u1], qs[:, a : a + k].reshape(-1, Fd, G * C))
            ci = class_inverses()
            if ci is not None:
                v = torch.einsum("ufgc,ugcd->ufgd", v.view(-1, Fd, G, C), ci[0][u0:u1])
                if bi is not None:
                    a2, k2 = start[bi], sizes[bi]
                    qb = qs[:, a2 : a2 + k2].view(-1, G, C)
                    out[u0:u1, a2 : a2 + k2] = torch.einsum("ugc,ugcd->ugd", qb, ci[1][u0:u1]).reshape(u1 - u0, -1)
            out[u0:u1, a : a + k] = v.reshape(u1 - u0, -1)
            if "mix_logits" in names:
                a3, k3 = start[names.index("mix_logits")], sizes[names.index("mix_logits")]
                out[u0:u1, a3 : a3 + k3] *= MIX_LOGIT_STEP
        return out

    return M


def _train_adam(probe, feats, y, max_epochs, tol, lr, min_steps, batch_size, seed, bar) -> TrainLog:
    """Minibatch Adam with step-halving on plateaus (see the module docstring)."""
    n = len(feats)
    batch_size = auto_batch(n, ADAM_EPOCHS_HINT, batch_size)
    steps_per_epoch = math.ceil(n / batch_size)
    min_epochs = math.ceil(min_steps / steps_per_epoch)
    max_epochs = max(max_epochs, min_epochs)
    mix = [p for name, p in probe.named_parameters() if name in ("mix_logits", "att") and p.requires_grad]
    main = [p for name, p in probe.named_parameters() if name not in ("mix_logits", "att") and p.requires_grad]
    groups = [{"params": main, "lr": lr}] + ([{"params": mix, "lr": lr * 3}] if mix else [])
    opt = _adam(groups)
    rng = np.random.default_rng(seed)
    prev = None
    small = np.zeros(probe.U, dtype=int)
    halvings, best, history, epoch = 0, None, [], 0
    with threads_for(step_work(probe, feats, batch_size)):
        while epoch < max_epochs:
            per_unit = _adam_epoch(probe, feats, y, opt, rng, batch_size)
            epoch += 1
            if bar is not None:
                bar.update(1)
            history.append(float(per_unit.sum()))
            if prev is not None:
                rel = np.abs(prev - per_unit) / np.maximum(np.abs(per_unit), 1e-12)
                small = np.where(rel <= tol, small + 1, 0)
            if best is not None and history[-1] > best * (1 - tol):
                halvings += 1
                for g_ in opt.param_groups:
                    g_["lr"] *= 0.5
            best = history[-1] if best is None else min(best, history[-1])
            prev = per_unit
            if epoch >= min_epochs and halvings >= 3 and bool((small >= 2).all()):
                break
    conv = (small >= 2) & (halvings >= 3)
    return TrainLog(
        "adam",
        epoch,
        conv,
        prev,
        np.full(probe.U, np.nan),
        hit_cap=bool(not conv.all() and epoch >= max_epochs),
        history=history,
        unit_epochs=np.full(probe.U, epoch),
    )


def _adam_epoch(probe, feats, y, opt, rng, batch_size) -> np.ndarray:
    """One epoch of minibatch steps; returns each unit's mean objective over the epoch."""
    n = len(feats)
    run = torch.zeros(probe.U, dtype=torch.float64)
    for idx, (x, m) in feats.batches(batch_size, rng):
        logits = probe(x, m)  # [U, B, G, C]
        U, B, G, C = logits.shape
        target = y[idx].unsqueeze(0).expand(U, B, G)
        ce = F.cross_entropy(logits.reshape(-1, C), target.reshape(-1), reduction="none").view(U, B * G).sum(1) / B
        opt.zero_grad(set_to_none=True)
        ce.sum().backward()
        probe.add_penalty_grad_()  # the L2 term's gradient, added in place
        opt.step()
        run += ce.detach().double() * (B / n)
    with torch.no_grad():
        return (run + probe.penalty_per_unit().double()).numpy()


def _adam(groups) -> torch.optim.Optimizer:
    """Adam with the fused kernel where this torch has it for CPU tensors (one pass over each
    weight per step instead of about eight), else the multi-tensor one."""
    try:
        return torch.optim.Adam(groups, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(groups, foreach=True)


@torch.no_grad()
def log_probs(probe: BatchedProbe, feats: Features, *, batch_size: int = 1024) -> torch.Tensor:
    """Log-probabilities ``[U, N, G, C]`` of every class, examples in ``feats``' order."""
    probe.eval()
    out = torch.empty(probe.U, len(feats), probe.G, probe.C)
    with threads_for(step_work(probe, feats, batch_size)):
        for idx, (x, m) in feats.batches(batch_size):
            out[:, torch.from_numpy(np.asarray(idx, dtype=np.int64))] = torch.log_softmax(probe(x, m), -1)
    return out


@torch.no_grad()
def predict(probe: BatchedProbe, feats: Features, y: torch.Tensor | None = None, *, batch_size: int = 1024):
    """Predicted classes ``[U, N, G]`` and, with labels ``y [N, G]`` (indices < C), the
    code length ``-log2 p(y)`` of each example ``[U, N, G]`` (else None)."""
    probe.eval()
    n = len(feats)
    preds = torch.empty(probe.U, n, probe.G, dtype=torch.long)
    bits = torch.empty(probe.U, n, probe.G) if y is not None else None
    if y is not None:
        y = torch.as_tensor(y, dtype=torch.long)
        if y.dim() == 1:
            y = y[:, None]
    with threads_for(step_work(probe, feats, batch_size)):
        _predict_loop(probe, feats, y, batch_size, preds, bits)
    return preds, bits


def _predict_loop(probe, feats, y, batch_size, preds, bits) -> None:
    for idx, (x, m) in feats.batches(batch_size):
        ti = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        logits = probe(x, m)
        preds[:, ti] = logits.argmax(-1)
        if y is not None:
            logp = torch.log_softmax(logits, -1)
            t = y[ti].unsqueeze(0).expand(logits.shape[0], -1, -1)
            bits[:, ti] = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1) / math.log(2)
