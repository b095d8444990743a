"""LEACE concept erasure as an edit of the residual stream, and its random controls of the same rank.

=====================================  ===========================================================
:class:`Erasure`                       the affine map ``x -> x - ((x - bias) @ right.T) @ left.T``
                                       (float32, on the tensor's device): applied to features and,
                                       as :meth:`Erasure.hook`, inside the forward pass
:class:`EditMeter`                     the root mean square of the edits a hook made (per token)
``fit_erasure(x, labels, n_classes)``  LEACE (:class:`concept_erasure.LeaceFitter`, fitted in
                                       float64 without the covariance-trace constraint):
                                       ``(Erasure, fitter)``
``edit_rms(erasure, x=, fitter=)``     ``sqrt(mean ||x - erasure(x)||^2)``: the edit's size in
                                       the stream's own (raw) units, on rows ``x`` or, from the
                                       fitter's statistics, on the fitting data
``random_erasure(fitter, rank, seed,   the control: ``rank`` seeded random directions removed;
control=, target_rms=)``               ``"raw"`` (default) orthogonal removal in raw units whose
                                       edit has LEACE's rms on the fitting data; ``"whitened"``
                                       LEACE's own form with random whitened directions
``one_hot(labels, n_classes)``         the concept ``z`` LEACE erases
=====================================  ===========================================================

LEACE (Belrose et al. 2023) finds the affine edit ``P x + b`` of least mean squared size after
which the features' covariance with the one-hot label is zero; then no linear classifier
does better than a constant (in expectation, for any convex loss) on the data it was fitted on.
With whitening ``W = Sigma^-1/2`` and ``U`` an orthonormal basis of the range of
``W Sigma_xz``, ``P = I - W^+ U U^T W``: it removes ``rank(Sigma_xz) <= C - 1`` directions in
whitened coordinates.

The controls remove as many directions that aim at nothing, so that ``used`` compares aimed and
unaimed damage of one size. Size is measured in the stream's own units: the root mean square,
over the fitting rows, of the change ``||x - x'||`` (:func:`edit_rms`; what the next layer sees).

* ``"raw"`` (the default): ``x' = x - a (x - mean) Q Q^T``, an orthogonal removal of ``rank``
  random directions ``Q``. Uniformly random directions of a residual stream carry a very different
  share of its variance than LEACE's, so ``Q`` is drawn tilted toward the stream's high- or
  low-variance directions: ``Q(g) = orth(C^(g/2) G)`` with ``C`` the covariance, ``G`` a seeded
  Gaussian ``[d, rank]`` (``g = 0``: uniformly random), and ``g`` found by bisection so that
  ``mean ||(x - mean) Q||^2`` equals LEACE's mean squared edit (continuous in ``g``, from the
  ``rank`` smallest to the ``rank`` largest eigenvalues' sum; LEACE's edit is below the latter:
  the orthogonal removal of ``Sigma_xz``'s range also zeroes the covariance, and LEACE is the
  least such edit). The factor ``a`` closes what the bisection leaves (1 to 1e-4 when the target
  is in range; the only change made when it is not), so the control's edit equals LEACE's on the
  fitting data exactly.
* ``"whitened"``: LEACE's own form with a random orthonormal ``Q`` in whitened coordinates,
  ``P = I - W^+ Q Q^T W`` (the same whitening and bias): the same size in the units of the
  covariance, not in the stream's (its raw edit is often several times LEACE's or a fraction of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from concept_erasure import LeaceFitter

from depthscope.analyses.causal.erasure.config import CONTROL_KINDS
from depthscope.common.errors import InputError

#: the bisection stops when the control's mean squared edit is within this fraction of the target
TILT_TOL = 1e-4
#: the largest tilt ``|g|`` tried (at 64 the removal is all but the top or bottom ``rank`` components)
TILT_MAX = 64.0


@dataclass
class EditMeter:
    """Running ``sum ||delta||^2`` and token count of the edits a :meth:`Erasure.hook` made (real
    tokens only, when the call has a mask); :attr:`rms` the root mean square per token."""

    sq: float = 0.0
    n: int = 0

    def add(self, delta: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Count the edits ``delta [B, P, d]`` at the positions ``mask [B, P]`` marks (None: all)."""
        sq = delta.double().pow(2).sum(-1)
        if mask is not None:
            sq = sq[mask.to(sq.device).bool()]
        self.sq += float(sq.sum())
        self.n += int(sq.numel())

    @property
    def rms(self) -> float:
        return (self.sq / self.n) ** 0.5 if self.n else float("nan")


@dataclass(frozen=True)
class Erasure:
    """``x -> x - ((x - bias) @ right.T) @ left.T``: ``left [d, k]``, ``right [k, d]``, ``bias [d]``
    (float32). ``rank`` is ``k``, the number of directions removed."""

    left: torch.Tensor
    right: torch.Tensor
    bias: torch.Tensor
    info: dict = field(default_factory=dict, compare=False)

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    def edit(self, x: torch.Tensor) -> torch.Tensor:
        """The change ``x - self(x)`` (float32)."""
        dev = x.device
        return ((x.float() - self.bias.to(dev)) @ self.right.to(dev).T) @ self.left.to(dev).T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The erased ``x [..., d]``, computed in float32 and returned in ``x``'s dtype."""
        return (x.float() - self.edit(x)).to(x.dtype)

    def hook(self, start: int = 0, meter: EditMeter | None = None):
        """A write hook ``fn(stream, ctx)`` for ``model.run(hooks={site: fn})``: the stream erased
        at every position from ``start`` on (1 leaves a leading BOS token alone); ``meter``
        (optional) counts the edits at the call's real tokens."""

        def erase(t: torch.Tensor, ctx) -> torch.Tensor:
            out = t.clone()
            delta = self.edit(t[:, start:])
            out[:, start:] = (t[:, start:].float() - delta).to(t.dtype)
            if meter is not None:
                mask = getattr(ctx, "mask", None)
                meter.add(delta, None if mask is None else mask[:, start:])
            return out

        return erase


def one_hot(labels, n_classes: int) -> torch.Tensor:
    """``[N, n_classes]`` float64 one-hot rows of integer ``labels`` (all below ``n_classes``)."""
    y = torch.as_tensor(labels, dtype=torch.long)
    return torch.nn.functional.one_hot(y, n_classes).double()


def _compact(left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor, **info) -> Erasure:
    """An :class:`Erasure` in float32 with the zero columns of ``left`` (singular values LEACE
    truncated) dropped."""
    keep = left.abs().sum(0) > 0
    return Erasure(
        left[:, keep].float().contiguous(), right[keep].float().contiguous(), bias.float().contiguous(), info
    )


def fit_erasure(x: torch.Tensor, labels, n_classes: int) -> tuple[Erasure, LeaceFitter]:
    """LEACE fitted on features ``x [N, d]`` and integer ``labels [N]`` (float64 statistics,
    ``constrain_cov_trace=False``): the :class:`Erasure` (the fitter's own ``LeaceEraser``, its
    truncated directions dropped) and the fitter (for :func:`random_erasure` and :func:`edit_rms`)."""
    fitter = LeaceFitter(x.shape[1], n_classes, dtype=torch.float64, constrain_cov_trace=False)
    fitter.update(x.double(), one_hot(labels, n_classes))
    er = fitter.eraser
    return _compact(er.proj_left, er.proj_right, er.bias), fitter


def fitting_covariance(fitter: LeaceFitter) -> torch.Tensor:
    """The fitting rows' covariance about their mean (float64, divided by N: the plain mean of
    the outer products), from the fitter's running sums (no shrinkage, unlike ``fitter.sigma_xx``)."""
    s = fitter.sigma_xx_
    return (s + s.mH) / (2 * int(fitter.n))


def edit_rms(erasure: Erasure, x: torch.Tensor | None = None, *, fitter: LeaceFitter | None = None) -> float:
    """The root mean square per row of ``erasure``'s edit ``||x - erasure(x)||``: over the rows of
    ``x [N, d]``, or (``fitter``) over the rows the fitter saw, exactly, from their mean and
    covariance (the bias of every eraser here is that mean)."""
    if x is not None:
        return float(erasure.edit(x).double().pow(2).sum(-1).mean().sqrt())
    if fitter is None:
        raise InputError("edit_rms needs rows x or the fitter of the fitting rows")
    m = erasure.left.double() @ erasure.right.double()  # x - x' = (x - bias) m^T
    cov = fitting_covariance(fitter)
    shift = fitter.mean_x - erasure.bias.double()
    ms = torch.trace(m @ cov @ m.T) + (m @ shift).pow(2).sum()
    return float(ms.clamp_min(0).sqrt())


def _whitening(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, W^+)``: the (pseudo) inverse square root of ``sigma`` and its inverse, thresholded
    as ``concept_erasure`` does."""
    L, V = torch.linalg.eigh(sigma)
    mask = L > (L[-1] * sigma.shape[-1] * torch.finfo(L.dtype).eps)
    L = L.clamp_min(0.0)
    W = V * torch.where(mask, L.rsqrt(), 0.0) @ V.mH
    W_inv = V * torch.where(mask, L.sqrt(), 0.0) @ V.mH
    return W, W_inv


def _gaussian(d: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(d, rank, generator=g, dtype=torch.float64)


def whitened_erasure(fitter: LeaceFitter, rank: int, seed: int) -> Erasure:
    """The whitened control: ``P = I - W^+ Q Q^T W`` with ``Q`` a random orthonormal ``[d, rank]``
    basis (seeded), the same whitening ``W`` and bias as ``fitter``'s eraser."""
    W, W_inv = _whitening(fitter.sigma_xx)
    q = _gaussian(W.shape[0], rank, seed)
    q = torch.linalg.qr(q)[0] if rank else q
    return _compact(W_inv @ q, q.T @ W, fitter.mean_x, control="whitened")


class _Tilt:
    """``Q(g) = orth(C^(g/2) G)`` and its mean squared removal ``tr(Q^T C Q)`` (float64)."""

    def __init__(self, cov: torch.Tensor, g0: torch.Tensor):
        L, self.V = torch.linalg.eigh(cov)
        L = L.clamp_min(0.0)
        top = float(L[-1]) if float(L[-1]) > 0 else 1.0
        self.log_l = torch.log(torch.clamp(L / top, min=1e-12))
        self.L, self.g0 = L, self.V.mH @ g0  # G in the eigenbasis

    def basis(self, tilt: float) -> torch.Tensor:
        """``Q(tilt)`` in the eigenbasis (scaled to the largest weight: no overflow)."""
        logw = 0.5 * tilt * self.log_l
        return torch.linalg.qr(torch.exp(logw - logw.max())[:, None] * self.g0)[0]

    def ms(self, tilt: float) -> float:
        q = self.basis(tilt)
        return float((self.L[:, None] * q * q).sum())


def _solve_tilt(tilt: _Tilt, target: float) -> float:
    """The tilt ``g`` whose removal's mean square is ``target`` (bisection; the nearest end of
    ``[-TILT_MAX, TILT_MAX]`` when it is out of reach)."""
    f0 = tilt.ms(0.0)
    if abs(f0 - target) <= TILT_TOL * target:
        return 0.0
    sign = 1.0 if f0 < target else -1.0
    lo, hi = 0.0, 1.0
    while (tilt.ms(sign * hi) - target) * sign < 0:
        lo, hi = hi, 2 * hi
        if hi > TILT_MAX:
            return sign * TILT_MAX
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        f = tilt.ms(sign * mid)
        if abs(f - target) <= TILT_TOL * target:
            return sign * mid
        if (f - target) * sign < 0:
            lo = mid
        else:
            hi = mid
    return sign * 0.5 * (lo + hi)


def raw_erasure(fitter: LeaceFitter, rank: int, seed: int, target_rms: float) -> Erasure:
    """The raw control (module docstring): ``rank`` seeded random directions, tilted toward the
    stream's high- or low-variance directions until their orthogonal removal edits the fitting
    rows by ``target_rms`` (raw units, root mean square per row), then scaled by the factor
    left (``info``: ``tilt``, ``scale``)."""
    cov = fitting_covariance(fitter)
    d = cov.shape[0]
    if rank == 0 or target_rms <= 0:
        z = torch.zeros(d, 0, dtype=torch.float64)
        return Erasure(z.float(), z.T.float(), fitter.mean_x.float(), {"control": "raw", "tilt": 0.0, "scale": 1.0})
    tilt = _Tilt(cov, _gaussian(d, rank, seed))
    g = _solve_tilt(tilt, target_rms**2)
    ms = tilt.ms(g)
    scale = target_rms / ms**0.5 if ms > 0 else 1.0
    q = tilt.V @ tilt.basis(g)  # back from the eigenbasis
    info = {"control": "raw", "tilt": g, "scale": scale}
    return Erasure((scale * q).float().contiguous(), q.T.float().contiguous(), fitter.mean_x.float(), info)


def random_erasure(
    fitter: LeaceFitter, rank: int, seed: int, *, control: str = "raw", target_rms: float | None = None
) -> Erasure:
    """A control of a LEACE fit (module docstring): ``rank`` seeded random directions removed,
    ``control="raw"`` (needs ``target_rms``, LEACE's :func:`edit_rms` on the fitting data: the
    control's edit there is made equal to it) or ``"whitened"`` (LEACE's form, whitened directions)."""
    if control == "whitened":
        return whitened_erasure(fitter, rank, seed)
    if control != "raw":
        raise InputError(f"control must be one of {CONTROL_KINDS}, got {control!r}")
    if target_rms is None:
        raise InputError("the raw control needs target_rms: LEACE's edit_rms on the fitting data")
    return raw_erasure(fitter, rank, seed, target_rms)
