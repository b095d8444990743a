"""Block-level interventions: run a model's decoder blocks in another order, or with some blocks
replaced by the identity.

>>> with block_order(model, skip(model.n_layers, 3)):      # block 3's output = its input
...     logits = model.run(ids, mask=mask).logits
>>> with block_order(model, swap(model.n_layers, 3)):      # block 4, then block 3
...     logits = model.run(ids, mask=mask).logits

==========================  ===================================================================
:func:`block_order`         context manager: the blocks in ``order`` (one entry per position: a
                            block index, or None for the identity); restored on exit, also on
                            error
:func:`skip`                the order with block ``l`` replaced by the identity
:func:`swap`                the order with blocks ``l`` and ``l + 1`` exchanged (Lad et al. 2024)
:func:`check_order`         the checks :func:`block_order` applies to an order
==========================  ===================================================================

The model's own block container (the ``nn.ModuleList`` of :attr:`ResolvedArch.blocks`) is
rearranged in place, so the model's own forward loop runs the blocks: every kernel, mask and
norm is the model's. The list keeps its length (a position is never removed), so models that
look up per-position settings by the loop index keep their shape; settings a block carries
itself (its sliding window, ``attention_type``) move with the block, and the config's
per-position ``layer_types`` list, where the model has one, is permuted the same way, so a block
always runs with its own attention mask. The identity runs the block it replaces and returns
its *input* in the block's output format (a tensor, or a tuple whose first element is the
hidden states, as older transformers return): exact, format-agnostic, at the cost of one block.
Run with ``use_cache=False`` (``model.run`` does): a moved block's ``layer_idx`` would address
another block's key/value cache. Hook points keep naming blocks by their own index (``3.mlp`` is
block 3's MLP wherever block 3 runs). No forward hook is registered here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from depthscope.common.errors import InputError

Order = Sequence[int | None]


class Identity(nn.Module):
    """Stands for ``block`` at its position: runs it and returns its input (the hidden states) in
    the block's output format, so the stream passes through unchanged."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        out = self.block(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return hidden
        return (hidden, *tuple(out)[1:])


def skip(n_layers: int, layer: int) -> list[int | None]:
    """The order of ``n_layers`` blocks with block ``layer`` replaced by the identity."""
    order: list[int | None] = list(range(n_layers))
    if not 0 <= layer < n_layers:
        raise InputError(f"skip: layer {layer} out of range 0..{n_layers - 1}")
    order[layer] = None
    return order


def swap(n_layers: int, layer: int) -> list[int | None]:
    """The order of ``n_layers`` blocks with blocks ``layer`` and ``layer + 1`` exchanged: block
    ``layer + 1`` runs first, then block ``layer``."""
    if not 0 <= layer < n_layers - 1:
        raise InputError(f"swap: layer {layer} needs a next block, i.e. a layer in 0..{n_layers - 2}")
    order: list[int | None] = list(range(n_layers))
    order[layer], order[layer + 1] = layer + 1, layer
    return order


def check_order(order: Order, n_layers: int) -> list[int | None]:
    """``order`` as a list, checked: one entry per block position, each a block index in range or
    None (identity)."""
    order = list(order)
    if len(order) != n_layers:
        raise InputError(f"a block order needs one entry per position ({n_layers}), got {len(order)}")
    for i in order:
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers):
            raise InputError(f"block order entries are block indices 0..{n_layers - 1} or None, got {i!r}")
    return order


@contextlib.contextmanager
def block_order(model, order: Order) -> Iterator[None]:
    """Within the context, ``model`` (a HookedModel) runs block ``order[p]`` at position ``p``
    (None: the identity, see :class:`Identity`); the original blocks and ``config.layer_types``
    come back on exit, also when the body raises. See the module docstring."""
    order = check_order(order, model.n_layers)
    blocks: nn.ModuleList = model.arch.blocks
    saved = dict(blocks._modules)
    originals = list(saved.values())
    config = model.hf_model.config
    types = getattr(config, "layer_types", None)
    permute_types = isinstance(types, list) and len(types) == len(originals)
    try:
        for p, key in enumerate(saved):
            i = order[p]
            blocks._modules[key] = Identity(originals[p]) if i is None else originals[i]
        if permute_types:
            config.layer_types = [types[p] if i is None else types[i] for p, i in enumerate(order)]
        yield
    finally:
        for key, module in saved.items():
            blocks._modules[key] = module
        if permute_types:
            config.layer_types = types
