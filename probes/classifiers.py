"""Probes at every site, fitted in one batched computation.

:class:`BatchedProbe` holds one classifier per *unit* and per *head*: a unit is a site (the
per-site probes) or a scalar mix of sites (:mod:`depthscope.probes.mixing`); heads are label
sets trained side by side on the same features (the task's labels, its control labels, one
per L2 strength of a grid). Weights are tensors ``[U, F, G*C]`` (linear) or
``[U, G, F, H]`` + ``[U, G, H, C]`` (MLP), so a minibatch is one ``bmm`` for all units and
heads, never a Python loop over sites.

Features are standardised per site and dimension with the train split's mean and standard
deviation (so the scale growth of a pre-norm residual stream does not decide which site a
scalar mix prefers), gathered per minibatch from the span store, and edge tasks concatenate
the two spans' vectors (as jiant does): ``[pool(span1); pool(span2)]``.

Objective per unit and head: mean cross-entropy + ``l2 * ||W||^2`` (biases and mixing
weights unpenalised); scikit-learn's ``LogisticRegression(C=...)`` minimises the same
objective with ``C = 1 / (2 * l2 * n_train)``. Optimiser: Adam with a cosine-decayed step
size over a fixed number of epochs from zero weights (linear) or a seeded init (MLP);
deterministic for a given seed. Because the loss is a sum of per-unit, per-head losses and
Adam is per-coordinate, training them together equals training them apart.

Precision: resident features and the products with them are bfloat16 where the CPU
multiplies bf16 at least 1.5x faster than float32 (:func:`compute_dtype`, measured once per
process; ``DEPTHSCOPE_PROBE_DTYPE=float32`` forces float32). Standardisation happens in
float32 first; parameters, optimiser state, logits and losses are float32. On the default
model this halves cumulative scoring's time at equal accuracy (see benchmarks/bench_probes.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .activations import SpanStore

PROBES = ("linear", "mlp")
DEFAULT_L2 = 1e-3
DEFAULT_EPOCHS = 12
DEFAULT_LR = 1e-2
DEFAULT_HIDDEN = 256
DEFAULT_MIN_STEPS = 100
#: minibatch size (None: :func:`auto_batch`)
DEFAULT_BATCH = None
#: auto_batch aims at this many optimiser steps: Adam needs steps, not epochs, to reach the
#: L2-regularised optimum (EWT upos, 4640 words x 12 epochs: batch 512 = 120 steps ended 35%
#: above scikit-learn's objective, batch 128 = 480 steps within 10%, for 1.4x the time)
TARGET_STEPS = 500


def auto_batch(n: int, epochs: int, batch_size: Optional[int] = None) -> int:
    """``batch_size`` if given, else the batch (between 128 and 512, a multiple of 32) that
    gives about ``TARGET_STEPS`` steps over ``epochs`` epochs of ``n`` examples: large
    batches (cheap steps) for large data, small batches (more steps) for small data."""
    if batch_size is not None:
        return int(batch_size)
    b = n * max(epochs, 1) / TARGET_STEPS
    return int(min(512, max(128, round(b / 32) * 32)))


# ----------------------------------------------------------------------------- features
@dataclass
class Features:
    """Examples' span rows in a store: ``span_ids[i, k]`` is span ``k`` of example ``i``.

    After :meth:`fit_standardiser` (train) or :meth:`standardise_like` (other splits),
    :meth:`make_resident` copies the standardised, pooled features into memory in site-major
    layout ``[S, N, n_spans * D]`` (:func:`compute_dtype`, or bfloat16 if only that fits), in
    a seeded shuffled order, so a minibatch is a contiguous slice fed straight to ``bmm``.
    Without it (attention pooling, or too large), minibatches are gathered from the store.
    """

    store: SpanStore
    span_ids: np.ndarray  # [N, n_spans]
    mean: Optional[torch.Tensor] = None  # [S, D]
    std: Optional[torch.Tensor] = None
    max_len: int = 1
    resident: Optional[torch.Tensor] = None  # [S, N, n_spans * D], rows in ``order``
    order: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.span_ids)

    @property
    def n_spans(self) -> int:
        return self.span_ids.shape[1]

    @property
    def n_sites(self) -> int:
        return self.store.n_sites

    @property
    def d(self) -> int:
        return self.store.d_model

    @property
    def tokens(self) -> bool:
        """True when examples carry several subword rows (attention pooling)."""
        return self.store.pooling == "attn"

    def standardise_like(self, other: "Features") -> "Features":
        self.mean, self.std = other.mean, other.std
        return self

    def fit_standardiser(self, chunk: int = 1024) -> "Features":
        """Mean and std per site and dimension over the rows these examples use, in one pass
        over the store: per-chunk mean and squared deviations (float32, about the chunk's own
        mean, so no cancellation) merged in float64 (Chan et al.'s pairwise update)."""
        spans = np.unique(self.span_ids.reshape(-1))
        S, D = self.n_sites, self.d
        mean = torch.zeros(S, D, dtype=torch.float64)
        m2 = torch.zeros(S, D, dtype=torch.float64)
        n = 0
        for a in range(0, len(spans), chunk):
            x, m = self.store.gather(spans[a : a + chunk], self.max_len)
            x = x[m]  # [rows, S, D] float32
            k = x.shape[0]
            if k == 0:
                continue
            cm = x.mean(0)
            cm2 = ((x - cm) ** 2).sum(0).double()
            cm = cm.double()
            tot = n + k
            d = cm - mean
            mean += d * (k / tot)
            m2 += cm2 + d * d * (n * k / tot)
            n = tot
        std = (m2 / max(n, 1)).sqrt()
        std = torch.where(std > 1e-6 * (mean.abs() + 1), std, torch.ones_like(std))
        self.mean, self.std = mean.float(), std.float()
        return self

    def make_resident(self, *, max_bytes: float = 4e9, seed: int = 0, chunk: int = 1024, dtype=None) -> bool:
        """Standardised features in memory, site-major; False if they do not fit (or attn).

        ``dtype`` None picks :func:`compute_dtype` (bfloat16 where this CPU multiplies it
        faster than float32, else float32), then a 2-byte type if float32 does not fit in
        ``max_bytes``. Standardisation is done in float32 before any rounding."""
        if self.tokens:
            return False
        N, S, F_ = len(self), self.n_sites, self.n_spans * self.d
        need = N * S * F_
        dt = compute_dtype() if dtype is None else dtype
        if need * dt.itemsize > max_bytes:
            dt = torch.bfloat16 if dt == torch.float32 else dt
        if need * dt.itemsize > max_bytes:
            return False
        self.order = np.random.default_rng(seed).permutation(N)
        X = torch.empty(S, N, F_, dtype=dt)
        st = self.store
        D = self.d
        with _threads_for(0):
            for a in range(0, N, chunk):
                idx = self.order[a : a + chunk]
                for k in range(self.n_spans):
                    rows = st.row_start[self.span_ids[idx, k]]
                    x = torch.from_numpy(np.asarray(st.feats[rows])).float().permute(1, 0, 2)  # [S, B, D]
                    if self.mean is not None:
                        x = (x - self.mean[:, None]) / self.std[:, None]
                    X[:, a : a + len(idx), k * D : (k + 1) * D] = x
        self.resident = X
        return True

    def _gather(self, idx: np.ndarray):
        xs, ms = [], []
        for k in range(self.n_spans):
            x, m = self.store.gather(self.span_ids[idx, k], self.max_len)
            xs.append(x)
            ms.append(m)
        L = max(x.shape[1] for x in xs)
        for k in range(len(xs)):
            pad = L - xs[k].shape[1]
            if pad:
                xs[k] = F.pad(xs[k], (0, 0, 0, 0, 0, pad))
                ms[k] = F.pad(ms[k], (0, pad), value=False)
        x = torch.stack(xs, 1)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x, torch.stack(ms, 1)

    def batches(self, batch_size: int, rng: Optional[np.random.Generator] = None):
        """Yield ``(example indices, inputs)``; inputs are ``(X [S, B, n*D], None)`` when
        resident, else ``(x [B, n, L, S, D], mask [B, n, L])``. With ``rng``: random
        order (resident: fixed shuffled slices visited in random order)."""
        n = len(self)
        starts = np.arange(0, n, batch_size)
        if self.resident is not None:
            if rng is not None:
                starts = rng.permutation(starts)
            for a in starts:
                X = self.resident[:, a : a + batch_size]
                yield self.order[a : a + batch_size], (X if X.dtype != torch.float16 else X.float(), None)
        else:
            perm = rng.permutation(n) if rng is not None else np.arange(n)
            for a in starts:
                idx = np.sort(perm[a : a + batch_size])
                yield idx, self._gather(idx)


@functools.lru_cache(maxsize=None)
def compute_dtype() -> torch.dtype:
    """The dtype probes compute in: ``DEPTHSCOPE_PROBE_DTYPE`` (float32 or bfloat16) if set,
    else bfloat16 when a quick timing shows this CPU multiplies it at least 1.5x faster than
    float32 (AVX512-BF16 / AMX), else float32. Parameters, optimiser state and losses stay
    float32 either way; only the feature matrices and the products with them are bf16."""
    env = os.environ.get("DEPTHSCOPE_PROBE_DTYPE", "").strip().lower()
    if env:
        if env not in ("float32", "bfloat16"):
            raise ValueError(f"DEPTHSCOPE_PROBE_DTYPE must be float32 or bfloat16, got {env!r}")
        return getattr(torch, env)
    w, x = torch.randn(64, 64), torch.randn(64, 32768)

    def best(a, b):
        a @ b
        times = []
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        return min(times)

    try:
        fast = best(w.bfloat16(), x.bfloat16()) * 1.5 < best(w, x)
    except RuntimeError:
        fast = False
    return torch.bfloat16 if fast else torch.float32


@contextlib.contextmanager
def _threads_for(work: float):
    """One intra-op thread for small per-step work: thread synchronisation then costs more
    than it saves (badly so on a busy machine); the default thread count otherwise."""
    old = torch.get_num_threads()
    small = work < 2e7
    if small and old > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if small and old > 1:
            torch.set_num_threads(old)


def _step_work(probe: "BatchedProbe", feats: "Features", batch_size: int) -> float:
    width = probe.G * (probe.C if probe.kind == "linear" else probe.hidden)
    return float(probe.U) * min(batch_size, len(feats)) * feats.n_spans * feats.d * max(width, 1)


# ----------------------------------------------------------------------------- the probe
class BatchedProbe(nn.Module):
    """Classifiers for ``U`` units x ``G`` heads over ``C`` classes.

    ``mix_mask`` (bool ``[U, S]``) turns units into scalar mixes: unit ``u`` reads
    ``gamma_u * sum_s softmax(a_u)_s x_s`` over the sites allowed by its row (Tenney's
    scalar mix); without it unit ``u`` reads site ``u``. ``attn_pool`` adds per-unit,
    per-span self-attentive pooling over the span's subwords (weights ``[U, n_spans, D]``).
    """

    def __init__(
        self,
        *,
        n_sites: int,
        d: int,
        n_spans: int,
        n_classes: int,
        n_heads: int = 1,
        kind: str = "linear",
        hidden: int = DEFAULT_HIDDEN,
        mix_mask: Optional[torch.Tensor] = None,
        attn_pool: bool = False,
        l2=DEFAULT_L2,
        seed: int = 0,
    ):
        super().__init__()
        if kind not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {kind!r}")
        self.kind, self.S, self.d, self.n_spans = kind, n_sites, d, n_spans
        self.C, self.G, self.hidden = n_classes, n_heads, hidden
        U = n_sites if mix_mask is None else mix_mask.shape[0]
        self.U = U
        Fdim = d * n_spans
        g = torch.Generator().manual_seed(seed)
        l2 = torch.as_tensor(l2, dtype=torch.float32).reshape(-1)
        if l2.numel() == 1:
            l2 = l2.expand(n_heads).clone()
        if l2.numel() != n_heads:
            raise ValueError(f"l2 has {l2.numel()} values for {n_heads} heads")
        self.register_buffer("l2", l2)
        if mix_mask is not None:
            self.register_buffer("mix_mask", mix_mask.bool())
            self.mix_logits = nn.Parameter(torch.zeros(U, n_sites))
            self.gamma = nn.Parameter(torch.ones(U))
        else:
            self.mix_mask = None
        self.attn_pool = attn_pool
        if attn_pool:
            self.att = nn.Parameter(torch.zeros(U, n_spans, d))
        if kind == "linear":
            self.W = nn.Parameter(torch.zeros(U, Fdim, n_heads * n_classes))
            self.b = nn.Parameter(torch.zeros(U, 1, n_heads * n_classes))
        else:
            self.W1 = nn.Parameter(torch.randn(U, n_heads, Fdim, hidden, generator=g) / math.sqrt(Fdim))
            self.b1 = nn.Parameter(torch.zeros(U, n_heads, 1, hidden))
            self.W2 = nn.Parameter(torch.randn(U, n_heads, hidden, n_classes, generator=g) / math.sqrt(hidden))
            self.b2 = nn.Parameter(torch.zeros(U, n_heads, 1, n_classes))

    def mix_weights(self) -> Optional[torch.Tensor]:
        """Softmax mixing weights ``[U, S]`` (zeros outside each unit's allowed sites)."""
        if self.mix_mask is None:
            return None
        return torch.softmax(self.mix_logits.masked_fill(~self.mix_mask, float("-inf")), -1)

    def features(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Per-unit features ``[U, B, n*D]`` from pooled site-major ``x [S, B, n*D]``
        (``mask`` None) or from subword rows ``x [B, n, L, S, D]`` with ``mask [B, n, L]``."""
        if mask is None:
            S, B, Fd = x.shape
            if self.mix_mask is None:
                return x
            w = (self.mix_weights() * self.gamma[:, None]).to(x.dtype)
            return (w @ x.reshape(S, B * Fd)).reshape(self.U, B, Fd)
        B, n, L, S, D = x.shape
        if self.mix_mask is not None:
            w = self.mix_weights() * self.gamma[:, None]
            xu = torch.einsum("us,bnlsd->ubnld", w, x)
        else:
            xu = x.permute(3, 0, 1, 2, 4)  # [U=S, B, n, L, D]
        if self.attn_pool:
            scores = torch.einsum("ubnld,und->ubnl", xu, self.att)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            alpha = torch.softmax(scores, -1)
            pooled = torch.einsum("ubnl,ubnld->ubnd", alpha, xu)
        else:
            pooled = xu[:, :, :, 0]
        return pooled.reshape(self.U, B, n * D)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[U, B, G, C]``."""
        f = self.features(x, mask)
        U, B, _ = f.shape
        dt = f.dtype  # bfloat16 features: the products in bf16 (fp32 accumulation), logits fp32
        if self.kind == "linear":
            out = torch.baddbmm(self.b.to(dt), f, self.W.to(dt))
            return out.float().reshape(U, B, self.G, self.C)
        h = torch.relu(torch.einsum("ubf,ugfh->ugbh", f, self.W1.to(dt)) + self.b1.to(dt))
        out = torch.einsum("ugbh,ughc->ugbc", h, self.W2.to(dt)).float() + self.b2
        return out.permute(0, 2, 1, 3)

    @torch.no_grad()
    def add_penalty_grad_(self) -> None:
        """Add the gradient of :meth:`penalty` to the weights' ``.grad`` in place (one fused
        op per weight, instead of building the penalty into the autograd graph each step)."""
        if self.kind == "linear":
            col = self.l2.repeat_interleave(self.C)  # [G*C]
            self.W.grad.addcmul_(self.W, col, value=2.0)
        else:
            g = self.l2[None, :, None, None]
            self.W1.grad.addcmul_(self.W1, g, value=2.0)
            self.W2.grad.addcmul_(self.W2, g, value=2.0)

    def penalty(self) -> torch.Tensor:
        if self.kind == "linear":
            w2 = self.W.reshape(self.U, -1, self.G, self.C).pow(2).sum((0, 1, 3))
        else:
            w2 = self.W1.pow(2).sum((0, 2, 3)) + self.W2.pow(2).sum((0, 2, 3))
        return (self.l2 * w2).sum()


def train_probe(
    probe: BatchedProbe,
    feats: Features,
    y: torch.Tensor,
    *,
    epochs: int = DEFAULT_EPOCHS,
    batch_size: Optional[int] = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    min_steps: int = DEFAULT_MIN_STEPS,
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
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="step", leave=False)
    step = 0
    probe.train()
    with _threads_for(_step_work(probe, feats, batch_size)):
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
def predict(probe: BatchedProbe, feats: Features, y: Optional[torch.Tensor] = None, *, batch_size: int = 1024):
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
    with _threads_for(_step_work(probe, feats, batch_size)):
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


# ----------------------------------------------------------------------------- metrics
def accuracy(preds: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Accuracy (= micro-F1 for single-label classification) per unit: preds ``[U, N]``."""
    return (preds == torch.as_tensor(y)[None]).float().mean(1)


def macro_f1(preds: torch.Tensor, y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Macro-F1 per unit over the classes present in the gold labels or the predictions
    (scikit-learn's ``f1_score(average="macro")``). ``n_classes`` must exceed every index."""
    y = torch.as_tensor(y, dtype=torch.long)
    U, N = preds.shape
    Ct = n_classes
    flat = (torch.arange(U)[:, None] * Ct * Ct + y[None] * Ct + preds).reshape(-1)
    conf = torch.bincount(flat, minlength=U * Ct * Ct).reshape(U, Ct, Ct).double()
    tp = conf.diagonal(dim1=1, dim2=2)
    rows, cols = conf.sum(2), conf.sum(1)
    denom = rows + cols
    f1 = torch.where(denom > 0, 2 * tp / denom.clamp_min(1), torch.zeros_like(tp))
    present = denom > 0
    return (f1.sum(1) / present.sum(1).clamp_min(1)).float()
