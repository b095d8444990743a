"""Subspace Newton for per-site linear softmax probes: one product each way per pass, an exact small Newton step.

=============================================  ====================================================
``fit_softmax(X, y, W, b, l2, settings)``        minimise each unit's regularised softmax objective
                                               from ``W [U, F, G*C]``, ``b [U, 1, G*C]`` in place;
                                               a :class:`~depthscope.probes.solvers.lbfgs.Solved`
``unit_blocks(U, n, F, G, C, ...)``            the unit ranges solved ``workers`` at a time (memory)
``newton_system(P, A, gram, l2)``              the per-class subspace's Hessian (the Newton step's)
``damped_solve(H, grad)``                      the damped Newton direction of that system
``hessian_rows(n, count)``                     the rows pass ``count`` forms that Hessian from
=============================================  ====================================================

The objective of a linear probe (per unit and head ``g``: mean cross-entropy of the logits
``Z = X W_g + b_g`` plus ``l2_g ||W_g||^2``) is a function of the logits plus a quadratic, so a
step restricted to a few directions costs no pass over the features once their logit images are
known. Each iteration (one *pass*) therefore does two products and nothing else of size
``n x F``:

1. the gradient ``X^T (softmax(Z) - Y) / n + 2 l2 W`` (also the stopping test);
2. the logit image ``X d`` of the new direction ``d = -gradient``;

both over ``C - 1`` columns per head: a row of ``softmax(Z) - Y`` sums to zero, so the last
class's column of ``X^T (softmax(Z) - Y)`` is minus the sum of the others', and the image of
the last column of ``d`` is minus the others' images and ``2 l2 sum_c X W_c`` (the logits less
the biases).

Then one damped Newton step, with Armijo backtracking, on the objective restricted to a subspace
*per class* (:meth:`_Block.step`, in phases: the subspace's inner products, the coordinates kept,
the Newton direction, the line search, the move): class ``c``'s column of the weights moves along
the ``c`` columns of the new direction and of the last ``memory`` steps, each with its own
coefficient, and its bias moves too (the most frequent class's bias is held, since one shift of
all biases changes nothing). A column's logit image is one row of its direction's image, so the
subspace has ``C (2 + memory)`` coordinates and needs no product:
``Z_c(theta) = Z_c + beta_c + sum_j alpha_jc (X V_j)_c``. Its Newton system (the softmax's
curvature along the coordinates' images, coupled across classes) costs ``O(n (C K)^2)`` for
``K = 2 + memory``; above ``2 HESSIAN_ROWS`` examples it is formed from a contiguous part of the
rows, a different part each pass (a subsampled Newton step, as in Byrd et al. 2011: the gradient
and the line search use every row, so a sample only changes the step's quality; the rows must be
in random order to be a sample, as depthscope's resident features are). This is the sequential
subspace optimisation of Narkiss and Zibulevsky (2005) with the subspace split by class: one
coefficient per direction would ignore that the classes' curvatures differ by orders of
magnitude (a rare class's softmax is flat where a frequent one's is steep), and the split
removes most of that ill-conditioning. No curvature preconditioner is used: the penalty
dominates the Hessian in most directions of probing features. ``benchmarks/bench_probe_fit.py``
compares this solver with scikit-learn and with the L-BFGS solver.

Numerics: the logits are carried along in float32 and updated from the directions' images
(never as a difference of logits, which would lose a small step's digits), recomputed from the
weights every ``REFRESH`` passes (the last class's image reads them, so it shares their drift
until then); the line search re-evaluates only the units whose trial failed, and the accepted
trial's log-softmax is the next gradient's; nearly dependent columns (``MIN_CORR_EIG``) drop that
class's memory for that step. A class absent from the labels (its bias' optimum is ``-inf``)
descends until its mean probability is ``ABSENT_TOL * gtol`` and stays there, so how far a solver
goes does not set the code length MDL gives such a label. A head whose gradient already passes
``gtol`` may find no decrease (float32's precision floor); a failed search of a head above it
forgets the memory (as L-BFGS does) and, twice in a row, stops the unit, reported as not
converged.

Units (sites) are independent problems solved side by side (batched products); a unit that
has stopped (the rule of :mod:`depthscope.probes.solvers.lbfgs`: largest gradient entry ``<= gtol``
and relative decrease ``<= ftol`` twice in a row) is frozen, and the others go on in contiguous
runs of units (views of the features, no gather). Units are taken in blocks sized so that the
solver's state (logits, softmax, directions, their images and the Newton system's products:
about ``10 + 2 memory`` copies of ``n x G*C`` floats per unit, and a contiguous copy of the
block's ``X^T``, which the logit images' product reads faster than a transposed view) stays
under ``STATE_BYTES``. On the CPU the blocks are solved side by side, one per intra-op thread
(each block's products on one thread: :func:`~depthscope.common.threads.side_by_side`), with
``STATE_BYTES`` shared by the blocks in flight, when there are at least ``BALANCE`` blocks per
thread (with fewer, the last ones would leave threads idle: the blocks then run one after
another, each product on every thread). A unit's arithmetic does not depend on its block, so
side by side a fit is the same whatever the thread count and the schedule.
The objectives returned are those of the logits carried along
(:class:`~depthscope.probes.solvers.methods.SubspaceSolver` reports a fresh evaluation).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from depthscope.common.threads import Stopped, side_by_side
from depthscope.probes.solvers.base import TrainSettings
from depthscope.probes.solvers.lbfgs import ARMIJO, MAX_BACKTRACKS, Solved, Stopping
from depthscope.probes.solvers.lbfgs import unit_runs as _runs
from depthscope.probes.store.span_rows import SpanRows

#: memory for the solver state of the blocks of units in flight (logits, directions, their
#: images): one block of 3 (deprel) to 7 (upos) sites of the default model's two-head probes on
#: the bundled EWT sample, or two side by side of 1 to 3
STATE_BYTES = 2.5e8
#: blocks of units run side by side only when each thread has at least this many to solve
BALANCE = 4
#: a class absent from the labels stops descending when its mean probability is this times gtol
ABSENT_TOL = 0.01
#: the smallest eigenvalue of the directions' correlation matrix below which the memory is dropped
MIN_CORR_EIG = 1e-4
#: the logits are recomputed from the weights every this many passes (float32 drift)
REFRESH = 20
#: the Newton system is formed from this many rows at least: from ``n // HESSIAN_ROWS`` equal
#: contiguous parts of the rows, a different one each pass (a sample costs a few more passes and
#: saves more in each; below twice this many rows the extra passes cost more than they save)
HESSIAN_ROWS = 4000
#: a backtracking step re-evaluates the failed units if they form at most this many contiguous
#: runs, else all units (the same values for those that passed)
MAX_RUNS = 4
#: the products skip each head's last class above this many features x examples (below it the
#: extra small operations cost more than the column saves)
SKIP_LAST_MIN = 2**20
#: the past steps kept in the subspace: more steps mean fewer passes but a Newton system that
#: grows as ``(2 + MEMORY)^2``
MEMORY = 2


def hessian_rows(n: int, count: int) -> slice:
    """The rows the Newton system of pass ``count`` is formed from: part ``count mod k`` of
    ``k = max(1, n // HESSIAN_ROWS)`` equal contiguous parts (all rows while ``n < 2 HESSIAN_ROWS``).
    A sample only if the rows are in random order: depthscope's resident features are (in a
    sorted order the steps are worse, never wrong: the gradient and the line search use all rows)."""
    k = max(1, n // HESSIAN_ROWS)
    h = n // k
    j = count % k
    return slice(j * h, (j + 1) * h if j < k - 1 else n)


def unit_bytes(n: int, F: int, G: int, C: int, memory: int = MEMORY) -> float:
    """The solver's state for one unit, in bytes (``n F``: its share of the block's copy of ``X^T``)."""
    return 4.0 * ((10 + 2 * memory) * n * G * C + (4 + memory) * F * G * C + n * F)


def unit_blocks(U: int, n: int, F: int, G: int, C: int, memory: int = MEMORY, workers: int = 1) -> list:
    """``(start, stop)`` ranges of units solved ``workers`` at a time so that the blocks in
    flight hold at most ``STATE_BYTES`` of state together."""
    size = max(1, int(STATE_BYTES // max(unit_bytes(n, F, G, C, memory) * max(workers, 1), 1.0)))
    return [(a, min(U, a + size)) for a in range(0, U, size)]


@torch.no_grad()
def fit_softmax(
    X: torch.Tensor,
    y: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor,
    l2: torch.Tensor,
    settings: TrainSettings,
    *,
    on_pass: Callable | None = None,
    memory: int = MEMORY,
) -> Solved:
    """Fit ``U`` linear softmax probes over features ``X [U, n, F]`` (any float type: the two
    products run in it, everything else in float32/float64; a
    :class:`~depthscope.probes.store.span_rows.SpanRows` is read as one dense copy per block of
    units, within the block's ``STATE_BYTES``) with labels ``y [n, G]`` (class
    indices, rows aligned with ``X``), ``G`` heads with penalties ``l2 [G]``; ``W [U, F, G*C]``
    and ``b [U, 1, G*C]`` are the start and receive the result. ``settings``: the stopping rule's
    ``tol`` and ``gtol``, and ``max_epochs`` (the pass cap). Returns a :class:`Solved` whose ``x``
    is None (the result is in ``W``, ``b``), ``evals`` the passes of the longest block and
    ``unit_evals`` each unit's; ``on_pass()`` once per pass over every unit (a block's pass counts
    for its share of the units, so a progress bar of ``max_epochs`` passes is not overrun by the
    blocks).

    Everything runs on ``X.device``: ``y`` and ``l2`` are moved there, ``W`` and ``b`` must
    already be there (they are updated in place; a :class:`ValueError` otherwise), and the
    solver's state is allocated there (each allocation names the device, whatever default is
    set outside). The returned tensors (``f``,
    ``grad_max``, ``converged``, ``unit_evals``) are on ``X.device`` too."""
    dev = X.device
    if W.device != dev or b.device != dev:
        raise ValueError(
            f"fit_softmax updates W and b in place: they must be on the features' device {dev}, "
            f"got W on {W.device} and b on {b.device}"
        )
    y, l2 = y.to(dev), l2.to(dev)
    U, n, F = X.shape
    G = y.shape[1]
    C = W.shape[2] // G
    max_passes, ftol, gtol = settings.max_epochs, settings.tol, settings.gtol
    workers, blocks = _schedule(dev, U, n, F, G, C, memory)
    done, lock = [0.0], threading.Lock()

    def solve(a: int, z: int, stop: threading.Event) -> Solved:
        tick = _share(on_pass, (z - a) / U, done, lock, stop)
        Xb = X.dense(sites=slice(a, z)) if isinstance(X, SpanRows) else X[a:z]  # span rows: a block's copy
        return _Block(Xb, y, W[a:z], b[a:z], l2, C, memory, gtol).run(max_passes, ftol, tick)

    sols = side_by_side([functools.partial(solve, a, z) for a, z in blocks], workers)
    history: list = []
    f = torch.zeros(U, dtype=torch.float64, device=dev)
    gmax = torch.zeros(U, dtype=torch.float64, device=dev)
    conv = torch.zeros(U, dtype=torch.bool, device=dev)
    at = torch.zeros(U, dtype=torch.long, device=dev)
    for (a, z), sol in zip(blocks, sols):
        f[a:z], gmax[a:z], conv[a:z], at[a:z] = sol.f, sol.grad_max, sol.converged, sol.unit_evals
        history = _add_padded(history, sol.history)
    return Solved(None, f, gmax, conv, max(sol.evals for sol in sols), history, at)


def _schedule(dev: torch.device, U: int, n: int, F: int, G: int, C: int, memory: int) -> tuple:
    """``(workers, blocks)``: the threads that solve blocks side by side (on the CPU, one per
    intra-op thread, at most as many as hold one unit each within ``STATE_BYTES``) and the
    blocks' unit ranges; one worker, each product on every thread, when the blocks would be
    fewer than ``BALANCE`` per thread."""
    workers = torch.get_num_threads() if dev.type == "cpu" else 1
    workers = max(1, min(workers, int(STATE_BYTES // unit_bytes(n, F, G, C, memory))))
    blocks = unit_blocks(U, n, F, G, C, memory, workers)
    if len(blocks) < BALANCE * workers:  # too few to keep the threads busy
        return 1, unit_blocks(U, n, F, G, C, memory)
    return workers, blocks


def _share(on_pass: Callable | None, share: float, done: list, lock: threading.Lock, stop: threading.Event):
    """A block's pass callback, worth ``share`` of a whole pass: it stops the block once
    ``stop`` is set (:func:`~depthscope.common.threads.side_by_side`), adds ``share`` to the
    running total ``done[0]`` (shared by the blocks, under ``lock``: blocks may run side by side)
    and calls ``on_pass`` once for each whole pass completed."""

    def tick() -> None:
        if stop.is_set():
            raise Stopped
        if on_pass is None:
            return
        with lock:
            before = int(done[0] + 1e-9)
            done[0] += share
            for _ in range(int(done[0] + 1e-9) - before):
                on_pass()

    return tick


def _add_padded(a: list, b: list) -> list:
    """Elementwise sum of two objective histories, the shorter held at its last value."""
    if not a:
        return list(b)
    k = max(len(a), len(b))
    a, b = a + a[-1:] * (k - len(a)), b + b[-1:] * (k - len(b))
    return [x + y for x, y in zip(a, b)]


def newton_system(P: torch.Tensor, A: torch.Tensor, gram: torch.Tensor, l2: torch.Tensor, work=None) -> torch.Tensor:
    """The Hessian, at ``theta = 0``, of the objective restricted to the per-class subspace:
    softmax ``P [B, C, n]`` at the current logits; ``A [B, C, K, n]`` per class the logit images of
    its ``K = 1 + J`` coordinates (``k = 0`` its bias: ones; ``k = 1 + j`` the coefficient of
    direction ``j``'s column ``c``, whose image is row ``c`` of ``X V_j``); the directions'
    per-class Gram ``gram [B, C, J, J]`` and the penalties ``l2 [B]``. Returns ``[B, C K, C K]``
    float64, coordinates ``(c, k)`` row-major: ``(1/n) sum_i A_i^T (diag(p_i) - p_i p_i^T) A_i``
    plus ``2 l2`` times the Gram on the coefficients of each class's diagonal block. ``work``
    (``[B, C, K, n]``, optional) receives ``P A``: no allocation of that size."""
    B, C, K, n = A.shape
    M = torch.mul(P[:, :, None], A, out=work)  # [B, C, K, n]: p times each coordinate's image
    Mf = M.view(B, C * K, n)
    H = torch.bmm(Mf, Mf.transpose(1, 2)).double().neg_()  # - sum_i (p a)(p a)^T, all classes coupled
    # the diag(p) part, per class: sum_i p a_k a_k' (a_0 = 1: the bias rows), plus the penalty
    D = torch.bmm(M.view(B * C, K, n), A.view(B * C, K, n).transpose(1, 2)).double().view(B, C, K, K)
    D[:, :, 1:, 1:] += 2 * n * l2[:, None, None, None] * gram
    H.view(B, C, K, C, K).diagonal(dim1=1, dim2=3).add_(D.permute(0, 2, 3, 1))  # [B, K, K, C]
    return H.div_(n)


def damped_solve(H: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The Newton direction ``-(H + D)^-1 grad`` per row of ``H [B, P, P]``, ``grad [B, P]``, with
    ``D`` a damping relative to each diagonal entry (``1e-8``, raised a hundredfold where the
    Cholesky factorisation fails, up to eight times) plus a floor of ``1e-12`` times the largest;
    a row that never factorises gets direction 0."""
    B = H.shape[0]
    diag = H.diagonal(dim1=1, dim2=2).abs()
    floor = 1e-12 * diag.amax(1, keepdim=True).clamp_min(1e-30)
    damp = torch.full((B, 1), 1e-8, dtype=torch.float64, device=H.device)  # relative to each diagonal entry
    d = torch.zeros_like(grad)
    todo = torch.ones(B, dtype=torch.bool, device=H.device)
    for _k in range(8):
        Lh, info = torch.linalg.cholesky_ex(H + torch.diag_embed(damp * diag + floor))
        ok = (info == 0) & todo
        d = torch.where(ok[:, None], -torch.cholesky_solve(grad[:, :, None], Lh)[..., 0], d)
        todo &= ~ok
        if not bool(todo.any()):
            break
        damp = torch.where(todo[:, None], damp * 100.0, damp)
    return d


@dataclass
class _Subspace:
    """What one step of units ``s`` (``u`` units, ``B = u G`` unit-heads) works on: the directions'
    class columns ``VW [B, C, J, F]`` and their logit images ``A [B, C, K, n]`` (slot 0 the biases'
    ones), their Gram ``gram [B, C, J, J]`` and inner products with the weights ``wv [B, C, J]``,
    ``||W||^2`` ``ww [B]``, the penalties ``l2 [B]``, the logits ``Z0 [B, C, n]``, the labels
    ``yb [B, 1, n]``, and the workspaces the trial step writes: its weight part's image ``S``, its
    logits ``T`` and their log-softmax ``L`` (views of the block's buffers)."""

    s: slice
    u: int
    B: int
    J: int
    K: int
    VW: torch.Tensor
    A: torch.Tensor
    gram: torch.Tensor
    wv: torch.Tensor
    ww: torch.Tensor
    l2: torch.Tensor
    Z0: torch.Tensor
    yb: torch.Tensor
    S: torch.Tensor
    T: torch.Tensor
    L: torch.Tensor


class _Block:
    """The solver's state for a block of ``u`` units (see the module docstring), class-major:
    logits and softmax ``[u, G, C, n]``; per class the logit images of its subspace's
    coordinates ``A [u, G, C, K, n]`` (slot 0 ones, the biases'; slot 1 the new direction's
    column; slots 2.. the memory's), so the Newton system, the trial logits and the memory
    update are batched products over contiguous rows; directions ``[u, G, C, J + 1, F]`` (per
    class, its columns of the directions: slot 0 the new direction, slots 1..m the memory, a
    ring: each step overwrites the oldest; slot J a copy of the weights, for their inner
    products). Every array of size ``n`` is allocated here once: a pass allocates nothing that
    large (the C allocator would map and zero large blocks anew at each allocation)."""

    def __init__(self, X, y, W, b, l2, C, memory, gtol):
        self.X, self.W, self.b = X, W, b  # W, b: views of the caller's tensors, updated in place
        # every array is made on the features' device by name: a torch.device context instead
        # would route each of the solver's many small calls through Python
        self.dev = dev = X.device
        self.XT = None  # X^T, contiguous (:meth:`_XT`)
        u, n, F = X.shape
        G = y.shape[1]
        self.u, self.n, self.F, self.G, self.C, self.m = u, n, F, G, C, memory
        self.dt = X.dtype if X.dtype != torch.float16 else torch.float32  # no half products on CPU
        self.yg = y.T.contiguous().view(1, G, 1, n)  # labels, class-major
        # the logits are invariant to one shift of all of a head's biases: the most frequent
        # class's bias is held fixed (its direction left out of the subspace)
        counts = torch.stack([torch.bincount(y[:, g], minlength=C) for g in range(G)])  # [G, C]
        self.free_b = torch.ones(G, C, dtype=torch.bool, device=dev)
        self.free_b[torch.arange(G, device=dev), counts.argmax(1)] = False
        self.absent = counts == 0  # [G, C]: their biases' optimum is -inf (see step)
        self.gtol = gtol
        self.l2 = l2.float()
        self.l2col = l2.float().repeat_interleave(C)  # [G*C]
        J, K = 1 + memory, 2 + memory
        self.slots = torch.arange(J, device=dev)  # the direction slots, and their identity (_memory_used)
        self.eye = torch.eye(J, dtype=torch.float64, device=dev)
        self.Z = torch.empty(u, G, C, n, device=dev)
        if bool(W.any()):
            self.refresh(slice(0, u))
        else:  # from zero weights the logits are the biases (the product would add zeros)
            self.Z.copy_(b.view(u, G, C, 1).expand(u, G, C, n))
        # class-major: per class, its columns of the directions, and (slot J) of the weights
        self.VW = torch.zeros(u, G, C, J + 1, F, device=dev)
        self.A = torch.zeros(u, G, C, K, n, device=dev)
        self.A[:, :, :, 0] = 1.0
        # the products' columns per head: C - 1 where a product is large enough to gain from it
        self.k = C - 1 if n * F >= SKIP_LAST_MIN and C > 1 else C
        self.logp_of = None  # the units whose logits' log-softmax the workspace M holds (step)
        self.count = 0  # passes made (the Newton system's rows: hessian_rows)
        # steps taken per unit (memory slots held: min(steps, m))
        self.steps = torch.zeros(u, dtype=torch.long, device=dev)
        self.f = torch.zeros(u, dtype=torch.float64, device=dev)
        self.gW = torch.zeros(u, F, G * C, device=dev)
        self.gb = torch.zeros(u, G * C, device=dev)
        self.g_head = torch.zeros(u, G, device=dev)  # largest gradient entry per unit and head (the stopping test's)
        self.P = torch.zeros(u, G, C, n, device=dev)
        self.phi = torch.zeros(u, G, dtype=torch.float64, device=dev)
        self.wsq = torch.zeros(u, G, dtype=torch.float64, device=dev)  # ||W_g||^2 per unit and head
        # workspace: the residual (also the new direction's image), the trial logits, the trial
        # step's image, and P A (also the trial's log-softmax)
        self.R, self.T, self.S = (torch.empty(u, G, C, n, device=dev) for _ in range(3))
        self.M = torch.empty(u, G, C, K, n, device=dev)
        self.minus = torch.full((u, G, 1, n), -1.0 / n, device=dev)

    def _X(self, s: slice) -> torch.Tensor:
        return self.X[s] if self.X.dtype == self.dt else self.X[s].to(self.dt)

    def _XT(self, s: slice) -> torch.Tensor:
        """``X^T [u, F, n]`` of units ``s``, contiguous (made on first use): the logit images'
        products read it about a third faster than the transposed view of ``X``."""
        if self.XT is None:
            self.XT = self.X.transpose(1, 2).to(self.dt).contiguous()
        return self.XT[s]

    # --- one product each way -------------------------------------------------------------
    def gradient(self, s: slice) -> None:
        """Objective and gradient of units ``s`` at their logits (one product)."""
        u = s.stop - s.start
        n, F, G, C = self.n, self.F, self.G, self.C
        yi = self.yg.expand(u, G, 1, n)
        R = self.R[s]
        if self.logp_of == (s.start, s.stop):  # the accepted trial's, computed by the line search
            logp = self.M[s].view(-1)[: u * G * C * n].view(u, G, C, n)
        else:
            logp = torch.ops.aten._log_softmax.out(self.Z[s], 2, False, out=R)
        self.logp_of = None
        ce = -logp.gather(2, yi)[:, :, 0].double().sum(-1) / n  # [u, G]
        W = self.W[s]
        self.wsq[s] = wsq = W.view(u, -1, G, C).double().pow(2).sum((1, 3))
        pen = self.l2.double() * wsq
        self.phi[s] = phi = ce + pen
        self.f[s] = phi.sum(1)
        P = torch.exp(logp, out=self.P[s])  # the softmax, for the step's Newton system
        R = torch.div(P, n, out=R)
        R.scatter_add_(2, yi, self.minus[:u])  # (P - Y) / n
        # the product over each head's first C - 1 classes only: a row of P - Y sums to zero, so
        # the last class's column of X^T (P - Y) is minus the sum of the others'
        k = self.k
        Rk = R[:, :, :k]
        if G > 1 and k < C:  # the heads' rows are not one matrix: copied into the trial buffer (free here)
            Rk = self.T[s].view(-1)[: u * G * k * n].view(u, G, k, n).copy_(Rk)
        gk = torch.bmm(Rk.reshape(u, G * k, n).to(self.dt), self._X(s)).float()  # (R^T X)^T: X's feature-major layout
        if k < C:
            gt = torch.empty(u, G, C, F, device=self.dev)
            gt[:, :, :k] = gk.view(u, G, k, F)
            torch.sum(gk.view(u, G, k, F), 2, out=gt[:, :, k]).neg_()
            gk = gt
        gW = gk.view(u, G * C, F).transpose(1, 2)
        self.gW[s] = gW = gW.addcmul(W, self.l2col, value=2.0)
        self.gb[s] = gb = R.view(u, G * C, n).sum(-1)
        self.g_head[s] = torch.maximum(gW.abs().view(u, -1, G, C).amax((1, 3)), gb.abs().view(u, G, C).amax(2))

    def refresh(self, s: slice) -> None:
        """Recompute the logits of units ``s`` from their weights (one product): the logits
        carried along accumulate float32 rounding."""
        u = s.stop - s.start
        Wt = self.W[s].transpose(1, 2).contiguous().to(self.dt)
        Zt = torch.baddbmm(self.b[s].transpose(1, 2).to(self.dt), Wt, self._XT(s)).float()
        self.Z[s] = Zt.view(u, self.G, self.C, self.n)

    def direction(self, s: slice) -> None:
        """The new direction (minus the gradient) and its logit image (one product)."""
        u, n, F, G, C = s.stop - s.start, self.n, self.F, self.G, self.C
        d = -self.gW[s]
        dc = d.view(u, F, G, C).permute(0, 2, 3, 1)  # [u, G, C, F]
        self.VW[s, :, :, 0] = dc
        # the image of each head's first C - 1 columns (one product); the last column is minus
        # the sum of the others and of 2 l2 W (the gradient's columns of X^T (P - Y) sum to
        # zero): its image is minus theirs and 2 l2 sum_c X W_c, the logits less the biases
        k = self.k
        dt = dc[:, :, :k].reshape(u, G * k, F).to(self.dt)
        if self.dt == torch.float32:  # (X d)^T, into the workspace
            out = self.R[s].view(-1)[: u * G * k * n].view(u, G * k, n)
            img = torch.bmm(dt, self._XT(s), out=out)
        else:
            img = torch.bmm(dt, self._XT(s)).float()
        img = img.view(u, G, k, n)
        A1 = self.A[s, :, :, 1]  # [u, G, C, n]
        A1[:, :, :k] = img
        if k == C:
            return
        # sum_c X W_c [u, G, n], into the trial step's buffer (free here: the step's image is in A)
        xw = torch.sum(self.Z[s], 2, out=self.S[s][:, :, 0]).sub_(self.b[s].view(u, G, C).sum(2, keepdim=True))
        last = torch.sum(img, 2, out=A1[:, :, C - 1])
        last.add_(xw.mul_(self.l2.view(1, G, 1) * 2.0)).neg_()

    # --- the small problem: one step in named phases ------------------------------------------
    def step(self, s: slice) -> torch.Tensor:
        """Minimise over the subspace of units ``s`` and move there; returns which units found a
        decrease (``[u]``; False: a line search along a Newton direction failed, the precision
        floor). Coordinates ``theta [B, C, K]`` per unit and head: per class, its bias
        (``k = 0``) and the coefficients of the directions' class columns (``k = 1 + j``, whose
        logit images are the rows ``A[:, c, k]``). The phases: the subspace's inner products,
        the coordinates kept, the damped Newton direction, the line search, the move."""
        sub = self._subspace(s)
        keep = self._kept(sub)
        d, gd = self._newton_direction(sub, keep)
        theta, failed = self._line_search(sub, d, gd)
        return self._move(sub, theta, failed)

    def _subspace(self, s: slice) -> _Subspace:
        """Phase 1: the views of units ``s`` a step reads, and the directions' inner products per
        unit, head and class column, in one batched product: ``<V_j, V_k>`` (their Gram) and
        ``<W, V_j>``. The subspace's gradient at ``theta = 0`` is the full gradient's, and
        ``<dW, V_j> = -<V_0, V_j>`` (the new direction is minus the gradient)."""
        u, n, F, G, C = s.stop - s.start, self.n, self.F, self.G, self.C
        J, B = 1 + self.m, u * G
        K = 1 + J
        self.VW[s, :, :, J] = self.W[s].view(u, F, G, C).permute(0, 2, 3, 1)  # the weights, class-major
        VWx = self.VW[s].view(B, C, J + 1, F)
        VW = VWx[:, :, :J]  # [B, C, J, F]
        ip = torch.bmm(VW.reshape(B * C, J, F), VWx.view(B * C, J + 1, F).transpose(1, 2))
        ip = ip.view(B, C, J, J + 1).double()
        return _Subspace(
            s=s,
            u=u,
            B=B,
            J=J,
            K=K,
            VW=VW,
            A=self.A[s].view(B, C, K, n),
            gram=ip[..., :J],
            wv=ip[..., J],
            ww=self.wsq[s].view(B),
            l2=self.l2.double().repeat(u),
            Z0=self.Z[s].view(B, C, n),
            yb=self.yg.expand(u, G, 1, n).reshape(B, 1, n),
            S=self.S[s].view(B * C, 1, n),
            T=self.T[s].view(B, C, n),
            L=self.M[s].view(-1)[: B * C * n].view(B, C, n),
        )

    def _memory_used(self, sub: _Subspace) -> torch.Tensor:
        """The direction slots each class's step may use ``[B, C, J]``: the new direction always,
        the memory slots filled so far, less a class's whole memory where its columns are nearly
        dependent (they would be combined with large cancelling coefficients, and the logits
        carried along would drift from ``X W + b``)."""
        B, C, J = sub.B, self.C, sub.J
        used = (self.slots[None, :] <= self.steps[sub.s][:, None]).repeat_interleave(self.G, 0)  # [B, J]
        used = used[:, None, :].expand(B, C, J)
        norm = sub.gram.diagonal(dim1=2, dim2=3).clamp_min(1e-300).sqrt()
        corr = sub.gram / (norm[..., :, None] * norm[..., None, :])
        both = used[..., :, None] & used[..., None, :]
        corr = torch.where(both, corr, 0.0) + torch.diag_embed((~used).double())
        # not positive definite after the shift: an eigenvalue below it
        used = used & (torch.linalg.cholesky_ex(corr - MIN_CORR_EIG * self.eye)[1] == 0)[..., None]
        used[..., 0] = True
        return used

    def _kept(self, sub: _Subspace) -> torch.Tensor:
        """Phase 2: the coordinates the step moves ``[B, C K]``: the biases, less the held one
        (the most frequent class's) and those of absent classes that are done, and the direction
        slots of :meth:`_memory_used`. An absent class's bias descends until its gradient (the
        class's mean probability, and its share of the objective) is ``ABSENT_TOL * gtol``, then
        stays: its optimum is ``-inf``, and how far a solver goes would set the code length of
        such a label."""
        u, B, C = sub.u, sub.B, self.C
        done_b = self.absent.repeat(u, 1) & (self.gb[sub.s].view(B, C).abs() <= ABSENT_TOL * self.gtol)
        bias = (self.free_b.repeat(u, 1) & ~done_b)[:, :, None]
        return torch.cat([bias, self._memory_used(sub)], 2).view(B, C * sub.K)

    def _newton_direction(self, sub: _Subspace, keep: torch.Tensor) -> tuple:
        """Phase 3: the damped Newton direction ``d [B, C, K]`` over the kept coordinates and its
        slope ``gd [B]``. The gradient uses every row; the Newton system (at the gradient's
        softmax) a part of them (:func:`hessian_rows`); coordinates not kept get identity rows."""
        s, B, C, K = sub.s, sub.B, self.C, sub.K
        grad = torch.cat([self.gb[s].view(B, C, 1).double(), -sub.gram[:, :, 0]], 2)  # [B, C, K]
        r = hessian_rows(self.n, self.count)
        h = r.stop - r.start
        work = self.M[s].view(-1)[: B * C * K * h].view(B, C, K, h)
        H = newton_system(self.P[s].view(B, C, self.n)[..., r], sub.A[..., r], sub.gram, sub.l2, work=work)
        grad = grad.view(B, C * K) * keep
        pair = keep[:, :, None] & keep[:, None, :]
        H = torch.where(pair, H, 0.0) + torch.diag_embed((~keep).double())
        d = damped_solve(H, grad) * keep
        gd = (grad * d).sum(1)
        return d.view(B, C, K), gd

    def _trial(self, sub: _Subspace, theta: torch.Tensor, a: int, z: int) -> torch.Tensor:
        """The objective at ``theta`` of rows ``a:z`` (unit-heads), leaving their trial logits in
        ``T``, their log-softmax in ``L`` and the step's weight part's image in ``S``. The logits
        come from the images (``Z0 + beta + sum_j alpha_j (X V_j)``), never as a difference of
        logits; the penalty from the inner products (``||W + sum_j alpha_j V_j||^2``)."""
        C, J, n = self.C, sub.J, self.n
        th, Sr = theta[a:z], sub.S[a * C : z * C]
        torch.bmm(th[:, :, 1:].float().reshape(-1, 1, J), sub.A[a:z, :, 1:].reshape(-1, J, n), out=Sr)
        Za = torch.add(sub.Z0[a:z], Sr.view(-1, C, n), out=sub.T[a:z]).add_(th[:, :, :1].float())
        logp = torch.ops.aten._log_softmax.out(Za, 1, False, out=sub.L[a:z])
        ce = -logp.gather(1, sub.yb[a:z])[:, 0].double().sum(1) / n
        al, gr = th[:, :, 1:], sub.gram[a:z]
        quad = sub.ww[a:z] + 2 * (sub.wv[a:z] * al).sum((1, 2))
        quad = quad + (al[..., None, :] @ gr @ al[..., :, None]).sum((1, 2, 3))
        return ce + sub.l2[a:z] * quad

    def _line_search(self, sub: _Subspace, d: torch.Tensor, gd: torch.Tensor) -> tuple:
        """Phase 4: Armijo backtracking from step 1 along ``d``; each backtrack re-evaluates only
        the rows that failed (a few contiguous runs of them, else all rows: small calls cost more).
        Returns ``(theta, failed)``: a row with no decrease along a Newton direction (its head at
        its precision floor) stays put (theta 0, trial logits reset to the current ones)."""
        B = sub.B
        phi = self.phi[sub.s].reshape(B)  # at theta = 0: the gradient's evaluation
        t = (gd < 0).double()
        val = torch.empty(B, dtype=torch.float64, device=self.dev)
        todo = torch.ones(B, dtype=torch.bool, device=self.dev)  # the rows whose step changed (all, then the failed)
        for _k in range(MAX_BACKTRACKS):
            theta = t[:, None, None] * d
            runs = _runs(todo)
            for a, z in runs if len(runs) <= MAX_RUNS else [(0, B)]:
                val[a:z] = self._trial(sub, theta, a, z)
            ok = (val <= phi + ARMIJO * t * gd) | (t == 0)
            if bool(ok.all()):
                break
            t = torch.where(ok, t, t * 0.5)
            todo = ~ok
        failed = ~ok & (gd < 0)
        if bool(failed.any()):
            theta = torch.where(failed[:, None, None], 0.0, theta)
            sub.S.view(B, self.C, self.n)[failed] = 0.0
            sub.T[failed] = sub.Z0[failed]
            sub.L[failed] = torch.log_softmax(sub.Z0[failed], 1)
        return theta, failed

    def _move(self, sub: _Subspace, theta: torch.Tensor, failed: torch.Tensor) -> torch.Tensor:
        """Phase 5: move the weights and biases by ``theta``, make the trial logits the logits
        (their log-softmax is the next gradient's), and put the step's weight part and its image
        in the oldest memory slot (the subspace has no order). A failed search of a head still
        above ``gtol`` forgets the unit's memory, as L-BFGS does (the next pass searches along the
        gradient and the biases alone); a head already below it may sit at float32's precision
        floor, where no decrease is to be found. Returns which units succeeded ``[u]``."""
        s, u, n, F, G, C = sub.s, sub.u, self.n, self.F, self.G, self.C
        self.logp_of = (s.start, s.stop)
        al = theta[:, :, 1:].float()  # [B, C, J]
        sW = (al[:, :, None, :] @ sub.VW)[:, :, 0]  # [B, C, F]
        self.W[s] += sW.view(u, G, C, F).permute(0, 3, 1, 2).reshape(u, F, G * C)
        self.b[s] += theta[:, :, 0].float().reshape(u, 1, G * C)
        if s.start == 0 and s.stop == self.u:  # the trial logits become the logits: no copy
            self.Z, self.T = self.T, self.Z
        else:
            self.Z[s] = sub.T.view(u, G, C, n)
        ok = ~(failed.view(u, G) & (self.g_head[s] > self.gtol)).any(1)
        if self.m > 0:
            ui = torch.arange(s.start, s.stop, device=self.dev)
            k = 1 + self.steps[s] % self.m
            self.VW[ui, :, :, k] = sW.view(u, G, C, F)
            self.A[ui, :, :, 1 + k] = sub.S.view(u, G, C, n)  # its image
        self.steps[s] = torch.where(ok, self.steps[s] + 1, torch.zeros_like(self.steps[s]))
        return ok

    def run(self, max_passes: int, ftol: float, on_pass) -> Solved:
        u = self.u
        st = Stopping(u, device=self.dev)
        self.gradient(slice(0, u))
        passes, history = 1, [float(self.f.sum())]
        if on_pass is not None:
            on_pass()
        while not bool(st.done.all()) and passes < max_passes:
            f_prev = self.f.clone()
            moved = torch.ones(u, dtype=torch.bool, device=self.dev)
            for a, z in _runs(~st.done):
                s = slice(a, z)
                if passes % REFRESH == 0:
                    self.refresh(s)
                self.direction(s)
                moved[s] = self.step(s)
                self.gradient(s)
            passes += 1
            self.count += 1
            if on_pass is not None:
                on_pass()
            # the stopping rule reads the largest gradient entry only: the per-head maxima stand in
            st.update(moved | st.done, f_prev, self.f, self.g_head, ftol=ftol, gtol=self.gtol, count=passes)
            history.append(float(self.f.sum()))
        return st.solved(None, self.f, self.g_head, passes, history)
