"""The hook points inside the attention function: ``l.rot_q``, ``l.rot_k``, ``l.scores``, ``l.pattern``.

transformers (>= 4.48) routes every attention layer of the supported families through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. depthscope registers one more entry,
``"depthscope_eager"`` (:func:`depthscope_attention`, with transformers' eager mask), and switches
a model to it only for the calls that read or replace one of these points (:func:`eager_patterns`
restores the model's own setting afterwards, also on error). Each attention module of such a call
has a small set of handlers (``ATTENTION_KINDS``, set by :mod:`depthscope.hooks.engine` for one
call), run in forward order; a handler returns a replacement or None:

=========  =====================================================================================
handler    what it gets, and what a replacement does
=========  =====================================================================================
``rot_q``  the queries as the attention function receives them (after rotary embedding and any
           query norm) ``[batch, pos, heads, d_head]``; a replacement is the query
``rot_k``  the keys likewise ``[batch, keys, kv_heads, d_head]``: with a key/value cache, every key
           position the attention sees (cached ones included); a replacement is used by this
           call's attention only (the cache keeps the keys it stored)
``scores`` the pre-softmax scores ``[batch, heads, query, key]``: ``q k^T`` scaled, soft-capped
           where the family does, plus the additive causal/padding mask; a replacement is
           softmaxed (in float32, as transformers' eager attention) and multiplied with V
``pattern`` the probabilities ``[batch, heads, query, key]``; a replacement is multiplied with V
=========  =====================================================================================

The function

1. calls the family's own eager attention (the module-level ``eager_attention_forward`` of the
   model's modeling file), so a read pattern is exactly what ``output_attentions=True`` under
   ``attn_implementation="eager"`` returns, softcapping and GQA expansion included;
2. for ``scores``, computes the scores with one generic formula (:func:`attention_scores`: the
   ``scaling`` and ``softcap`` keywords transformers passes, GPT-2's own scaling rules when no
   ``scaling`` is passed) and checks on every call that their softmax equals the family's eager
   pattern (:func:`check_scores`, 1e-5 in float32); a family whose eager attention does anything
   else (attention sinks, relative positions...) is refused with
   :class:`~depthscope.common.errors.UnsupportedArchitecture`, never served a wrong tensor;
3. if the scores or the pattern are replaced, recomputes the heads' outputs ``pattern @ V`` (K/V of
   grouped-query models expanded to the query heads).

So every layer of such a call runs the eager kernel (SDPA/flash models then equal their eager
run, ~1e-6 apart in float32); calls that touch none of these points keep the model's own kernel.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from depthscope.common.errors import UnsupportedArchitecture

NAME = "depthscope_eager"
#: the handlers an attention module can have, in the order they run
ATTENTION_KINDS = ("rot_q", "rot_k", "scores", "pattern")
#: largest difference allowed between softmax(scores) and the family's eager pattern, per dtype
SCORE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
HALF_TOLERANCE = 1e-2  # bfloat16 / float16

Handler = Callable[[torch.Tensor], "torch.Tensor | None"]
# id(attention module) -> {kind: handler(tensor) -> replacement or None}; set only inside one call
_HANDLERS: dict[int, dict[str, Handler]] = {}


def _generic_eager(module, query, key, value, attention_mask, **kwargs):
    """Eager attention for modeling files without an ``eager_attention_forward`` of their own
    (keywords as transformers passes them: ``scaling``, ``softcap``; dropout is off in eval)."""
    w = attention_scores(module, query, key, attention_mask, kwargs)
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return _weighted(w, value), w


def family_eager(module: nn.Module) -> Callable:
    """The eager attention function of ``module``'s own modeling file."""
    mod = sys.modules.get(type(module).__module__)
    return getattr(mod, "eager_attention_forward", None) or _generic_eager


def _scaling(module: nn.Module, query: torch.Tensor, kwargs: dict) -> float:
    """The factor on ``q k^T``: the ``scaling`` keyword, else GPT-2's rules (``scale_attn_weights``,
    ``scale_attn_by_inverse_layer_idx``), else the module's ``scaling``, else ``d_head ** -0.5``."""
    if kwargs.get("scaling") is not None:
        return kwargs["scaling"]
    if hasattr(module, "scale_attn_weights"):
        s = query.shape[-1] ** -0.5 if module.scale_attn_weights else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            s /= float(module.layer_idx + 1)
        return s
    s = getattr(module, "scaling", None)
    return s if isinstance(s, float) else query.shape[-1] ** -0.5


def attention_scores(module, query, key, attention_mask, kwargs: dict) -> torch.Tensor:
    """Pre-softmax scores ``[batch, heads, query, key]``: ``q k^T * scaling``, soft-capped when a
    ``softcap`` is passed, plus the additive mask (keys of grouped-query models expanded)."""
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * _scaling(module, query, kwargs)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask[..., : key.shape[-2]]
    return w


def _softmax(scores: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(like.dtype)


def check_scores(module: nn.Module, scores: torch.Tensor, pattern: torch.Tensor, query: torch.Tensor) -> None:
    """Refuse (:class:`UnsupportedArchitecture`) when ``softmax(scores)`` is not the family's own
    eager ``pattern`` to ``SCORE_TOLERANCE``: the generic formula does not fit this family."""
    got, pattern = _softmax(scores.detach(), query).float(), pattern.detach().float()
    diff = (got - pattern).abs()
    err = float(diff.masked_fill(got.isnan() & pattern.isnan(), 0).max()) if diff.numel() else 0.0
    tol = SCORE_TOLERANCE.get(query.dtype, HALF_TOLERANCE)
    if not err <= tol:
        family = type(module).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")
        layer = getattr(module, "layer_idx", None)
        raise UnsupportedArchitecture(
            f"{family} ({type(module).__name__}, layer {layer}): the attention scores depthscope computes for "
            f"the hook point l.scores (attn.hook_attn_scores) differ from the family's own eager attention "
            f"(softmax max difference {err:.2e} > {tol:.0e}), so depthscope refuses to serve them; "
            f"l.pattern, l.rot_q and l.rot_k are still exact"
        )


def _weighted(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The heads' outputs ``[batch, query, heads, d_head]`` of ``pattern @ V`` (GQA expanded)."""
    n_rep = pattern.shape[1] // value.shape[1]
    v = value.repeat_interleave(n_rep, dim=1) if n_rep > 1 else value
    return torch.matmul(pattern.to(v.dtype), v).transpose(1, 2).contiguous()


def _swap(handler: Handler | None, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, heads, pos, d]`` through a handler that sees ``[batch, pos, heads, d]``."""
    if handler is None:
        return x
    new = handler(x.transpose(1, 2))
    return x if new is None else new.transpose(1, 2)


def depthscope_attention(module, query, key, value, attention_mask, **kwargs):
    """The family's eager attention with this module's handlers (``ATTENTION_KINDS``) in between."""
    handlers = _HANDLERS.get(id(module))
    if not handlers:
        return family_eager(module)(module, query, key, value, attention_mask, **kwargs)
    query, key = _swap(handlers.get("rot_q"), query), _swap(handlers.get("rot_k"), key)
    out, weights = family_eager(module)(module, query, key, value, attention_mask, **kwargs)
    if "scores" in handlers:
        scores = attention_scores(module, query, key, attention_mask, kwargs)
        check_scores(module, scores, weights, query)
        new = handlers["scores"](scores)
        if new is not None:
            weights = _softmax(new, query)
            out = _weighted(weights, value)
    if "pattern" in handlers:
        new = handlers["pattern"](weights)
        if new is not None:
            out, weights = _weighted(new, value), new
    return out, weights


def _register() -> None:
    AttentionInterface.register(NAME, depthscope_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)


_register()


@contextlib.contextmanager
def eager_patterns(model: nn.Module, handlers: dict[nn.Module, dict[str, Handler]]) -> Iterator[None]:
    """Route ``model``'s attention through :func:`depthscope_attention` with ``handlers``
    (attention module -> {kind: handler}) for the body; the model's setting is restored on exit."""
    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    old = {k: c._attn_implementation_internal for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation_internal = NAME
        for mod, fns in handlers.items():
            _HANDLERS[id(mod)] = dict(fns)
        yield
    finally:
        for mod in handlers:
            _HANDLERS.pop(id(mod), None)
        for k, c in configs.items():
            c._attn_implementation_internal = old[k]
