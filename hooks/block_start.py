"""Forwards that start at a block: the stream entering block ``b`` given, the blocks before it not run.

>>> first = model.residual_stream(ids, sites=["4.resid_pre"], mask=mask, return_logits=False)
>>> with from_block(model, 4, first.resid[0]):
...     logits = model.run(ids, mask=mask, hooks={"6.mlp": erase}).logits   # blocks 4.. only

==========================  ===================================================================
:func:`from_block`          context manager: within it, the model's forwards skip blocks
                            ``0 .. block - 1`` and feed ``stream`` to block ``block`` as its
                            input; restored on exit, also on error
:class:`Skipped`            what stands at a skipped position: returns its input, computes nothing
:class:`Entered`            what stands at position ``block``: the block, called on ``stream``
:func:`start_block`         the block the forwards start at now (0: the plain forward)
==========================  ===================================================================

Why: an intervention at a site changes nothing before the site, so many forwards that differ only
in an edit at (or after) block ``b`` share the stream entering ``b``. Computing it once and
starting each forward there saves the blocks before ``b`` (on average half the model when the
sites run through the depth), exactly: block ``b`` receives the same tensor the full forward
would give it, and every later operation is the model's own, on the same batch.

How: as :func:`~depthscope.hooks.block_order.block_order`, the model's own block list is
rearranged in place (no hook is registered): the positions before ``block`` hold :class:`Skipped`
modules, and the position ``block`` a :class:`Entered` module that calls the block with
``stream`` in place of its hidden-states input (so the engine's hooks on the block, ``l.resid_pre``
and ``l.attn``, read the given stream). Both stand for their block: any other attribute the
model's loop reads of them (``attention_type``...) is the block's. The embedding, rotary tables
and masks are still computed by the model (cheap); a skipped position's output never reaches
anything, since the entered block replaces it. Hook points keep naming blocks by their index;
points at blocks before ``block`` are never reached: asking for one is an error naming the
skipped blocks, before the forward runs (:class:`~depthscope.hooks.engine.Engine`). ``stream``
must be a tensor with the shape, dtype and device of that input (``[batch, pos, d_model]`` of the
call's ids, the model's dtype, on its device; anything else is refused with what was expected);
run with ``use_cache=False`` (``model.run`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from depthscope.common.errors import InputError
from depthscope.hooks.stream_pass import worker

__all__ = ["from_block", "Skipped", "Entered", "start_block"]


class _StandsFor(nn.Module):
    """Stands for ``block`` at its position: every attribute but ``forward`` is the block's."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)


class Skipped(_StandsFor):
    """A block position that is not run: its hidden-states input goes out as it came in."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


class Entered(_StandsFor):
    """The first block run: called with ``stream`` as its hidden-states input."""

    def __init__(self, block: nn.Module, stream: torch.Tensor):
        super().__init__(block)
        self.stream = stream

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.shape != self.stream.shape:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise InputError(f"from_block: the stream given is {tuple(self.stream.shape)}, the block's input is {got}")
        s = self.stream
        if (s.dtype, s.device) != (hidden.dtype, hidden.device):
            raise InputError(
                f"from_block: the stream must be what the block receives, dtype {hidden.dtype} on device "
                f"{hidden.device}; got dtype {s.dtype} on device {s.device} (convert it: stream.to(model.dtype) "
                f"on model.device)"
            )
        if worker() is not None:  # a layer-major pass: the stream may wait on disk, so it must be this forward's own
            s = s.clone()
        if args:
            return self.block(s, *args[1:], **kwargs)
        return self.block(*args, **{**kwargs, "hidden_states": s})


@contextlib.contextmanager
def from_block(model, block: int, stream: torch.Tensor | None) -> Iterator[None]:
    """Within the context, ``model`` (a HookedModel) starts its forwards at ``block`` with
    ``stream`` as that block's input (see the module docstring). ``block`` 0 with ``stream``
    None changes nothing (the plain forward)."""
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < model.n_layers:
        raise InputError(f"from_block: block must be in 0..{model.n_layers - 1}, got {block!r}")
    if stream is not None and not isinstance(stream, torch.Tensor):
        raise InputError(
            f"from_block: the stream must be a torch.Tensor [batch, pos, d_model] of the model's dtype "
            f"({model.dtype}) on its device ({model.device}), got {type(stream).__name__}"
        )
    if stream is None:
        if block:
            raise InputError(f"from_block: starting at block {block} needs the stream entering it")
        yield
        return
    blocks: nn.ModuleList = model.arch.blocks
    saved = dict(blocks._modules)
    keys = list(saved)
    try:
        for key in keys[:block]:
            blocks._modules[key] = Skipped(saved[key])
        blocks._modules[keys[block]] = Entered(saved[keys[block]], stream)
        yield
    finally:
        for key, module in saved.items():
            blocks._modules[key] = module


def start_block(blocks: nn.ModuleList) -> int:
    """The block the model's forwards start at now: the position of the :class:`Entered` module
    (0 outside :func:`from_block`)."""
    return next((i for i, b in enumerate(blocks) if isinstance(b, Entered)), 0)
