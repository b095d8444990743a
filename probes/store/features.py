"""Features: the examples' span rows in a store, standardised, held in memory site-major.

=================================  ==============================================================
``Features(store, span_ids)``      examples' rows (``span_ids[i, k]``: span ``k`` of example ``i``)
``.fit_standardiser()``            train mean and std per site and dimension (one pass, stable)
``.standardise_like(train)``       other splits reuse train's statistics
``.make_resident(...)``            standardised features in memory ``[S, N, n_spans * D]``, in
                                   ``dtype``, on ``device`` (RAM, or a GPU's: copied there once);
                                   edge examples whose spans recur as :class:`SpanRows`
``.batches(batch_size, rng)``      minibatches for the probes (resident slices, where the
                                   features are, or store gathers)
``.subset(idx)``                   the examples ``idx`` (resident rows copied, not re-read)
``.with_sites(sites)``             resident features of some sites only
=================================  ==============================================================

Features are standardised per site and dimension with the train split's mean and standard
deviation (so the scale growth of a pre-norm residual stream does not decide which site a
scalar mix prefers), and edge tasks concatenate the two spans' vectors (as jiant does):
``[pool(span1); pool(span2)]``. Where the examples' spans recur (a dependency arc's head is
another arc's dependent), resident features hold each distinct span once
(:class:`~depthscope.probes.store.span_rows.SpanRows`, half the memory for arcs) and the solvers
read dense copies of a block of sites or a batch of examples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from depthscope.common.threads import one_thread
from depthscope.probes.store.activations import SpanStore
from depthscope.probes.store.span_rows import SpanRows, factor, worth_factoring


@dataclass
class Features:
    """Examples' span rows in a store: ``span_ids[i, k]`` is span ``k`` of example ``i``.

    After :meth:`fit_standardiser` (train) or :meth:`standardise_like` (other splits),
    :meth:`make_resident` copies the standardised, pooled features into memory, site-major:
    ``resident [S, N, n_spans * D]`` (``dtype``, or bfloat16 if only that fits), in a seeded
    shuffled order (``order[r]``: the example in row ``r``), so a minibatch is a slice fed
    straight to ``bmm`` and any contiguous part of the rows is a random sample. In memory each site's
    features are stored feature-major (``resident`` is the transposed view of a contiguous
    ``[S, F, N]`` tensor, :func:`feature_major`): both products of a full-batch linear probe's
    pass, ``X W`` and ``X^T G``, are faster with the examples innermost (``bench_probe_fit``
    measures the products' floor).
    When the examples' spans recur enough to save a quarter of that (:func:`worth_factoring`),
    ``resident`` is a :class:`SpanRows` instead: each distinct span's standardised row once, and
    every example's index into them (the same values, in the same order, read as dense copies).
    Without it (attention pooling, or too large), minibatches are gathered from the store.
    """

    store: SpanStore
    span_ids: np.ndarray  # [N, n_spans]
    mean: torch.Tensor | None = None  # [S, D]
    std: torch.Tensor | None = None
    max_len: int = 1
    resident: torch.Tensor | SpanRows | None = None  # [S, N, n_spans * D], rows in ``order``
    order: np.ndarray | None = None
    sites: np.ndarray | None = None  # a subset of the store's sites (resident features only)

    def __len__(self) -> int:
        return len(self.span_ids)

    @property
    def n_spans(self) -> int:
        return self.span_ids.shape[1]

    @property
    def n_sites(self) -> int:
        return self.store.n_sites if self.sites is None else len(self.sites)

    @property
    def d(self) -> int:
        return self.store.d_model

    @property
    def tokens(self) -> bool:
        """True when examples carry several subword rows (attention pooling)."""
        return self.store.pooling == "attn"

    def standardise_like(self, other: Features) -> Features:
        self.mean, self.std = other.mean, other.std
        return self

    def fit_standardiser(self, chunk: int | None = None) -> Features:
        """Mean and std per site and dimension over the rows these examples use, in one pass
        over the store: per-chunk mean and squared deviations (float32, about the chunk's own
        mean, so no cancellation) merged in float64 (Chan et al.'s pairwise update). Chunks hold
        about ``CHUNK_BYTES`` of float32 rows, so memory beyond the features stays flat."""
        spans = np.unique(self.span_ids.reshape(-1))
        S, D = self.n_sites, self.d
        chunk = chunk or _rows_per_chunk(S * D * max(1, self.max_len or 1))
        mean = torch.zeros(S, D, dtype=torch.float64)
        m2 = torch.zeros(S, D, dtype=torch.float64)
        n = 0
        for a in range(0, len(spans), chunk):
            x, m = self.store.gather(spans[a : a + chunk], self.max_len)
            self.store.release()  # the chunk is copied: its pages of the store need not stay mapped
            x = x[m]  # [rows, S, D] float32
            k = x.shape[0]
            if k == 0:
                continue
            cm = x.mean(0)
            cm2 = ((x - cm) ** 2).sum(0).double()
            cm = cm.double()
            tot = n + k
            d = cm - mean
            mean += d * (k / tot)
            m2 += cm2 + d * d * (n * k / tot)
            n = tot
        std = (m2 / max(n, 1)).sqrt()
        std = torch.where(std > 1e-6 * (mean.abs() + 1), std, torch.ones_like(std))
        self.mean, self.std = mean.float(), std.float()
        return self

    def make_resident(
        self, *, max_bytes: float = 4e9, seed: int = 0, chunk: int | None = None, dtype=None, device=None
    ) -> bool:
        """Standardised features in memory, site-major; False if they do not fit (or attn).

        ``dtype`` None means float32 (callers pass ``ProbeConfig.precision`` resolved), then a
        2-byte type if float32 does not fit in ``max_bytes`` (recorded as the summary's
        ``precision``). Standardisation is done in float32, on the CPU, before any rounding.
        ``device`` (None: the CPU; callers pass ``ProbeConfig.device`` resolved): where the
        resident tensor lives; each chunk is copied there once as it is read, so the solvers that
        read ``resident`` compute there with no copy per pass (``max_bytes`` bounds it there).
        Edge examples whose spans recur are held as :class:`SpanRows` (``max_bytes`` then
        bounds the distinct spans' rows)."""
        if self.tokens:
            return False
        N, S, F_ = len(self), self.n_sites, self.n_spans * self.d
        uniq, idx = factor(self.store.row_start[self.span_ids])  # distinct store rows, [n_spans, N]
        factored = worth_factoring(N, self.n_spans, len(uniq))
        need = len(uniq) * S * self.d if factored else N * S * F_
        dt = torch.float32 if dtype is None else dtype
        if need * dt.itemsize > max_bytes:
            dt = torch.bfloat16 if dt == torch.float32 else dt
        if need * dt.itemsize > max_bytes:
            return False
        if device is not None and torch.device(device).type != "cpu":
            check_device_room(need * dt.itemsize, torch.device(device))
        self.order = np.random.default_rng(seed).permutation(N)
        with one_thread():
            if factored:
                words = torch.empty(S, self.d, len(uniq), dtype=dt, device=device)
                self._standardised(uniq, words, chunk)
                self.resident = SpanRows(words, idx[:, torch.from_numpy(self.order)].to(words.device))
            else:
                self.resident = self._concatenated(dt, device, chunk)
        return True

    def _standardised(self, rows: np.ndarray, out: torch.Tensor, chunk: int | None) -> None:
        """The store's ``rows`` standardised into ``out [S, D, len(rows)]`` (feature-major, any
        dtype and device), read in chunks (each copied there once)."""
        st, S, D = self.store, self.n_sites, self.d
        chunk = chunk or _rows_per_chunk(S * D)
        for a in range(0, len(rows), chunk):
            x = torch.from_numpy(np.asarray(st.feats[rows[a : a + chunk]])).float().permute(1, 0, 2)  # [S, B, D]
            st.release()  # copied: the store's pages would otherwise add up to its size in memory
            if self.mean is not None:  # in place (a gathered copy): one chunk of temporaries
                x.sub_(self.mean[:, None]).div_(self.std[:, None])
            out[:, :, a : a + x.shape[1]] = x.transpose(1, 2)

    def _concatenated(self, dt, device, chunk: int | None) -> torch.Tensor:
        """The examples' spans' rows concatenated, ``[S, N, n_spans * D]`` (feature-major: the
        transposed view of a contiguous ``[S, F, N]``), rows in ``order``."""
        st, S, D = self.store, self.n_sites, self.d
        XT = torch.empty(S, self.n_spans * D, len(self), dtype=dt, device=device)
        chunk = chunk or _rows_per_chunk(S * D)
        for a in range(0, len(self), chunk):
            idx = self.order[a : a + chunk]
            for k in range(self.n_spans):  # straight into the span's block of rows: no temporary
                self._standardised(
                    st.row_start[self.span_ids[idx, k]], XT[:, k * D : (k + 1) * D, a : a + len(idx)], None
                )
        return XT.transpose(1, 2)

    def subset(self, idx: np.ndarray, *, max_bytes: float = 4e9, seed: int = 0) -> Features:
        """The examples ``idx`` with this split's standardisation: resident rows are copied from
        memory (same dtype; :class:`SpanRows` share their rows and copy only the indices), in a
        ``seed``-shuffled order like every resident tensor (the probe solver forms its curvature
        from a contiguous part of the rows:
        :func:`~depthscope.probes.solvers.subspace.hessian_rows`), else the subset is made
        resident from the store when it fits."""
        idx = np.asarray(idx, dtype=np.int64)
        sub = Features(self.store, self.span_ids[idx], self.mean, self.std, self.max_len, sites=self.sites)
        if self.resident is None:
            sub.make_resident(max_bytes=max_bytes, seed=seed)
            return sub
        pos = np.empty(len(self), dtype=np.int64)
        pos[self.order] = np.arange(len(self))  # example -> row of the resident tensor
        sub.order = np.random.default_rng(seed).permutation(len(idx))
        rows = torch.from_numpy(pos[idx[sub.order]])
        if isinstance(self.resident, SpanRows):
            sub.resident = self.resident.take_rows(rows)
        else:
            sub.resident = _take(self.resident, 1, rows)
        return sub

    def with_sites(self, sites) -> Features:
        """These examples at the store's sites ``sites`` only (resident features). Evenly spaced
        sites (the penalty search's) are a view of this split's features, no memory of their own;
        other sites a copy of those rows."""
        if self.resident is None:
            raise ValueError("with_sites needs resident features")
        sites = np.asarray(sites, dtype=np.int64)
        sub = Features(self.store, self.span_ids, self.mean, self.std, self.max_len, order=self.order, sites=sites)
        run = _evenly_spaced(sites, self.resident.shape[0])
        if isinstance(self.resident, SpanRows):
            sub.resident = self.resident.take_sites(run if run is not None else torch.from_numpy(sites))
        elif run is not None:
            sub.resident = self.resident[run]
        else:
            sub.resident = _take(self.resident, 0, torch.from_numpy(sites))
        return sub

    def _gather(self, idx: np.ndarray):
        """``(x [B, n_spans, L, S, D], mask [B, n_spans, L])`` of examples ``idx`` read from the
        store, standardised. Each span's rows are copied into one preallocated batch (zero rows
        where a span is shorter) and standardised in place, so a streamed batch holds about one
        copy of its rows: a batch of edge examples at every site is hundreds of MB."""
        got = []
        for k in range(self.n_spans):
            got.append(self.store.gather(self.span_ids[idx, k], self.max_len))
            self.store.release()  # the rows are copied: a streamed split's pages need not stay mapped
        L = max(x.shape[1] for x, _ in got)
        B, _, S, D = got[0][0].shape
        x = torch.zeros(B, self.n_spans, L, S, D) if L > 1 else torch.empty(B, self.n_spans, 1, S, D)
        mask = torch.zeros(B, self.n_spans, L, dtype=torch.bool)
        for k in range(self.n_spans):
            xk, mk = got[k]
            got[k] = None  # each span's rows freed once copied into the batch
            x[:, k, : xk.shape[1]] = xk
            mask[:, k, : mk.shape[1]] = mk
            del xk, mk
        if self.mean is not None:
            x.sub_(self.mean).div_(self.std)
        return x, mask

    def batches(self, batch_size: int, rng: np.random.Generator | None = None):
        """Yield ``(example indices, inputs)``; inputs are ``(X [S, B, n*D], None)`` when
        resident, else ``(x [B, n, L, S, D], mask [B, n, L])``. With ``rng``: random
        order (resident: fixed shuffled slices visited in random order; for :class:`SpanRows`
        dense copies gathered into one buffer reused from batch to batch, so a batch's inputs are
        valid until the next is drawn, and without ``rng`` in the order of their first span's
        row, so that each reads nearby span rows). Resident slices are on the features' device:
        callers compute there (:func:`~depthscope.probes.solvers.objective.on_features_device`)."""
        n = len(self)
        starts = np.arange(0, n, batch_size)
        if isinstance(self.resident, SpanRows):
            yield from self._span_batches(batch_size, rng)
        elif self.resident is not None:
            if rng is not None:
                starts = rng.permutation(starts)
            for a in starts:
                X = self.resident[:, a : a + batch_size]
                yield self.order[a : a + batch_size], (X if X.dtype != torch.float16 else X.float(), None)
        else:
            perm = rng.permutation(n) if rng is not None else np.arange(n)
            for a in starts:
                idx = np.sort(perm[a : a + batch_size])
                yield idx, self._gather(idx)

    def _span_batches(self, batch_size: int, rng: np.random.Generator | None):
        """:meth:`batches` of :class:`SpanRows`: dense copies gathered into one buffer, in the
        order of each example's first span's row without ``rng`` (each batch reads nearby span
        rows), else fixed shuffled slices in random order."""
        n = len(self)
        starts = np.arange(0, n, batch_size)
        by_span = self.resident.local_order() if rng is None else None
        if rng is not None:
            starts = rng.permutation(starts)
        buffer = self.resident.batch_buffer(min(batch_size, n))
        for a in starts:
            if by_span is None:
                rows, idx = slice(a, a + batch_size), self.order[a : a + batch_size]
            else:
                rows = by_span[a : a + batch_size]
                idx = self.order[rows.cpu().numpy()]
            yield idx, (self.resident.dense(rows=rows, buffer=buffer), None)


def _evenly_spaced(sites: np.ndarray, n: int) -> slice | None:
    """``sites`` (indices below ``n``) as a slice when they are evenly spaced and increasing, else None."""
    step = np.unique(np.diff(sites))
    if len(sites) == 0 or sites[0] < 0 or sites[-1] >= n or len(step) > 1 or (len(step) and step[0] <= 0):
        return None
    return slice(int(sites[0]), int(sites[-1]) + 1, int(step[0]) if len(step) else 1)


#: on a GPU the probe solvers hold up to about this many times a task's features at once (the
#: features, a block's transposed copy, one fold's copy during the refits)
DEVICE_HEADROOM = 2.0


def check_device_room(nbytes: int, device: torch.device) -> None:
    """Refuse to place ``nbytes`` of features on ``device`` when, with the solvers' copies
    (:data:`DEVICE_HEADROOM`), they exceed its free memory: a clear error before any copy, not an
    out-of-memory failure in the middle of a fit."""
    from depthscope.hooks.devices import DeviceError, short_of

    free = short_of(nbytes, device, DEVICE_HEADROOM)
    if free is not None:
        raise DeviceError(
            f"--probe-device {device}: this task's features need {nbytes / 2**30:.2f} GiB "
            f"(x{DEVICE_HEADROOM:g} with the solvers' copies) but {device} has {free / 2**30:.2f} GiB free; "
            "use --probe-device cpu, or probe fewer sites"
        )


def feature_major(X: torch.Tensor) -> bool:
    """True when features ``[S, N, F]`` hold the examples innermost in memory (the resident layout)."""
    return X.stride(1) == 1 and X.shape[2] > 1


def _take(X: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``X.index_select(dim, idx)`` for resident features ``[S, N, F]`` (``dim`` 0: sites, 1:
    examples), keeping a feature-major layout feature-major, on ``X``'s device (``idx`` is
    moved there)."""
    idx = idx.to(X.device)
    if feature_major(X):
        XT = X.transpose(1, 2)  # [S, F, N]
        if dim == 0:
            return XT.index_select(0, idx).transpose(1, 2)
        S, F_, N = XT.shape  # examples: a 2-D selection along rows (much faster than along a 3-D tensor's last dim)
        if XT.is_contiguous():
            return XT.reshape(S * F_, N).index_select(1, idx).view(S, F_, len(idx)).transpose(1, 2)
        # a view of some sites: site by site, no copy of it
        out = torch.empty(S, F_, len(idx), dtype=XT.dtype, device=XT.device)
        for s in range(S):
            torch.index_select(XT[s], 1, idx, out=out[s])
        return out.transpose(1, 2)
    return X.index_select(dim, idx)


class Resident(NamedTuple):
    """How resident copies of features are held in memory (:meth:`Features.make_resident`): at
    most ``max_bytes`` of them, in ``dtype`` (None: float32)."""

    max_bytes: float = 4e9
    dtype: torch.dtype | None = None


CHUNK_BYTES = 8 * 2**20  # float32 rows per chunk when reading the store: small temporaries, flat memory


def _rows_per_chunk(values_per_row: int) -> int:
    """Rows of ``values_per_row`` float32 values that fill ``CHUNK_BYTES`` (at least 16)."""
    return max(16, CHUNK_BYTES // (4 * max(1, values_per_row)))
