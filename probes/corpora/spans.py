"""Words and spans to subword tokens, and the texts that are run through the model.

A *passage* is the text of one forward pass: a single sentence (``context="sentence"``) or
consecutive sentences of one document (``context="document"``, for coreference), joined by a
space. In document mode each sentence is *owned* by exactly one passage and may be preceded
by context sentences owned by the previous passage: a document that fits in ``max_tokens``
is one passage; a longer one is cut into passages whose owned part fills about half the
budget and whose context part fills the rest, so every sentence sees at least about half a
window of preceding text (and the model runs at most about twice the document's tokens).

Spans map to subwords through the tokenizer's character offsets: the subwords of a span
``[cs, ce)`` are those whose offsets overlap it (a leading-space subword " world" belongs to
"world"; a subword shared by two words, e.g. across ``SpaceAfter=No``, belongs to both).
A span no subword covers, or one cut off by ``max_tokens`` truncation, is *skipped* and
counted, never silently mapped elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from depthscope.common.errors import InputError
from depthscope.probes.config import CONTEXTS


@dataclass
class Passage:
    """The text of one forward pass and the sentences it holds (see the module docstring)."""

    text: str
    sents: list  # sentence indices (context first, then owned)
    offsets: list  # char offset of each of those sentences in ``text``
    owned: list  # bool per sentence


@dataclass
class Tokenized:
    """Token ids and char offsets of passages (special tokens get zero-width offsets)."""

    ids: list  # list[np.ndarray[int64]]
    starts: list  # list[np.ndarray[int64]]
    ends: list
    n_truncated: int = 0


def build_passages(sentences: Sequence, context: str = "sentence", *, tokenizer=None, max_tokens: int = 512) -> tuple:
    """Passages for a list of sentences and, per sentence, (passage index, char offset).

    ``sentences`` are :class:`~depthscope.probes.corpora.conllu.Sentence` objects (``text``,
    ``doc_id``). Returns ``(passages, where)`` with ``where[i] = (passage, offset)`` for the
    passage owning sentence ``i``.
    """
    if context not in CONTEXTS:
        raise InputError(f"context must be one of {CONTEXTS}, got {context!r}")
    if context == "sentence":
        passages = [Passage(s.text, [i], [0], [True]) for i, s in enumerate(sentences)]
        return passages, [(i, 0) for i in range(len(sentences))]
    if tokenizer is None:
        raise InputError("document context needs a tokenizer to measure sentence lengths")
    texts = [s.text for s in sentences]
    lens = [len(x) + 1 for x in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    budget = max(2, int(0.97 * max_tokens) - 2)  # joined text may tokenise slightly differently
    where: list = [None] * len(sentences)
    passages: list = []
    for idx in _documents(sentences):
        for a, b in _owned_chunks([lens[i] for i in idx], budget):
            c = _context_start([lens[i] for i in idx], a, b, budget)
            p = _passage(texts, idx, c, a, b)
            for sent, off, o in zip(p.sents, p.offsets, p.owned):
                if o:
                    where[sent] = (len(passages), off)
            passages.append(p)
    return passages, where


def _documents(sentences: Sequence) -> list:
    """Sentence indices of each document: runs of consecutive sentences with one ``doc_id``."""
    docs: list = []
    for i, s in enumerate(sentences):
        if docs and docs[-1][0] == s.doc_id and docs[-1][1][-1] == i - 1:
            docs[-1][1].append(i)
        else:
            docs.append((s.doc_id, [i]))
    return [idx for _, idx in docs]


def _owned_chunks(lens: list, budget: int) -> list:
    """``[(a, b)]``: the sentences ``a:b`` each passage of a document owns (``lens``: tokens per
    sentence). A document within ``budget`` is one chunk; a longer one is cut into chunks of
    about half the budget (at least one sentence each), leaving room for preceding context."""
    if sum(lens) <= budget:
        return [(0, len(lens))]
    half = max(1, budget // 2)
    chunks, a = [], 0
    while a < len(lens):
        b, tok = a, 0
        while b < len(lens) and (tok == 0 or tok + lens[b] <= half):
            tok += lens[b]
            b += 1
        chunks.append((a, b))
        a = b
    return chunks


def _context_start(lens: list, a: int, b: int, budget: int) -> int:
    """The first sentence of the passage owning ``a:b``: preceding sentences are added as
    context while they fit in what the owned ones leave of ``budget``."""
    c, room = a, budget - sum(lens[a:b])
    while c > 0 and lens[c - 1] <= room:
        room -= lens[c - 1]
        c -= 1
    return c


def _passage(texts: list, idx: list, c: int, a: int, b: int) -> Passage:
    """The passage of document sentences ``idx[c:b]``, joined by spaces; ``idx[a:b]`` owned."""
    parts, offs, own, pos = [], [], [], 0
    for k in range(c, b):
        offs.append(pos)
        parts.append(texts[idx[k]])
        pos += len(texts[idx[k]]) + 1
        own.append(k >= a)
    return Passage(" ".join(parts), [idx[k] for k in range(c, b)], offs, own)


def bos_id(tokenizer) -> int | None:
    """The token to prepend when the tokenizer adds no special token at the start of a text:
    its BOS token, else its EOS token (None when it already adds one, or has neither)."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    if ids and ids[0] in special:
        return None
    for name in ("bos_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return v
    return None


def tokenize_passages(
    tokenizer, texts: Sequence[str], *, max_tokens: int, batch: int = 256, prepend: int | None = None
) -> Tokenized:
    """Tokenize with offsets (the tokenizer's own special tokens included, plus ``prepend``
    as a first token when given), truncating to ``max_tokens``. Needs a fast tokenizer."""
    if tokenizer is None:
        raise InputError("this model has no tokenizer: probing needs one to map words to subwords")
    if not getattr(tokenizer, "is_fast", True):
        raise InputError("probing needs a fast tokenizer (return_offsets_mapping)")
    out = Tokenized([], [], [])
    for a in range(0, len(texts), batch):
        enc = tokenizer(list(texts[a : a + batch]), return_offsets_mapping=True, add_special_tokens=True)
        for ids, offs in zip(enc["input_ids"], enc["offset_mapping"]):
            ids = np.asarray(ids, dtype=np.int64)
            offs = np.asarray(offs, dtype=np.int64).reshape(-1, 2)
            if prepend is not None:
                ids = np.concatenate([[prepend], ids])
                offs = np.concatenate([[[0, 0]], offs])
            if len(ids) > max_tokens:
                out.n_truncated += 1
                ids, offs = ids[:max_tokens], offs[:max_tokens]
            st, en = _sorted_offsets(offs)
            out.ids.append(ids)
            out.starts.append(st)
            out.ends.append(en)
    return out


def _sorted_offsets(offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of one passage's tokens. Special tokens report (0, 0): they are made
    zero-width at the current position so the offset arrays stay sorted and they never overlap
    a span."""
    st, en = offs[:, 0].copy(), offs[:, 1].copy()
    pos = 0
    for k in range(len(st)):
        if en[k] <= st[k]:
            st[k] = en[k] = pos
        else:
            pos = max(pos, en[k])
    return st, en


def span_tokens(starts: np.ndarray, ends: np.ndarray, cs: np.ndarray, ce: np.ndarray, text_len: int | None = None):
    """First and last subword (inclusive) overlapping each char span ``[cs, ce)``; -1 if none.

    ``starts``/``ends`` are one passage's token offsets (sorted). A span whose end lies past
    the last token's end (text truncated) gets -1 as well.
    """
    cs = np.asarray(cs, dtype=np.int64)
    ce = np.asarray(ce, dtype=np.int64)
    first = np.full(len(cs), -1, dtype=np.int64)
    last = np.full(len(cs), -1, dtype=np.int64)
    if len(starts) == 0:
        return first, last
    real = ends > starts
    if not real.any():
        return first, last
    rs, re_, ridx = starts[real], ends[real], np.nonzero(real)[0]
    # first real token with end > cs; last real token with start < ce
    f = np.searchsorted(re_, cs, side="right")
    l = np.searchsorted(rs, ce, side="left") - 1
    ok = (f <= l) & (f < len(rs)) & (l >= 0) & (ce > cs)
    covered_end = re_[-1]
    ok &= ce <= covered_end
    first[ok] = ridx[f[ok]]
    last[ok] = ridx[l[ok]]
    return first, last


@dataclass
class SpanTable:
    """Unique spans of one extraction: passage index, char span, token range (inclusive)."""

    passage: np.ndarray
    cs: np.ndarray
    ce: np.ndarray
    first: np.ndarray = field(default=None)
    last: np.ndarray = field(default=None)

    def __len__(self) -> int:
        return len(self.passage)

    @property
    def skipped(self) -> np.ndarray:
        return self.first < 0


def map_spans(tok: Tokenized, table: SpanTable) -> SpanTable:
    """Fill ``table.first``/``table.last`` (token indices within each passage, -1 = skipped)."""
    n = len(table)
    table.first = np.full(n, -1, dtype=np.int64)
    table.last = np.full(n, -1, dtype=np.int64)
    order = np.argsort(table.passage, kind="stable")
    p_sorted = table.passage[order]
    bounds = np.searchsorted(p_sorted, np.arange(len(tok.ids) + 1))
    for p in range(len(tok.ids)):
        sel = order[bounds[p] : bounds[p + 1]]
        if len(sel) == 0:
            continue
        f, l = span_tokens(tok.starts[p], tok.ends[p], table.cs[sel], table.ce[sel])
        table.first[sel] = f
        table.last[sel] = l
    return table
