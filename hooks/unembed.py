"""Decoding: hidden state -> logits, the way the model decodes its last stream (written once).

``model.unembed`` is an :class:`Unembed`: the model's final norm, its unembedding and the
logit post-processing the architecture has (logit scale, soft-capping), or an encoder's MLM
head. Every analysis that turns a stream into logits goes through it.

==================================  =============================================================
``unembed(h)``                      logits of streams ``[..., d_model]`` (final norm,
                                    unembedding, post-processing); ``model.decode(h)`` is the
                                    same call
``unembed.norm(h)``                 the model's own final norm
``unembed.project(x)``              unembedding + post-processing of an already normed stream
``unembed.project_into(x, out)``    the same written into a reused ``[rows, vocab]`` buffer
``unembed.check()``                 refuse a model whose output is not final norm -> unembedding
``unembed.frozen(h_ref)``           :class:`FrozenUnembed`: the final norm's scale frozen at a
                                    reference stream, so decoding is linear (attribution)
``unembed.digest()``                weight digest of the final norm and unembedding
:class:`NormParams`                 a norm module read as gain, bias, eps and kind (RMS / Layer)
==================================  =============================================================

Precision (a fixed rule, never a measurement): logits are computed in the weights' dtype and
written into a float32 buffer by :meth:`Unembed.project_into` (a block of rows at a time when
the dtypes differ, so a bfloat16 model never holds a second full-size logits copy); nothing switches to a lower
precision on its own. The tuned lens's trainer may multiply in bfloat16 when asked
(``matmul_dtype``), which :meth:`Unembed.matmul_weight` provides.

Frozen norm (as TransformerLens's ``apply_ln_to_stack``): with ``sigma`` the final norm's
RMS (std for LayerNorm) of a reference stream ``h`` (eps included), the norm becomes the linear
map ``c -> gain * centre(c) / sigma``, so the logits of ``h = sum_i c_i`` split exactly into the
parts ``W_U^T (gain * centre(c_i) / sigma) * scale`` plus a constant (norm bias and
unembedding bias through the same map).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from depthscope.common.digest import digest_tensors
from depthscope.common.errors import UnsupportedArchitecture

#: :meth:`Unembed.project_into` with a buffer of another dtype (a bfloat16 model's logits into a
#: float32 buffer) computes this many bytes of logits at a time, never a second full-size copy
PROJECT_BLOCK_BYTES = 16 * 2**20


@dataclass
class NormParams:
    """A norm module read as ``gain * centre(h) / sqrt(mean(centre(h)^2) + eps) + bias`` (float64,
    on the CPU); ``kind`` "rms" (no centring) or "layer" (mean-centring)."""

    kind: str
    gain: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, norm: nn.Module, d_model: int) -> NormParams:
        w = getattr(norm, "weight", None)
        b = getattr(norm, "bias", None)
        eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-5
        kind = "rms" if "rms" in type(norm).__name__.lower() else "layer"
        f64 = torch.float64
        gain = torch.ones(d_model, dtype=f64) if w is None else w.detach().to("cpu", f64).reshape(-1)
        bias = None if b is None else b.detach().to("cpu", torch.float64).reshape(-1)
        return cls(kind, gain, bias, float(eps))

    def centre(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(-1, keepdim=True) if self.kind == "layer" else h

    def sigma(self, h: torch.Tensor) -> torch.Tensor:
        """The norm's scale of streams ``h`` ``[..., d]`` (keepdim), eps included."""
        c = self.centre(h.double())
        return torch.sqrt((c * c).mean(-1, keepdim=True) + self.eps)

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """Our reading of the norm, in float64 (compare it with the module: :meth:`mismatch`)."""
        h = h.double()
        out = self.gain.to(h.device) * self.centre(h) / self.sigma(h)
        return out if self.bias is None else out + self.bias.to(h.device)

    def mismatch(self, norm: nn.Module, h: torch.Tensor, what: str) -> str | None:
        """None when these parameters reproduce ``norm(h)``, else a sentence saying why not."""
        with torch.no_grad():
            ref = norm(h).double()
        err = float((ref - self.apply(h)).abs().max() / ref.abs().max().clamp_min(1e-12))
        if not math.isfinite(err) or err > 1e-3:
            return (
                f"{what} ({type(norm).__name__}) is not gain * centre(h) / sqrt(mean(centre(h)^2) + eps) "
                f"[+ bias] (relative error {err:.1e})"
            )
        return None


class Unembed:
    """Final norm + unembedding + logit post-processing of one model (see the module doc)."""

    def __init__(self, arch, *, name: str, d_model: int, is_decoder: bool, cls_name: str = ""):
        self.arch = arch
        self.name = name
        self.d_model = d_model
        self.is_decoder = is_decoder
        self.cls_name = cls_name

    # read from the architecture on every use, so a swapped module (tests, patching) is seen
    final_norm = property(lambda self: self.arch.final_norm, doc="the final norm module (or None)")
    linear = property(lambda self: self.arch.unembed, doc="the unembedding module (or None)")
    head = property(lambda self: self.arch.head, doc="an encoder's MLM head (or None)")
    logit_scale = property(lambda self: self.arch.logit_scale, doc="a constant multiplying the logits (or None)")
    softcap = property(lambda self: self.arch.softcap, doc="c of tanh(z / c) * c soft-capping (or None)")

    def __repr__(self) -> str:
        return (
            f"Unembed({self.name!r}, norm={type(self.final_norm).__name__}, "
            f"unembedding={type(self.linear).__name__}, logit_scale={self.logit_scale}, softcap={self.softcap})"
        )

    # ------------------------------------------------------------------ what it can do
    @property
    def available(self) -> bool:
        """Whether streams can be decoded at all (an MLM head, or final norm -> unembedding)."""
        return self.head is not None or (self.linear is not None and self.final_norm is not None)

    @property
    def is_plain_linear(self) -> bool:
        """An ``nn.Linear`` without bias, logit scale or soft-capping (a bare ``x @ W^T``)."""
        return (
            isinstance(self.linear, nn.Linear)
            and self.linear.bias is None
            and self.logit_scale is None
            and not self.softcap
        )

    @property
    def decodes_stream(self) -> bool:
        """A decoder whose logits are ``unembedding(final_norm(stream))``: what :meth:`check` asks."""
        return self.is_decoder and self.head is None and self.linear is not None and self.final_norm is not None

    def check(self) -> None:
        """Refuse a model whose output is not ``final norm -> unembedding`` (lenses need it)."""
        if not self.is_decoder or self.head is not None:
            raise UnsupportedArchitecture(
                f"{self.name} ({self.cls_name}) is a {self.arch.layout} encoder: its output is not final norm -> "
                f"unembedding (an MLM head, or no head at all), and it has no next-token distribution, "
                f"so the logit lens does not apply. Use a decoder (Llama, GPT-2, GPT-NeoX, ...)."
            )
        if self.linear is None or self.final_norm is None:
            missing = "unembedding (LM head)" if self.linear is None else "final norm"
            raise UnsupportedArchitecture(
                f"{self.name} ({self.cls_name}) has no {missing}: its output is not final norm -> unembedding, so "
                f"the logit lens does not apply. Load the model with its LM head (e.g. *ForCausalLM)."
            )

    # ------------------------------------------------------------------ decoding
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from any site's stream ``[..., d_model]``: final norm, then unembedding."""
        if self.head is not None:
            return self.head(h)
        return self.project(self.norm(h))

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        """The model's own final norm applied to a stream ``[..., d_model]``."""
        if self.final_norm is None:
            raise NotImplementedError(f"{self.name} has no final norm before an unembedding")
        return self.final_norm(h)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The unembedding (plus logit scale / soft-capping) of a normed stream."""
        if self.linear is None:
            raise NotImplementedError(
                f"{self.name} ({self.cls_name}) has no unembedding: its output is not "
                f"norm -> unembed, so the logit lens does not apply"
            )
        return self.post(self.linear(x))

    def post(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit scale, then soft-capping (``tanh(z / c) * c``), as the architecture has them."""
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap:
            c = self.softcap
            logits = torch.tanh(logits / c) * c
        return logits

    def project_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`project` written into ``out`` ``[rows, vocab]`` (no fresh allocation when
        ``x``, ``out`` and the weights share a dtype; otherwise computed, then copied)."""
        lin = self.linear
        if isinstance(lin, nn.Linear) and lin.weight.dtype == out.dtype and x.dtype == out.dtype:
            if lin.bias is not None:
                torch.addmm(lin.bias, x, lin.weight.t(), out=out)
            else:
                torch.mm(x, lin.weight.t(), out=out)
            if self.logit_scale is not None:
                out.mul_(self.logit_scale)
            if self.softcap:
                c = float(self.softcap)
                out.div_(c).tanh_().mul_(c)
        else:  # another dtype (a bfloat16 model, a float32 buffer) or an unusual head module
            step = max(1, PROJECT_BLOCK_BYTES // max(1, out.shape[-1] * x.element_size()))
            for start in range(0, x.shape[0], step):  # one block's logits in the weights' dtype at a time
                out[start : start + step].copy_(self.project(x[start : start + step]))
        return out

    def matmul_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The unembedding matrix ``[vocab, d_model]`` (detached) in ``dtype``, for trainers
        that multiply by it themselves (only for :attr:`is_plain_linear` unembeddings)."""
        if not self.is_plain_linear:
            raise NotImplementedError(f"{self.name}'s unembedding is not a bare linear map")
        W = self.linear.weight.detach()
        return W if W.dtype == dtype else W.to(dtype)

    # ------------------------------------------------------------------ weights
    @property
    def W_U(self) -> torch.Tensor:
        """Unembedding matrix ``[d_model, vocab]`` (a view, no copy)."""
        if self.linear is None:
            raise NotImplementedError(f"{self.name} has no unembedding")
        return self.linear.weight.T

    @property
    def b_U(self) -> torch.Tensor | None:
        return getattr(self.linear, "bias", None) if self.linear is not None else None

    def norm_params(self) -> NormParams:
        if self.final_norm is None:
            raise NotImplementedError(f"{self.name} has no final norm before an unembedding")
        return NormParams.of(self.final_norm, self.d_model)

    def digest(self) -> str:
        """Weight digest (:func:`depthscope.common.digest.digest_tensors`) of the final norm, the
        unembedding and the post-processing constants."""
        named = []
        for what, mod in (("final_norm", self.final_norm), ("unembed", self.linear)):
            if mod is not None:
                named += [(f"{what}.{n}", p) for n, p in mod.named_parameters()]
        return digest_tensors(named, extra={"logit_scale": self.logit_scale, "softcap": self.softcap})

    # ------------------------------------------------------------------ attribution
    def frozen(self, reference: torch.Tensor) -> FrozenUnembed:
        """The final norm's scale frozen at ``reference`` streams ``[..., d_model]`` (one scale
        per stream): decoding becomes linear. Refuses soft-capped logits (not linear)."""
        self.check()
        if self.softcap:
            raise UnsupportedArchitecture(
                f"{self.name} soft-caps its logits (tanh(x/{self.softcap})*{self.softcap}): logits are "
                f"not linear in the stream, so they do not decompose into parts"
            )
        params = self.norm_params()
        return FrozenUnembed(params, params.sigma(reference), self, float(self.logit_scale or 1.0))


@dataclass
class FrozenUnembed:
    """Linear decoding with the final norm's scale ``sigma`` frozen (float64).

    ``contributions(parts, t, c)`` is each part's share of ``logit[t]`` (minus ``logit[c]``);
    with ``constant(t, c)`` they sum to the logit of the reference stream exactly (up to
    rounding) when the parts sum to it. ``sigma`` has the reference's leading shape (keepdim).
    """

    params: NormParams
    sigma: torch.Tensor
    unembed: Unembed
    scale: float

    def direction(self, target: int, contrast: int | None = None) -> torch.Tensor:
        """``gain * (W_U[:, target] - W_U[:, contrast]) * scale``, float64 ``[d_model]``."""
        W = self.unembed.W_U.detach()
        w = W[:, target].double()
        if contrast is not None:
            w = w - W[:, contrast].double()
        return self.params.gain.to(w.device) * w * self.scale

    def contributions(self, parts: torch.Tensor, target: int, contrast: int | None = None) -> torch.Tensor:
        """Per part ``[..., n, d]`` -> ``[..., n]``: ``centre(part) . direction / sigma``."""
        w = self.direction(target, contrast)
        parts = self.params.centre(parts.double().to(w.device))
        return (parts @ w) / self.sigma.to(w.device)

    def constant(self, target: int, contrast: int | None = None) -> float:
        """The parts of the logit no stream component writes: norm bias and unembedding bias."""
        W = self.unembed.W_U.detach()
        w = W[:, target].double() - (W[:, contrast].double() if contrast is not None else 0.0)
        const = 0.0
        if self.params.bias is not None:
            const += float(self.params.bias.to(w.device) @ w)
        b = self.unembed.b_U
        if b is not None:
            const += float(b[target]) - (float(b[contrast]) if contrast is not None else 0.0)
        return const * self.scale

    def logits(self, parts: torch.Tensor) -> torch.Tensor:
        """Every vocabulary logit of each part ``[..., n, d]`` -> ``[..., n, vocab]`` (no biases)."""
        W = self.unembed.W_U.detach().double()
        sigma = self.sigma.to(W.device).unsqueeze(-1)
        x = self.params.gain.to(W.device) * self.params.centre(parts.double().to(W.device)) / sigma
        return (x @ W) * self.scale
