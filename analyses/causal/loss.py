"""The model's next-token loss on held-out text, per document, with write hooks; the ``used`` score.

=====================================  ===========================================================
``held_out(model, texts, window=,      the texts tokenized once (the BOS token prepended as the
bos=, max_tokens=)``                   probes do; documents longer than ``window`` split into
                                       windows, each starting with that token; whole documents
                                       up to ``max_tokens`` predicted tokens): a :class:`HeldOut`
``doc_nll(model, held, hooks,          summed next-token negative log-likelihood (nats) and the
batch_size=)``                         number of predicted tokens per document, one forward
                                       pass per batch through ``model.run(hooks=...)``: a
                                       :class:`DocLoss`
``used_score(clean, erased,            ``(L_erased - mean_c L_control_c) / L_clean``, the losses
controls)``                            token-weighted means over the documents
``used_interval(clean, erased,         its two-level percentile bootstrap interval: documents
controls, n, seed=)``                  (the same draw for every condition) and controls
                                       resampled with replacement; NaN below 10 documents
=====================================  ===========================================================

``used`` is the extra loss that erasing the concept costs beyond erasing a random subspace of the
same rank, as a fraction of the clean loss: 0 when the model loses no more from losing the
concept than from losing as many random directions edited by as much, 0.1 when it loses 10%
of its clean loss more. Documents are the resampling unit, so the interval accounts for the
correlation of a sentence's tokens; the controls are resampled too, so it accounts for how much
the loss of one random erasure differs from another's (with one control it cannot: that spread
is then unmeasured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from depthscope.analyses.intervals import MIN_UNITS, too_few
from depthscope.analyses.next_token import next_token_nll
from depthscope.analyses.text import windows
from depthscope.common.errors import InputError
from depthscope.probes.corpora.spans import bos_id

#: the most token positions per forward pass (the logits are [rows, positions, vocabulary])
BATCH_TOKENS = 4096


@dataclass(frozen=True)
class HeldOut:
    """Token rows (``rows[i]``: a list of ids, at least 2), the document of each row (``doc``),
    how many documents, and ``start``: 1 when every row begins with a special token (BOS) that
    erasure leaves alone, else 0."""

    rows: list
    doc: np.ndarray
    n_docs: int
    start: int

    @property
    def n_tokens(self) -> int:
        """Predicted tokens: every position but each row's first."""
        return int(sum(len(r) - 1 for r in self.rows))


@dataclass(frozen=True)
class DocLoss:
    """Per document: summed next-token NLL in nats (``nll``, float64) and predicted tokens (``tokens``)."""

    nll: np.ndarray
    tokens: np.ndarray

    @property
    def mean(self) -> float:
        """The token-weighted mean loss."""
        return float(self.nll.sum() / max(int(self.tokens.sum()), 1))


def held_out(model, texts: Sequence[str], *, window: int, bos: bool = True, max_tokens: int | None = None) -> HeldOut:
    """``texts`` tokenized for :func:`doc_nll` (whole documents, in order, until ``max_tokens``
    predicted tokens are reached; None: all); see the module docstring."""
    tok = model.tokenizer
    if tok is None:
        raise InputError("this model has no tokenizer: the held-out text cannot be read")
    prepend = bos_id(tok) if bos else None
    special = set(getattr(tok, "all_special_ids", []) or [])
    rows, doc, lead, n_docs, n_tok = [], [], [], 0, 0
    for d, text in enumerate(texts):
        if max_tokens is not None and n_tok >= max_tokens:
            break
        n_docs = d + 1
        ids = list(tok(text, add_special_tokens=True)["input_ids"])
        lead = [prepend] if prepend is not None else ([ids[0]] if ids and ids[0] in special else [])
        body = ids[1:] if (prepend is None and lead) else ids
        for chunk in windows(body, max(window - len(lead), 1)) if body else []:
            if len(lead) + len(chunk) >= 2:
                rows.append(lead + chunk)
                doc.append(d)
                n_tok += len(lead) + len(chunk) - 1
    if not rows:
        raise InputError("the held-out text has no document of two or more tokens: nothing to predict")
    return HeldOut(rows, np.asarray(doc, dtype=np.int64), n_docs, 1 if lead else 0)


def _batches(held: HeldOut, batch_size: int):
    """Row indices per forward pass: rows of similar length together, at most ``batch_size``
    rows and about :data:`BATCH_TOKENS` positions each."""
    order = np.argsort([len(r) for r in held.rows], kind="stable")
    part: list = []
    for i in order:
        width = len(held.rows[i])
        if part and (len(part) >= batch_size or (len(part) + 1) * width > BATCH_TOKENS):
            yield part
            part = []
        part.append(int(i))
    if part:
        yield part


def _padded(rows: list, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask of token lists."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return ids, mask


@torch.no_grad()
def doc_nll(model, held: HeldOut, hooks: dict | None = None, *, batch_size: int = 16) -> DocLoss:
    """Per-document next-token loss of ``model`` on ``held`` with ``hooks`` (``{point: fn}``,
    None: the plain forward); see the module docstring."""
    pad = getattr(model.tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    nll = np.zeros(held.n_docs, dtype=np.float64)
    count = np.zeros(held.n_docs, dtype=np.int64)
    for part in _batches(held, batch_size):
        ids, mask = _padded([held.rows[i] for i in part], pad)
        per, valid = next_token_nll(model.run(ids, mask=mask, hooks=hooks).logits, ids, mask)
        np.add.at(nll, held.doc[part], per.sum(1).double().cpu().numpy())
        np.add.at(count, held.doc[part], valid.sum(1).cpu().numpy())
    return DocLoss(nll, count)


def used_score(clean: DocLoss, erased: DocLoss, controls: Sequence[DocLoss]) -> float:
    """``(L_erased - mean_c L_control_c) / L_clean`` (module docstring)."""
    return (erased.mean - float(np.mean([c.mean for c in controls]))) / clean.mean


def used_interval(
    clean: DocLoss,
    erased: DocLoss,
    controls: Sequence[DocLoss],
    n: int,
    *,
    seed: int = 0,
    level: float = 0.95,
    min_units: int = MIN_UNITS,
) -> tuple[float, float]:
    """The ``level`` two-level percentile bootstrap interval of :func:`used_score`: each of the ``n``
    resamples draws the documents with replacement (the same draw for every condition) and the
    controls with replacement (so the interval widens with the controls' spread), and recomputes
    the score. NaN, NaN for ``n`` 0 or fewer than ``min_units`` documents
    (:data:`~depthscope.analyses.intervals.MIN_UNITS`)."""
    k = len(clean.nll)
    if n <= 0 or too_few(k, min_units):
        return float("nan"), float("nan")
    rng = np.random.default_rng([seed, 3535])
    w = rng.multinomial(k, np.full(k, 1.0 / k), size=n).astype(np.float64)  # [n, docs]
    tok = np.maximum(w @ clean.tokens, 1.0)
    base = w @ clean.nll / tok
    per_control = np.stack([w @ c.nll / tok for c in controls], 1)  # [n, C]
    pick = rng.integers(0, len(controls), size=(n, len(controls)))  # the controls drawn per resample
    gap = w @ erased.nll / tok - np.take_along_axis(per_control, pick, 1).mean(1)
    lo, hi = np.quantile(gap / base, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
