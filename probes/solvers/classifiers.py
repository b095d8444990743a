"""BatchedProbe: one classifier per site (or scalar mix) and per label set, as one tensor model.

:class:`BatchedProbe` holds one classifier per *unit* and per *head*: a unit is a site (the
per-site probes) or a scalar mix of sites (:mod:`depthscope.probes.mixing`); heads are label
sets trained side by side on the same features (the task's labels, its control labels, one
per L2 strength of a grid). Weights are tensors ``[U, F, G*C]`` (linear) or
``[U, G, F, H]`` + ``[U, G, H, C]`` (MLP), so a minibatch is one ``bmm`` for all units and
heads, never a Python loop over sites.

Objective per unit and head: mean cross-entropy + ``l2 * ||W||^2`` (biases and mixing
weights unpenalised); scikit-learn's ``LogisticRegression(C=...)`` minimises the same
objective with ``C = 1 / (2 * l2 * n_train)``. Training: :mod:`depthscope.probes.solvers.training`.
Bfloat16 features (:mod:`depthscope.probes.solvers.cpu`) make the products bf16 with float32
parameters, logits and losses.

``DEFAULT_L2`` (1e-3) is the penalty of a probe built by hand; runs choose theirs per task on
held-out data (:class:`~depthscope.probes.config.ProbeConfig` ``l2="auto"``).

Scalar mixes: a unit reads ``sum_s softmax(a)_s x_s`` with ``gamma`` fixed at 1. Tenney's
trainable scale ``gamma`` is left out on purpose: with a penalty on the classifier's weights and
none on ``gamma``, growing ``gamma`` while shrinking the weights lowers the objective without
end, so a probe trained to convergence would have no optimum (features are standardised, so
no scale is needed). ``gamma`` stays a buffer of ones for the tables.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from depthscope.probes.config import PROBES, ProbeConfig
from depthscope.probes.store.features import feature_major

_DEFAULTS = ProbeConfig()
DEFAULT_L2 = 1e-3
DEFAULT_HIDDEN = _DEFAULTS.hidden


def numeric_l2(l2) -> float:
    """``l2`` as a number; ``"auto"`` / ``"dev"`` (a per-task choice, made by
    :func:`~depthscope.probes.fitting.choose_l2`) mean :data:`DEFAULT_L2` for a building block
    used on its own."""
    return DEFAULT_L2 if isinstance(l2, str) else float(l2)


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
        mix_mask: torch.Tensor | None = None,
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
            self.register_buffer("gamma", torch.ones(U))  # fixed: see the module docstring
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

    def mix_weights(self) -> torch.Tensor | None:
        """Softmax mixing weights ``[U, S]`` (zeros outside each unit's allowed sites)."""
        if self.mix_mask is None:
            return None
        return torch.softmax(self.mix_logits.masked_fill(~self.mix_mask, float("-inf")), -1)

    def features(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Per-unit features ``[U, B, n*D]`` from pooled site-major ``x [S, B, n*D]``
        (``mask`` None) or from subword rows ``x [B, n, L, S, D]`` with ``mask [B, n, L]``."""
        if mask is None:
            S, B, Fd = x.shape
            if self.mix_mask is None:
                return x
            w = (self.mix_weights() * self.gamma[:, None]).to(x.dtype)
            if feature_major(x):  # resident features: a view when B is all of them
                return (w @ x.transpose(1, 2).reshape(S, Fd * B)).reshape(self.U, Fd, B).transpose(1, 2)
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
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

    def unit_logits(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Logits ``[b - a, B, G, C]`` of units ``a .. b-1`` of a per-site linear probe from
        resident features ``x [S, B, F]`` (one batched product over those units only)."""
        dt = x.dtype
        out = torch.baddbmm(self.b[a:b].to(dt), x[a:b], self.W[a:b].to(dt))
        return out.float().reshape(b - a, x.shape[1], self.G, self.C)

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

    def penalty_per_unit(self) -> torch.Tensor:
        """The L2 term of each unit ``[U]`` (summed over its heads)."""
        if self.kind == "linear":
            w2 = self.W.reshape(self.U, -1, self.G, self.C).pow(2).sum((1, 3))  # [U, G]
        else:
            w2 = self.W1.pow(2).sum((2, 3)) + self.W2.pow(2).sum((2, 3))
        return (w2 * self.l2).sum(1)

    def penalty(self) -> torch.Tensor:
        return self.penalty_per_unit().sum()


def site_probe(feats, n_classes: int, cfg: ProbeConfig, *, l2=None, n_heads: int = 1, mix_mask=None) -> BatchedProbe:
    """One probe per site of ``feats`` (``n_heads`` label sets) with ``cfg``'s kind, hidden units
    and seed; penalty ``l2`` (None: ``cfg.l2`` as a number); ``mix_mask``: scalar mixes instead
    (see :class:`BatchedProbe`)."""
    return BatchedProbe(
        n_sites=feats.n_sites,
        d=feats.d,
        n_spans=feats.n_spans,
        n_classes=n_classes,
        n_heads=n_heads,
        l2=numeric_l2(cfg.l2) if l2 is None else l2,
        seed=cfg.seed,
        kind=cfg.probe,
        hidden=cfg.hidden,
        mix_mask=mix_mask,
        attn_pool=feats.tokens,
    )
