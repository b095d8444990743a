"""The hook engine: the one place that puts forward hooks on a model's torch modules.

Every call that reads or changes a model's tensors goes through :class:`Engine`:
``model.run``, ``model.residual_stream``, ``model.hooks``, ``model.generate``, patching and the
head analyses. For each point asked for (a :class:`~depthscope.hooks.points.Point`), the engine
looks its kind up in :data:`~depthscope.hooks.points.REGISTRY`, finds the module there on the
model's :class:`~depthscope.hooks.arch.ResolvedArch` and hands it to the capture function the
row names:

================  ==========================================================================
capture           what it hooks and reads; how a replacement goes back into the model
================  ==========================================================================
``block_input``   pre-hook of block 0: its input hidden states; replaced in the block's input
``input``         pre-hook: the module's first input; replaced there
``output``        hook: the module's (first) output; replaced there
``qkv``           hook of a query/key/value projection: its output viewed ``[..., heads,
                  d_head]`` (fused projections: that part of the output, :func:`read_qkv`);
                  a replacement goes back into the output (:func:`write_qkv`)
``heads_input``   pre-hook of the output projection: its input viewed ``[..., heads, d_head]``
``heads_output``  hook of the output projection: each head's term ``z_h W_O^h``; a replacement
                  becomes the projection's output ``heads.sum(heads) + bias``
``resid_mid``     pre-hook of the block (keeps ``resid_pre``) and hook of the attention's write:
                  ``resid_pre + write`` (post-norm: the sublayer's output); a replacement
                  becomes the write ``new - resid_pre``
``attention``     no forward hook: a handler inside the attention function for ``rot_q``,
                  ``rot_k``, ``scores`` and ``pattern`` (:mod:`depthscope.hooks.attention`)
``values``        hook of the value projection: value vectors per query head (read only)
================  ==========================================================================

A capture function is ``capture(engine, point, module)``; it registers its hooks with
:meth:`Engine.hook` / :meth:`Engine.pre_hook` (the only calls of ``register_forward_hook`` and
``register_forward_pre_hook`` in depthscope) and hands each tensor to :meth:`Engine.apply`, which
runs the user hooks ``fn(tensor, ctx)``, checks a replacement, stores cached points and stops the
forward after the last cached point when asked to. A new kind of capture is one such function and
one entry in ``CAPTURES``.

Hooks are called in forward order. Several hooks at one point run in order, each seeing the
previous one's output; the cache holds each point as the model used it, i.e. after the hooks.
A point asked for that the forward never reached (a module the model does not run, an attention
that does not go through transformers' attention function) is an error after the forward, never
a silently missing entry. A point at a block that a forward starting late skips
(:func:`~.block_start.from_block`) is refused before the forward, naming the skipped blocks.
``ctx`` is a :class:`HookContext`: the canonical point name (a ``str``, so ``fn(stream, label)``
hooks work unchanged) with the call's ``mask``, ``positions`` and ``step``.
A replacement must have the shape and dtype it was given and real values (not a meta tensor).
A replacement that holds NaN or inf where its input was finite is an error
(:class:`~depthscope.common.errors.NonFiniteActivationError` naming the point) once the call
ends, even when the model's output stays finite (an attention kernel can absorb a NaN query);
-inf is allowed in ``scores``, where it masks. The check costs one reduction per replacement and
one device sync per call; generation also names the points at the step whose logits went
non-finite (:meth:`Engine.watch_nonfinite`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from depthscope.common.errors import InputError, NonFiniteActivationError, UnsupportedArchitecture
from depthscope.hooks.arch import read_qkv, read_values, write_qkv
from depthscope.hooks.attention import ATTENTION_KINDS, eager_patterns
from depthscope.hooks.block_start import start_block
from depthscope.hooks.points import Point, parse_point, spec_of
from depthscope.hooks.stream_pass import isolated

HookFn = Callable[[torch.Tensor, "HookContext"], torch.Tensor | None]
Hooks = Mapping[str, HookFn | Sequence[HookFn]] | Iterable[tuple[str, HookFn]] | None
Sink = Callable[[Point, torch.Tensor], torch.Tensor]


class StopForward(Exception):
    """Raised inside a hook once the last cached point is stored (``Engine(stop=True)``)."""


@dataclass
class State:
    """What hooks see of the call beside the tensor: the mask so far, the rows' positions, the step."""

    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    step: int | None = None


class HookContext(str):
    """The canonical point name (a ``str``) with the call's state: ``point``, ``kind``,
    ``layer``, ``mask``, ``positions``, ``step``."""

    def __new__(cls, point: Point, state: State):
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


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    """A block's input hidden states, passed by position or as ``hidden_states=``."""
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    """A block's (args, kwargs) with its input hidden states replaced by ``new``."""
    if args:
        return (new,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": new}


def _proj_weight(proj) -> torch.Tensor:
    """[out, in] matrix of a Linear or a GPT-2 Conv1D (whose weight is [in, out])."""
    return proj.weight.T if type(proj).__name__ == "Conv1D" else proj.weight


class Engine:
    """Hooks at the points of ``model`` for a ``with`` block: user ``hooks`` (``{Point: [fn]}``)
    run, ``cache`` points are stored in ``self.store`` (name -> tensor; ``sink(point, tensor)``
    decides what is kept, default the tensor itself) and, with ``grad``, keep their gradients in
    ``self.grad_src``. ``stop=True`` ends the forward once the last cached point is stored: the
    ``with`` block then ends quietly (its forward returns nothing). ``on_forward(module, args,
    kwargs)`` runs before every forward of the whole model (generation steps). Everything is
    removed on exit, also on error."""

    def __init__(
        self,
        model,
        cache: Iterable[Point] = (),
        hooks: Mapping[Point, list[HookFn]] | None = None,
        *,
        grad: bool = False,
        state: State | None = None,
        sink: Sink | None = None,
        stop: bool = False,
        on_forward: Callable | None = None,
    ):
        self.model, self.arch = model, model.arch
        self.cache, self.hooks, self.grad = set(cache), dict(hooks or {}), grad
        self.state = state or State()
        self.sink, self.on_forward = sink, on_forward
        self.stop_at = max(self.cache, key=lambda p: p.order) if stop and self.cache else None
        self._names = {p: p.name for p in self.cache}  # cached point -> its key in the store
        self.store: dict[str, torch.Tensor] = {}
        self.grad_src: dict[str, tuple[torch.Tensor, Callable]] = {}
        self.resid_pre: dict[int, torch.Tensor] = {}  # block input kept for its l.attn site
        self.attention: dict[nn.Module, dict[str, Callable]] = {}  # attention module -> {kind: handler}
        self.reached: set[Point] = set()  # points whose tensor went through apply
        self.forwards = 0  # forwards of the whole model that ran to their end
        self.nonfinite: dict[str, torch.Tensor] | None = None  # see watch_nonfinite
        self.made_nonfinite: dict[str, torch.Tensor] = {}  # point -> flag: a replacement made NaN/inf
        self._handles: list = []
        self._stack = contextlib.ExitStack()
        self._ctx = {p: HookContext(p, self.state) for p in self.cache | set(self.hooks)}
        self._modules = {p: self.module_of(p) for p in self._ctx}
        self._check_supported()
        self._check_started()

    # ------------------------------------------------------------------ registration
    def hook(self, module: nn.Module, fn: Callable) -> None:
        """A forward hook ``fn(module, args, output)`` on ``module`` until the engine exits (inside a
        layer-major pass: in this worker's forwards only, :func:`~.stream_pass.isolated`)."""
        self._handles.append(module.register_forward_hook(isolated(fn)))

    def pre_hook(self, module: nn.Module, fn: Callable, with_kwargs: bool = False) -> None:
        """A forward pre-hook ``fn(module, args[, kwargs])`` on ``module`` until the engine exits."""
        self._handles.append(module.register_forward_pre_hook(isolated(fn), with_kwargs=with_kwargs))

    def module_of(self, point: Point) -> nn.Module | None:
        """The module a point is read at (the registry's ``module`` field of the architecture)."""
        module = spec_of(point.kind).module
        found = getattr(self.arch, module)
        if module == "blocks" and point.kind != "embed":
            found = self.arch.by_index  # l.mlp is block l's output wherever block_order runs it
        if isinstance(found, (list, nn.ModuleList)):
            return found[max(point.layer, 0)] if found else None
        return found

    def _check_supported(self) -> None:
        arch, missing = self.arch, []
        heads_known = bool(arch.n_heads and arch.d_head)
        for p, module in self._modules.items():
            if module is None or (spec_of(p.kind).per_head and not heads_known):
                missing.append(p.name)
        if missing:
            raise UnsupportedArchitecture(
                f"{self.model.name} ({arch.family}): depthscope does not know where the hook points "
                f"{sorted(missing)} live (add the module paths to its ArchSpec in depthscope/hooks/arch.py)"
            )
        bridged = sorted(
            p.name
            for p, module in self._modules.items()
            if p.kind in ATTENTION_KINDS and type(module).__module__.startswith("transformer_lens")
        )
        if bridged:
            raise UnsupportedArchitecture(
                f"{self.model.name}: the hook points {bridged} live inside transformers' attention function, "
                f"which a TransformerLens TransformerBridge replaces by its own attention code; read them "
                f"with the bridge's hooks (bridge.run_with_cache), or load the transformers model itself "
                f"(load_model(hf_model) on a model no bridge was booted on)"
            )

    def _check_started(self) -> None:
        """Refuse points at blocks a forward that starts late skips (:func:`~.block_start.from_block`)."""
        start = start_block(self.arch.blocks)
        early = sorted(p.name for p in self._ctx if 0 <= p.layer < start)
        if early:
            raise InputError(
                f"the hook points {early} are at blocks 0..{start - 1}, which this forward skips: it starts at "
                f"block {start} from a given stream (from_block); ask for points at block {start} or later, or "
                f"run the full forward"
            )

    def _check_reached(self, stopped: bool) -> None:
        """Refuse a call in which a point asked for was never reached although the forward ran
        (to its end, or up to the last cached point when ``stopped``)."""
        if (stopped and self.stop_at is None) or not (stopped or self.forwards):
            return
        limit = self.stop_at.order if stopped else None
        missed = [p.name for p in self._ctx if p not in self.reached and (limit is None or p.order <= limit)]
        if missed:
            raise UnsupportedArchitecture(
                f"{self.model.name} ({self.arch.family}): the hook points {sorted(missed)} were asked for but "
                f"never reached in the forward: this model does not run the modules depthscope hooks there "
                f"(or, for {list(ATTENTION_KINDS)}, computes attention without transformers' attention function)"
            )

    def __enter__(self) -> Engine:
        try:
            self._register_all()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.resid_pre.clear()
        self._stack.close()
        stopped = exc_type is not None and issubclass(exc_type, StopForward)
        if exc_type is None or stopped:
            self._check_reached(stopped)
            self._check_finite()
        return stopped

    #: False: a replacement holding NaN or inf is not an error (``residual_stream(check_finite=False)``)
    check_finite = True

    def _check_finite(self) -> None:
        """Refuse a call in which a hook's replacement held NaN or inf where its input was finite."""
        if not self.check_finite:
            return
        bad = sorted(name for name, flag in self.made_nonfinite.items() if bool(flag))
        if bad:
            raise NonFiniteActivationError(
                f"hook at {', '.join(bad)} returned NaN or inf where the model's tensor was finite; the results "
                f"of this call would not mean anything (-inf is allowed in scores, where it masks)"
            )

    def _register_all(self) -> None:
        if self.on_forward is not None:
            self.pre_hook(self.model.hf_model, self.on_forward, with_kwargs=True)
        if self.grad:
            self.pre_hook(self.arch.blocks[0], _grad_leaf, with_kwargs=True)
        for point in sorted(self._ctx, key=lambda p: p.order):
            CAPTURES[spec_of(point.kind).capture](self, point, self._modules[point])
        if self.attention:
            self._stack.enter_context(eager_patterns(self.model.hf_model, self.attention))
        self.hook(self.model.hf_model, self._count_forward)

    def _count_forward(self, mod, args, output) -> None:
        self.forwards += 1

    # ------------------------------------------------------------------ the tensors
    def apply(self, point: Point, t: torch.Tensor) -> torch.Tensor | None:
        """Run the user hooks at ``point`` on ``t``; store it if cached; the replacement or None."""
        self.reached.add(point)
        fns = self.hooks.get(point)
        new = self._run_hooks(point, fns, t) if fns else None
        name = self._names.get(point)
        if name is not None:
            val = t if new is None else new
            if self.sink is not None:
                val = self.sink(point, val)
            self.store[name] = val if self.grad else val.detach()
            if point == self.stop_at:
                raise StopForward
        return new

    def _run_hooks(self, point: Point, fns: list[HookFn], t: torch.Tensor) -> torch.Tensor | None:
        """The user hooks at ``point`` in order, each on the previous one's output; the checked
        replacement (on ``t``'s device) or None when every hook only read. With ``nonfinite``
        (a dict, :meth:`watch_nonfinite`), whether a replacement turned a finite tensor into one
        with NaN or inf is noted there, as a tensor (no device sync)."""
        new, ctx = None, self._ctx[point]
        for fn in fns:
            out = fn(t if new is None else new, ctx)
            if out is not None:
                _check_replacement(point, out, t)
                new = out.to(t.device)
        if new is not None and new.is_floating_point():
            bad = (torch.isnan(new) | torch.isposinf(new)) if point.kind == "scores" else ~torch.isfinite(new)
            made = torch.isfinite(t).all() & bad.any()  # a tensor: read once the call ends (no sync here)
            prev = self.made_nonfinite.get(point.name)
            self.made_nonfinite[point.name] = made if prev is None else prev | made
            if self.nonfinite is not None:
                prev = self.nonfinite.get(point.name)
                self.nonfinite[point.name] = made if prev is None else prev | made
        return new

    def watch_nonfinite(self) -> dict[str, torch.Tensor]:
        """Note from now on, per point name, whether a hook's replacement holds NaN or inf where
        its input was finite (one reduction per replacement, no device sync: read the flags only
        once something downstream is non-finite, as generation does). Returns the dict."""
        self.nonfinite = {}
        return self.nonfinite

    def keep_grad(self, point: Point, t: torch.Tensor, transform: Callable = lambda g: g) -> None:
        """With ``grad``, keep ``t``'s gradient for a cached point (read as ``transform(t.grad)``)."""
        if self.grad and point in self.cache and t.requires_grad:
            if not t.is_leaf:
                t.retain_grad()
            self.grad_src[point.name] = (t, transform)


def _check_replacement(point: Point, out, t: torch.Tensor) -> None:
    """A hook's replacement is a tensor with real values of the shape and dtype it was given."""
    if not isinstance(out, torch.Tensor) or out.shape != t.shape or out.dtype != t.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(
            f"hook at {point.name} returned {got}, expected shape {tuple(t.shape)} {t.dtype} (the tensor it was given)"
        )
    if out.is_meta:
        raise InputError(
            f"hook at {point.name} returned a tensor on the meta device, which holds no values (made with "
            f"device='meta', or from a model not yet loaded); return a tensor with values, e.g. on {t.device}"
        )


def _grad_leaf(mod, args, kwargs):
    """Block 0's input as a leaf that requires grad: every point below it then has a gradient."""
    h = _hidden(args, kwargs)
    if h.requires_grad:
        return None
    return _with_hidden(args, kwargs, h.detach().requires_grad_(True))


# ----------------------------------------------------------------------------- captures
def _block_input(eng: Engine, point: Point, block: nn.Module) -> None:
    def hook(mod, args, kwargs):
        h = _hidden(args, kwargs)
        new = eng.apply(point, h)
        eng.keep_grad(point, h if new is None else new)
        return None if new is None else _with_hidden(args, kwargs, new)

    eng.pre_hook(block, hook, with_kwargs=True)


def _input(eng: Engine, point: Point, module: nn.Module) -> None:
    def hook(mod, args):
        x = args[0]
        new = eng.apply(point, x)
        eng.keep_grad(point, x if new is None else new)
        return None if new is None else (new,) + tuple(args[1:])

    eng.pre_hook(module, hook)


def _output(eng: Engine, point: Point, module: nn.Module) -> None:
    def hook(mod, args, output):
        w = _first(output)
        new = eng.apply(point, w)
        eng.keep_grad(point, w if new is None else new)
        return None if new is None else _replace_first(output, new)

    eng.hook(module, hook)


def _heads_input(eng: Engine, point: Point, proj: nn.Module) -> None:
    H, dh = eng.arch.n_heads, eng.arch.d_head

    def hook(mod, args):
        x = args[0]
        new = eng.apply(point, x.view(*x.shape[:-1], H, dh))
        if new is not None:
            x = new.reshape(x.shape)
        eng.keep_grad(point, x, lambda g: g.view(*g.shape[:-1], H, dh))
        return None if new is None else (x,) + tuple(args[1:])

    eng.pre_hook(proj, hook)


def _heads_output(eng: Engine, point: Point, proj: nn.Module) -> None:
    H, dh = eng.arch.n_heads, eng.arch.d_head

    def hook(mod, args, output):
        x = args[0]
        W = _proj_weight(mod)  # [d_model, H * dh]
        heads = torch.einsum("...hk,dhk->...hd", x.view(*x.shape[:-1], H, dh), W.view(W.shape[0], H, dh))
        new = eng.apply(point, heads)
        if new is not None:
            bias = getattr(mod, "bias", None)
            output = new.sum(-2) + (bias if bias is not None else 0)
        eng.keep_grad(point, output, lambda g: g.unsqueeze(-2).expand(*g.shape[:-1], H, g.shape[-1]))
        return output if new is not None else None

    eng.hook(proj, hook)


def _resid_mid(eng: Engine, point: Point, site: nn.Module) -> None:
    """``l.attn``: post-norm, the attention sublayer's output; otherwise ``resid_pre + write``, the
    gradient taken at the write (the only input of that sum inside the block that carries it)."""
    layer, post_norm = point.layer, eng.arch.layout == "post_norm"
    if not post_norm:

        def keep_input(mod, args, kwargs):
            eng.resid_pre[layer] = _hidden(args, kwargs)

        eng.pre_hook(eng.arch.by_index[layer], keep_input, with_kwargs=True)  # block l, wherever it runs

    def hook(mod, args, output):
        out = _first(output)
        rp = None if post_norm else eng.resid_pre.pop(layer)
        new = eng.apply(point, out if post_norm else rp + out)
        if new is not None:
            out = new if post_norm else new - rp
            output = _replace_first(output, out)
        eng.keep_grad(point, out)
        return output if new is not None else None

    eng.hook(site, hook)


def _qkv(eng: Engine, point: Point, proj: nn.Module) -> None:
    """``l.q`` / ``l.k`` / ``l.v``: the projection's output read as that part; a replacement is
    written back into it (the gradient read from the output's, the same part)."""
    arch, part = eng.arch, "qkv".index(point.kind)

    def hook(mod, args, output):
        out = _first(output)
        new = eng.apply(point, read_qkv(arch, part, out))
        if new is not None:
            out = write_qkv(arch, part, out, new)
        eng.keep_grad(point, out, lambda g: read_qkv(arch, part, g))
        return None if new is None else _replace_first(output, out)

    eng.hook(proj, hook)


def _attention(eng: Engine, point: Point, attn_fn: nn.Module) -> None:
    """``l.rot_q``, ``l.rot_k``, ``l.scores``, ``l.pattern``: a handler inside the attention
    function. With ``grad`` a cached tensor is handed back as its own replacement, so the model
    computes on from it and its gradient is kept."""

    def handler(t):
        new = eng.apply(point, t)
        if new is None and eng.grad and point in eng.cache:
            new = t
        if new is not None:
            eng.keep_grad(point, new)
        return new

    eng.attention.setdefault(attn_fn, {})[point.kind] = handler


def _values(eng: Engine, point: Point, value_proj: nn.Module) -> None:
    def hook(mod, args, output):
        if eng.apply(point, read_values(eng.arch, _first(output))) is not None:
            raise InputError(f"{point.name} is read only: its hooks must return None")

    eng.hook(value_proj, hook)


#: capture name (the registry's ``capture`` field) -> ``capture(engine, point, module)``
CAPTURES: dict[str, Callable[[Engine, Point, nn.Module], None]] = {
    "block_input": _block_input,
    "input": _input,
    "output": _output,
    "qkv": _qkv,
    "heads_input": _heads_input,
    "heads_output": _heads_output,
    "resid_mid": _resid_mid,
    "attention": _attention,
    "values": _values,
}


def cache_points(model, ids: torch.Tensor, mask: torch.Tensor, points: Sequence[Point]) -> dict[str, torch.Tensor]:
    """One no-grad forward of ``ids`` storing ``points`` (any registry kind, depthscope's own
    included), stopped right after the last of them; name -> tensor."""
    ids, mask = model._prepare(ids, mask)
    with torch.no_grad(), Engine(model, points, stop=True) as eng:
        model._forward(ids, mask)
    return eng.store
