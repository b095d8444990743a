"""LEACE concept erasure as an edit of the residual stream, and its random control of the same rank.

===================================  =============================================================
:class:`Erasure`                     the affine map ``x -> x - ((x - bias) @ right.T) @ left.T``
                                     (float32, on the tensor's device): applied to features and,
                                     as :meth:`Erasure.hook`, inside the forward pass
``fit_erasure(x, labels, n_classes)`` LEACE (:class:`concept_erasure.LeaceFitter`, fitted in
                                     float64 without the covariance-trace constraint, so the
                                     guarantee below is exact): ``(Erasure, fitter)``
``random_erasure(fitter, rank,       the control: the same form with a seeded random rank-``rank``
seed)``                              subspace in LEACE's whitened coordinates instead of the
                                     concept's
``one_hot(labels, n_classes)``       the concept ``z`` LEACE erases
===================================  =============================================================

LEACE (Belrose et al. 2023) finds the affine edit ``P x + b`` of least mean squared size after
which the features' covariance with the one-hot label is zero; then no linear classifier
does better than a constant (in expectation, for any convex loss) on the data it was fitted on.
With whitening ``W = Sigma^-1/2`` and ``U`` an orthonormal basis of the range of
``W Sigma_xz``, ``P = I - W^+ U U^T W``: it removes ``rank(Sigma_xz) <= C - 1`` directions in
whitened coordinates. The control removes as many random whitened directions ``Q`` (a Gaussian
matrix's QR factor), so it edits the stream by a comparable amount but aims at nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from concept_erasure import LeaceFitter


@dataclass(frozen=True)
class Erasure:
    """``x -> x - ((x - bias) @ right.T) @ left.T``: ``left [d, k]``, ``right [k, d]``, ``bias [d]``
    (float32). ``rank`` is ``k``, the number of directions removed."""

    left: torch.Tensor
    right: torch.Tensor
    bias: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The erased ``x [..., d]``, computed in float32 and returned in ``x``'s dtype."""
        dev = x.device
        xf = x.float()
        out = xf - ((xf - self.bias.to(dev)) @ self.right.to(dev).T) @ self.left.to(dev).T
        return out.to(x.dtype)

    def hook(self, start: int = 0):
        """A write hook ``fn(stream, ctx)`` for ``model.run(hooks={site: fn})``: the stream erased
        at every position from ``start`` on (1 leaves a leading BOS token alone)."""

        def erase(t: torch.Tensor, ctx) -> torch.Tensor:
            out = t.clone()
            out[:, start:] = self(t[:, start:])
            return out

        return erase


def one_hot(labels, n_classes: int) -> torch.Tensor:
    """``[N, n_classes]`` float64 one-hot rows of integer ``labels`` (all below ``n_classes``)."""
    y = torch.as_tensor(labels, dtype=torch.long)
    return torch.nn.functional.one_hot(y, n_classes).double()


def _compact(left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor) -> Erasure:
    """An :class:`Erasure` in float32 with the zero columns of ``left`` (singular values LEACE
    truncated) dropped."""
    keep = left.abs().sum(0) > 0
    return Erasure(left[:, keep].float().contiguous(), right[keep].float().contiguous(), bias.float().contiguous())


def fit_erasure(x: torch.Tensor, labels, n_classes: int) -> tuple[Erasure, LeaceFitter]:
    """LEACE fitted on features ``x [N, d]`` and integer ``labels [N]`` (float64 statistics,
    ``constrain_cov_trace=False``): the :class:`Erasure` (the fitter's own ``LeaceEraser``, its
    truncated directions dropped) and the fitter (for :func:`random_erasure`)."""
    fitter = LeaceFitter(x.shape[1], n_classes, dtype=torch.float64, constrain_cov_trace=False)
    fitter.update(x.double(), one_hot(labels, n_classes))
    er = fitter.eraser
    return _compact(er.proj_left, er.proj_right, er.bias), fitter


def _whitening(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, W^+)``: the (pseudo) inverse square root of ``sigma`` and its inverse, thresholded
    as ``concept_erasure`` does."""
    L, V = torch.linalg.eigh(sigma)
    mask = L > (L[-1] * sigma.shape[-1] * torch.finfo(L.dtype).eps)
    L = L.clamp_min(0.0)
    W = V * torch.where(mask, L.rsqrt(), 0.0) @ V.mH
    W_inv = V * torch.where(mask, L.sqrt(), 0.0) @ V.mH
    return W, W_inv


def random_erasure(fitter: LeaceFitter, rank: int, seed: int) -> Erasure:
    """The control of a LEACE fit: ``P = I - W^+ Q Q^T W`` with ``Q`` a random orthonormal
    ``[d, rank]`` basis (seeded), the same whitening ``W`` and bias as ``fitter``'s eraser."""
    W, W_inv = _whitening(fitter.sigma_xx)
    g = torch.Generator().manual_seed(int(seed))
    q = torch.randn(W.shape[0], rank, generator=g, dtype=torch.float64)
    q = torch.linalg.qr(q)[0] if rank else q
    return _compact(W_inv @ q, q.T @ W, fitter.mean_x)
