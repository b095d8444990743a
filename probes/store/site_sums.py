"""Sums over sites in float32 for features held in any precision (the scalar mix's two passes).

=================================  ================================================================
``weighted_sum(flat, p, out)``     ``sum_s p_s flat[s]`` ``[M]`` float32, for ``flat [S, M]``
``site_inner(flat, d)``            ``<flat[s], d>`` for every site ``[S]`` float32, for ``d [M]``
=================================  ================================================================

Float32 features are one matrix-vector product each way. Features held in a narrower type
(bfloat16) are read in chunks of :data:`CHUNK` columns, each copied into one float32 buffer
before its product, so that the weights ``p``, the vector ``d`` and every sum stay in float32.
A product in the features' own type would round ``p`` and ``d`` to 8 significant bits and each
sum to the same: the mix would then move in steps as its logits change, and the scalar mix's
L-BFGS can stall short of its convergence test (``docs/benchmarks.md`` has the measurements).
Both passes cost a read of the features, so the chunked pass takes about as long as the float32
one.
"""

from __future__ import annotations

import torch

#: columns per chunk of a narrow-type pass: 61 sites x 16384 float32 is a 4 MB buffer, which
#: stays in cache (1024 columns took twice as long per pass, 65536 about the same)
CHUNK = 16384


def weighted_sum(flat: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_s p_s flat[s]`` as ``[M]`` float32 for ``flat [S, M]`` and weights ``p [S]`` (into
    ``out`` when given)."""
    p = p.to(device=flat.device, dtype=torch.float32)
    out = torch.empty(flat.shape[1], device=flat.device) if out is None else out
    if flat.dtype == torch.float32:
        return torch.mv(flat.T, p, out=out)
    for cols, part in _float32_chunks(flat):
        torch.mv(part.T, p, out=out[cols])
    return out


def site_inner(flat: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``<flat[s], d>`` for every site, ``[S]`` float32, for ``flat [S, M]`` and ``d [M]``."""
    d = d.to(device=flat.device, dtype=torch.float32)
    if flat.dtype == torch.float32:
        return torch.mv(flat, d)
    acc = torch.zeros(flat.shape[0], device=flat.device)
    for cols, part in _float32_chunks(flat):
        acc.addmv_(part, d[cols])
    return acc


def _float32_chunks(flat: torch.Tensor):
    """``(columns, float32 copy of flat[:, columns])`` for consecutive chunks of :data:`CHUNK`
    columns, each copied into the same buffer (valid until the next chunk is drawn)."""
    S, M = flat.shape
    buf = torch.empty(S, min(CHUNK, M), device=flat.device)
    for j in range(0, M, CHUNK):
        cols = slice(j, min(j + CHUNK, M))
        part = buf[:, : cols.stop - j]
        part.copy_(flat[:, cols])
        yield cols, part
