"""The clean attention patterns of a replacement model, kept compactly and exactly, and the frozen
heads' mixing ``pattern @ V`` that unpacks a layer's pattern only while it is used.

==============================  ==============================================================
offers                          what
==============================  ==============================================================
:class:`Patterns`               every layer's pattern ``[heads, q, k]``: the causal lower
                                triangle when nothing above it is nonzero (half the bytes),
                                else the dense pattern; ``layer(l)`` unpacks one
:func:`mix`                     ``einsum("hqk,bkhd->bqhd", pattern, v)`` whose backward unpacks
                                the pattern again instead of keeping it in the autograd graph
==============================  ==============================================================

Why: on the default model a 1,024-token prompt has 1.1 GB of patterns (30 layers x 9 heads x
1,024^2 float32). Kept dense, and held again by the kept forward's autograd graph, they were the
largest part of an attribution graph's memory. The packed values are the recorded ones, copied
(not recomputed, not rounded): the frozen model is unchanged to the bit.
"""

from __future__ import annotations

import torch

#: patterns up to this size are mixed in one batched matmul in the backward (copied per row),
#: larger ones one head at a time
SMALL_PATTERN_BYTES = 2**20


class Patterns:
    """The patterns of one prompt, one entry per layer (see the module doc)."""

    def __init__(self, n_pos: int, device):
        self.n_pos = n_pos
        self._tril = torch.tril_indices(n_pos, n_pos, device=device)
        self._flat = self._tril[0] * n_pos + self._tril[1]  # each packed value's place in [q * k]
        self._kept: list[tuple[bool, torch.Tensor]] = []

    def append(self, pattern: torch.Tensor) -> None:
        """Keep one layer's pattern ``[1, heads, q, k]`` (or ``[heads, q, k]``)."""
        p = pattern.reshape(-1, self.n_pos, self.n_pos).detach()
        above = torch.triu(torch.ones(self.n_pos, self.n_pos, dtype=torch.bool, device=p.device), 1)
        if bool((p.masked_select(above) == 0).all()):
            self._kept.append((True, p.reshape(p.shape[0], -1)[:, self._flat].clone()))
        else:  # not causal: kept as it is
            self._kept.append((False, p.clone()))

    def __len__(self) -> int:
        return len(self._kept)

    def layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s pattern ``[heads, q, k]`` (a fresh tensor when packed)."""
        packed, p = self._kept[layer]
        if not packed:
            return p
        out = p.new_zeros(p.shape[0], self.n_pos * self.n_pos)
        out[:, self._flat] = p
        return out.view(p.shape[0], self.n_pos, self.n_pos)

    def __getitem__(self, layer: int) -> torch.Tensor:
        """``[1, heads, q, k]``, as the recording forward gives it."""
        return self.layer(layer).unsqueeze(0)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self._kept)


class _Mix(torch.autograd.Function):
    """``pattern @ V`` per head; the pattern is a constant, unpacked again in the backward."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, patterns: Patterns, layer: int) -> torch.Tensor:
        ctx.patterns, ctx.layer = patterns, layer
        return torch.einsum("hqk,bkhd->bqhd", patterns.layer(layer).to(v.dtype), v)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p = ctx.patterns.layer(ctx.layer).to(grad.dtype)
        # this runs under vmap (is_grads_batched), where einsum has no batching rule; a batched
        # matmul copies the pattern once per row (300 MB a layer at 1,024 tokens, batch 8), so
        # a large pattern goes one head (2-D) at a time, the batch folded into the rows
        if p.numel() * p.element_size() <= SMALL_PATTERN_BYTES:
            return torch.matmul(p.mT, grad.transpose(-3, -2)).transpose(-3, -2), None, None
        heads = [torch.matmul(grad[..., i, :].mT, p[i]).mT for i in range(p.shape[0])]
        return torch.stack(heads, -2), None, None


def mix(patterns: Patterns, layer: int, v: torch.Tensor) -> torch.Tensor:
    """Each head's clean pattern applied to values ``v`` ``[B, pos, heads, d_head]`` ->
    ``[B, pos, heads, d_head]``; one pattern for the whole batch, never copied per row."""
    return _Mix.apply(v, patterns, layer)
