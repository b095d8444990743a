"""The regularised objective of a batched probe, full batch: what every solver minimises.

=======================================  ========================================================
``objective(probe, feats, y, grad=,      the objective per unit ``[U]`` (float64); optionally its
curvature=, units=)``                    gradient (in ``.grad``), the softmax's mean curvature
                                         (the K-FAC class factor) and only some units
``trainable(probe)``                     the parameters a solver moves
``chunk_rows(probe, feats)``             the rows of one full-batch chunk (memory bound)
``label_matrix(y)``                      labels as a long ``[N, G]`` tensor
``features_device(feats)``               where resident features live (the CPU if streamed)
``on_features_device(probe, feats)``     the probe moved there for a block (and back to the CPU)
=======================================  ========================================================

Over resident features on a GPU the objective computes there: the probe's parameters (and
gradients) are moved to that device for the evaluation and back to the CPU after it (a copy of
the weights each way, no copy of the features); what it returns and leaves is on the CPU.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from depthscope.probes.solvers.lbfgs import unit_runs
from depthscope.probes.store.span_rows import DENSE_BYTES, SpanRows

#: memory for one full-batch chunk's activations (logits, mixed features)
CHUNK_BYTES = 2.5e8


def label_matrix(y) -> torch.Tensor:
    """Labels as class indices ``[N, G]`` (long); a vector becomes one head."""
    y = torch.as_tensor(y, dtype=torch.long)
    return y[:, None] if y.dim() == 1 else y


def features_device(feats) -> torch.device:
    """The device of ``feats``' resident features; the CPU when they are streamed."""
    return feats.resident.device if feats.resident is not None else torch.device("cpu")


@contextlib.contextmanager
def on_features_device(probe, feats):
    """The probe moved (in place: the same parameters, their data and gradients) to the device
    of ``feats``' features for the body, back to the CPU after it, also when the body raises;
    yields that device. Nothing moves on the CPU."""
    dev = features_device(feats)
    if dev.type == "cpu":
        yield dev
        return
    probe.to(dev)
    try:
        yield dev
    finally:
        probe.to("cpu")


def trainable(probe) -> list:
    """The probe's parameters that training moves."""
    return [p for p in probe.parameters() if p.requires_grad]


def chunk_rows(probe, feats) -> int:
    """Examples per full-batch chunk: the logits (and a scalar mix's mixed features) of every
    unit fit ``CHUNK_BYTES``."""
    width = probe.G * probe.C + (feats.n_spans * feats.d if probe.mix_mask is not None else 0)
    rows = int(max(64, min(len(feats), CHUNK_BYTES // (4 * probe.U * max(width, 1)))))
    if isinstance(feats.resident, SpanRows):  # each chunk is a dense copy of its examples
        rows = min(rows, feats.resident.rows_within(DENSE_BYTES))
    return rows


def _unit_runs(probe, feats, units) -> list:
    """The contiguous unit ranges to evaluate: only those of ``units`` for per-site linear probes
    over resident features (each run one batched product), else every unit at once."""
    U = probe.U
    if units is not None and probe.kind == "linear" and probe.mix_mask is None and feats.resident is not None:
        return unit_runs(units)
    return [(0, U)]


@torch.no_grad()
def _add_curvature(A: torch.Tensor, logits: torch.Tensor, a: int, b: int) -> None:
    """Add the chunk's ``sum_i diag(p_i) - p_i p_i^T`` per unit and head to ``A[a:b]``."""
    p = torch.softmax(logits.detach(), -1).transpose(1, 2)  # [u, G, B, C]
    A[a:b] -= torch.einsum("ugbc,ugbd->ugcd", p, p)
    A[a:b].diagonal(dim1=2, dim2=3).add_(p.sum(2))


def _chunk_loss(probe, x, m, yb, run, n: int) -> tuple:
    """Logits of units ``run`` on one chunk and their summed cross-entropy per unit over ``n``."""
    a, b = run
    logits = probe(x, m) if (a, b) == (0, probe.U) else probe.unit_logits(x, a, b)  # [u, B, G, C]
    u, B, G, C = logits.shape
    target = yb.unsqueeze(0).expand(u, B, G).reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, C), target, reduction="none")
    return logits, ce.view(u, B * G).sum(1) / n


def _store_curvature(A, curvature: dict, runs: list, units, n: int, U: int) -> None:
    """``curvature["A"]``: the mean curvature; units outside ``runs`` keep their last one."""
    A /= n
    if runs != [(0, U)] and curvature.get("A") is not None:
        A = torch.where(units[:, None, None, None], A, curvature["A"])
    curvature["A"] = A


def objective(
    probe,
    feats,
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
    (objective, gradient, curvature) are left stale. Computed where the resident features are
    (module docstring); the results are on the CPU."""
    dev = features_device(feats)
    if dev.type == "cpu":
        return _objective(probe, feats, label_matrix(y), grad, curvature, units)
    if curvature is not None and curvature.get("A") is not None:  # the stale units' curvature
        curvature["A"] = curvature["A"].to(dev)
    units = units.to(dev) if units is not None else None
    try:
        with on_features_device(probe, feats):
            total = _objective(probe, feats, label_matrix(y).to(dev), grad, curvature, units)
    finally:
        if curvature is not None and curvature.get("A") is not None:
            curvature["A"] = curvature["A"].cpu()
    return total.cpu()


def _objective(probe, feats, y, grad, curvature, units) -> torch.Tensor:
    """:func:`objective` with the probe, labels and features on one device (the tensors made
    here are put on it)."""
    dev = y.device
    n, U = len(feats), probe.U
    runs = _unit_runs(probe, feats, units)
    total = torch.zeros(U, dtype=torch.float64, device=dev)
    A = torch.zeros(U, probe.G, probe.C, probe.C, device=dev) if curvature is not None else None
    if grad:
        for p in trainable(probe):
            p.grad = None
    with torch.set_grad_enabled(grad):
        for idx, (x, m) in feats.batches(chunk_rows(probe, feats)):
            yb = y[torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(dev)]
            for a, b in runs:
                logits, per_unit = _chunk_loss(probe, x, m, yb, (a, b), n)
                if A is not None:
                    _add_curvature(A, logits, a, b)
                if grad:
                    per_unit.sum().backward()
                total[a:b] += per_unit.detach().double()
    if A is not None:
        _store_curvature(A, curvature, runs, units, n, U)
    if grad:
        for p in trainable(probe):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        probe.add_penalty_grad_()
    with torch.no_grad():
        return total + probe.penalty_per_unit().double()
