"""Interventions: what an edited forward writes at a site, from the base run's value and a source's.

>>> swap = SubspaceSwap(basis)                 # basis [d, k], orthonormal columns
>>> new = swap(base, source)                   # base + (source - base) R Rᵀ

An intervention is a small object called as ``intervention(base, source) -> new`` on tensors of the
same shape (the vectors ``[..., d]`` of a site at the edited positions; a source may be None for
those that need none). The analyses pick the rows, positions and heads it applies to, and put it in
a hook; a new intervention is one class here (as pyvene's are).

========================  ========================================================================
:class:`Intervention`     the interface: ``__call__(base, source) -> new``
:class:`Unchanged`        the base as it is (the no-intervention floor, a plain forward)
:class:`VectorSwap`       full-vector interchange: the source's vector, in the base's dtype
                          (activation patching, interchange intervention accuracy)
:class:`SubspaceSwap`     the source's part within a fixed subspace ``R`` ``[d, k]``:
                          ``base + ((source - base) R) Rᵀ`` (a learned DAS subspace at test time)
:class:`RotatedSwap`      the trainable DAS rotation (Geiger et al. 2023): ``R`` with orthonormal
                          columns as a parametrised ``nn.Linear``; Boundless DAS (Wu et al. 2023)
                          adds a soft boundary on the rotated dimensions
:class:`FeatureSwap`      SAE features: the source's value of one feature per row (the other
                          features, and so the rest of the reconstruction, are the base's)
========================  ========================================================================

Mean-difference steering is not here: no analysis uses it (:meth:`Subspace.hook
<depthscope.analyses.causal.variables.subspaces.Subspace.hook>` sets coordinates of a subspace instead).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

__all__ = ["Intervention", "Unchanged", "VectorSwap", "SubspaceSwap", "RotatedSwap", "FeatureSwap"]


class Intervention:
    """``intervention(base, source)``: the value written where the base had ``base``."""

    def __call__(self, base: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Unchanged(Intervention):
    """The base's value itself (the source is not read)."""

    def __call__(self, base, source=None):
        return base


class VectorSwap(Intervention):
    """The source's whole vector, cast to the base's dtype."""

    def __call__(self, base, source):
        return source.to(base.dtype)


class SubspaceSwap(Intervention):
    """``base + ((source - base) R) Rᵀ`` for a fixed ``basis`` ``R`` ``[d, k]`` with orthonormal
    columns: the source's coordinates in the subspace, the base's elsewhere."""

    def __init__(self, basis: torch.Tensor):
        self.basis = basis

    def __call__(self, base, source):
        r = self.basis.to(base.device)
        return base + ((source - base) @ r) @ r.T


class RotatedSwap(nn.Module, Intervention):
    """The trained parameters of DAS: ``weight`` ``[k, d]`` with orthonormal rows (``R =
    weight.T``) and, for Boundless DAS (``k = d``), the ``boundary``: rotated dimension ``i`` is
    mixed in with the weight ``sigmoid((boundary - i) / temperature)`` (``hard``: 1 for the first
    ``round(boundary)`` dimensions, 0 after)."""

    def __init__(self, d: int, k: int, boundless: bool):
        super().__init__()
        self.lin = orthogonal(nn.Linear(d, k, bias=False))
        self.boundless = boundless
        self.boundary = nn.Parameter(torch.tensor(d / 2.0)) if boundless else None
        self.temperature = 1.0

    def weights(self, hard: bool) -> torch.Tensor | None:
        """The mixing weight of each rotated dimension (None: every one, plain DAS)."""
        if not self.boundless:
            return None
        i = torch.arange(self.lin.weight.shape[0], dtype=torch.float32)
        if hard:
            return (i < torch.round(self.boundary.detach())).float()
        return torch.sigmoid((self.boundary - i) / self.temperature)

    def forward(self, base: torch.Tensor, source: torch.Tensor, hard: bool = False) -> torch.Tensor:
        w = self.lin.weight  # [k, d]
        delta = (source - base) @ w.T
        m = self.weights(hard)
        if m is not None:
            delta = delta * m.to(delta.device)
        return base + delta @ w

    def basis(self) -> torch.Tensor:
        """``R`` ``[d, k']``: the directions swapped at test time (:class:`SubspaceSwap`)."""
        w = self.lin.weight.detach().float()
        m = self.weights(hard=True)
        return (w if m is None else w[m.bool()]).T.contiguous().cpu()


class FeatureSwap(Intervention):
    """For SAE feature vectors ``[rows, d_sae]``: row ``i`` takes the source's value of feature
    ``index[i]``; every other feature keeps the base's."""

    def __init__(self, index: torch.Tensor):
        self.index = index

    def __call__(self, base, source):
        rows = torch.arange(base.shape[0], device=base.device)
        new = base.clone()
        new[rows, self.index] = source[rows, self.index].to(base.dtype)
        return new
