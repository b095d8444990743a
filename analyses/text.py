"""Text in, token batches out: the streaming input of every dataset-level analysis.

``read_documents`` reads plain text (one document per line, or the whole file as one
document), or the sentences of a CoNLL-U file (its ``# text =`` lines, so the bundled UD samples
serve as text too), with clear errors for empty or undecodable files: UTF-8 is read by the rule of
every data reader (:func:`~depthscope.probes.corpora.conllu.read_utf8`: a byte-order mark dropped,
other bytes refused with ``file:line``). ``token_batches`` turns documents
(or a LongTensor) into padded batches of at most ``window`` tokens, splitting documents longer
than the context into consecutive windows, so a corpus of any length streams through in
bounded memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from depthscope.common.errors import InputError
from depthscope.probes.corpora.conllu import read_utf8

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


@dataclass
class TokenBatch:
    ids: torch.Tensor  # [batch, pos]
    mask: torch.Tensor  # [batch, pos] bool, True at real tokens
    doc_index: list[int]  # which document each row came from
    window_index: list[int]  # which window of that document


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


def token_batches(
    model,
    inputs: torch.Tensor | Sequence[str] | str,
    *,
    batch_size: int = 8,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> Iterator[TokenBatch]:
    """Yield padded batches (right padding) of windows of at most ``window`` tokens.

    ``window`` defaults to min(model context, 512). Documents longer than it are split into
    consecutive windows (no token is dropped; each window starts a fresh context).
    """
    ctx = model.max_context or 2048
    window = min(window or 512, ctx)
    pad = getattr(model.tokenizer, "pad_token_id", None) if model.tokenizer is not None else None
    pad = 0 if pad is None else int(pad)
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


def count_tokens(batches: Iterable[TokenBatch]) -> int:
    return sum(int(b.mask.sum()) for b in batches)
