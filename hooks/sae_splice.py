"""SAEs and transcoders spliced into a forward pass: their features as hook points.

``model.run(texts, saes={"6.mlp": sae}, cache=["6.mlp.sae.features"], hooks={...})`` reads the
SAE's input at its point and offers three more points per SAE, named after the point it reads:

==================================  ================================================================
point                               tensor
==================================  ================================================================
``<p>.sae.features``                the SAE's latents ``encode(x)`` ``[batch, pos, d_sae]``
``<p>.sae.reconstruction``          ``decode(features)`` ``[batch, pos, d_out]``
``<p>.sae.error``                   what the SAE misses: ``y - decode(encode(x))`` (``y``: the
                                    tensor at the point it writes; ``x`` for an SAE)
==================================  ================================================================

All three can be cached and replaced (a hook gets ``fn(tensor, ctx)`` as at any point, with
``ctx`` the sub-point's name). The point the SAE writes (its own point; a transcoder's output
point, by default the same block's ``mlp_out``) becomes ``reconstruction + error``:

- with ``keep_error=True`` (the default) and nothing edited, the model's tensor is left as it
  was: splicing changes no number until a feature, the reconstruction or the error is replaced;
- ``keep_error=False`` runs the model on the reconstruction alone (the error is zero);
- with ``grad=True`` the write is ``decode(features) + (y - decode(encode(x)))`` computed in two
  branches, so the gradient reaching ``x`` is the model's own (the two SAE paths cancel) while
  ``features`` gets ``d loss / d features`` through the decoder, as attribution needs.

The SAE computes in its own dtype; what goes back into the model is cast to the model's dtype.
Hooks at the host point itself run before the SAE reads it.

Attaching an SAE checks it against the point: a tensor there whose width per position is not the
SAE's ``d_in`` (or, where it writes, ``d_out``) is an :class:`~depthscope.common.errors.InputError`
naming the SAE and the point, and an SAE attached by name at another point than the hook it was
recorded for (its ``hook_name``) is logged as a warning: its features were learned elsewhere.

=========================  ==================================================================
offers                     what
=========================  ==================================================================
:func:`plan_splices`       ``saes`` -> one :class:`Splice` per SAE, points resolved and checked
:func:`split_names`        cache names / hooks -> those of the engine and those of the SAEs
:class:`Splicer`           the engine hooks that run the SAEs, and what they cached
``SUB_POINTS``             ``features``, ``reconstruction``, ``error``
=========================  ==================================================================
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from depthscope.common.errors import InputError
from depthscope.hooks.points import Point, parse_point
from depthscope.hooks.run import Run
from depthscope.hooks.sae import SAE, sae_point

SUB_POINTS = ("features", "reconstruction", "error")
_SEP = ".sae."
log = logging.getLogger("depthscope")


@dataclass(frozen=True)
class Splice:
    """One SAE at one point: ``prefix`` names its sub-points (the canonical name of ``read``)."""

    prefix: str
    sae: SAE
    read: Point
    write: Point
    keep_error: bool


def plan_splices(saes, n_layers: int, *, keep_error: bool = True) -> list[Splice]:
    """``saes``: ``{point name: SAE}`` (a TransformerLens alias works; None or ``"auto"`` as the
    key reads the SAE's own ``hook_name``) or a list of SAEs (each at its own hook name)."""
    if not saes:
        return []
    items = saes.items() if isinstance(saes, Mapping) else [(None, s) for s in saes]
    out, seen = [], set()
    for name, sae in items:
        if not isinstance(sae, SAE):
            raise InputError(f"saes[{name!r}] is not an SAE (load one with depthscope.hooks.load_sae): {sae!r}")
        read = sae_point(sae, n_layers) if name in (None, "auto") else parse_point(name, n_layers)
        if name not in (None, "auto"):
            _warn_elsewhere(sae, read, n_layers)
        write = sae_point(sae, n_layers, out=True) if sae.is_transcoder else read
        if write.order < read.order:
            raise InputError(f"the transcoder at {read.name} writes {write.name}, which comes before what it reads")
        if read.name in seen:
            raise InputError(f"two SAEs at {read.name}: attach one SAE per point")
        seen.add(read.name)
        out.append(Splice(read.name, sae, read, write, keep_error))
    return out


def _warn_elsewhere(sae: SAE, at: Point, n_layers: int) -> None:
    """Log a warning when ``sae`` records a hook (``hook_name``) that is not the point ``at``."""
    if sae.hook_name is None:
        return
    try:
        own = sae_point(sae, n_layers).name
    except InputError:
        own = None
    if own != at.name:
        where = f" ({own})" if own is not None else " (no point of this model)"
        log.warning(
            "the SAE %r was recorded for the hook %r%s but is attached at %s: its features were learned at "
            "another point",
            sae,
            sae.hook_name,
            where,
            at.name,
        )


def check_width(s: Splice, x: torch.Tensor, y: torch.Tensor) -> None:
    """The widths per position of what ``s`` reads (``x``) and writes (``y``) are the SAE's
    ``d_in`` and ``d_out``; else an :class:`InputError` naming the SAE and the point."""
    flat = 2 if s.sae.reshape_hook_z else 1
    for t, point, want, what in ((x, s.read, s.sae.d_in, "reads d_in"), (y, s.write, s.sae.d_out, "writes d_out")):
        width = math.prod(t.shape[t.dim() - flat :]) if t.dim() >= 2 + flat else -1
        if width != want:
            got = f"{width} values per position" if width >= 0 else f"a tensor of shape {tuple(t.shape)}"
            raise InputError(
                f"the SAE {s.sae!r} {what}={want}, but the point {point.name} holds {got}: attach an SAE trained "
                f"at this point of this model"
            )


def sub_name(name: str, n_layers: int) -> tuple[str, str] | None:
    """``(prefix, sub)`` for an SAE sub-point name (``"6.mlp.sae.features"``,
    ``"blocks.6.hook_resid_post.sae.error"``), None for any other name."""
    if not isinstance(name, str) or _SEP not in name:
        return None
    head, sub = name.rsplit(_SEP, 1)
    if sub not in SUB_POINTS:
        raise InputError(f"unknown SAE point {name!r}: after '{_SEP}' comes one of {list(SUB_POINTS)}")
    return parse_point(head, n_layers).name, sub


def split_names(cache, hooks, n_layers: int, splices: list[Splice]):
    """Separate the SAE sub-points from the engine's points: returns ``(cache, hooks, sub_cache,
    sub_hooks)`` where ``sub_cache`` is a list of ``(prefix, sub)`` and ``sub_hooks`` maps
    ``(prefix, sub)`` to a list of functions. A sub-point of a point without an SAE is an error."""
    prefixes = {s.prefix for s in splices}

    def check(name):
        got = sub_name(name, n_layers)
        if got is not None and got[0] not in prefixes:
            raise InputError(f"{name!r}: no SAE attached at {got[0]} (attached: {sorted(prefixes) or 'none'})")
        return got

    names = [cache] if isinstance(cache, str) else list(cache or [])
    sub_cache = [got for n in names if (got := check(n)) is not None]
    rest_cache = [n for n in names if check(n) is None] if sub_cache else cache
    sub_hooks: dict[tuple[str, str], list] = {}
    rest_hooks = []
    items = hooks.items() if isinstance(hooks, Mapping) else (hooks or [])
    for name, fns in items:
        got = check(name)
        if got is None:
            rest_hooks.append((name, fns))
        else:
            sub_hooks.setdefault(got, []).extend(fns if isinstance(fns, (list, tuple)) else [fns])
    return rest_cache, rest_hooks, sub_cache, sub_hooks


class SubContext(str):
    """What a hook at an SAE sub-point receives: the sub-point's name (a ``str``) with the host
    point's state (``mask``, ``positions``, ``step``, ``layer``)."""

    def __new__(cls, name: str, host):
        self = str.__new__(cls, name)
        self._host = host
        return self

    @property
    def name(self) -> str:
        return str(self)

    def __getattr__(self, attr):
        return getattr(self.__dict__["_host"], attr)


class Splicer:
    """Runs the SAEs inside one forward (or every step of a generation): :meth:`hooks` gives the
    engine hooks to add, :attr:`store` the cached sub-points (name -> list over calls)."""

    def __init__(self, splices: list[Splice], sub_cache, sub_hooks, *, grad: bool = False):
        self.splices = splices
        self.wanted = {f"{p}{_SEP}{s}" for p, s in sub_cache}
        self.sub_hooks = {f"{p}{_SEP}{s}": fns for (p, s), fns in sub_hooks.items()}
        self.grad = grad
        self.store: dict[str, list[torch.Tensor]] = {}
        self.grad_src: dict[str, torch.Tensor] = {}
        self._inputs: dict[str, torch.Tensor] = {}

    def hooks(self) -> list[tuple[Point, object]]:
        """``(point, fn)`` pairs for the engine: a transcoder's input is kept where it is read,
        every SAE runs where it writes."""
        out = []
        for s in self.splices:
            if s.read != s.write:
                out.append((s.read, self._keeper(s)))
            out.append((s.write, self._runner(s)))
        return out

    def _keeper(self, s: Splice):
        def keep(t, ctx):
            self._inputs[s.prefix] = t
            return None

        return keep

    def _runner(self, s: Splice):
        def run_sae(t, ctx):
            x = t if s.read == s.write else self._inputs.pop(s.prefix)
            return self._splice(s, x, t, ctx)

        return run_sae

    def _edit(self, name: str, value: torch.Tensor, ctx) -> tuple[torch.Tensor, bool]:
        """The value at a sub-point after its hooks (each sees the previous one's output)."""
        edited = False
        for fn in self.sub_hooks.get(name, []):
            new = fn(value, SubContext(name, ctx))
            if new is None:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != value.shape:
                got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                raise InputError(f"hook at {name} returned {got}; expected a tensor of shape {tuple(value.shape)}")
            value, edited = new.to(value.dtype), True
        return value, edited

    def _keep(self, name: str, value: torch.Tensor) -> None:
        if name in self.wanted:
            if self.grad and value.requires_grad:
                value.retain_grad()
                self.grad_src[name] = value
            self.store.setdefault(name, []).append(value if self.grad else value.detach())

    def _splice(self, s: Splice, x: torch.Tensor, y: torch.Tensor, ctx):
        check_width(s, x, y)
        names = {sub: f"{s.prefix}{_SEP}{sub}" for sub in SUB_POINTS}
        feats = s.sae.encode(x)
        feats, e1 = self._edit(names["features"], feats, ctx)
        self._keep(names["features"], feats)
        recon = s.sae.decode(feats, x)
        recon, e2 = self._edit(names["reconstruction"], recon, ctx)
        self._keep(names["reconstruction"], recon)
        clean = s.sae.reconstruct(x) if (e1 or e2 or self.grad) else recon
        error = y.to(clean.dtype) - clean
        if not s.keep_error:
            error = torch.zeros_like(error)
        error, e3 = self._edit(names["error"], error, ctx)
        self._keep(names["error"], error)
        if not (e1 or e2 or e3 or self.grad or not s.keep_error):
            return None  # nothing edited: the model's own tensor, bit for bit
        return (recon + error).to(y.dtype)

    def results(self) -> dict[str, torch.Tensor]:
        """The cached sub-points of a single forward: name -> tensor."""
        return {k: v[0] if len(v) == 1 else torch.cat(v, dim=1) for k, v in self.store.items()}


@dataclass
class SaeRun(Run):
    """A :class:`~depthscope.hooks.run.Run` that also answers to SAE sub-point names
    (``run["6.mlp.sae.features"]``, ``run.grad("6.mlp.sae.features")``)."""

    def _key(self, name) -> str:
        got = sub_name(name, self.n_layers) if isinstance(name, str) else None
        if got is None:
            return super()._key(name)
        key = f"{got[0]}{_SEP}{got[1]}"
        if key not in self.cache:
            raise KeyError(f"SAE point {name!r} ({key}) was not cached; cached: {list(self.cache)}")
        return key

    def __contains__(self, name) -> bool:
        try:
            self._key(name)
        except (KeyError, InputError):
            return False
        return True


def _prepare(model, saes, keep_error: bool, cache, hooks, grad: bool):
    splices = plan_splices(saes, model.n_layers, keep_error=keep_error)
    cache, hooks, sub_cache, sub_hooks = split_names(cache, hooks, model.n_layers, splices)
    splicer = Splicer(splices, sub_cache, sub_hooks, grad=grad)
    return cache, list(hooks) + splicer.hooks(), splicer


def run_with_saes(run_fn, model, inputs, *, saes, keep_error: bool = True, cache=None, hooks=None, **kwargs) -> SaeRun:
    """``run_fn(model, inputs, cache=..., hooks=..., **kwargs)`` (:func:`depthscope.hooks.run.run`)
    with ``saes`` spliced in; the result also holds the SAE sub-points that were cached."""
    grad = bool(kwargs.get("grad", False))
    cache, hooks, splicer = _prepare(model, saes, keep_error, cache, hooks, grad)
    r = run_fn(model, inputs, cache=cache, hooks=hooks, **kwargs)
    fields = {f: getattr(r, f) for f in ("logits", "mask", "input_ids", "positions", "n_layers", "cache", "_grads")}
    fields["cache"] = {**r.cache, **splicer.results()}
    fields["_grads"] = {**r._grads, **{k: (t, lambda g: g) for k, t in splicer.grad_src.items()}}
    return SaeRun(**fields)


def generate_with_saes(gen_fn, model, prompts, *, saes, keep_error: bool = True, cache=None, hooks=None, **kwargs):
    """``gen_fn(model, prompts, cache=..., hooks=..., **kwargs)`` (:func:`depthscope.hooks.generate.generate`)
    with ``saes`` spliced in at every step; ``out.cache`` also holds the SAE sub-points per step."""
    cache, hooks, splicer = _prepare(model, saes, keep_error, cache, hooks, False)
    out = gen_fn(model, prompts, cache=cache, hooks=hooks, **kwargs)
    out.cache.update(splicer.store)
    return out
