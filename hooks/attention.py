"""The ``l.pattern`` hook point: attention probabilities read and replaced inside the model.

transformers (>= 4.48) routes every attention layer of the supported families through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. depthscope registers one more entry,
``"depthscope_eager"`` (:func:`depthscope_attention`, with transformers' eager mask), and switches
a model to it only for the calls that read or replace a pattern (:func:`eager_patterns`
restores the model's own setting afterwards, also on error). The function

1. calls the family's own eager attention (the module-level ``eager_attention_forward`` of the
   model's modeling file), so a read pattern is exactly what ``output_attentions=True`` under
   ``attn_implementation="eager"`` returns, softcapping and GQA expansion included;
2. hands the probabilities ``[batch, query heads, query, key]`` to the layer's handler (set by
   :mod:`depthscope.hooks.run` for the duration of one call), which may return a replacement;
3. if replaced, recomputes the heads' outputs ``pattern @ V`` with the same matmul the eager
   function uses (K/V of grouped-query models expanded to the query heads).

So every layer of such a call runs the eager kernel (SDPA/flash models then equal their eager
run, ~1e-6 apart in float32); calls that do not touch a pattern keep the model's own kernel.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

NAME = "depthscope_eager"

# id(attention module) -> handler(weights) -> replacement or None; set only inside one call
_HANDLERS: dict[int, Callable[[torch.Tensor], torch.Tensor | None]] = {}


def _generic_eager(module, query, key, value, attention_mask, **kwargs):
    """Eager attention for modeling files without an ``eager_attention_forward`` of their own
    (keywords as transformers passes them: ``scaling``, ``softcap``; dropout is off in eval)."""
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def family_eager(module: nn.Module) -> Callable:
    """The eager attention function of ``module``'s own modeling file."""
    mod = sys.modules.get(type(module).__module__)
    return getattr(mod, "eager_attention_forward", None) or _generic_eager


def depthscope_attention(module, query, key, value, attention_mask, **kwargs):
    """The family's eager attention with the ``l.pattern`` handler of this module in between."""
    out, weights = family_eager(module)(module, query, key, value, attention_mask, **kwargs)
    handler = _HANDLERS.get(id(module))
    if handler is None:
        return out, weights
    new = handler(weights)
    if new is None:
        return out, weights
    n_rep = new.shape[1] // value.shape[1]
    v = value.repeat_interleave(n_rep, dim=1) if n_rep > 1 else value
    out = torch.matmul(new.to(v.dtype), v).transpose(1, 2).contiguous()
    return out, new


def _register() -> None:
    AttentionInterface.register(NAME, depthscope_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)


_register()


@contextlib.contextmanager
def eager_patterns(model: nn.Module, handlers: dict[nn.Module, Callable]) -> Iterator[None]:
    """Route ``model``'s attention through :func:`depthscope_attention` with ``handlers``
    (attention module -> handler) for the body; the model's setting is restored on exit."""
    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    old = {k: c._attn_implementation_internal for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation_internal = NAME
        for mod, fn in handlers.items():
            _HANDLERS[id(mod)] = fn
        yield
    finally:
        for mod in handlers:
            _HANDLERS.pop(id(mod), None)
        for k, c in configs.items():
            c._attn_implementation_internal = old[k]
