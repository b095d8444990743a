"""Fitting and applying a BatchedProbe: the minibatch training loop and batched prediction.

==============================  ===============================================================
``train_probe(probe, feats, y)`` Adam, cosine-decayed step size, fixed epochs but at least
                                ``min_steps`` steps; returns the objective per epoch
``predict(probe, feats, y)``    predicted classes ``[U, N, G]`` (and code lengths given ``y``)
``auto_batch(n, epochs)``       the minibatch size when none is given
==============================  ===============================================================

Training starts from zero weights (linear) or a seeded init (MLP) and is deterministic for a
given seed. Because the loss is a sum of per-unit, per-head losses and Adam is
per-coordinate, training units and heads together equals training them apart. Defaults are
those of :class:`~depthscope.probes.config.ProbeConfig`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .classifiers import BatchedProbe
from .config import ProbeConfig
from .cpu import step_work, threads_for
from .features import Features

_DEFAULTS = ProbeConfig()
#: auto_batch aims at this many optimiser steps: Adam needs steps, not epochs, to reach the
#: L2-regularised optimum (EWT upos, 4640 words x 12 epochs: batch 512 = 120 steps ended 35%
#: above scikit-learn's objective, batch 128 = 480 steps within 10%, for 1.4x the time)
TARGET_STEPS = 500


def auto_batch(n: int, epochs: int, batch_size: int | None = None) -> int:
    """``batch_size`` if given, else the batch (between 128 and 512, a multiple of 32) that
    gives about ``TARGET_STEPS`` steps over ``epochs`` epochs of ``n`` examples: large
    batches (cheap steps) for large data, small batches (more steps) for small data."""
    if batch_size is not None:
        return int(batch_size)
    b = n * max(epochs, 1) / TARGET_STEPS
    return int(min(512, max(128, round(b / 32) * 32)))


def train_probe(
    probe: BatchedProbe,
    feats: Features,
    y: torch.Tensor,
    *,
    epochs: int = _DEFAULTS.epochs,
    batch_size: int | None = _DEFAULTS.batch_size,
    lr: float = _DEFAULTS.lr,
    min_steps: int = _DEFAULTS.min_steps,
    seed: int = 0,
    progress: bool = False,
    desc: str = "probe",
) -> list:
    """Fit ``probe`` on ``feats`` with labels ``y [N, G]`` (class indices); returns losses.
    ``batch_size`` None picks :func:`auto_batch`.

    The number of epochs grows so that at least ``min_steps`` optimiser steps are taken
    (small training sets, e.g. the first MDL blocks).
    """
    n = len(feats)
    if n == 0:
        raise ValueError("no training examples")
    y = torch.as_tensor(y, dtype=torch.long)
    if y.dim() == 1:
        y = y[:, None]
    batch_size = auto_batch(n, epochs, batch_size)
    steps_per_epoch = math.ceil(n / batch_size)
    epochs = max(epochs, math.ceil(min_steps / steps_per_epoch))
    total = epochs * steps_per_epoch
    mix_params = [p for name, p in probe.named_parameters() if name in ("mix_logits", "gamma", "att")]
    main = [p for name, p in probe.named_parameters() if name not in ("mix_logits", "gamma", "att")]
    groups = [{"params": main, "lr": lr}]
    if mix_params:
        groups.append({"params": mix_params, "lr": lr * 3})
    opt = _adam(groups)
    base = [g["lr"] for g in opt.param_groups]
    rng = np.random.default_rng(seed)
    losses = []
    bar = None
    if progress:
        from depthscope.hooks.progress import progress_bar

        bar = progress_bar(total, desc=desc, unit="step")
    probe.train()
    with threads_for(step_work(probe, feats, batch_size)):
        losses = _train_loop(probe, feats, y, opt, base, rng, epochs, total, batch_size, bar)
    if bar is not None:
        bar.close()
    probe.eval()
    return losses


def _train_loop(probe, feats, y, opt, base, rng, epochs, total, batch_size, bar) -> list:
    n, step, losses = len(feats), 0, []
    for _ in range(epochs):
        run = 0.0
        for idx, (x, m) in feats.batches(batch_size, rng):
            logits = probe(x, m)  # [U, B, G, C]
            U, B, G, C = logits.shape
            target = y[idx].unsqueeze(0).expand(U, B, G)
            loss = F.cross_entropy(logits.reshape(-1, C), target.reshape(-1), reduction="sum") / B
            opt.zero_grad(set_to_none=True)
            loss.backward()
            probe.add_penalty_grad_()  # the L2 term's gradient, added in place
            scale = 0.5 * (1 + math.cos(math.pi * step / total))
            for g_, b_ in zip(opt.param_groups, base):
                g_["lr"] = b_ * scale
            opt.step()
            step += 1
            run += float(loss.detach()) * B
            if bar is not None:
                bar.update(1)
        with torch.no_grad():
            losses.append(run / n + float(probe.penalty()))  # mean data loss + the penalty at epoch end
    return losses


def _adam(groups) -> torch.optim.Optimizer:
    """Adam with the fused kernel where this torch has it for CPU tensors (one pass over each
    weight per step instead of about eight), else the multi-tensor one."""
    try:
        return torch.optim.Adam(groups, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(groups, foreach=True)


@torch.no_grad()
def predict(probe: BatchedProbe, feats: Features, y: torch.Tensor | None = None, *, batch_size: int = 1024):
    """Predicted classes ``[U, N, G]`` and, with labels ``y [N, G]`` (indices < C), the
    code length ``-log2 p(y)`` of each example ``[U, N, G]`` (else None)."""
    probe.eval()
    n = len(feats)
    preds = torch.empty(probe.U, n, probe.G, dtype=torch.long)
    bits = torch.empty(probe.U, n, probe.G) if y is not None else None
    if y is not None:
        y = torch.as_tensor(y, dtype=torch.long)
        if y.dim() == 1:
            y = y[:, None]
    with threads_for(step_work(probe, feats, batch_size)):
        _predict_loop(probe, feats, y, batch_size, preds, bits)
    return preds, bits


def _predict_loop(probe, feats, y, batch_size, preds, bits) -> None:
    for idx, (x, m) in feats.batches(batch_size):
        ti = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        logits = probe(x, m)
        preds[:, ti] = logits.argmax(-1)
        if y is not None:
            logp = torch.log_softmax(logits, -1)
            t = y[ti].unsqueeze(0).expand(logits.shape[0], -1, -1)
            bits[:, ti] = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1) / math.log(2)
