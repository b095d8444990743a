"""The held-out text's clean stream entering each block, so that edited forwards start at their site.

=================================  ============================================================
:class:`Prefixes`                  the batches of the held-out text and, for each, the clean
                                   stream entering block :attr:`Prefixes.block`;
                                   :meth:`Prefixes.advance` moves it deeper one block at a time
                                   (one block's forward per batch), :meth:`Prefixes.start`
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
        """Streams entering ``block`` (no change when disabled; back to block 0 when ``block`` is
        before the current one): one block's forward per batch per block moved."""
        if not self.enabled:
            return
        if block < self.block:
            self.block, self.streams = 0, [None] * len(self.batches)
        while self.block < block:
            site = 2 * self.block + 2  # the block's output: the next block's input
            for i, b in enumerate(self.batches):
                with self.start(i):
                    got = self.model.residual_stream(b.ids, sites=[site], mask=b.mask, return_logits=False)
                self.streams[i] = got.resid[0]
            self.block += 1

    def start(self, i: int) -> contextlib.AbstractContextManager:
        """The context in which batch ``i``'s forward starts at :attr:`block` from its stream."""
        return from_block(self.model, self.block, self.streams[i])
