"""Batched L-BFGS: many independent smooth problems minimised side by side, each to its own convergence.

==========================================  =========================================================
``lbfgs(fg, x0, max_evals=, ftol=, gtol=)``  minimise ``U`` objectives ``f_u(x_u)`` given ``fg(x,
                                            active) -> (f [U], grad [U, P])``; a :class:`Solved`
``newton(fg, hess, x0, max_iters=, ...)``    the same for small problems whose Hessian ``[U, P, P]``
                                            is cheap: damped Newton steps with the same line search
                                            and stopping rule (converges in a few iterations)
``Solved``                                  the point, objectives, gradient norms, which units
                                            converged, and the number of evaluations (passes)
``unit_runs(units)``                        contiguous runs of the units still going
==========================================  =========================================================

Why batched: a probe per site (and per scalar-mix prefix) is a separate problem, but evaluating
all of them is one batched product over the resident features. Each unit keeps its own L-BFGS
memory, step size and stopping state, so a unit's iterates are exactly those of a plain L-BFGS
run on that unit alone; a converged unit is frozen while the others go on, and the loop stops
when every unit has converged or the evaluation cap is hit.

Convergence of a unit (SciPy's two L-BFGS-B tests, both required): the largest absolute
gradient entry is at most ``gtol``, and the relative decrease of its objective
``(f_prev - f) / max(|f|, 1e-12)`` is at most ``ftol`` on two iterations in a row (the gradient
test alone stops too early where the optimum's objective is small: near-separable classes
under a weak penalty). A unit whose
line search finds no decrease is at the precision floor of its objective: converged if its
gradient passes ``gtol``, else retried from steepest descent and, failing twice, stopped and
reported as not converged. Line search: backtracking from step 1 (the first step: ``1 / ||g||_1``, at
most 1) until Armijo's sufficient decrease holds; curvature pairs with ``s.y <= 0`` are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ARMIJO = 1e-4
MAX_BACKTRACKS = 12


@dataclass
class Solved:
    """``x [U, P]``, ``f [U]`` (float64), ``grad_max [U]`` (largest absolute gradient entry),
    ``converged [U]`` (bool), ``evals`` (objective-and-gradient evaluations), ``history``
    (the summed objective after each evaluation) and ``unit_evals [U]`` (the evaluations after
    which each unit stopped; ``evals`` for units still going at the cap)."""

    x: torch.Tensor
    f: torch.Tensor
    grad_max: torch.Tensor
    converged: torch.Tensor
    evals: int
    history: list
    unit_evals: torch.Tensor | None = None


class Stopping:
    """The stopping state of ``U`` units, shared by :func:`lbfgs` and :func:`newton` (the rule
    in the module docstring): ``done`` units are frozen, ``converged`` ones passed the test,
    ``at`` holds the evaluation count at which each unit stopped."""

    def __init__(self, U: int, device: torch.device | None = None):
        self.small = torch.zeros(U, dtype=torch.long, device=device)  # consecutive small relative decreases
        self.fails = torch.zeros(U, dtype=torch.long, device=device)  # consecutive failed line searches
        self.converged = torch.zeros(U, dtype=torch.bool, device=device)
        self.done = torch.zeros(U, dtype=torch.bool, device=device)
        self.at = torch.zeros(U, dtype=torch.long, device=device)

    def update(self, accepted, f_prev, f, g, *, ftol: float, gtol: float, count: int) -> None:
        """After one iteration: ``accepted [U]`` (the line search found a decrease, or the unit
        is frozen), objectives before and after, the gradient, the evaluation count."""
        rel = (f_prev - f) / f.abs().clamp_min(1e-12)
        self.fails = torch.where(accepted, torch.zeros_like(self.fails), self.fails + 1)
        self.small = torch.where(accepted & (rel <= ftol), self.small + 1, torch.zeros_like(self.small))
        newly = ~self.done & (g.abs().amax(1) <= gtol) & ((self.small >= 2) | (self.fails >= 1))
        self.converged |= newly
        stop = ~self.done & (newly | (self.fails >= 2))
        self.at[stop] = count
        self.done |= stop

    def solved(self, x, f, g, count: int, history: list) -> Solved:
        at = torch.where(self.done, self.at, torch.full_like(self.at, count))
        return Solved(x, f, g.abs().amax(1), self.converged, count, history, at)


def unit_runs(units: torch.Tensor) -> list:
    """Contiguous ``(start, stop)`` runs of the True entries of ``units [U]`` (units still going,
    evaluated as views of contiguous blocks instead of gathered)."""
    idx = torch.nonzero(units)[:, 0].tolist()
    runs: list = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs]


def _two_loop(g, S, Y, R, h0, M):
    """The L-BFGS direction ``-H g`` per unit (pairs with ``rho = 0`` are skipped for that unit),
    with ``h0 * M`` as the initial inverse Hessian."""
    q = g.clone()
    alphas = []
    for s, y, rho in zip(reversed(S), reversed(Y), reversed(R)):
        a = rho * (s * q).sum(1)
        q.sub_(y * a[:, None])
        alphas.append(a)
    r = M(q) * h0[:, None]
    for (s, y, rho), a in zip(zip(S, Y, R), reversed(alphas)):
        b = rho * (y * r).sum(1)
        r.add_(s * (a - b)[:, None])
    return -r


class _Lbfgs:
    """The state of a batched L-BFGS run: the iterate ``x``, its objectives ``f [U]`` and
    gradients ``g [U, P]``, the curvature pairs ``S, Y`` with their ``R = 1 / s.y`` (0: skipped
    for that unit), the initial inverse-Hessian scale ``h0 [U]``, the stopping state and the
    evaluation count."""

    def __init__(self, fg: Callable, x0: torch.Tensor, precond: Callable | None, memory: int):
        self.fg, self.precond, self.memory = fg, precond, memory
        self.x = x0.detach().clone()
        self.st = Stopping(self.x.shape[0])
        self.S: list = []
        self.Y: list = []
        self.R: list = []
        self.evals = 0

    def M(self, q: torch.Tensor) -> torch.Tensor:
        """The preconditioner, asked only for the units still going (``st.done`` is updated in
        place, so this always sees the current ones)."""
        return q if self.precond is None else self.precond(q, ~self.st.done)

    def first_step(self, g: torch.Tensor) -> torch.Tensor:
        """The first step length per unit: ``1 / ||M g||_1``, at most 1."""
        return (1.0 / self.M(g).abs().sum(1).clamp_min(1e-12)).clamp(max=1.0)

    def start(self) -> float:
        """Evaluate the starting point; its summed objective."""
        self.f, self.g = self.fg(self.x, torch.ones(self.x.shape[0], dtype=torch.bool))
        self.evals = 1
        self.h0 = self.first_step(self.g)
        return float(self.f.sum())

    def direction(self) -> tuple:
        """The search direction ``d [U, P]`` and its slope ``g.d [U]``: the two-loop recursion,
        or (preconditioned) steepest descent for a unit where that is not a descent direction."""
        g, h0 = self.g, self.h0
        d = _two_loop(g, self.S, self.Y, self.R, h0, self.M)
        gd = (g * d).sum(1)
        uphill = gd >= 0
        if bool(uphill.any()):
            d[uphill] = -self.M(g)[uphill] * h0[uphill, None]
            gd = (g * d).sum(1)
        return d, gd

    def line_search(self, d, gd, max_evals: int, on_eval: Callable | None) -> tuple:
        """Backtrack from step 1 until Armijo's condition holds for every unit (or the cap):
        ``(x, f, g, ok)`` at the accepted points. Each evaluation asks only for the units whose
        trial point is still needed; the others keep theirs."""
        done, x, f, g = self.st.done, self.x, self.f, self.g
        U = x.shape[0]
        t = torch.where(done, torch.zeros(U), torch.ones(U))
        need = ~done
        xn, fn, gn = x.clone(), f.clone(), g.clone()
        for _ in range(MAX_BACKTRACKS):
            xt = x + t[:, None] * d
            ft, gt = self.fg(xt, need)
            xn[need], fn[need], gn[need] = xt[need], ft[need], gt[need]
            self.evals += 1
            if on_eval is not None:
                on_eval()
            ok = (fn <= f + ARMIJO * t * gd) | (t == 0)
            if bool(ok.all()) or self.evals >= max_evals:
                break
            need = ~ok
            t = torch.where(ok, t, t * 0.5)
        return xn, fn, gn, ok

    def stay_if_failed(self, xn, fn, gn, ok) -> None:
        """A unit whose line search failed stays put and forgets its curvature memory."""
        keep = ~ok
        if bool(keep.any()):
            xn[keep], fn[keep], gn[keep] = self.x[keep], self.f[keep], self.g[keep]
            self.R = [torch.where(keep, torch.zeros_like(r), r) for r in self.R]
            self.h0 = torch.where(keep, self.first_step(self.g), self.h0)

    def remember(self, xn, gn, ok) -> None:
        """Add the step's curvature pair (skipped for a unit where ``s.y`` is not positive
        enough) and rescale ``h0``; keep the last ``memory`` pairs."""
        s, y = xn - self.x, gn - self.g
        sy, yy = (s * y).sum(1), (y * self.M(y)).sum(1)
        valid = (sy > 1e-10 * (yy.sqrt() * s.norm(dim=1)).clamp_min(1e-30)) & ~self.st.done & ok
        self.S.append(s)
        self.Y.append(y)
        self.R.append(torch.where(valid, 1.0 / sy.clamp_min(1e-30), torch.zeros_like(sy)))
        self.h0 = torch.where(valid, sy / yy.clamp_min(1e-30), self.h0)
        if len(self.S) > self.memory:
            self.S.pop(0), self.Y.pop(0), self.R.pop(0)


def lbfgs(
    fg: Callable,
    x0: torch.Tensor,
    *,
    max_evals: int,
    ftol: float = 1e-6,
    gtol: float = 1e-4,
    memory: int = 10,
    precond: Callable | None = None,
    on_eval: Callable | None = None,
) -> Solved:
    """Minimise ``U`` independent objectives from ``x0 [U, P]``; see the module docstring.
    ``fg(x, active)`` returns ``(f [U], grad [U, P])``, where ``active [U]`` marks the units whose
    values are needed (units that have stopped, or that already passed the current line search,
    are not; it may return anything for the others). ``precond(q, active)`` (optional) applies a
    fixed symmetric positive definite approximation of each unit's inverse Hessian to ``q [U, P]``
    for the units still going (it may return the others as given: a stopped unit's direction is
    never used); it only changes the path, not the optimum. ``on_eval()`` is called after each
    evaluation."""
    run = _Lbfgs(fg, x0, precond, memory)
    history = [run.start()]
    while not bool(run.st.done.all()) and run.evals < max_evals:
        d, gd = run.direction()
        xn, fn, gn, ok = run.line_search(d, gd, max_evals, on_eval)
        run.stay_if_failed(xn, fn, gn, ok)
        run.remember(xn, gn, ok)
        run.st.update(ok, run.f, fn, gn, ftol=ftol, gtol=gtol, count=run.evals)
        run.x, run.f, run.g = xn, fn, gn
        history.append(float(fn.sum()))
    return run.st.solved(run.x, run.f, run.g, run.evals, history)


def _newton_directions(H: torch.Tensor, g: torch.Tensor, act: torch.Tensor, damping: float) -> torch.Tensor:
    """Newton directions ``[U, P]`` of the units ``act`` (zero for the others): ``(H + mu I) d = -g``
    per unit, ``mu`` relative to the largest diagonal entry and raised a hundredfold where
    ``H + mu I`` is not numerically positive definite."""
    d = torch.zeros_like(g)
    eye = torch.eye(g.shape[1], dtype=torch.float64)
    mu = damping * (1.0 + H.diagonal(dim1=1, dim2=2).abs().amax(1))  # [A]
    todo = torch.ones(len(act), dtype=torch.bool)
    for _ in range(12):
        L, info = torch.linalg.cholesky_ex(H[todo] + mu[todo, None, None] * eye)
        ok = info == 0
        idx = torch.nonzero(todo)[:, 0]
        if bool(ok.any()):
            units = act[idx[ok]]
            d[units] = -torch.cholesky_solve(g[units, :, None], L[ok])[..., 0]
        todo = todo.clone()
        todo[idx[ok]] = False
        if not bool(todo.any()):
            break
        mu = torch.where(todo, mu * 100.0, mu)
    return d


def _backtrack(fg: Callable, x, f, g, d, t) -> tuple:
    """Armijo backtracking of every unit along its direction ``d`` from steps ``t`` (0: the unit
    does not move): each unit's step halves until its objective falls enough, and only the
    units still searching are evaluated. Returns ``(t, ok, f at x + t d, g there)``; a unit that
    never passed has ``ok`` False."""
    gd = (g * d).sum(1)
    fn, gn, need = f.clone(), g.clone(), t > 0
    ok = ~need
    for _ in range(MAX_BACKTRACKS):
        if not bool(need.any()):
            break
        ft, gt = fg(x + t[:, None] * d, need)
        fn, gn = torch.where(need, ft, fn), torch.where(need[:, None], gt, gn)
        ok = (fn <= f + ARMIJO * t * gd) | (t == 0)
        t = torch.where(ok, t, t * 0.5)
        need = ~ok
    return t, ok, fn, gn


def newton(
    fg: Callable,
    hess: Callable,
    x0: torch.Tensor,
    *,
    max_iters: int,
    ftol: float = 1e-6,
    gtol: float = 1e-4,
    damping: float = 1e-8,
    reuse_below: float = 0.0,
) -> Solved:
    """Minimise ``U`` independent convex objectives from ``x0 [U, P]`` by Newton's method:
    ``fg(x, active) -> (f [U], grad [U, P])`` (float64; only the units ``active [U]`` are needed:
    those still going whose line search has not yet passed), ``hess(x, units) -> [len(units), P, P]`` the
    Hessians of the units asked for (``units``: their indices, ascending; any float type: it
    only sets the direction, the line search and the stopping rule use ``fg``). Each iteration
    solves ``(H + damping * I) d = -g`` per unit (more damping where the Cholesky factorisation
    fails), then backtracks from step 1 until Armijo's condition holds; convergence and freezing
    of units as in :func:`lbfgs`. A unit whose last step was a full one with a relative decrease
    of at most ``reuse_below`` keeps its Hessian for the next step (the point barely moved, so the
    Hessian barely changed: near the optimum the stopping rule's last iterations then cost no
    Hessian; any positive definite matrix gives a descent direction, so the optimum is the same).
    ``evals`` counts iterations, ``history`` the summed objective after each."""
    x = x0.detach().clone().double()
    U = x.shape[0]
    f, g = fg(x, torch.ones(U, dtype=torch.bool))
    history, iters = [float(f.sum())], 0
    st = Stopping(U)
    done = st.done
    Hs = torch.zeros(U, x.shape[1], x.shape[1], dtype=torch.float64)  # the Hessians in use
    fresh = torch.ones(U, dtype=torch.bool)  # units whose Hessian is recomputed this iteration
    while not bool(done.all()) and iters < max_iters:
        act = torch.nonzero(~done)[:, 0]  # the units still going: only their Hessians are computed
        need = act[fresh[act]]
        if len(need):
            Hs[need] = hess(x, need).double()
        iters += 1
        d = _newton_directions(Hs[act], g, act, damping)
        gd = (g * d).sum(1)
        t = torch.where(done | (gd >= 0), torch.zeros(U, dtype=torch.float64), torch.ones(U, dtype=torch.float64))
        t, ok, fn, gn = _backtrack(fg, x, f, g, d, t)
        xn = x + t[:, None] * d
        moved = ok & (t > 0)
        xn = torch.where(moved[:, None], xn, x)
        fn = torch.where(moved, fn, f)
        gn = torch.where(moved[:, None], gn, g)
        fresh = ~(moved & (t == 1) & ((f - fn) <= reuse_below * fn.abs().clamp_min(1e-12)))
        st.update(moved | done, f, fn, gn, ftol=ftol, gtol=gtol, count=iters)
        done = st.done
        x, f, g = xn, fn, gn
        history.append(float(f.sum()))
    return st.solved(x, f, g, iters, history)
