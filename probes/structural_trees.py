"""Dependency trees for the structural probes: gold distances and depths, spanning trees, scores.

=====================================  ========================================================
``tree_distances(heads)``              ``[n, n]`` path lengths between words in the tree
``tree_depths(heads)``                 edges from the root to each word (the root: 0)
``tree_edges(heads, keep)``            the gold undirected edges between kept words
``mst_edges(dist)``                    the minimum spanning tree of a dense distance matrix
                                       (Prim), as undirected edges ``(i, j)``, ``i < j``
``uuas_counts(pred, heads, keep)``     gold edges between kept words, and how many of them
                                       the spanning tree of ``pred`` recovers
``rank_rows(x)``                       average ranks along the last axis
``spearman_rows(a, b)``                Spearman's rho of each row pair (average ranks for ties;
                                       NaN where a row is constant)
``length_macro_mean(values, lengths)`` the mean over sentence lengths 5-50 of each length's mean
``chain_distances(n)``,                the linear-chain baseline: each word attached to the next
``chain_depths(n)``                    (distance ``|i - j|``; depth = position, the first word
                                       the root)
=====================================  ========================================================

The heads come from :func:`depthscope.probes.corpora.tasks.tree_heads` (0-based, -1 for the root).
Hewitt and Manning (2019) evaluate with punctuation left out: a word is *kept* unless its UPOS is
``PUNCT``; the spanning tree, its gold edges, the correlations and the root are taken over kept
words only. Empty nodes (``8.1``) are not words (the corpus reader skips them) and multiword
tokens contribute their syntactic words, so the tree is the basic tree of the word lines.
"""

from __future__ import annotations

import numpy as np

#: sentence lengths (words, punctuation included) whose Spearman correlations are averaged, as in the paper
SPEARMAN_LENGTHS = (5, 50)
PUNCT = "PUNCT"


def tree_depths(heads: np.ndarray) -> np.ndarray:
    """``[n]`` int64: the number of edges from the root to each word (the root: 0)."""
    n = len(heads)
    depth = np.full(n, -1, dtype=np.int64)
    for k in range(n):
        path, j = [], k
        while j >= 0 and depth[j] < 0:
            path.append(j)
            j = int(heads[j])
        base = -1 if j < 0 else int(depth[j])
        for step, m in enumerate(reversed(path), 1):
            depth[m] = base + step
    return depth


def tree_distances(heads: np.ndarray) -> np.ndarray:
    """``[n, n]`` int64: the number of tree edges between each pair of words
    (``depth_i + depth_j - 2 depth_lca``)."""
    n = len(heads)
    depth = tree_depths(heads)
    # ancestors[k]: k and its ancestors; the lowest common ancestor is the deepest shared one
    anc = np.zeros((n, n), dtype=bool)
    for k in range(n):
        j = k
        while j >= 0:
            anc[k, j] = True
            j = int(heads[j])
    shared = anc[:, None, :] & anc[None, :, :]  # [n, n, n]
    lca_depth = np.where(shared, depth[None, None, :], -1).max(-1)
    return depth[:, None] + depth[None, :] - 2 * lca_depth


def tree_edges(heads: np.ndarray, keep: np.ndarray | None = None) -> set:
    """The gold undirected edges ``(i, j)``, ``i < j``, whose two words are both kept."""
    keep = np.ones(len(heads), bool) if keep is None else np.asarray(keep, bool)
    return {(min(k, int(h)), max(k, int(h))) for k, h in enumerate(heads) if h >= 0 and keep[k] and keep[h]}


def mst_edges(dist: np.ndarray) -> set:
    """The minimum spanning tree of the complete graph with edge weights ``dist`` (symmetrised:
    the mean of ``dist`` and its transpose), by Prim's algorithm from word 0; ties go to the
    lower index. Undirected edges ``(i, j)``, ``i < j``."""
    d = np.asarray(dist, dtype=np.float64)
    d = (d + d.T) / 2
    n = len(d)
    if n < 2:
        return set()
    inside = np.zeros(n, bool)
    inside[0] = True
    best, parent = d[0].copy(), np.zeros(n, dtype=np.int64)
    edges = set()
    for _ in range(n - 1):
        cand = np.where(inside, np.inf, best)
        j = int(np.argmin(cand))
        edges.add((min(j, int(parent[j])), max(j, int(parent[j]))))
        inside[j] = True
        closer = ~inside & (d[j] < best)
        best[closer], parent[closer] = d[j][closer], j
    return edges


def uuas_counts(pred_dist: np.ndarray, heads: np.ndarray, keep: np.ndarray) -> tuple[int, int]:
    """``(correct, total)``: how many of the gold edges between kept words the minimum spanning
    tree of ``pred_dist`` (over the kept words) recovers, and how many gold edges there are."""
    idx = np.flatnonzero(keep)
    gold = tree_edges(heads, keep)
    pred = {(int(idx[i]), int(idx[j])) for i, j in mst_edges(np.asarray(pred_dist)[np.ix_(idx, idx)])}
    return len(gold & pred), len(gold)


def rank_rows(x: np.ndarray) -> np.ndarray:
    """Ranks (1-based) along the last axis, ties given their average rank."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, -1)
    n = x.shape[-1]
    pos = np.broadcast_to(np.arange(1, n + 1, dtype=np.float64), x.shape)
    out = np.empty_like(x)
    for row in np.ndindex(x.shape[:-1]):
        v, p = xs[row], pos[row]
        new = np.r_[True, v[1:] != v[:-1]]
        group = np.cumsum(new) - 1
        mean_rank = np.bincount(group, weights=p) / np.bincount(group)
        out[row + (order[row],)] = mean_rank[group]
    return out


def spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rho between ``a[..., :]`` and ``b[..., :]`` row by row: the Pearson correlation
    of their average ranks (as ``scipy.stats.spearmanr``); NaN where either row is constant."""
    ra, rb = rank_rows(a), rank_rows(b)
    ra = ra - ra.mean(-1, keepdims=True)
    rb = rb - rb.mean(-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.where(den > 0, den, 1), np.nan)


def length_macro_mean(values, lengths, span: tuple = SPEARMAN_LENGTHS) -> float:
    """The paper's average: per sentence length in ``span`` (inclusive), the mean of the
    ``values`` of that length (NaN values left out), then the mean over those lengths; NaN when
    no length in ``span`` has a value."""
    values, lengths = np.asarray(values, dtype=np.float64), np.asarray(lengths)
    ok = np.isfinite(values) & (lengths >= span[0]) & (lengths <= span[1])
    if not ok.any():
        return float("nan")
    v, n = values[ok], lengths[ok]
    return float(np.mean([v[n == k].mean() for k in np.unique(n)]))


def chain_distances(n: int) -> np.ndarray:
    """The linear-chain baseline's distances: ``|i - j|`` (each word attached to the next)."""
    pos = np.arange(n)
    return np.abs(pos[:, None] - pos[None, :])


def chain_depths(n: int) -> np.ndarray:
    """The left-to-right baseline's depths: the word's position (the first word the root)."""
    return np.arange(n)
