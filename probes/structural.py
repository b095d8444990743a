"""Structural probes (Hewitt and Manning 2019): is the dependency tree a linear map of the stream?

=======================================  ======================================================
``tree_split(corpus, examples,           the sentences of one split the probes read: each
extraction)``                            word's store row, gold heads, punctuation mask
                                         (a :class:`TreeSplit`)
``fit_tree_probe(x, split, settings)``   one site's rank-limited map ``B [rank, d]`` by
                                         minibatch Adam to convergence (a :class:`TreeFit`)
``tree_predictions(x, B, split, kind)``  per sentence: squared distances ``[n, n]`` or squared
                                         norms ``[n]`` of the mapped words
``tree_scores(preds, split, kind)``      ``uuas`` and ``spearman`` (``structural``) or
                                         ``root_accuracy`` and ``spearman`` (``depth``)
``baseline_scores(split, kind)``         the same scores of the linear chain / left-to-right
                                         baseline
=======================================  ======================================================

``structural`` (the distance probe): ``d_B(h_i, h_j) = ||B (h_i - h_j)||^2`` is trained to match
the gold tree distance with an L1 loss, each sentence's sum over word pairs divided by its length
squared, averaged over sentences; the predicted tree is the minimum spanning tree of ``d_B``.
``depth`` (the norm probe): ``||B h_i||^2`` against the word's depth in the tree, each sentence's
sum divided by its length. Scores follow the paper (:mod:`.structural_trees`): punctuation (UPOS
``PUNCT``) is left out of evaluation; UUAS over all test sentences; the distance Spearman is
each word's row of predicted against gold distances, and the depth Spearman each sentence's
predicted against gold depths, averaged per sentence length and then over lengths 5-50; root
accuracy is the fraction of sentences whose shallowest kept word is the gold root. Beside them,
the linear-chain baseline (distance ``|i - j|``: each word attached to the next) and the
left-to-right baseline for depth (depth = position, the first word the root).

Features are each word's pooled vector from the activation store (the same extraction as every
task), centred with train's mean and divided by one scale per site (the root mean square of the
centred dimensions: the stream's norm grows with depth, the paper's raw vectors have no such
scale; per-dimension z-scores, as the classifiers use, lowered UUAS on EWT). ``B`` (``rank`` rows,
``ProbeConfig.probe_rank``) starts from a seeded Gaussian scaled to the mean gold target and is
trained as in the paper, by Adam on batches of 20 sentences at step size 1e-3; the step halves
whenever an epoch's loss is not below the best so far (by a ``tol`` fraction), and training stops
once the loss changed by at most ``tol`` (relative) two epochs in a row after at least
:data:`MIN_HALVINGS` halvings, or at ``max_epochs`` epochs (``converged = False``): the rule of
the classifiers' Adam solver (:mod:`depthscope.probes.solvers.methods`). The task's tables are
:mod:`.structural_task`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from depthscope.common.threads import one_thread
from depthscope.probes.store.extraction import span_ids
from depthscope.probes.structural_trees import (
    PUNCT,
    chain_depths,
    chain_distances,
    length_macro_mean,
    spearman_rows,
    tree_depths,
    tree_distances,
    uuas_counts,
)

#: sentences per padded bucket (sorted by length, so padding stays small)
BUCKET = 64
#: step halvings before a fit may stop (as the classifiers' Adam solver)
MIN_HALVINGS = 3
#: the main score of each task (the table column the best site is chosen by)
MAIN_SCORE = {"structural": "uuas", "depth": "root_accuracy"}


@dataclass
class TreeSplit:
    """One split's sentences with a tree, all words covered: ``rows`` the store row of each word
    (sentence after sentence; ``offsets[k]:offsets[k + 1]`` is sentence ``k``), ``heads`` and
    ``keep`` (not punctuation) per sentence, and how many sentences were left out because a
    word is not covered by subwords (``n_dropped``)."""

    rows: np.ndarray
    offsets: np.ndarray
    heads: list
    keep: list
    n_dropped: int = 0

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def targets(self, kind: str) -> list:
        """Gold tree distances ``[n, n]`` (``structural``) or depths ``[n]`` (``depth``) per sentence."""
        f = tree_distances if kind == "structural" else tree_depths
        return [f(h) for h in self.heads]


def tree_split(corpus, examples, extraction) -> TreeSplit:
    """The sentences of ``examples`` (one per word, from
    :func:`~depthscope.probes.corpora.tasks.tree_task`) whose words all have a store row."""
    ids, ok = span_ids(examples, extraction)
    sent = np.asarray(examples.sent1)
    starts = np.flatnonzero(np.r_[True, sent[1:] != sent[:-1]]) if len(sent) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(sent)]
    rows, heads, keep, offsets, dropped = [], [], [], [0], 0
    for a, b in zip(starts, ends):
        if not ok[a:b].all():
            dropped += 1
            continue
        words = corpus.sentences[int(sent[a])].words
        rows.append(extraction.store.row_start[ids[a:b, 0]])
        heads.append(np.asarray([int(x) for x in examples.labels[a:b]], dtype=np.int64))
        keep.append(np.array([w.upos != PUNCT for w in words], dtype=bool))
        offsets.append(offsets[-1] + (b - a))
    cat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    return TreeSplit(cat, np.asarray(offsets, dtype=np.int64), heads, keep, dropped)


# ----------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class TreeSettings:
    """How a tree probe is fitted: ``kind`` (``structural`` or ``depth``), ``rank`` (rows of
    ``B``), the epoch cap, the relative loss tolerance, the seed (``B``'s start, the batches),
    Adam's step size and the sentences per batch (the paper's 1e-3 and 20)."""

    kind: str
    rank: int
    max_epochs: int = 200
    tol: float = 1e-5
    seed: int = 0
    lr: float = 1e-3
    batch: int = 20


@dataclass
class _Bucket:
    """Sentences padded to the longest: ``index [n, L]`` rows of ``x``, ``mask [n, L]``, the gold
    ``target`` (``[n, L, L]`` or ``[n, L]``) and each sentence's weight."""

    index: torch.Tensor
    mask: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor


def _bucket(split: TreeSplit, targets: list, part: np.ndarray, kind: str, n_total: int) -> _Bucket:
    """Sentences ``part`` of ``split`` as one padded bucket whose ``index`` counts their words
    in order from 0 (the rows of ``x[_rows(split, part)]``); a sentence's weight is
    ``1 / (n_total * length^p)`` (``p`` 2 for distances, 1 for depths)."""
    lengths = split.lengths[part]
    L = int(lengths.max())
    index = torch.zeros(len(part), L, dtype=torch.long)
    mask = torch.zeros(len(part), L, dtype=torch.bool)
    target = torch.zeros((len(part), L, L) if kind == "structural" else (len(part), L))
    start = 0
    for r, (k, n) in enumerate(zip(part, lengths)):
        n = int(n)
        index[r, :n] = torch.arange(start, start + n)
        mask[r, :n] = True
        t = torch.from_numpy(targets[k].astype(np.float32))
        if kind == "structural":
            target[r, :n, :n] = t
        else:
            target[r, :n] = t
        start += n
    power = 2 if kind == "structural" else 1
    weight = 1.0 / (n_total * torch.from_numpy(lengths.astype(np.float32)) ** power)
    return _Bucket(index, mask, target, weight)


def _rows(split: TreeSplit, part: np.ndarray) -> torch.Tensor:
    """The rows of ``x`` (``split``'s word order) of sentences ``part``, in that order."""
    return torch.from_numpy(np.concatenate([np.arange(split.offsets[k], split.offsets[k + 1]) for k in part]))


def _bucket_pred(p: torch.Tensor, b: _Bucket, kind: str) -> torch.Tensor:
    """Predicted squared distances ``[n, L, L]`` or squared norms ``[n, L]`` of a bucket's words."""
    q = p[b.index]  # [n, L, rank]
    sq = (q * q).sum(-1)
    if kind == "depth":
        return sq
    return (sq[:, :, None] + sq[:, None, :] - 2 * q @ q.transpose(1, 2)).clamp_min(0)


def bucket_loss(p: torch.Tensor, b: _Bucket, kind: str) -> torch.Tensor:
    """The weighted L1 loss of one bucket's mapped words ``p`` (see the module docstring)."""
    err = (_bucket_pred(p, b, kind) - b.target).abs()
    if kind == "structural":
        m = b.mask[:, :, None] & b.mask[:, None, :]
        m = m & ~torch.eye(m.shape[1], dtype=torch.bool)  # a word's distance to itself is 0 exactly
        err = (err * m).sum((1, 2))
    else:
        err = (err * b.mask).sum(1)
    return (err * b.weight).sum()


def tree_loss(x: torch.Tensor, B: torch.Tensor, split: TreeSplit, kind: str) -> float:
    """The loss of ``B`` on all of ``split`` (features ``x``), sentences in buckets of
    :data:`BUCKET` by length."""
    targets = split.targets(kind)
    order = np.argsort(split.lengths, kind="stable")
    total = 0.0
    with torch.no_grad():
        for a in range(0, len(order), BUCKET):
            part = order[a : a + BUCKET]
            total += float(
                bucket_loss(x[_rows(split, part)] @ B.T, _bucket(split, targets, part, kind, len(split)), kind)
            )
    return total


@dataclass
class TreeFit:
    """One site's fitted map ``B [rank, d]``, its final train loss, epochs and whether the loss
    converged before the cap."""

    B: torch.Tensor
    loss: float
    epochs: int
    converged: bool


def _start(d: int, targets: list, settings: TreeSettings) -> torch.Tensor:
    """A seeded Gaussian ``B`` whose expected output matches the mean gold target on
    the scaled features (``E||B v||^2 = rank * sigma^2 * ||v||^2``, ``||v||^2`` about ``2d``
    for a difference and ``d`` for a word)."""
    tg = np.concatenate([t.reshape(-1) for t in targets]) if targets else np.zeros(0)
    mean = float(tg[tg > 0].mean()) if (tg > 0).any() else 1.0
    spread = 2 * d if settings.kind == "structural" else d
    g = torch.Generator().manual_seed(int(settings.seed))
    return torch.randn(settings.rank, d, generator=g) * (mean / (settings.rank * spread)) ** 0.5


def _epoch(x, B, split: TreeSplit, targets: list, opt, rng, settings: TreeSettings) -> float:
    """One pass of minibatch Adam steps over ``split`` (sentences in a seeded order, batches of
    ``settings.batch`` sentences); returns the epoch's loss (the batches' losses summed)."""
    order = rng.permutation(len(split))
    total = 0.0
    for a in range(0, len(order), settings.batch):
        part = order[a : a + settings.batch]
        loss = bucket_loss(
            x[_rows(split, part)] @ B.T, _bucket(split, targets, part, settings.kind, len(split)), settings.kind
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total


def fit_tree_probe(x: torch.Tensor, split: TreeSplit, settings: TreeSettings) -> TreeFit:
    """Fit ``B`` on the scaled features ``x [N, d]`` of ``split``'s words by minibatch Adam
    (batches of sentences), the step size halved whenever an epoch's loss is not below the best
    so far by a ``tol`` fraction; converged after two epochs in a row whose loss changed by at
    most ``tol`` (relative) once the step has been halved :data:`MIN_HALVINGS` times."""
    targets = split.targets(settings.kind)
    B = _start(x.shape[1], targets, settings).requires_grad_(True)
    opt = torch.optim.Adam([B], lr=settings.lr)
    rng = np.random.default_rng([settings.seed, 7])
    best = prev = None
    calm = halvings = epochs = 0
    converged = False
    with one_thread():  # small products: one thread, no spin-waiting on a shared machine
        while epochs < settings.max_epochs:
            epochs += 1
            loss = _epoch(x, B, split, targets, opt, rng, settings)
            calm = calm + 1 if prev is not None and abs(prev - loss) <= settings.tol * max(loss, 1e-12) else 0
            if best is not None and loss > best * (1 - settings.tol):
                halvings += 1
                for group in opt.param_groups:
                    group["lr"] *= 0.5
            best = loss if best is None else min(best, loss)
            prev = loss
            if calm >= 2 and halvings >= MIN_HALVINGS:
                converged = True
                break
        B = B.detach()
        return TreeFit(B, tree_loss(x, B, split, settings.kind), epochs, converged)


# ----------------------------------------------------------------------------- scoring
def tree_predictions(x: torch.Tensor, B: torch.Tensor, split: TreeSplit, kind: str) -> list:
    """Per sentence, the probe's squared distances ``[n, n]`` (``structural``) or squared norms
    ``[n]`` (``depth``) as float64 arrays."""
    with torch.no_grad():
        p = (x @ B.T).double()
    out = []
    for a, b in zip(split.offsets[:-1], split.offsets[1:]):
        q = p[a:b]
        sq = (q * q).sum(1)
        out.append((sq if kind == "depth" else torch.cdist(q, q) ** 2).numpy())
    return out


def tree_scores(preds: list, split: TreeSplit, kind: str) -> dict:
    """``{"uuas", "spearman"}`` (``structural``) or ``{"root_accuracy", "spearman"}`` (``depth``)
    of the predictions ``preds`` on ``split`` (see the module docstring)."""
    gold = split.targets(kind)
    lengths = split.lengths
    rho, rho_len = [], []
    if kind == "structural":
        correct = total = 0
        for pred, g, heads, keep, n in zip(preds, gold, split.heads, split.keep, lengths):
            c, t = uuas_counts(pred, heads, keep)
            correct, total = correct + c, total + t
            k = np.ix_(keep, keep)
            r = spearman_rows(pred[k], g[k]) if keep.sum() > 1 else np.zeros(0)
            rho.append(r)
            rho_len.append(np.full(len(r), n))
        main = {"uuas": correct / total if total else float("nan")}
    else:
        hits = []
        for pred, g, heads, keep in zip(preds, gold, split.heads, split.keep):
            kept = np.flatnonzero(keep)
            hits.append(len(kept) > 0 and int(kept[np.argmin(pred[kept])]) == int(np.flatnonzero(heads < 0)[0]))
            rho.append(spearman_rows(pred[kept], g[kept])[None] if len(kept) > 1 else np.zeros(0))
        rho_len = [np.full(len(r), n) for r, n in zip(rho, lengths)]
        main = {"root_accuracy": float(np.mean(hits)) if hits else float("nan")}
    main["spearman"] = length_macro_mean(np.concatenate(rho), np.concatenate(rho_len)) if rho else float("nan")
    return main


def baseline_scores(split: TreeSplit, kind: str) -> dict:
    """The scores of the linear chain (``structural``) or of depth = position (``depth``)."""
    f = chain_distances if kind == "structural" else chain_depths
    return tree_scores([f(int(n)).astype(np.float64) for n in split.lengths], split, kind)
