"""One call that caches and intervenes at any hook point: ``model.run(...)`` and its ``Run``.

>>> run = model.run(["When Mary and John went to the store, John gave a drink to"],
...                 cache=["5.pattern", "blocks.5.hook_attn_out", "12.mlp"],
...                 hooks={"3.neurons": lambda t, ctx: t * 0})       # ablate layer 3's MLP
>>> run.logits.shape, run["5.pattern"].shape                        # [1, pos, vocab], [1, 9, pos, pos]

=====================  =====================================================================
offers                 what
=====================  =====================================================================
:func:`run`            one forward with ``cache`` (names, ``"all"``, ``"resid"``) and ``hooks``
:func:`cache_run`      ``run(..., cache_to=DIR)``: every token's points written to disk in
                       chunks (:mod:`depthscope.hooks.activation_cache`), the store returned
:class:`Run`           ``.logits``, ``.mask``, ``.positions``, ``run[name]`` (aliases too),
                       ``.grad(name)``, ``.stack(names)``
:class:`HookContext`   what a hook receives beside the tensor (also the point's name, a ``str``;
                       defined in :mod:`depthscope.hooks.engine`, which registers every hook)
:func:`position_ids`   absolute positions of a (left- or right-) padded batch
=====================  =====================================================================

Hook functions are called as ``fn(tensor, ctx)`` and return a replacement (same shape and dtype;
anything else raises :class:`~depthscope.common.errors.InputError` naming the point and both
shapes) or None. ``ctx`` is a :class:`HookContext`: a ``str`` equal to the canonical point name
(so ``fn(stream, label)`` hooks written for ``model.hooks`` work unchanged) with ``.point``,
``.mask`` (bool ``[batch, keys]``, True at real tokens, the whole sequence so far),
``.positions`` (``[batch, rows]`` absolute positions of this tensor's rows; query positions for a
pattern) and ``.step`` (None in ``run``; 0 for the prompt and ``k`` for the k-th new token in
``generate``). Several hooks at one point run in order, each seeing the previous one's output.
The cache holds each point as the model used it, i.e. after the hooks.

Replacing a point changes everything downstream as the same edit inside the model would:
``l.z`` and ``l.neurons`` replace the input of the output projection, ``l.heads`` replaces the
projection's output by ``heads.sum(heads) + bias``, ``l.pattern`` goes through
:mod:`depthscope.hooks.attention`, ``l.attn`` of pre-norm models replaces the attention write by
``new - resid_pre``. Reading a point never changes the numbers (``l.heads`` is computed beside the
projection, not instead of it).

``grad=True`` keeps the graph: the input of block 0 becomes a leaf that requires grad, every
cached tensor retains its gradient, and after ``run.logits[...].sum().backward()``
``run.grad(name)`` is the gradient at that point. Two points are not tensors the model itself
uses, so their gradients are read where they are exact: ``l.attn`` of pre-norm/parallel models
(the model adds ``resid_pre + attn_out`` inside its block) takes the gradient of the attention
write, which is the only input of that sum that carries it; ``l.heads`` takes the gradient of the
output projection's output, identical for every head (its output is their sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from depthscope.common.errors import InputError
from depthscope.hooks.activation_cache import Activations, write_activations
from depthscope.hooks.engine import Engine, HookContext, HookFn, Hooks, State, normalise_hooks
from depthscope.hooks.points import parse_point, parse_points

__all__ = [
    "HookContext",
    "HookFn",
    "Hooks",
    "PADDING_SIDES",
    "Run",
    "cache_run",
    "is_left_padded",
    "position_ids",
    "row_positions",
    "run",
]

PADDING_SIDES = ("right", "left")


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Absolute positions of each token within its own text (padding: 0), as transformers'
    ``generate`` computes them: ``cumsum(mask) - 1``."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(~mask.bool(), 0)


def is_left_padded(mask: torch.Tensor) -> bool:
    """True when some row has padding before a real token (its positions do not start at 0)."""
    m = mask.bool()
    return bool((m.long().cumsum(-1) < torch.arange(1, m.shape[-1] + 1, device=m.device)).logical_and(m).any())


def row_positions(mask: torch.Tensor) -> torch.Tensor:
    """Absolute positions ``[batch, pos]`` of a batch's rows: :func:`position_ids` when it is
    left-padded, ``0..pos-1`` for every row otherwise."""
    if is_left_padded(mask):
        return position_ids(mask)
    return torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)


@dataclass
class Run:
    """The result of :func:`run`: ``logits`` ``[batch, pos, vocab]`` (encoders: the MLM head's),
    ``mask`` (True at real tokens), ``input_ids``, ``positions`` (absolute positions), and the
    cached points by canonical name or alias (``run["5.pattern"]``,
    ``run["blocks.5.attn.hook_pattern"]``)."""

    logits: torch.Tensor | None
    mask: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    n_layers: int
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    _grads: dict = field(default_factory=dict, repr=False)

    def _key(self, name) -> str:
        key = parse_point(name, self.n_layers).name
        if key not in self.cache:
            raise KeyError(f"hook point {name!r} ({key}) was not cached; cached: {list(self.cache)}")
        return key

    def __getitem__(self, name) -> torch.Tensor:
        return self.cache[self._key(name)]

    def __contains__(self, name) -> bool:
        try:
            return parse_point(name, self.n_layers).name in self.cache
        except InputError:
            return False

    def keys(self) -> list[str]:
        """Names of the cached points, in forward order."""
        return list(self.cache)

    def stack(self, names="resid") -> torch.Tensor:
        """Cached points of one shape stacked in forward order: ``run.stack("resid")`` is
        ``[2L+1, batch, pos, d_model]`` (like ``ResidualStream.resid``), ``run.stack(["1.z", "2.z"])``..."""
        points = parse_points(names, self.n_layers)
        return torch.stack([self[p.name] for p in points])

    def grad(self, name) -> torch.Tensor:
        """The gradient at a cached point after ``backward()`` (needs ``run(..., grad=True)``)."""
        key = self._key(name)
        if key not in self._grads:
            raise InputError(f"no gradient kept at {key}: call model.run(..., grad=True) and cache it")
        t, transform = self._grads[key]
        if t.grad is None:
            raise InputError(f"no gradient at {key} yet: call .backward() on a function of run.logits first")
        return transform(t.grad)


def run(
    model,
    inputs,
    *,
    cache=None,
    hooks: Hooks = None,
    grad: bool = False,
    padding_side: str = "right",
    mask: torch.Tensor | None = None,
    cache_to=None,
) -> Run | Activations:
    """One forward of ``model`` (a HookedModel) caching ``cache`` (names, ``"all"``, ``"resid"``
    or None) with ``hooks`` ({name: fn}); see the module docstring. ``cache_to`` (a folder):
    write the points of every token to disk instead, chunk by chunk (:func:`cache_run`)."""
    if cache_to is not None:
        return cache_run(model, inputs, cache=cache, hooks=hooks, grad=grad, mask=mask, cache_to=cache_to)
    if padding_side not in PADDING_SIDES:
        raise InputError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    ids, mask = model._prepare(inputs, mask, padding_side=padding_side)
    points = parse_points(cache, model.n_layers)
    user = normalise_hooks(hooks, model.n_layers)
    left = is_left_padded(mask)
    pos = position_ids(mask) if left else torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
    state = State(mask=mask, positions=pos, step=None)
    if grad and torch.is_inference_mode_enabled():
        raise InputError("grad=True inside torch.inference_mode(): no graph can be kept; leave inference mode")
    kwargs = dict(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    if left:
        kwargs["position_ids"] = pos
    with Engine(model, points, user, grad=grad, state=state) as att:
        with torch.enable_grad() if grad else torch.no_grad():
            try:
                out = model.hf_model(**kwargs)
            except RuntimeError as e:
                if grad and "nference tensor" in str(e):
                    raise InputError(
                        f"grad=True: {model.name}'s weights are inference tensors (created under "
                        f"torch.inference_mode), which autograd cannot use: {e}"
                    ) from e
                raise
    logits = getattr(out, "logits", None)
    order = [p.name for p in points]
    return Run(
        logits=logits if grad or logits is None else logits.detach(),
        mask=mask,
        input_ids=ids,
        positions=pos,
        n_layers=model.n_layers,
        cache={k: att.store[k] for k in order if k in att.store},
        _grads=att.grad_src,
    )


def cache_run(
    model, inputs, *, cache=None, hooks: Hooks = None, grad: bool = False, mask=None, cache_to
) -> Activations:
    """``run(model, texts, cache=..., cache_to=DIR)``: the points ``cache`` (default ``"resid"``)
    of every real token of the documents ``inputs`` (a list of strings), computed a chunk of
    documents at a time and written to the store ``DIR``
    (:func:`~depthscope.hooks.activation_cache.write_activations`; a re-run resumes it). Returns
    the store, opened (:func:`~depthscope.hooks.activation_cache.open_activations`)."""
    if grad:
        raise InputError("cache_to writes activations to disk: no gradient is kept (leave grad=False)")
    if mask is not None or isinstance(inputs, torch.Tensor):
        raise InputError("cache_to takes documents as strings (each is tokenized alone, only its own tokens kept)")
    return write_activations(model, inputs, "resid" if cache is None else cache, cache_to, hooks=hooks)
