"""Forwards that start late: at a block from a given stream, or at a position from a key/value prefix.

>>> prefix = KVPrefix.build(model, ids, start=7)            # positions 0..6 of ids, computed once
>>> logits = prefix.forward(ids, hooks={"3.mlp": edit})     # positions 7.. only, the prefix kept whole

=========================  ==========================================================================
:func:`from_block`         (:mod:`.block_start`) context manager: the model's forwards skip blocks
                           ``0 .. block - 1`` and feed a given stream to block ``block``
:class:`KVPrefix`          the key/value cache of a prompt's positions ``0 .. start - 1``:
                           :meth:`~KVPrefix.build`, :meth:`~KVPrefix.repeat` (to ``n`` rows),
                           :attr:`~KVPrefix.nbytes`, :meth:`~KVPrefix.forward` (the positions
                           ``start ..`` with hooks)
:func:`tail_logits`        logits of a forward with hooks that starts at a prefix's position, or of
                           the plain forward of every position when there is no prefix
:class:`Budget`            bytes of kept prefixes (streams or caches) against :data:`PREFIX_BYTES`
:data:`PREFIX_BYTES`       the most bytes of prefixes one analysis keeps; past it, prefixes are
                           recomputed at each use (KV) or forwards start at block 0 (streams)
=========================  ==========================================================================

Why: an edit at a site and position changes nothing before it, in depth (the blocks before the
site's) and in time (the positions before the edited one: attention is causal). Forwards that
differ only in an edit there share what comes before, so it is computed once and every edited
forward starts after it. Both starts are exact: the blocks or positions that run receive the very
tensors the full forward gives them (a key/value prefix is the cache the full forward would fill).

How, for a position start: the transformers model is called with the positions ``start ..`` only,
its cache keyword (``past_key_values`` or the architecture's own, :func:`~.arch.cache_keyword`)
holding the prefix and an attention mask over every position; the hooks go through depthscope's
engine (:class:`~.engine.Engine`) as in every forward. Hook points then see tensors of the tail's
positions only (position ``p`` of the prompt is ``p - start`` there), except points that span every
key position (``rot_k``). The forward appends the tail to the cache it is given:
:meth:`KVPrefix.forward` hands it a copy unless told the prefix is used once (``keep=False``).
Encoders, and models whose cache is not a transformers ``Cache``, get no prefix (``build`` returns
None): callers then run every position.
"""

from __future__ import annotations

import copy
import inspect

import torch

from depthscope.hooks.arch import cache_keyword, returned_cache
from depthscope.hooks.block_start import from_block
from depthscope.hooks.engine import Engine, normalise_hooks

__all__ = ["from_block", "KVPrefix", "tail_logits", "Budget", "PREFIX_BYTES"]

#: the most bytes of prefixes one analysis keeps at once (key/value caches of the interchange
#: batches, clean streams of the causal test's held-out text); tests set it to 0 to turn reuse off
PREFIX_BYTES = 1 << 30


class Budget:
    """Bytes of kept prefixes: :meth:`take` adds some and says whether the total is still within
    :data:`PREFIX_BYTES` (read at each call); once over, it stays closed."""

    def __init__(self):
        self.used = 0
        self.open = True

    def take(self, nbytes: int) -> bool:
        if self.open:
            self.used += nbytes
            self.open = self.used <= PREFIX_BYTES
        return self.open


def _accepts(hf_model, name: str) -> bool:
    try:
        return name in inspect.signature(hf_model.forward).parameters
    except (TypeError, ValueError):
        return False


class KVPrefix:
    """The key/value cache ``cache`` of positions ``0 .. start - 1`` of a prompt, for ``model`` (a
    HookedModel); :meth:`build` makes one."""

    def __init__(self, model, cache, start: int):
        self.model, self.cache, self.start = model, cache, start

    @classmethod
    def build(cls, model, ids: torch.Tensor, start: int) -> KVPrefix | None:
        """The prefix of ``ids`` ``[rows, pos]`` up to ``start`` (no hooks, no graph); None when
        there is nothing to reuse (``start`` 0, an encoder, a model that returns no transformers
        ``Cache``)."""
        if start <= 0 or not model.is_decoder:
            return None
        keep = {"logits_to_keep": 1} if _accepts(model.hf_model, "logits_to_keep") else {}  # its logits go unused
        with torch.no_grad():
            cache = returned_cache(model.hf_model(input_ids=ids[:, :start], use_cache=True, **keep))
        if cache is None or not all(hasattr(cache, a) for a in ("get_seq_length", "batch_repeat_interleave")):
            return None
        return cls(model, cache, start)

    def repeat(self, n: int) -> KVPrefix:
        """Each row repeated ``n`` times, in place (a one-row prefix shared by ``n`` rows)."""
        self.cache.batch_repeat_interleave(n)
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value tensors the cache holds."""
        seen = 0
        for layer in getattr(self.cache, "layers", []) or []:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    seen += t.numel() * t.element_size()
        return seen

    def forward(self, ids: torch.Tensor, hooks, *, keep: bool = True, last_only: bool = False) -> torch.Tensor:
        """Logits of the positions ``start ..`` of ``ids`` ``[rows, pos]`` (the whole prompt; its
        first ``start`` positions are the prefix's) with ``hooks`` (as ``model.run`` takes them,
        positions counted from ``start``); ``last_only``: the last position's only, where the model
        can skip the others. ``keep`` False: the cache is appended to (use the prefix once)."""
        model = self.model
        mask = torch.ones(ids.shape, dtype=torch.long, device=ids.device)  # every position, cached ones too
        kwargs = {"input_ids": ids[:, self.start :], "attention_mask": mask}
        kwargs[cache_keyword(model.hf_model)] = copy.deepcopy(self.cache) if keep else self.cache
        return _forward(model, hooks, kwargs, use_cache=True, last_only=last_only)


def tail_logits(model, ids: torch.Tensor, hooks, prefix: KVPrefix | None = None, *, last_only: bool = False):
    """Logits of ``ids`` with ``hooks``: from ``prefix``'s position (kept whole) when given, else
    of every position (a plain forward of the transformers model, no cache)."""
    if prefix is not None:
        return prefix.forward(ids, hooks, last_only=last_only)
    return _forward(model, hooks, {"input_ids": ids}, use_cache=False, last_only=last_only)


def _forward(model, hooks, kwargs: dict, *, use_cache: bool, last_only: bool) -> torch.Tensor:
    if last_only and _accepts(model.hf_model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    with Engine(model, (), normalise_hooks(hooks, model.n_layers)):
        return model.hf_model(**kwargs, use_cache=use_cache).logits
