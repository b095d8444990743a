"""The K-FAC preconditioner of the L-BFGS probe solver: an approximate inverse Hessian per unit.

The softmax loss's Hessian in a linear probe's weights is
``E[(diag(p) - p p^T) (x) x x^T] + 2 l2 I``; K-FAC (Martens and Grosse 2015) approximates it by the
Kronecker product ``A (x) Sigma`` of the features' second moments ``Sigma_u = X_u^T X_u / n`` (for a
scalar-mix unit, those of its sites' uniform mean) and the softmax's mean curvature
``A = E[diag(p) - p p^T]`` per unit and head. The preconditioner applies ``(Sigma + 8 l2 I)^-1`` on
the feature side and ``(A + 2 l2 I)^-1`` on the class side of the weight gradient,
``(A + 1e-3 I)^-1`` to the biases and ``MIX_LOGIT_STEP`` times the identity to a scalar mix's
logits. The feature factor removes the correlation between residual-stream dimensions, the class
factor the spread of curvature between frequent and rare classes. Any fixed symmetric positive
definite preconditioner changes only L-BFGS's path, never the optimum.

``Sigma`` is computed once per feature set (cached on per-site features and reused across the
fits of a penalty search); ``A`` follows the fit: it is read from the latest objective evaluation
(``curv["A"]``, set by :func:`~depthscope.probes.solvers.objective.objective`) and refactored
whenever it changes.
"""

from __future__ import annotations

import torch

from depthscope.probes.solvers.lbfgs import unit_runs
from depthscope.probes.solvers.objective import chunk_rows, features_device

#: the preconditioner's scale on a scalar mix's logits, against the identity: their curvature is
#: orders of magnitude below the weights', so unscaled steps would leave the mix nearly unmoved
MIX_LOGIT_STEP = 1e3


@torch.no_grad()
def feature_gram(probe, feats) -> torch.Tensor:
    """The features' second moments ``[U, F, F]`` per unit (a mix unit: of the uniform mean over
    its sites); per-site ones are cached on ``feats`` (``feats._gram``). Summed where the
    features are, returned on the CPU."""
    U, n, Fd = probe.U, len(feats), feats.n_spans * feats.d
    mix = probe.mix_mask
    gram = getattr(feats, "_gram", None) if mix is None else None
    if gram is not None:
        return gram
    dev = features_device(feats)
    gram = torch.zeros(U, Fd, Fd, device=dev)
    w = None if mix is None else (mix.float() / mix.float().sum(1, keepdim=True)).to(dev)  # uniform over each prefix
    for _, (x, _m) in feats.batches(chunk_rows(probe, feats)):
        x = x.float()
        if w is not None:
            x = (w @ x.reshape(x.shape[0], -1)).reshape(U, -1, Fd)
        gram.baddbmm_(x.transpose(1, 2), x)
    gram = gram.div_(n).cpu()
    if mix is None:
        feats._gram = gram
    return gram


@torch.no_grad()
def preconditioner(probe, feats, names: list, sizes: list, curv: dict) -> KfacPreconditioner:
    """The K-FAC preconditioner of ``probe`` over ``feats`` (module docstring). ``names`` and
    ``sizes``: the trainable parameters' names and per-unit sizes, in the order of the flat
    vectors L-BFGS works on; ``curv``: the dict the objective leaves the class curvature in."""
    l2 = probe.l2.clamp_min(1e-6)  # [G]
    reg = feature_gram(probe, feats).clone()
    reg.diagonal(dim1=1, dim2=2).add_(8.0 * float(l2.min()))
    inv = torch.cholesky_inverse(torch.linalg.cholesky(reg))  # applied as one batched GEMM per call
    start = [sum(sizes[:i]) for i in range(len(sizes))]
    where = {name: (a, a + k) for name, a, k in zip(names, start, sizes)}
    return KfacPreconditioner(inv, l2, where, curv, (probe.G, probe.C))


class KfacPreconditioner:
    """``M(q, units=None)``: the preconditioner applied to ``q [U, P]`` (flat parameter vectors);
    ``units`` (bool ``[U]``, optional): only these units' rows are needed (the others are
    returned as given; each unit's result is the same either way), computed as contiguous runs of
    units (views of the factors: no gather of the ``[U, F, F]`` inverses)."""

    def __init__(self, inv: torch.Tensor, l2: torch.Tensor, where: dict, curv: dict, shape: tuple):
        self.inv, self.l2, self.where, self.curv = inv, l2, where, curv
        self.G, self.C = shape
        self.eye = torch.eye(self.C)
        self._A = None  # the class curvature the cached inverses were computed from
        self._inverses = None

    def class_inverses(self) -> tuple | None:
        """``((A + 2 l2 I)^-1, (A + 1e-3 I)^-1)`` per unit and head at the latest evaluation's
        curvature (None before the first), refactored only when a new evaluation set it."""
        A = self.curv.get("A")
        if A is None:
            return None
        if self._A is not A:
            self._A = A
            self._inverses = (
                torch.linalg.inv(A + 2.0 * self.l2[None, :, None, None] * self.eye),
                torch.linalg.inv(A + 1e-3 * self.eye),
            )
        return self._inverses

    def __call__(self, q: torch.Tensor, units: torch.Tensor | None = None) -> torch.Tensor:
        out = q.clone()
        for u0, u1 in [(0, q.shape[0])] if units is None else unit_runs(units):
            self._apply(out, q[u0:u1], u0, u1)
        return out

    def _apply(self, out: torch.Tensor, qs: torch.Tensor, u0: int, u1: int) -> None:
        """Write units ``u0:u1`` of the preconditioned ``qs`` into ``out``."""
        G, C = self.G, self.C
        Fd = self.inv.shape[-1]
        a, z = self.where["W"]
        v = torch.bmm(self.inv[u0:u1], qs[:, a:z].reshape(-1, Fd, G * C))
        ci = self.class_inverses()
        if ci is not None:
            v = torch.einsum("ufgc,ugcd->ufgd", v.view(-1, Fd, G, C), ci[0][u0:u1])
            if "b" in self.where:
                a2, z2 = self.where["b"]
                qb = qs[:, a2:z2].view(-1, G, C)
                out[u0:u1, a2:z2] = torch.einsum("ugc,ugcd->ugd", qb, ci[1][u0:u1]).reshape(u1 - u0, -1)
        out[u0:u1, a:z] = v.reshape(u1 - u0, -1)
        if "mix_logits" in self.where:
            a3, z3 = self.where["mix_logits"]
            out[u0:u1, a3:z3] *= MIX_LOGIT_STEP
