"""95% intervals for per-site means over a corpus, clustered by document, from running sums; and
the convention every interval in depthscope follows (defined in :mod:`depthscope.common.ci`, so
that ``depthscope.probes`` follows it too, and re-exported here): it names its n and its method
(:func:`provenance`: ``ci_n``, ``ci_unit``, ``ci_method`` columns) and is NaN below
:data:`MIN_UNITS` units, with a table note (:func:`too_few_note`, :func:`add_notes`) that says why.

The dataset-level tables (:func:`~depthscope.analyses.lens.logit.logit_lens`,
:func:`~depthscope.analyses.norms.contribution_norms`) report per-site means of per-token values.
Tokens of one text are not independent draws (they share a topic, a register and, within a
window, a context), so a standard error that counts tokens as independent would be too small.
Each document is therefore one cluster: with documents ``g = 1..G`` holding token sums ``S_g``
and token counts ``n_g`` of a value, the mean is the ratio ``m = sum_g S_g / N`` (``N = sum_g
n_g``, the plain mean over tokens) and its cluster-robust (CR1) variance is

    Var(m) = G / (G - 1) * sum_g (S_g - m n_g)^2 / N^2

(the linearised variance of a ratio estimator: each document weighs by its tokens). The interval
is ``m +- t(0.975, G - 1) * SE``, Student's t with ``G - 1`` degrees of freedom (the usual
correction when clusters are few), cut to the metric's range (a share stays in [0, 1], a norm
stays >= 0). With fewer than two clusters the SE and interval are NaN; with fewer than
:data:`MIN_UNITS` the SE is given and the interval is NaN (:func:`cluster_provenance` names the
clusters and the method in ``ci_n, ci_unit, ci_method`` and writes the note that says why).

A corpus that is a single document (one long text split into windows) would have no
between-document variance to measure; its windows (each a fresh context of the model) are the
clusters then. The tables count both (``n_docs``, ``n_windows``: those holding at least one
token), so the unit used is the documents when ``n_docs >= 2`` and the windows otherwise.

Streaming. Documents arrive in order (a document's windows are consecutive in
:func:`~depthscope.analyses.text.token_batches`), so a document's sums are complete once a later
one appears; they are then folded into five running totals per value and forgotten. Memory is
the open documents' sums (a batch's worth), never the corpus. The totals are kept about a shift
(the first cluster's mean), so ``sum (S_g - m n_g)^2`` is formed without cancellation even when
the value barely varies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from scipy.stats import t as student_t

from depthscope.common.ci import MIN_UNITS, add_notes, provenance, too_few, too_few_note

__all__ = [
    "ClusterSums",
    "t_quantile",
    "interval_columns",
    "pick_clusters",
    "cluster_provenance",
    "add_notes",
    "MIN_UNITS",
    "provenance",
    "too_few",
    "too_few_note",
]

LEVEL = 0.95


class ClusterSums:
    """Running cluster totals of several named values (each an array of a fixed shape, e.g.
    ``[sites]`` or ``[sites, groups]``): :meth:`add` per chunk, :meth:`se` at the end."""

    def __init__(self) -> None:
        self.open: dict[Hashable, dict[str, list[np.ndarray]]] = {}
        self.last_closed: Hashable | None = None
        self.n_clusters = 0  # clusters that held at least one token
        self.tot: dict[str, dict[str, np.ndarray]] = {}

    def add(self, keys: Sequence[Hashable], values: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """``keys[i]``: the cluster of row ``i``; ``values[name] = (sums, counts)``, each
        ``[len(keys), *shape]``: the row's sum of the value and its number of tokens. Keys come in
        non-decreasing order (a cluster's rows are consecutive in the stream)."""
        if not len(keys):
            return
        first = min(keys)
        if self.last_closed is not None and first <= self.last_closed:
            raise RuntimeError(f"cluster {first!r} came back after it was closed: inputs out of order")
        for k in sorted(k for k in self.open if k < first):
            self._close(k)
        for i, key in enumerate(keys):
            slot = self.open.setdefault(key, {})
            for name, (s, n) in values.items():
                if name in slot:
                    slot[name][0] += s[i]
                    slot[name][1] += n[i]
                else:
                    slot[name] = [np.array(s[i], dtype=np.float64), np.array(n[i], dtype=np.float64)]

    def close_all(self) -> None:
        """Close every open cluster (at the end of the data: no later rows can join them)."""
        for k in sorted(self.open):
            self._close(k)

    def _close(self, key: Hashable) -> None:
        """Fold cluster ``key``'s sums into the running totals (about each value's shift) and forget it."""
        slot = self.open.pop(key)
        self.last_closed = key
        self.n_clusters += 1
        for name, (s, n) in slot.items():
            t = self.tot.get(name)
            if t is None:
                z = np.zeros_like(s)
                t = self.tot[name] = {k: z.copy() for k in ("shift", "a", "b", "c", "n", "s", "g")}
                t["has"] = np.zeros(s.shape, dtype=bool)
            need = ~t["has"] & (n > 0)
            t["shift"][need] = s[need] / n[need]
            t["has"] |= need
            d = s - t["shift"] * n  # the sum about the shift
            t["a"] += d * d
            t["b"] += d * n
            t["c"] += n * n
            t["n"] += n
            t["s"] += d
            t["g"] += n > 0

    def se(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The cluster-robust standard error of the mean of ``name`` and the number of clusters
        holding it (NaN SE below two clusters)."""
        self.close_all()
        t = self.tot[name]
        n, g = t["n"], t["g"]
        with np.errstate(invalid="ignore", divide="ignore"):
            m = np.where(n > 0, t["s"] / np.where(n > 0, n, 1), 0.0)
            e2 = np.clip(t["a"] - 2 * m * t["b"] + m * m * t["c"], 0.0, None)
            var = g / np.where(g > 1, g - 1, 1) * e2 / np.where(n > 0, n, 1) ** 2
        return np.where(g >= 2, np.sqrt(var), np.nan), g.astype(np.int64)


def t_quantile(df: np.ndarray, level: float = LEVEL) -> np.ndarray:
    """The two-sided ``level`` quantile of Student's t with ``df`` degrees of freedom (NaN below 1)."""
    df = np.asarray(df, dtype=float)
    with np.errstate(invalid="ignore"):
        return np.where(df >= 1, student_t.ppf(0.5 + level / 2, np.maximum(df, 1)), np.nan)


def interval_columns(mean, se, n_clusters, bounds=(None, None)) -> dict[str, np.ndarray]:
    """``{"se", "lo", "hi"}``: the mean +- t(0.975, G - 1) SE, cut to ``bounds`` (NaN where the
    mean or the SE is undefined, and ``lo``/``hi`` NaN below :data:`MIN_UNITS` clusters: the SE
    is still given, the interval is not)."""
    mean = np.asarray(mean, dtype=float)
    half = t_quantile(np.asarray(n_clusters) - 1) * se
    half = np.where(too_few(np.asarray(n_clusters)), np.nan, half)
    lo, hi = mean - half, mean + half
    if bounds[0] is not None:
        lo = np.where(np.isnan(lo), lo, np.maximum(lo, bounds[0]))
    if bounds[1] is not None:
        hi = np.where(np.isnan(hi), hi, np.minimum(hi, bounds[1]))
    return {"se": np.asarray(se, dtype=float), "lo": lo, "hi": hi}


def pick_clusters(docs: ClusterSums, windows: ClusterSums) -> ClusterSums:
    """Documents as clusters when there are at least two, else the windows of the one document."""
    docs.close_all()
    windows.close_all()
    return docs if docs.n_clusters >= 2 else windows


def cluster_provenance(docs: ClusterSums, windows: ClusterSums, what: str) -> tuple[dict, list[str]]:
    """The ``ci_n, ci_unit, ci_method`` of the cluster intervals of :func:`interval_columns` (the
    clusters :func:`pick_clusters` picks) and the table's notes: why ``what`` is NaN when there are
    fewer than :data:`MIN_UNITS` of them. ``ci_n`` counts the clusters holding a token; a metric
    defined at fewer positions (e.g. only where a next token exists) may hold fewer, and its
    interval is withheld on its own count."""
    clusters = pick_clusters(docs, windows)
    unit = "documents" if clusters is docs else "windows of one document"
    n = clusters.n_clusters
    method = f"cluster-robust (CR1) standard error, clustered by {unit}; Student t with (clusters - 1) df"
    notes = [too_few_note(n, unit, what)] if too_few(n) else []
    return provenance(n, unit, method), notes
