"""Forwards that skip sublayers whose output is thrown away: the module computes nothing and hands on zeros.

>>> with skipped([(mlp, None) for mlp in model.arch.mlp]):   # their outputs are replaced at l.mlp_out
...     model._forward(ids, mask)

=====================  ===========================================================================
:func:`skipped`        context manager: within it, each of the given modules returns zeros of its
                       output's shape instead of computing; restored on exit, also on error
:func:`out_width`      the output width of a linear projection (``Linear`` or GPT-2's ``Conv1D``)
=====================  ===========================================================================

Why: a forward that replaces a sublayer's output by a hook (the frozen replacement model puts
transcoder + error at ``l.mlp_out`` and the clean pattern's heads at ``l.z``) still pays for the
sublayer itself -- the real MLP, the query and key projections -- although nothing of it reaches
the result. Skipping them is exact for such a forward: the replaced output never depended on
what the module computed.

How: the module's ``forward`` is shadowed on the instance (no hook is registered and no module
moved), so ``nn.Module.__call__`` still runs the engine's pre-hooks and hooks on it: ``l.mlp_in``
sees the MLP's input and ``l.mlp_out`` replaces its (zero) output as before. Only for modules
whose output is one tensor of the input's leading shape (the MLPs, the q/k/v projections of the
families depthscope loads); callers check the forward they skip in (the replacement model
compares its frozen forward with the clean one on every build).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from depthscope.hooks.arch import linear_weight

__all__ = ["skipped", "out_width"]

_MISSING = object()


def out_width(proj: nn.Module) -> int:
    """Output features of a projection: ``weight.shape[0]`` of a ``Linear``, ``nf`` of a ``Conv1D``."""
    return linear_weight(proj).shape[0]


def _zeros(width: int | None) -> Callable:
    def forward(*args, **kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        return x.new_zeros(*x.shape[:-1], x.shape[-1] if width is None else width)

    return forward


@contextlib.contextmanager
def skipped(modules: Iterable[tuple[nn.Module | None, int | None]]) -> Iterator[None]:
    """Within the context, each module of the ``(module, width)`` pairs returns ``zeros(
    *input.shape[:-1], width)`` (of its first input; ``width`` None: the input's own) without
    computing; hooks on it still run. None modules are passed over; a module given twice (a fused
    projection named for q, k and v) is skipped once, with its first width."""
    saved: dict[int, tuple[nn.Module, object]] = {}
    try:
        for m, width in modules:
            if m is not None and id(m) not in saved:
                saved[id(m)] = (m, m.__dict__.get("forward", _MISSING))
                m.__dict__["forward"] = _zeros(width)
        yield
    finally:
        for m, old in saved.values():
            if old is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = old
