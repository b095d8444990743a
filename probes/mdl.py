"""Minimum description length probing: online codelength (Voita & Titov, 2020).

The train examples are put in a seeded random order and cut at the fractions
``0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.25, 12.5, 25, 50, 100 %``. The first block is sent with the
uniform code (``t_1 * log2 K`` bits for ``K`` classes); every later block is sent with a probe
trained on all earlier examples: ``-log2 p(y | x)`` summed over the block. The online
codelength is the total in bits; the uniform codelength is ``N * log2 K``; compression =
uniform / online (higher = the property is easier to extract from that site).

Every block's probe is trained for all sites at once (one batched fit per block, ten in
all), from scratch, to convergence like every probe (the Adam solver takes at least
``min_steps`` steps: the first blocks hold a handful of examples); the task's L2 penalty keeps
those small fits from overconfident codes. The penalty is on the mean cross-entropy, so a block
of ``t`` examples gets ``l2 * n / t``: the same prior on the weights (relative to the summed
cross-entropy) in every block, as the full-data probe has; without it, converged probes on
the first, tiny blocks overfit and their codes cost more than the uniform code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from depthscope.common.progress import progress_bar
from depthscope.probes.config import ProbeConfig, override
from depthscope.probes.solvers.classifiers import numeric_l2, site_probe
from depthscope.probes.solvers.training import predict, train_kwargs, train_probe
from depthscope.probes.store.features import Features, Resident

VOITA_FRACTIONS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.0625, 0.125, 0.25, 0.5, 1.0)


@dataclass
class MDLResult:
    online_bits: np.ndarray  # [S]
    uniform_bits: float
    block_ends: list

    @property
    def compression(self) -> np.ndarray:
        return self.uniform_bits / self.online_bits


def block_ends(n: int, fractions=VOITA_FRACTIONS) -> list:
    """Strictly increasing block boundaries ``t_1 < ... < t_k = n`` (at least 1 example each)."""
    ends = []
    for f in fractions:
        t = min(n, max(1, int(round(f * n))))
        if not ends or t > ends[-1]:
            ends.append(t)
    if ends[-1] != n:
        ends.append(n)
    return ends


def _subset(feats: Features, idx: np.ndarray, seed: int, max_bytes: float, dtype=None) -> Features:
    sub = Features(feats.store, feats.span_ids[idx], feats.mean, feats.std, feats.max_len)
    sub.make_resident(max_bytes=max_bytes, seed=seed, dtype=dtype)
    return sub


def online_codelength(
    feats: Features,
    y,
    *,
    n_classes: int,
    config: ProbeConfig | None = None,
    min_steps: int = 300,
    fractions=VOITA_FRACTIONS,
    resident: Resident | None = None,
    progress: bool = False,
    **overrides,
) -> MDLResult:
    """Online codelength per site of labels ``y`` (class indices < n_classes), in bits.
    ``config`` (None: the defaults; ``overrides`` by field name) sets kind, l2, solver,
    tolerances, the epoch cap, lr, batch, hidden units and seed; MDL keeps its own floor of
    ``min_steps`` Adam steps per block (the first blocks hold a handful of examples). ``resident``:
    the memory and precision of the blocks' resident features (:class:`Resident`; default 4 GB,
    float32)."""
    (cfg,) = override([config or ProbeConfig()], overrides)
    y = np.asarray(y, dtype=np.int64)
    n = len(y)
    if n < 2:
        raise ValueError("MDL needs at least two examples")
    order = np.random.default_rng([cfg.seed, 31337]).permutation(n)
    ends = block_ends(n, fractions)
    bits = np.full(feats.n_sites, ends[0] * math.log2(n_classes), dtype=np.float64)
    blocks = list(zip(ends[:-1], ends[1:]))
    resident = resident or Resident()
    code = _BlockCode(feats, y, n_classes, cfg, min_steps, resident.max_bytes, resident.dtype)
    bar = progress_bar(len(blocks), desc="MDL blocks", unit="block") if progress else None
    for t0, t1 in blocks:
        bits += code.bits(order[:t0], order[t0:t1])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return MDLResult(bits, n * math.log2(n_classes), ends)


@dataclass(frozen=True)
class _BlockCode:
    """How one block of the online code is sent: a probe of ``cfg``'s kind over every site,
    trained from scratch on the examples before the block (penalty scaled by ``n / t``, see the
    module docstring; at least ``min_steps`` Adam steps, batches no larger than the training
    set), its code length summed over the block. ``max_bytes`` and ``dtype``: the resident
    blocks' memory and precision."""

    feats: Features
    y: np.ndarray
    n_classes: int
    cfg: ProbeConfig
    min_steps: int
    max_bytes: float
    dtype: torch.dtype | None

    def bits(self, tr_idx: np.ndarray, ev_idx: np.ndarray) -> np.ndarray:
        """Code length per site ``[S]`` of examples ``ev_idx`` under a probe trained on ``tr_idx``."""
        cfg, feats, t0 = self.cfg, self.feats, len(tr_idx)
        ftr = _subset(feats, tr_idx, cfg.seed, self.max_bytes, self.dtype)
        fev = _subset(feats, ev_idx, cfg.seed, self.max_bytes, self.dtype)
        probe = site_probe(feats, self.n_classes, cfg, l2=numeric_l2(cfg.l2) * len(self.y) / t0)
        batch_size = None if cfg.batch_size is None else min(cfg.batch_size, max(8, t0))
        settings = {**train_kwargs(cfg), "min_steps": self.min_steps, "batch_size": batch_size}
        train_probe(probe, ftr, torch.from_numpy(self.y[tr_idx])[:, None], **settings)
        _, b = predict(probe, fev, torch.from_numpy(self.y[ev_idx])[:, None])
        return b[:, :, 0].double().sum(1).numpy()
