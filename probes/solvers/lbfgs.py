"""Batched L-BFGS: many independent smooth problems minimised side by side, each to its own convergence.

==========================================  =========================================================
``lbfgs(fg, x0, max_evals=, ftol=, gtol=)``  minimise ``U`` objectives ``f_u(x_u)`` given ``fg(x) ->
                                            (f [U], grad [U, P])``; a :class:`Solved`
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


class _Stopping:
    """The stopping state of ``U`` units, shared by :func:`lbfgs` and :func:`newton` (the rule
    in the module docstring): ``done`` units are frozen, ``converged`` ones passed the test,
    ``at`` holds the evaluation count at which each unit stopped."""

    def __init__(self, U: int):
        self.small = torch.zeros(U, dtype=torch.long)  # consecutive small relative decreases
        self.fails = torch.zeros(U, dtype=torch.long)  # consecutive failed line searches
        self.converged = torch.zeros(U, dtype=torch.bool)
        self.done = torch.zeros(U, dtype=torch.bool)
        self.at = torch.zeros(U, dtype=torch.long)

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
    partial: bool = False,
) -> Solved:
    """Minimise ``U`` independent objectives from ``x0 [U, P]``; see the module docstring.
    ``fg(x)`` returns ``(f [U], grad [U, P])``; ``precond(q)`` (optional) applies a fixed
    symmetric positive definite approximation of each unit's inverse Hessian to ``q [U, P]``
    (preconditioned L-BFGS: it only changes the path, not the optimum); ``on_eval(evals)`` is
    called after each evaluation. ``partial``: ``fg`` is called as ``fg(x, active)`` with
    ``active [U]`` the units whose values are needed (units that have stopped, or that already
    passed the current line search, are not); it may return anything for the others; and
    ``precond(q, active)`` is given the units still going (it may return the others as given:
    a stopped unit's direction is never used)."""
    x = x0.detach().clone()
    U = x.shape[0]
    st = _Stopping(U)
    if precond is None:

        def M(q):
            return q

    elif partial:  # st.done is updated in place: the preconditioner sees the units still going

        def M(q):
            return precond(q, ~st.done)

    else:
        M = precond
    if partial:
        evaluate = fg
    else:

        def evaluate(x, _active):
            return fg(x)

    f, g = evaluate(x, torch.ones(U, dtype=torch.bool))
    evals, history = 1, [float(f.sum())]
    S, Y, R = [], [], []

    def first_step(g):
        return (1.0 / M(g).abs().sum(1).clamp_min(1e-12)).clamp(max=1.0)

    h0 = first_step(g)  # first step length, per unit
    done = st.done
    while not bool(done.all()) and evals < max_evals:
        d = _two_loop(g, S, Y, R, h0, M)
        gd = (g * d).sum(1)
        uphill = gd >= 0
        if bool(uphill.any()):  # not a descent direction: (preconditioned) steepest descent for those units
            d[uphill] = -M(g)[uphill] * h0[uphill, None]
            gd = (g * d).sum(1)
        t = torch.where(done, torch.zeros(U), torch.ones(U))
        need = ~done  # the units whose trial point still has to be evaluated
        xn, fn, gn = x.clone(), f.clone(), g.clone()
        for _ in range(MAX_BACKTRACKS):
            xt = x + t[:, None] * d
            ft, gt = evaluate(xt, need)
            xn[need], fn[need], gn[need] = xt[need], ft[need], gt[need]
            evals += 1
            if on_eval is not None:
                on_eval(evals)
            ok = (fn <= f + ARMIJO * t * gd) | (t == 0)
            if bool(ok.all()) or evals >= max_evals:
                break
            need = ~ok
            t = torch.where(ok, t, t * 0.5)
        keep = ~ok  # failed line search: stay put, forget the curvature memory of that unit
        if bool(keep.any()):
            xn[keep], fn[keep], gn[keep] = x[keep], f[keep], g[keep]
            R = [torch.where(keep, torch.zeros_like(r), r) for r in R]
            h0 = torch.where(keep, first_step(g), h0)
        s, y = xn - x, gn - g
        sy, yy = (s * y).sum(1), (y * M(y)).sum(1)
        valid = (sy > 1e-10 * (yy.sqrt() * s.norm(dim=1)).clamp_min(1e-30)) & ~done & ok
        S.append(s)
        Y.append(y)
        R.append(torch.where(valid, 1.0 / sy.clamp_min(1e-30), torch.zeros_like(sy)))
        h0 = torch.where(valid, sy / yy.clamp_min(1e-30), h0)
        if len(S) > memory:
            S.pop(0), Y.pop(0), R.pop(0)
        st.update(ok, f, fn, gn, ftol=ftol, gtol=gtol, count=evals)
        done = st.done
        x, f, g = xn, fn, gn
        history.append(float(f.sum()))
    return st.solved(x, f, g, evals, history)


def newton(
    fg: Callable,
    hess: Callable,
    x0: torch.Tensor,
    *,
    max_iters: int,
    ftol: float = 1e-6,
    gtol: float = 1e-4,
    damping: float = 1e-8,
) -> Solved:
    """Minimise ``U`` independent convex objectives from ``x0 [U, P]`` by Newton's method:
    ``fg(x) -> (f [U], grad [U, P])`` (float64), ``hess(x, units) -> [len(units), P, P]`` the
    Hessians of the units still going (``units``: their indices, ascending; any float type: it
    only sets the direction, the line search and the stopping rule use ``fg``). Each iteration
    solves ``(H + damping * I) d = -g`` per unit (more damping where the Cholesky factorisation
    fails), then backtracks from step 1 until Armijo's condition holds; convergence and freezing
    of units as in :func:`lbfgs`. ``evals`` counts Hessians (iterations), ``history`` the
    summed objective after each."""
    x = x0.detach().clone().double()
    f, g = fg(x)
    U, P = x.shape
    eye = torch.eye(P, dtype=torch.float64)
    history, iters = [float(f.sum())], 0
    st = _Stopping(U)
    done = st.done
    while not bool(done.all()) and iters < max_iters:
        act = torch.nonzero(~done)[:, 0]  # the units still going: only their Hessians are computed
        H = hess(x, act).double()  # [A, P, P]
        iters += 1
        d = torch.zeros_like(x)
        mu = damping * (1.0 + H.diagonal(dim1=1, dim2=2).abs().amax(1))  # [A]
        todo = torch.ones(len(act), dtype=torch.bool)
        for _ in range(12):  # raise the damping where H + mu I is not numerically positive definite
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
        gd = (g * d).sum(1)
        t = torch.where(done | (gd >= 0), torch.zeros(U, dtype=torch.float64), torch.ones(U, dtype=torch.float64))
        for _ in range(MAX_BACKTRACKS):
            xn = x + t[:, None] * d
            fn, gn = fg(xn)
            ok = (fn <= f + ARMIJO * t * gd) | (t == 0)
            if bool(ok.all()):
                break
            t = torch.where(ok, t, t * 0.5)
        moved = ok & (t > 0)
        xn = torch.where(moved[:, None], xn, x)
        fn = torch.where(moved, fn, f)
        gn = torch.where(moved[:, None], gn, g)
        st.update(moved | done, f, fn, gn, ftol=ftol, gtol=gtol, count=iters)
        done = st.done
        x, f, g = xn, fn, gn
        history.append(float(f.sum()))
    return st.solved(x, f, g, iters, history)
