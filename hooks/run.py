"""One call that caches and intervenes at any hook point: ``model.run(...)`` and its ``Run``.

>>> run = model.run(["When Mary and John went to the store, John gave a drink to"],
...                 cache=["5.pattern", "blocks.5.hook_attn_out", "12.mlp"],
...                 hooks={"3.neurons": lambda t, ctx: t * 0})       # ablate layer 3's MLP
>>> run.logits.shape, run["5.pattern"].shape                        # [1, pos, vocab], [1, 9, pos, pos]

=====================  =====================================================================
offers                 what
=====================  =====================================================================
:func:`run`            one forward with ``cache`` (names, ``"all"``, ``"resid"``) and ``hooks``
:class:`Run`           ``.logits``, ``.mask``, ``.positions``, ``run[name]`` (aliases too),
                       ``.grad(name)``, ``.stack(names)``
:class:`HookContext`   what a hook receives beside the tensor (also the point's name, a ``str``)
:class:`Attached`      the machinery: hooks for a set of points on a model for a ``with`` block
                       (:mod:`depthscope.hooks.generate` reuses it for every generation step)
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

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from depthscope.common.errors import InputError, UnsupportedArchitecture
from depthscope.hooks.attention import eager_patterns
from depthscope.hooks.points import Point, parse_point, parse_points

HookFn = Callable[[torch.Tensor, "HookContext"], torch.Tensor | None]
Hooks = Mapping[str, HookFn | Sequence[HookFn]] | Iterable[tuple[str, HookFn]] | None

PADDING_SIDES = ("right", "left")


class HookContext(str):
    """The canonical point name (a ``str``) with the call's state: ``point``, ``kind``,
    ``layer``, ``mask``, ``positions``, ``step``."""

    def __new__(cls, point: Point, state: _State):
        self = str.__new__(cls, point.name)
        self.point = point
        self._state = state
        return self

    @property
    def name(self) -> str:
        return str(self)

    @property
    def kind(self) -> str:
        return self.point.kind

    @property
    def layer(self) -> int:
        return self.point.layer

    @property
    def mask(self) -> torch.Tensor | None:
        return self._state.mask

    @property
    def positions(self) -> torch.Tensor | None:
        return self._state.positions

    @property
    def step(self) -> int | None:
        return self._state.step


@dataclass
class _State:
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    step: int | None = None


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Absolute positions of each token within its own text (padding: 0), as transformers'
    ``generate`` computes them: ``cumsum(mask) - 1``."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(~mask.bool(), 0)


def is_left_padded(mask: torch.Tensor) -> bool:
    """True when some row has padding before a real token (its positions do not start at 0)."""
    m = mask.bool()
    return bool((m.long().cumsum(-1) < torch.arange(1, m.shape[-1] + 1, device=m.device)).logical_and(m).any())


def normalise_hooks(hooks: Hooks, n_layers: int) -> dict[Point, list[HookFn]]:
    """``{Point: [fn, ...]}`` from a mapping name -> fn (or list of fns) or (name, fn) pairs."""
    out: dict[Point, list[HookFn]] = {}
    if not hooks:
        return out
    items = hooks.items() if isinstance(hooks, Mapping) else hooks
    for name, fns in items:
        fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
        for fn in fns:
            if not callable(fn):
                raise InputError(f"hook at {name!r} is not callable: {fn!r}")
        out.setdefault(parse_point(name, n_layers), []).extend(fns)
    return out


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _replace_first(x, new):
    if isinstance(x, tuple):
        return (new,) + tuple(x[1:])
    if isinstance(x, list):
        return [new] + list(x[1:])
    return new


def _proj_weight(proj) -> torch.Tensor:
    """[out, in] matrix of a Linear or a GPT-2 Conv1D (whose weight is [in, out])."""
    return proj.weight.T if type(proj).__name__ == "Conv1D" else proj.weight


class Attached:
    """Hooks at ``points`` of ``model`` for a ``with`` block: user ``hooks`` run, ``cache`` points
    are stored in ``self.store`` (name -> tensor) and, with ``grad``, keep their gradients.
    Everything is removed on exit, also on error."""

    def __init__(
        self,
        model,
        cache: Sequence[Point],
        hooks: Mapping[Point, list[HookFn]],
        grad: bool = False,
        state: _State | None = None,
    ):
        self.model, self.arch = model, model.arch
        self.cache, self.hooks, self.grad = set(cache), dict(hooks), grad
        self.state = state or _State()
        self.store: dict[str, torch.Tensor] = {}
        self.grad_src: dict[str, tuple[torch.Tensor, Callable]] = {}
        self._handles: list = []
        self._stack = contextlib.ExitStack()
        self._ctx = {p: HookContext(p, self.state) for p in set(self.cache) | set(self.hooks)}
        self._check_supported()

    # ------------------------------------------------------------------ core
    def _apply(self, point: Point, t: torch.Tensor) -> torch.Tensor | None:
        """Run the user hooks at ``point`` on ``t``; store it if cached; the replacement or None."""
        new = None
        for fn in self.hooks.get(point, ()):
            out = fn(t if new is None else new, self._ctx[point])
            if out is not None:
                if not isinstance(out, torch.Tensor) or out.shape != t.shape or out.dtype != t.dtype:
                    got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
                    raise InputError(
                        f"hook at {point.name} returned {got}, expected shape {tuple(t.shape)} {t.dtype} "
                        f"(the tensor it was given)"
                    )
                new = out.to(t.device)
        if point in self.cache:
            val = t if new is None else new
            self.store[point.name] = val if self.grad else val.detach()
        return new

    def _keep_grad(self, point: Point, t: torch.Tensor, transform: Callable = lambda g: g) -> None:
        if self.grad and point in self.cache and t.requires_grad:
            if not t.is_leaf:
                t.retain_grad()
            self.grad_src[point.name] = (t, transform)

    def _wanted(self, point: Point) -> bool:
        return point in self.cache or point in self.hooks

    # ------------------------------------------------------------------ registration
    def __enter__(self) -> Attached:
        try:
            self._register_all()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.close()

    def _check_supported(self) -> None:
        arch, need = self.arch, {}
        for p in self._ctx:
            if p.kind == "pattern":
                need[p] = arch.attn_fn[p.layer]
            elif p.kind in ("z", "heads"):
                need[p] = arch.o_proj[p.layer] if arch.n_heads and arch.d_head else None
            elif p.kind == "neurons":
                need[p] = arch.down_proj[p.layer]
        missing = sorted(p.name for p, m in need.items() if m is None)
        if missing:
            raise UnsupportedArchitecture(
                f"{self.model.name} ({arch.family}): depthscope does not know where the hook points {missing} live "
                f"(add the module paths to its ArchSpec in depthscope/hooks/arch.py)"
            )

    def _register_all(self) -> None:
        arch, reg = self.arch, self._handles.append
        patterns = {}
        resid_pre: dict[int, torch.Tensor] = {}
        for layer, block in enumerate(arch.blocks):
            reg(block.register_forward_pre_hook(self._block_pre(layer, resid_pre), with_kwargs=True))
            if self._wanted(Point("pattern", layer)):
                patterns[arch.attn_fn[layer]] = self._pattern_handler(layer)
            if self._wanted(Point("z", layer)):
                reg(arch.o_proj[layer].register_forward_pre_hook(self._z_hook(layer)))
            if self._wanted(Point("heads", layer)):
                reg(arch.o_proj[layer].register_forward_hook(self._heads_hook(layer)))
            if self._wanted(Point("attn_out", layer)):
                reg(arch.attn_write[layer].register_forward_hook(self._write_hook(Point("attn_out", layer))))
            if self._wanted(Point("attn", layer)):
                reg(arch.attn_site[layer].register_forward_hook(self._attn_site_hook(layer, resid_pre)))
            if self._wanted(Point("neurons", layer)):
                reg(arch.down_proj[layer].register_forward_pre_hook(self._neurons_hook(layer)))
            if self._wanted(Point("mlp_out", layer)):
                reg(arch.mlp_write[layer].register_forward_hook(self._write_hook(Point("mlp_out", layer))))
            if self._wanted(Point("mlp", layer)):
                reg(block.register_forward_hook(self._block_post(layer)))
        if patterns:
            self._stack.enter_context(eager_patterns(self.model.hf_model, patterns))

    def _block_pre(self, layer: int, resid_pre: dict):
        point = Point("embed", -1)
        track = self._wanted(Point("attn", layer)) and self.arch.layout != "post_norm"

        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            new = None
            if layer == 0:
                if self.grad and not h.requires_grad:
                    new = h = h.detach().requires_grad_(True)
                if self._wanted(point):
                    out = self._apply(point, h)
                    if out is not None:
                        new = h = out
                    self._keep_grad(point, h)
            if track:
                resid_pre[layer] = h
            if new is None:
                return None
            if args:
                return (new,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": new}

        return hook

    def _block_post(self, layer: int):
        point = Point("mlp", layer)

        def hook(mod, args, output):
            h = _first(output)
            new = self._apply(point, h)
            self._keep_grad(point, h if new is None else new)
            return None if new is None else _replace_first(output, new)

        return hook

    def _write_hook(self, point: Point):
        def hook(mod, args, output):
            w = _first(output)
            new = self._apply(point, w) if self._wanted(point) else None
            w = w if new is None else new
            self._keep_grad(point, w)
            return None if new is None else _replace_first(output, new)

        return hook

    def _attn_site_hook(self, layer: int, resid_pre: dict):
        point, post_norm = Point("attn", layer), self.arch.layout == "post_norm"

        def hook(mod, args, output):
            out = _first(output)
            rp = None if post_norm else resid_pre.pop(layer)
            stream = out if post_norm else rp + out
            new = self._apply(point, stream)
            if new is not None:
                delta = new if post_norm else new - rp
                output = _replace_first(output, delta)
                out = delta
            if post_norm:
                self._keep_grad(point, out)
            elif self.grad and point in self.cache and out.requires_grad:
                if not out.is_leaf:
                    out.retain_grad()
                self.grad_src[point.name] = (out, lambda g: g)
            return output if new is not None else None

        return hook

    def _z_hook(self, layer: int):
        point, H, dh = Point("z", layer), self.arch.n_heads, self.arch.d_head

        def hook(mod, args):
            x = args[0]
            new = self._apply(point, x.view(*x.shape[:-1], H, dh))
            if new is not None:
                x = new.reshape(x.shape)
            self._keep_grad(point, x, lambda g: g.view(*g.shape[:-1], H, dh))
            return None if new is None else (x,) + tuple(args[1:])

        return hook

    def _heads_hook(self, layer: int):
        point, H, dh = Point("heads", layer), self.arch.n_heads, self.arch.d_head

        def hook(mod, args, output):
            x = args[0]
            W = _proj_weight(mod)  # [d_model, H * dh]
            heads = torch.einsum("...hk,dhk->...hd", x.view(*x.shape[:-1], H, dh), W.view(W.shape[0], H, dh))
            new = self._apply(point, heads)
            if new is not None:
                bias = getattr(mod, "bias", None)
                output = new.sum(-2) + (bias if bias is not None else 0)
            self._keep_grad(point, output, lambda g: g.unsqueeze(-2).expand(*g.shape[:-1], H, g.shape[-1]))
            return output if new is not None else None

        return hook

    def _neurons_hook(self, layer: int):
        point = Point("neurons", layer)

        def hook(mod, args):
            x = args[0]
            new = self._apply(point, x)
            self._keep_grad(point, x if new is None else new)
            return None if new is None else (new,) + tuple(args[1:])

        return hook

    def _pattern_handler(self, layer: int):
        point = Point("pattern", layer)

        def handler(weights):
            new = self._apply(point, weights)
            if new is None and self.grad and point in self.cache:
                new = weights  # recompute pattern @ V from this tensor so its gradient is kept
            if new is not None:
                self._keep_grad(point, new)
            return new

        return handler


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
) -> Run:
    """One forward of ``model`` (a HookedModel) caching ``cache`` (names, ``"all"``, ``"resid"``
    or None) with ``hooks`` ({name: fn}); see the module docstring."""
    if padding_side not in PADDING_SIDES:
        raise InputError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    ids, mask = model._prepare(inputs, mask, padding_side=padding_side)
    points = parse_points(cache, model.n_layers)
    user = normalise_hooks(hooks, model.n_layers)
    left = is_left_padded(mask)
    pos = position_ids(mask) if left else torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
    state = _State(mask=mask, positions=pos, step=None)
    if grad and torch.is_inference_mode_enabled():
        raise InputError("grad=True inside torch.inference_mode(): no graph can be kept; leave inference mode")
    kwargs = dict(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    if left:
        kwargs["position_ids"] = pos
    with Attached(model, points, user, grad=grad, state=state) as att:
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
