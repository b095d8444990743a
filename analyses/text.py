"""Text in, token rows and batches out: the streaming input of every dataset-level analysis.

=============================  ==================================================================
:func:`read_documents`         plain text (one document per line, or the whole file as one), or
                               the sentences of a CoNLL-U file (its ``# text =`` lines), with
                               clear errors for empty or undecodable files (UTF-8 read by the
                               rule of every data reader,
                               :func:`~depthscope.probes.corpora.conllu.read_utf8`)
:func:`text_rows`              documents -> :class:`TextRows` under one
                               :class:`~depthscope.analyses.text_settings.TextWindows` (the BOS
                               rule, window, stride, token and document caps): the one way the
                               causal test, ``layers``, SAE training and evaluation, the cache,
                               the lens and the norms read free text
:func:`iter_rows`              the same rows one at a time (bounded memory for any corpus)
:func:`row_batches`            rows -> right-padded :class:`TokenBatch` es
:func:`token_batches`          documents (or a LongTensor) -> padded batches of windows
:func:`windows`                a token list split into consecutive windows
=============================  ==================================================================

Every row records which of its positions count (``first``: the first one that does): a next-token
loss counts predicted tokens (``skip=1``: a window's first position predicts but is not
predicted), the lens, norms and cache the positions they read (``skip=0``); a window that
overlaps the previous one (a stride shorter than the window) counts only its new tokens. The
token cap counts the same positions, so "at most N tokens" is N of what the analysis measures,
cut inside a document.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.probes.corpora.conllu import read_utf8
from depthscope.probes.corpora.spans import bos_id

CONLLU_TEXT = "# text = "


def read_documents(path: str | Path, *, per_line: bool = True, encoding: str = "utf-8") -> list[str]:
    """Documents of a text file: one per non-blank line, or the whole file as one. A ``.conllu``
    file contributes the text of its sentences (``# text = ...``) as the lines."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such text file: {path}")
    text = read_utf8(path) if encoding.lower().replace("_", "-") in ("utf-8", "utf8") else _decode(path, encoding)
    lines = text.splitlines()
    if path.suffix.lower() == ".conllu":
        lines = [ln[len(CONLLU_TEXT) :] for ln in lines if ln.startswith(CONLLU_TEXT)]
        text = "\n".join(lines)
    docs = [ln.strip() for ln in lines] if per_line else [text.strip()]
    docs = [d for d in docs if d]
    if not docs:
        raise InputError(f"{path} holds no text")
    return docs


def _decode(path: Path, encoding: str) -> str:
    """The text of ``path`` in another ``encoding`` than UTF-8 (errors with ``file:line``, as
    :func:`~depthscope.probes.corpora.conllu.read_utf8` gives them)."""
    raw = path.read_bytes()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        where = f"{path}:{line}"
        raise InputError(f"{where}: bytes that are not valid {encoding} on line {line} (byte {e.start})") from None
    except LookupError:
        raise InputError(f"unknown text encoding {encoding!r}") from None


#: the window when none is given (and the model's context allows it)
DEFAULT_WINDOW = 512
#: documents tokenized per tokenizer call
TOKENIZE_GROUP = 256


@dataclass
class TokenBatch:
    """Right-padded rows of one forward pass: ``ids`` and ``mask`` ``[batch, pos]`` (True at real
    tokens), each row's document and window number, and ``first``: each row's first counted
    position (None: every real position counts)."""

    ids: torch.Tensor  # [batch, pos]
    mask: torch.Tensor  # [batch, pos] bool, True at real tokens
    doc_index: list[int]  # which document each row came from
    window_index: list[int]  # which window of that document
    first: list[int] | None = None

    @property
    def counted(self) -> torch.Tensor:
        """``[batch, pos]`` bool: the real positions that count (from each row's ``first`` on)."""
        if self.first is None:
            return self.mask
        pos = torch.arange(self.mask.shape[1], device=self.mask.device)
        return self.mask & (pos[None] >= torch.tensor(self.first, device=self.mask.device)[:, None])

    def first_tensor(self) -> torch.Tensor | None:
        """``first`` as a LongTensor ``[batch]`` (None when every position counts)."""
        return None if self.first is None else torch.tensor(self.first, dtype=torch.long)


def _tokenize_docs(model, docs: Sequence[str]) -> list[list[int]]:
    """Token ids of every document, with the tokenizer's own special tokens."""
    tok = model.tokenizer
    if tok is None:
        raise InputError("this model has no tokenizer: pass token ids")
    out = []
    for d in docs:
        ids = tok(d, add_special_tokens=True)["input_ids"]
        out.append(list(ids))
    return out


def windows(ids: list[int], window: int, stride: int | None = None) -> list[list[int]]:
    """Split a token list into consecutive windows of at most ``window`` tokens."""
    if window <= 0:
        raise ValueError("window must be positive")
    stride = stride or window
    if len(ids) <= window:
        return [ids]
    return [ids[i : i + window] for i in range(0, len(ids) - (window - stride), stride) if ids[i : i + window]]


@dataclass(frozen=True)
class Row:
    """One window of a document: its token ``ids`` (int64), the ``doc`` and ``window`` numbers,
    and ``first``, its first counted position."""

    doc: int
    window: int
    ids: np.ndarray
    first: int


@dataclass(frozen=True)
class TextRows:
    """Documents as token rows (:func:`text_rows`): ``rows[i]`` int64 ids, the document
    (``doc``), window (``window``) and first counted position (``first``) of each row;
    ``n_docs`` (one more than the last document with a row), ``start`` (1 when every row begins
    with a leading special token, the BOS, that edits leave alone; else 0), ``end`` ((document,
    token) where the next tokens of the text would be taken: :func:`text_rows` ``start=``)."""

    rows: list
    doc: np.ndarray
    window: np.ndarray
    first: np.ndarray
    n_docs: int
    start: int
    end: tuple[int, int]

    @property
    def n_tokens(self) -> int:
        """Counted tokens: each row's positions from its ``first`` on."""
        return int(sum(len(r) for r in self.rows) - int(self.first.sum()))

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def items(self, order: Sequence[int] | None = None) -> Iterator[Row]:
        """The rows as :class:`Row` s, in ``order`` (row numbers; None: as read)."""
        for i in range(len(self.rows)) if order is None else order:
            yield Row(int(self.doc[i]), int(self.window[i]), self.rows[i], int(self.first[i]))

    def batches(self, batch_size: int, pad: int, *, by_length: bool = False, max_tokens: int | None = None):
        """Right-padded :class:`TokenBatch` es of at most ``batch_size`` rows (``by_length``: rows
        of similar length together; ``max_tokens``: at most about this many padded positions)."""
        order = np.argsort([len(r) for r in self.rows], kind="stable") if by_length else None
        return row_batches(self.items(order), batch_size, pad, max_tokens=max_tokens)


def pad_id(model) -> int:
    """The id padding is filled with: the tokenizer's pad token, else 0 (the mask hides it)."""
    pad = getattr(model.tokenizer, "pad_token_id", None) if model.tokenizer is not None else None
    return 0 if pad is None else int(pad)


def with_window(text: TextWindows | None, window: int | None = None, max_tokens: int | None = None):
    """``text`` with a ``window`` and ``max_tokens`` given beside it filled in (a caller's shorthand
    keywords); a value that disagrees with the one ``text`` holds is an :class:`InputError`."""
    if text is None:
        return None
    for name, value in (("window", window), ("max_tokens", max_tokens)):
        if value is not None:
            if getattr(text, name) not in (None, value):
                raise InputError(
                    f"{name}={value} and the text settings' {name}={getattr(text, name)} disagree: give one"
                )
            text = replace(text, **{name: value})
    return text


def window_length(model, text: TextWindows) -> int:
    """Tokens per window: ``text.window`` (default :data:`DEFAULT_WINDOW`) within the model's context."""
    return min(text.window or DEFAULT_WINDOW, model.max_context or 2048)


class _Lead:
    """The token every window of a document begins with: the tokenizer's own first special token
    (when it adds one), else the BOS (or EOS) token when ``bos`` (:func:`bos_id`), else none."""

    def __init__(self, tok, bos: bool):
        special = set(getattr(tok, "all_special_ids", []) or [])
        probe = tok("a", add_special_tokens=True)["input_ids"]
        self.own = bool(probe) and probe[0] in special
        prepend = bos_id(tok) if bos and not self.own else None
        self.fixed = [] if prepend is None else [int(prepend)]

    def split(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """``(lead, body)`` of one document's token ids."""
        if self.own and ids:
            return [int(ids[0])], list(ids[1:])
        return self.fixed, list(ids)

    @property
    def length(self) -> int:
        return 1 if self.own else len(self.fixed)


class RowReader:
    """Iterates the rows of ``documents`` (:func:`iter_rows`); after the iteration ``end`` is
    where the text stopped, ``n_tokens`` the tokens counted and ``n_docs`` one more than the last
    document with a row."""

    def __init__(self, model, documents, text: TextWindows, *, skip: int = 0, start: tuple[int, int] = (0, 0)):
        if model.tokenizer is None:
            raise InputError("this model has no tokenizer: the text cannot be read (pass token ids)")
        if skip not in (0, 1):
            raise InputError(f"skip must be 0 or 1, got {skip!r}")
        self.tok, self.text, self.skip, self.start = model.tokenizer, text, skip, start
        docs = [documents] if isinstance(documents, str) else list(documents)
        if any(not isinstance(d, str) for d in docs):
            raise InputError("the text must be documents: strings (pass token ids as a tensor)")
        self.docs = docs[: text.max_docs] if text.max_docs else docs
        self.lead = _Lead(self.tok, text.bos)
        self.window = window_length(model, text)
        self.body = self.window - self.lead.length
        if self.body < 1:
            raise InputError(f"a window of {self.window} tokens leaves no room after the leading BOS token")
        self.stride = text.stride or self.body
        if self.stride > self.body:
            raise InputError(
                f"--stride {self.stride} is longer than a window's {self.body} document tokens (--window "
                f"{self.window} less the leading BOS): the tokens between windows would be skipped"
            )
        self.end, self.n_tokens, self.n_docs = start, 0, 0

    def n_windows(self, n: int) -> int:
        """The windows of a document of ``n`` tokens (as the tokenizer makes them)."""
        body = n - (1 if self.lead.own and n else 0)
        return 0 if body <= 0 else 1 + max(0, -(-(body - self.body) // self.stride))

    def positions(self, n: int) -> int:
        """The counted positions of a document of ``n`` tokens (as the tokenizer makes them), before
        any cap: each row's from its ``first`` on."""
        body, k, lead = n - (1 if self.lead.own and n else 0), self.n_windows(n), self.lead.length
        if k == 0:
            return 0
        if self.stride == self.body:  # no overlap: every row counts from position ``skip``
            return body + k * (lead - self.skip)
        return body + lead - self.skip  # later windows count only their new tokens

    def __iter__(self) -> Iterator[Row]:
        cap = self.text.max_tokens
        d0, offset = self.start
        for g in range(d0, len(self.docs), TOKENIZE_GROUP):
            group = self.docs[g : g + TOKENIZE_GROUP]
            ids = self.tok([t or " " for t in group], add_special_tokens=True)["input_ids"]
            for d, text, doc_ids in zip(range(g, g + len(group)), group, ids):
                lead, body = self.lead.split(doc_ids) if text else ([], [])
                skip_to = offset if d == d0 else 0
                for row in self._windows(d, lead, body, skip_to):
                    left = None if cap is None else cap - self.n_tokens
                    n = len(row.ids) - row.first
                    if left is not None and n >= left:
                        cut = row.first + left
                        self.n_tokens, self.n_docs = cap, d + 1
                        self.end = (d, row.window * self.stride + skip_to + cut - len(lead))
                        if self.end[1] >= len(body):
                            self.end = (d + 1, 0)
                        yield Row(row.doc, row.window, row.ids[:cut], row.first)
                        return
                    self.n_tokens, self.n_docs = self.n_tokens + n, d + 1
                    yield row
                self.end = (d + 1, 0)

    def _windows(self, d: int, lead: list[int], body: list[int], offset: int) -> Iterator[Row]:
        """The rows of document ``d`` from body token ``offset`` on: windows of ``self.body``
        tokens every ``self.stride``, each after ``lead``; those with no counted position left out."""
        body = body[offset:]
        k = 0
        while body:
            a = k * self.stride
            chunk = body[a : a + self.body]
            context = 0 if k == 0 else self.body - self.stride
            first = self.skip if context == 0 else max(self.skip, len(lead) + context)
            row = np.asarray(lead + chunk, dtype=np.int64)
            if len(row) > first:
                yield Row(d, k, row, first)
            if a + self.body >= len(body):
                return
            k += 1


def iter_rows(model, documents, text: TextWindows | None = None, *, skip: int = 0) -> RowReader:
    """The rows of ``documents`` under ``text`` (None: the defaults), one at a time: iterate the
    returned :class:`RowReader` (module docstring for ``skip``)."""
    return RowReader(model, documents, text or TextWindows(), skip=skip)


def text_rows(
    model, documents, text: TextWindows | None = None, *, skip: int = 0, start: tuple[int, int] = (0, 0), need=True
) -> TextRows:
    """``documents`` (strings) as :class:`TextRows` under ``text`` (None: the defaults): the
    BOS rule, windows, stride and caps of the module docstring; ``skip`` 1 counts predicted tokens
    (a window's first position left out), 0 every position read; ``start``: (document, token) to
    begin at (a previous :attr:`TextRows.end`). No row is an :class:`InputError` unless ``need`` is
    false."""
    reader = RowReader(model, documents, text or TextWindows(), skip=skip, start=start)
    got = list(reader)
    if not got and need:
        what = "predict (every document is empty or one token long)" if skip else "read (every document is empty)"
        raise InputError(f"the text gives no token to {what}")
    return TextRows(
        rows=[r.ids for r in got],
        doc=np.asarray([r.doc for r in got], dtype=np.int64),
        window=np.asarray([r.window for r in got], dtype=np.int64),
        first=np.asarray([r.first for r in got], dtype=np.int64),
        n_docs=reader.n_docs,
        start=reader.lead.length,
        end=reader.end,
    )


def row_batches(rows: Iterable[Row], batch_size: int, pad: int, *, max_tokens: int | None = None):
    """Right-padded :class:`TokenBatch` es of consecutive ``rows``: at most ``batch_size`` rows, and
    (``max_tokens``) at most about that many padded positions (at least one row)."""
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    part: list[Row] = []
    widest = 0
    for r in rows:
        width = max(widest, len(r.ids))
        if part and (len(part) >= batch_size or (max_tokens is not None and (len(part) + 1) * width > max_tokens)):
            yield _padded(part, pad)
            part, width = [], len(r.ids)
        part.append(r)
        widest = width
    if part:
        yield _padded(part, pad)


def _padded(part: list[Row], pad: int) -> TokenBatch:
    width = max(len(r.ids) for r in part)
    ids = torch.full((len(part), width), pad, dtype=torch.long)
    mask = torch.zeros((len(part), width), dtype=torch.bool)
    for i, r in enumerate(part):
        ids[i, : len(r.ids)] = torch.from_numpy(np.asarray(r.ids, dtype=np.int64))
        mask[i, : len(r.ids)] = True
    return TokenBatch(ids, mask, [r.doc for r in part], [r.window for r in part], [r.first for r in part])


def token_batches(
    model,
    inputs: torch.Tensor | Sequence[str] | str,
    *,
    batch_size: int = 8,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    text: TextWindows | None = None,
    skip: int = 0,
) -> Iterator[TokenBatch]:
    """Yield padded batches (right padding) of windows of at most ``window`` tokens.

    ``window`` defaults to min(model context, 512). Documents longer than it are split into
    consecutive windows (no token is dropped; each window starts a fresh context). Documents are
    tokenized as the tokenizer does, unless ``text`` is given: then they are read by
    :func:`iter_rows` under it (the BOS rule, window, stride and caps; ``skip``: what counts),
    in bounded memory. Token ids (a LongTensor, ``mask`` marking the real ones) are taken as
    they are, in windows of ``text.window`` when ``text`` is given.
    """
    text = with_window(text, window)
    window = (
        window_length(model, text) if text is not None else min(window or DEFAULT_WINDOW, model.max_context or 2048)
    )
    pad = pad_id(model)
    if text is not None and not isinstance(inputs, torch.Tensor):
        yield from _nonempty(row_batches(iter_rows(model, inputs, text, skip=skip), batch_size, pad))
        return
    if isinstance(inputs, torch.Tensor):
        ids2 = inputs if inputs.dim() == 2 else inputs[None]
        if ids2.numel() == 0:
            raise InputError("empty input: no tokens")
        m2 = torch.ones_like(ids2, dtype=torch.bool) if mask is None else mask.bool().reshape(ids2.shape)
        seqs = [row[m].tolist() for row, m in zip(ids2, m2)]
    else:
        if isinstance(inputs, str):
            inputs = [inputs]
        inputs = [t for t in inputs]
        if not inputs or all(not t for t in inputs):
            raise InputError("empty input: no texts given")
        seqs = _tokenize_docs(model, [t for t in inputs if t])
    rows: list[tuple[int, int, list[int]]] = []
    for d, seq in enumerate(seqs):
        for w, chunk in enumerate(windows(seq, window)):
            if chunk:
                rows.append((d, w, chunk))
    if not rows:
        raise InputError("empty input: the texts tokenize to no tokens")
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        width = max(len(r[2]) for r in part)
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        m = torch.zeros((len(part), width), dtype=torch.bool)
        for i, (_, _, chunk) in enumerate(part):
            ids[i, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            m[i, : len(chunk)] = True
        yield TokenBatch(ids, m, [r[0] for r in part], [r[1] for r in part])


def _nonempty(batches: Iterator[TokenBatch]) -> Iterator[TokenBatch]:
    """``batches``, or an :class:`InputError` when there is none."""
    seen = False
    for b in batches:
        seen = True
        yield b
    if not seen:
        raise InputError("empty input: the texts tokenize to no tokens")


def count_tokens(batches: Iterable[TokenBatch]) -> int:
    return sum(int(b.mask.sum()) for b in batches)
