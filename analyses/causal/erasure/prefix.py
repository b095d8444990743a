"""The held-out text's clean stream entering each block, so that edited forwards start at their site.

=================================  ============================================================
:class:`Prefixes`                  the batches of the held-out text and, for each, the clean
                                   stream entering block :attr:`Prefixes.block`;
                                   :meth:`Prefixes.advance` moves it deeper (a forward of
                                   the blocks between, per batch), :meth:`Prefixes.start`
                                   the context in which a batch's forward starts there
:func:`site_block`                 the block a residual site's forward starts at: ``embed`` 0,
                                   ``l.attn`` and ``l.mlp`` block ``l``
=================================  ============================================================

An edit at a residual site changes nothing before the site, so the causal test's erased and
control forwards of a site share the clean stream entering the site's block. Sites run through
the depth in order; the streams are advanced with them, so the whole depth costs one clean
forward, and each edited forward runs only the blocks from its site's on
(:func:`~depthscope.hooks.block_start.from_block`): on average about half the blocks. The result
is exact: each block sees the tensor the full forward gives it, in the same batch. The streams
are kept within the late-start engine's byte budget
(:data:`~depthscope.hooks.late_start.PREFIX_BYTES`); beyond it every forward starts at block 0
(the plain forward).
"""

from __future__ import annotations

import contextlib

import torch

from depthscope.analyses.text import pad_id
from depthscope.hooks.late_start import Budget, from_block
from depthscope.hooks.stream_pass import layer_major

__all__ = ["Prefixes", "site_block"]


def site_block(site: int) -> int:
    """The block whose input an edit at residual site ``site`` (0 = embed, ``2l+1`` = ``l.attn``,
    ``2l+2`` = ``l.mlp``) leaves unchanged: forwards with that edit start there."""
    return max(site - 1, 0) // 2


class Prefixes:
    """The held-out text's batches (``held.batches(batch_size, ..., by_length=True, max_tokens=)``,
    the batches :func:`~depthscope.analyses.causal.erasure.loss.doc_nll` runs) and the clean stream
    entering :attr:`block` for each. ``enabled`` False (the streams, one ``[rows, pos, d]`` per
    batch, would exceed :data:`~depthscope.hooks.late_start.PREFIX_BYTES`): the block stays 0 and
    every forward is the plain one."""

    def __init__(self, model, held, batch_size: int, max_tokens: int):
        self.model = model
        self.batches = list(held.batches(batch_size, pad_id(model), by_length=True, max_tokens=max_tokens))
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        total = sum(b.ids.numel() for b in self.batches) * model.d_model * itemsize
        self.enabled = Budget().take(total)
        self.block = 0
        self.streams: list[torch.Tensor | None] = [None] * len(self.batches)

    @torch.no_grad()
    def advance(self, block: int) -> None:
        """Streams entering ``block`` (no change when disabled; from block 0 when ``block`` is
        before the current one): each batch's forward from :attr:`block` to ``block``'s input, all
        of them as one layer-major pass (:func:`~depthscope.hooks.stream_pass.layer_major`: a
        streamed model reads each block once)."""
        if not self.enabled:
            return
        if block < self.block:
            self.block, self.streams = 0, [None] * len(self.batches)
        if block == self.block:
            return
        site = 2 * block  # block - 1's output: block's input

        def stream(i: int) -> torch.Tensor:
            b = self.batches[i]
            with self.start(i):
                return self.model.residual_stream(b.ids, sites=[site], mask=b.mask, return_logits=False).resid[0]

        def held(i: int) -> int:
            return 2 * self.batches[i].ids.numel() * self.model.d_model * 4

        self.streams = list(layer_major(self.model, range(len(self.batches)), stream, held=held))
        self.block = block

    def start(self, i: int) -> contextlib.AbstractContextManager:
        """The context in which batch ``i``'s forward starts at :attr:`block` from its stream."""
        return from_block(self.model, self.block, self.streams[i])
