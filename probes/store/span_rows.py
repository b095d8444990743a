"""Resident features of multi-span examples held once per distinct span: ``[S, D, R]`` plus indices.

====================================  ===========================================================
``SpanRows(words, idx)``              the features ``X [S, N, K*D]`` of ``N`` examples of ``K``
                                      spans: ``X[s, i, k*D:(k+1)*D] = words[s, :, idx[k, i]]``
``.dense(sites, rows, buffer)``       those features as a tensor, feature-major (a gathered copy,
                                      into ``buffer`` when given: ``.batch_buffer(n)``)
``.take_rows(pos)`` / ``.take_sites``  examples ``pos`` / some sites (the span rows shared)
``.mix(p, out)`` / ``.mix_grad(G)``   ``sum_s p_s X_s`` and ``<X_s, G>`` per site, over the span
                                      rows once (the scalar mix's two passes)
``.rows_within(nbytes)``              examples whose dense copy fits ``nbytes``
``.local_order()``                    the examples in the order of their first span's row
``dense(X)``                          resident features as a tensor (a copy of span rows')
``factor(span_rows)``                 distinct rows and each example's index into them
``worth_factoring(N, K, R)``          whether span rows save a quarter of the memory or more
====================================  ===========================================================

An edge task's example concatenates two spans' vectors (``[span1; span2]``, as jiant does), and
the spans recur: in a dependency treebank every word is the dependent of one arc and the head of
others, so the ``N`` arcs of a sample use about ``N`` distinct words, not ``2N``. Held as one row
per distinct span and an index per example, the features take half the memory of the
concatenated copy (deprel on the bundled EWT sample at the default model's 61 sites: 1.05 GiB
instead of 2.1). The products do not change: the solvers read a contiguous dense copy of a block
of sites (:func:`~depthscope.probes.solvers.subspace.fit_softmax`) or of a batch of examples
(:meth:`~depthscope.probes.store.features.Features.batches`), with the same values in the same
layout as the concatenated features. The scalar mix reads the span rows directly: the mix of
the examples is the mix of their spans, gathered, and its gradient the span rows' product with
the gradient summed onto the rows it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from depthscope.probes.store.site_sums import site_inner, weighted_sum

#: bytes of the dense copy of a batch of examples the evaluation loops gather at a time
DENSE_BYTES = 64 * 2**20


@dataclass
class SpanRows:
    """Features ``[S, N, K*D]`` as span rows ``words [S, D, R]`` (feature-major) and
    ``idx [K, N]`` (long, on the rows' device): example ``i``'s span ``k`` is row ``idx[k, i]``."""

    words: torch.Tensor
    idx: torch.Tensor
    #: a float32 ``[D, R]`` workspace of the scalar mix's passes, made on first use
    scratch: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> torch.Size:
        S, D, _ = self.words.shape
        K, N = self.idx.shape
        return torch.Size((S, N, K * D))

    @property
    def dtype(self) -> torch.dtype:
        return self.words.dtype

    @property
    def device(self) -> torch.device:
        return self.words.device

    def element_size(self) -> int:
        return self.words.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held: the span rows and the indices."""
        return self.words.numel() * self.words.element_size() + self.idx.numel() * self.idx.element_size()

    def dense(
        self, sites: slice = slice(None), rows: slice | torch.Tensor = slice(None), buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The features of ``sites`` and examples ``rows`` as a tensor ``[s, n, K*D]`` laid out
        feature-major (the transposed view of a contiguous ``[s, K*D, n]``, as resident
        features are): one gathered copy, written into the start of ``buffer`` (a 1-D tensor of
        the span rows' dtype and device, at least that size) when given, so that a loop over
        batches reuses one block of memory instead of allocating one per batch."""
        words = self.words[sites]
        idx = self.idx[:, rows]
        s, D, _ = words.shape
        K, n = idx.shape
        if buffer is None:
            out = torch.empty(s, K * D, n, dtype=words.dtype, device=words.device)
        else:
            out = buffer[: s * K * D * n].view(s, K * D, n)
        for k in range(K):
            for j in range(s):  # a 2-D selection along rows, site by site (words may be a view)
                torch.index_select(words[j], 1, idx[k], out=out[j, k * D : (k + 1) * D])
        return out.transpose(1, 2)

    def batch_buffer(self, n: int) -> torch.Tensor:
        """A 1-D workspace for :meth:`dense` copies of up to ``n`` examples at every site."""
        S, D, _ = self.words.shape
        return torch.empty(S * self.idx.shape[0] * D * n, dtype=self.words.dtype, device=self.words.device)

    def take_rows(self, pos: torch.Tensor) -> SpanRows:
        """Examples ``pos`` (indices into this one's), sharing the span rows: no copy of features."""
        return SpanRows(self.words, self.idx.index_select(1, pos.to(self.idx.device)))

    def take_sites(self, sites: slice | torch.Tensor) -> SpanRows:
        """Sites ``sites``: a view of the span rows for a slice, else a copy of those sites' rows."""
        if isinstance(sites, slice):
            return SpanRows(self.words[sites], self.idx)
        return SpanRows(self.words.index_select(0, sites.to(self.words.device)), self.idx)

    def to(self, device) -> SpanRows:
        return SpanRows(self.words.to(device), self.idx.to(device))

    def cpu(self) -> SpanRows:
        return self.to("cpu")

    def float(self) -> SpanRows:
        return SpanRows(self.words.float(), self.idx)

    def local_order(self) -> torch.Tensor:
        """The examples sorted by their first span's row (stable): a run of them reads a
        contiguous range of span rows for the first span, and for the others rows close by (an
        arc's head is in its dependent's sentence), where the shuffled order reads rows from
        everywhere (a batch of a few hundred examples then touches most of the span rows'
        memory)."""
        return torch.argsort(self.idx[0], stable=True)

    def rows_within(self, nbytes: float) -> int:
        """Examples whose dense copy at every site takes at most ``nbytes`` (at least 1)."""
        S, _, F = self.shape
        return max(1, int(nbytes // max(1, S * F * self.element_size())))

    def mix(self, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_s p_s X_s`` as ``[K*D, N]`` float32 (into ``out`` when given): the span rows'
        mix (one pass over them), gathered for each span."""
        S, D, R = self.words.shape
        K, N = self.idx.shape
        flat = self.words.reshape(S, D * R)
        mw = weighted_sum(flat, p, self._scratch().view(-1)).view(D, R)
        out = torch.empty(K * D, N, device=self.device) if out is None else out
        for k in range(K):
            torch.index_select(mw, 1, self.idx[k], out=out[k * D : (k + 1) * D])
        return out

    def mix_grad(self, G: torch.Tensor) -> torch.Tensor:
        """``<X_s, G>`` for every site ``[S]`` (float32) for ``G [K*D, N]``: ``G``'s columns
        summed onto the span rows they were gathered from, then one product with the rows."""
        S, D, R = self.words.shape
        K, _ = self.idx.shape
        onto = self._scratch().zero_()
        for k in range(K):
            onto.index_add_(1, self.idx[k], G[k * D : (k + 1) * D])
        return site_inner(self.words.reshape(S, D * R), onto.view(-1))

    def _scratch(self) -> torch.Tensor:
        """The ``[D, R]`` float32 workspace (made once: the mix evaluates these passes dozens of
        times, and a fresh buffer each time would fragment the heap)."""
        _, D, R = self.words.shape
        if self.scratch is None:
            self.scratch = torch.empty(D, R, device=self.device)
        return self.scratch


def dense(X) -> torch.Tensor:
    """Resident features as a tensor: ``X`` itself, or a :class:`SpanRows`' dense copy."""
    return X.dense() if isinstance(X, SpanRows) else X


def factor(span_rows: np.ndarray) -> tuple:
    """``(distinct rows [R] in increasing order, idx [K, N])`` of the examples' span rows
    ``span_rows [N, K]``: ``span_rows[i, k] == distinct[idx[k, i]]``."""
    uniq, inv = np.unique(span_rows.reshape(-1), return_inverse=True)
    return uniq, torch.from_numpy(inv.reshape(span_rows.shape).T.astype(np.int64))


def worth_factoring(n_examples: int, n_spans: int, n_distinct: int) -> bool:
    """Whether span rows save at least a quarter of the concatenated features' memory."""
    return n_spans > 1 and n_distinct <= 0.75 * n_examples * n_spans
