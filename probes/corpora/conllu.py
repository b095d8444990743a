"""CoNLL-U in, sentences with character spans out.

``read_conllu(path)`` validates every line itself first (10 tab-separated columns, well-formed
IDs and HEADs, consecutive word IDs) so a malformed file fails with ``file:line: what is
wrong`` (an :class:`~depthscope.common.errors.InputError`), then parses each sentence with the
``conllu`` package.

The sentence text is rebuilt from the surface tokens and their ``SpaceAfter=No`` marks (the
``# text`` comment is not trusted). Multiword tokens (``2-3  don't``) give the surface form;
their words get consecutive sub-spans when the word forms concatenate to the surface form
("do" + "n't"), otherwise each word gets the whole token's span. Empty nodes (``8.1``) have no
surface and are skipped (counted in ``Sentence.n_empty``).

GUM-style entity annotation in MISC (``Entity=(3-abstract-new-...``, ``Entity=3)``, one-token
``(5-object-...)``; field order from ``# global.Entity``) becomes :class:`Mention` objects
with word spans, an entity type and a coreference cluster id (the ``GRP``/``eid`` field,
prefixed with the document id so clusters never mix across documents).

``max_sentences`` keeps whole documents, picked in a seeded random order until the budget is
reached (the last one truncated), then restored to file order: a sample that spans the
genres of a treebank ordered by genre (GUM), deterministic for a given seed.

``read_utf8(path)`` is the decoding rule of every reader of data files (CoNLL-U, jiant JSONL,
plain text): a byte-order mark is dropped, bytes that are not UTF-8 are ``file:line`` errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import conllu
import numpy as np
from conllu.exceptions import ParseException

from depthscope.common.errors import InputError

_ID_INT = re.compile(r"^[1-9]\d*$")
_ID_RANGE = re.compile(r"^([1-9]\d*)-([1-9]\d*)$")
_ID_EMPTY = re.compile(r"^(\d+)\.([1-9]\d*)$")
_FIELD_PARSERS = {"deps": lambda line, i: line[i]}  # DEPS as raw text: no task reads it, so it is not parsed


class ConlluError(InputError):
    """A malformed CoNLL-U file; the message starts with ``file:line:``."""


@dataclass
class Word:
    """One syntactic word. ``index`` is its 0-based position among the sentence's words;
    ``start``/``end`` its character span in :attr:`Sentence.text`; ``head`` the CoNLL-U HEAD
    (0 = root; a word *id*, 1-based)."""

    index: int
    id: int
    form: str
    lemma: str
    upos: str
    xpos: str
    feats: dict
    head: int
    deprel: str
    misc: dict
    start: int
    end: int
    line: int


@dataclass
class Mention:
    """An entity mention: words ``[start, end)`` of one sentence, its type and cluster."""

    start: int
    end: int
    etype: str
    cluster: str


@dataclass
class Sentence:
    """One sentence: its text rebuilt from the surface tokens, its :class:`Word` objects, where it
    came from, and its entity mentions; ``n_empty``/``n_multiword`` count empty nodes and
    multiword tokens."""

    text: str
    words: list
    sent_id: str | None = None
    doc_id: str | None = None
    line: int = 0
    source: str = "<string>"
    metadata: dict = field(default_factory=dict)
    mentions: list = field(default_factory=list)
    n_empty: int = 0
    n_multiword: int = 0

    def span_text(self, start: int, end: int) -> str:
        """The text of words ``[start, end)``."""
        return self.text[self.words[start].start : self.words[end - 1].end]


@dataclass
class Corpus:
    """Parsed sentences of one file (in file order) plus counts of what was skipped."""

    sentences: list
    source: str = "<string>"
    n_sentences_in_file: int = 0
    n_unclosed_mentions: int = 0
    has_entities: bool = False

    def __len__(self) -> int:
        return len(self.sentences)

    def __iter__(self):
        return iter(self.sentences)

    def __getitem__(self, i):
        return self.sentences[i]

    @property
    def n_words(self) -> int:
        return sum(len(s.words) for s in self.sentences)


# ----------------------------------------------------------------------------- validation
@dataclass
class _Block:
    """One sentence block while it is validated: its lines, the number of its first line, and
    the word IDs and HEADs seen so far (each with its line number)."""

    source: str
    start: int
    lines: list = field(default_factory=list)
    word_ids: list = field(default_factory=list)
    heads: list = field(default_factory=list)

    def add(self, line: str, no: int) -> None:
        """Check line ``no`` of the block and keep it."""
        self.lines.append(line)
        if line.startswith("#"):
            if self.word_ids:
                raise ConlluError(f"{self.source}:{no}: comment line inside a sentence (missing blank line?)")
            return
        cols = line.split("\t")
        if len(cols) != 10:
            raise ConlluError(
                f"{self.source}:{no}: expected 10 tab-separated columns, found {len(cols)}"
                + (" (spaces instead of tabs?)" if len(cols) < 10 and "  " in line else "")
            )
        wid = cols[0]
        if _ID_INT.match(wid):
            self._check_word(cols, no)
        elif _ID_RANGE.match(wid):
            self._check_range(wid, no)
        elif not _ID_EMPTY.match(wid):  # empty nodes (N.M) need no check
            raise ConlluError(f"{self.source}:{no}: bad ID {wid!r} (expected N, N-M or N.M)")

    def _check_word(self, cols: list, no: int) -> None:
        """A word line: no empty column, a FORM, a HEAD that is ``_`` or a number."""
        if any(c == "" for c in cols):
            raise ConlluError(f"{self.source}:{no}: empty column (use '_' for no value)")
        if cols[1] == "":
            raise ConlluError(f"{self.source}:{no}: empty FORM")
        head = cols[6]
        if head != "_":  # unannotated trees are allowed; deprel tasks skip such words
            if not head.isdigit():
                raise ConlluError(f"{self.source}:{no}: HEAD {head!r} is not a word ID")
            self.heads.append((int(head), no))
        self.word_ids.append((int(cols[0]), no))

    def _check_range(self, wid: str, no: int) -> None:
        """A multiword token line ``N-M``: a forward range starting at the next word."""
        a, b = map(int, _ID_RANGE.match(wid).groups())
        if b < a:
            raise ConlluError(f"{self.source}:{no}: multiword range {wid} ends before it starts")
        if a != len(self.word_ids) + 1:
            raise ConlluError(f"{self.source}:{no}: multiword range {wid} does not start at the next word")

    def check_complete(self) -> None:
        """At the block's end: it has words, numbered 1..n in order, and no HEAD points past n."""
        if not self.word_ids:
            raise ConlluError(f"{self.source}:{self.start}: sentence block has comments but no word lines")
        n = len(self.word_ids)
        for i, (wid, ln) in enumerate(self.word_ids):
            if wid != i + 1:
                raise ConlluError(f"{self.source}:{ln}: word ID {wid} out of order (expected {i + 1})")
        for h, ln in self.heads:
            if h > n:
                raise ConlluError(f"{self.source}:{ln}: HEAD {h} points past the last word ({n})")


def _blocks(lines: list, source: str):
    """Validate lines; yield (first_line_no, [lines]) per sentence block (1-based numbers)."""
    block = None
    for no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            if block is not None:
                block.check_complete()
                yield block.start, block.lines
            block = None
            continue
        if block is None:
            block = _Block(source, no)
        block.add(line, no)
    if block is not None:
        block.check_complete()
        yield block.start, block.lines


# ----------------------------------------------------------------------------- entities
def _entity_fields(header: str | None) -> tuple[int, int]:
    """Positions of the cluster id and entity type in GUM's Entity fields."""
    if not header:
        return 0, 1
    names = [n.strip().lower() for n in header.split("-")]
    gi = next((i for i, n in enumerate(names) if n in ("grp", "eid")), 0)
    ti = next((i for i, n in enumerate(names) if n == "etype"), 1)
    return gi, ti


def _parse_entity_value(value: str):
    """Split an Entity MISC value into events: ('open', fields, single) or ('close', id)."""
    events, i, n = [], 0, len(value)
    while i < n:
        if value[i] == "(":
            j = i + 1
            while j < n and value[j] not in "()":
                j += 1
            fields = value[i + 1 : j]
            single = j < n and value[j] == ")"
            events.append(("open", fields, single))
            i = j + 1 if single else j
        else:
            j = value.find(")", i)
            if j < 0:
                raise ValueError(f"unbalanced Entity value {value!r}")
            events.append(("close", value[i:j]))
            i = j + 1
    return events


def _cluster_key(raw: str) -> str:
    return re.sub(r"\[\d+/\d+\]$", "", raw)  # discontinuous parts share the entity id


# ----------------------------------------------------------------------------- parsing
def _misc_str(misc) -> dict:
    """MISC as a dict of strings (a flag without a value maps to ``""``)."""
    if not misc:
        return {}
    return {k: ("" if v is None else str(v)) for k, v in misc.items()}


@dataclass
class _Piece:
    """One surface token of the sentence text: a word, or a multiword token covering the words
    ``first_id..last_id``; ``members`` are the positions of its words in the sentence."""

    first_id: int
    last_id: int
    form: str
    space_after: bool
    members: list


@dataclass
class _Tokens:
    """A parsed block split into surface pieces and words (``(token, line number)`` each)."""

    pieces: list = field(default_factory=list)
    words: list = field(default_factory=list)
    n_empty: int = 0
    n_multiword: int = 0


def _split_tokens(tl, data_lines: list) -> _Tokens:
    """Sort the block's tokens into surface pieces and syntactic words; count empty nodes and
    multiword tokens. A word inside the open multiword range joins that piece, any other word
    is a piece of its own."""
    out = _Tokens()
    open_range = None
    for tok, ln in zip(tl, data_lines):
        tid = tok["id"]
        if isinstance(tid, tuple):
            if tid[1] == "-":
                out.n_multiword += 1
                misc = _misc_str(tok.get("misc"))
                open_range = _Piece(tid[0], tid[2], tok["form"], misc.get("SpaceAfter") != "No", [])
                out.pieces.append(open_range)
            else:
                out.n_empty += 1
            continue
        out.words.append((tok, ln))
        if open_range is not None and open_range.first_id <= tid <= open_range.last_id:
            open_range.members.append(len(out.words) - 1)
            if tid == open_range.last_id:
                open_range = None
        else:
            misc = _misc_str(tok.get("misc"))
            out.pieces.append(_Piece(tid, tid, tok["form"], misc.get("SpaceAfter") != "No", [len(out.words) - 1]))
    return out


def _member_spans(piece: _Piece, forms: list, start: int, end: int) -> list:
    """Character spans of a piece's words: the whole piece for one word; consecutive sub-spans
    when the word forms concatenate to the surface form; else the whole piece for each."""
    if len(forms) == 1 or "".join(forms) != piece.form:
        return [(start, end)] * len(forms)
    spans, p = [], start
    for f in forms:
        spans.append((p, p + len(f)))
        p += len(f)
    return spans


def _text_and_spans(tokens: _Tokens) -> tuple[str, list]:
    """The sentence text rebuilt from the surface pieces and their ``SpaceAfter``, and each
    word's character span in it."""
    spans = [None] * len(tokens.words)
    text_parts, pos = [], 0
    for piece in tokens.pieces:
        start = pos
        text_parts.append(piece.form)
        pos += len(piece.form)
        forms = [str(tokens.words[m][0]["form"]) for m in piece.members]
        for m, sp in zip(piece.members, _member_spans(piece, forms, start, pos)):
            spans[m] = sp
        if piece.space_after:
            text_parts.append(" ")
            pos += 1
    return "".join(text_parts).rstrip(" "), spans


def _make_word(i: int, tok, line: int, span: tuple, text_len: int) -> Word:
    """The :class:`Word` of a parsed token (absent columns become ``_``, no HEAD -1)."""
    head = tok.get("head")
    feats = tok.get("feats") or {}
    return Word(
        index=i,
        id=int(tok["id"]),
        form=str(tok["form"]),
        lemma=str(tok.get("lemma") or "_"),
        upos=str(tok.get("upos") or "_"),
        xpos=str(tok.get("xpos") or "_"),
        feats={k: ("" if v is None else str(v)) for k, v in feats.items()} if isinstance(feats, dict) else {},
        head=-1 if head is None else int(head),
        deprel=str(tok.get("deprel") or "_"),
        misc=_misc_str(tok.get("misc")),
        start=span[0],
        end=min(span[1], text_len),
        line=line,
    )


@dataclass
class _MentionReader:
    """Entity mentions of one sentence from its words' ``Entity`` MISC values: open mentions
    wait on a stack until their cluster closes; ``unclosed`` counts closes of mentions opened
    in an earlier sentence and mentions still open at the sentence's end."""

    doc_id: str | None
    cluster_field: int
    type_field: int
    mentions: list = field(default_factory=list)
    open_: list = field(default_factory=list)  # (cluster, etype, start word)
    unclosed: int = 0

    def open_mention(self, fields: str, single: bool, index: int) -> None:
        """A mention opens at word ``index`` (and closes there when ``single``)."""
        parts = fields.split("-")
        cid = _cluster_key(parts[self.cluster_field] if self.cluster_field < len(parts) else parts[0])
        etype = parts[self.type_field] if self.type_field < len(parts) else "_"
        if single:
            self.mentions.append(Mention(index, index + 1, etype, f"{self.doc_id}#{cid}"))
        else:
            self.open_.append((cid, etype, index))

    def close_mention(self, raw: str, index: int) -> None:
        """The innermost open mention of cluster ``raw`` closes after word ``index``."""
        cid = _cluster_key(raw)
        for k in range(len(self.open_) - 1, -1, -1):
            if self.open_[k][0] == cid:
                c, etype, st = self.open_.pop(k)
                self.mentions.append(Mention(st, index + 1, etype, f"{self.doc_id}#{c}"))
                return
        self.unclosed += 1  # closes a mention opened in an earlier sentence

    def read(self, words: list, source: str) -> tuple[list, int]:
        """``(mentions sorted by start then longest first, unclosed count)``."""
        for w in words:
            val = w.misc.get("Entity")
            if not val:
                continue
            try:
                events = _parse_entity_value(val)
            except ValueError as e:
                raise ConlluError(f"{source}:{w.line}: {e}") from None
            for ev in events:
                if ev[0] == "open":
                    self.open_mention(ev[1], ev[2], w.index)
                else:
                    self.close_mention(ev[1], w.index)
        self.mentions.sort(key=lambda m: (m.start, -m.end))
        return self.mentions, self.unclosed + len(self.open_)


def _build_sentence(tl, line0: int, block: list, source: str, doc_id, ent_fields) -> tuple[Sentence, int]:
    """The :class:`Sentence` of a parsed block starting at line ``line0`` and the number of its
    unclosed mentions (entities are read only when ``ent_fields`` gives their field positions)."""
    data_lines = [line0 + k for k, ln in enumerate(block) if not ln.startswith("#")]  # token order -> line
    tokens = _split_tokens(tl, data_lines)
    text, spans = _text_and_spans(tokens)
    words = [_make_word(i, tok, ln, sp, len(text)) for i, ((tok, ln), sp) in enumerate(zip(tokens.words, spans))]
    md = dict(tl.metadata)
    sent = Sentence(
        text=text,
        words=words,
        sent_id=md.get("sent_id"),
        doc_id=doc_id,
        line=line0,
        source=source,
        metadata=md,
        n_empty=tokens.n_empty,
        n_multiword=tokens.n_multiword,
    )
    if ent_fields is None:
        return sent, 0
    sent.mentions, unclosed = _MentionReader(doc_id, *ent_fields).read(words, source)
    return sent, unclosed


def _select_blocks(blocks: list, doc_of: list, max_sentences: int | None, seed: int) -> list:
    """Indices of the blocks kept under ``max_sentences``: whole documents in a seeded random
    order until the budget is reached (the last one truncated), in file order."""
    if max_sentences is None or max_sentences >= len(blocks):
        return list(range(len(blocks)))
    if max_sentences <= 0:
        raise InputError(f"max_sentences must be positive, got {max_sentences}")
    docs: dict = {}
    for i, d in enumerate(doc_of):
        docs.setdefault(d, []).append(i)
    order = list(docs)
    rng = np.random.default_rng(seed)
    rng.shuffle(order)
    chosen: list = []
    for d in order:
        room = max_sentences - len(chosen)
        if room <= 0:
            break
        chosen += docs[d][:room]
    return sorted(chosen)


def read_conllu(
    source: str | Path | Corpus,
    *,
    max_sentences: int | None = None,
    seed: int = 0,
) -> Corpus:
    """Parse a CoNLL-U file (or pass a :class:`Corpus` through).

    Errors (missing file, undecodable bytes, malformed lines, no sentences) are
    :class:`ConlluError`/:class:`InputError` with the file and line.
    """
    if isinstance(source, Corpus):
        if max_sentences is None or max_sentences >= len(source):
            return source
        keep = _select_blocks(source.sentences, [s.doc_id for s in source.sentences], max_sentences, seed)
        return Corpus(
            [source.sentences[i] for i in keep],
            source.source,
            source.n_sentences_in_file,
            source.n_unclosed_mentions,
            source.has_entities,
        )
    path = Path(source)
    if not path.is_file():
        raise InputError(f"no such CoNLL-U file: {path}")
    text = read_utf8(path, ConlluError)
    return parse_conllu_text(text, source=str(path), max_sentences=max_sentences, seed=seed)


def read_utf8(path: Path, error: type[InputError] = InputError) -> str:
    """The text of a UTF-8 file, the one rule of every reader (CoNLL-U, jiant JSONL, plain text):
    a leading byte-order mark is dropped, and bytes that are not UTF-8 are an ``error`` (an
    :class:`~depthscope.common.errors.InputError`) that says ``file:line`` and the byte offset."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise error(
            f"{path}:{line}: bytes that are not valid UTF-8 on line {line} (byte {e.start}); "
            f"re-encode the file as UTF-8"
        ) from None


def _scan_comments(blocks: list, source: str) -> tuple[list, list]:
    """Per block, its document id and the ``# global.Entity`` header in force, read from the
    comments alone (cheap, before any sentence is parsed). Without any ``newdoc`` comment each
    sentence is a document of its own."""
    doc_of, headers = [], []
    doc, header, has_doc = None, None, False
    for line0, block in blocks:
        for ln in block:
            if not ln.startswith("#"):
                break
            body = ln[1:].strip()
            if body.startswith("newdoc"):
                has_doc = True
                doc = body.split("=", 1)[1].strip() if "=" in body else f"doc@{line0}"
            elif body.startswith("global.Entity"):
                header = body.split("=", 1)[1].strip() if "=" in body else None
        doc_of.append(doc if has_doc else f"{source}#s{line0}")
        headers.append(header)
    return doc_of, headers


def _parse_block(line0: int, block: list, source: str):
    """One block through the ``conllu`` parser (the DEPS column kept as raw text)."""
    try:
        return conllu.parse_token_and_metadata("\n".join(block), field_parsers=_FIELD_PARSERS)
    except (ParseException, ValueError, IndexError) as e:
        raise ConlluError(f"{source}:{line0}: sentence could not be parsed: {e}") from None


def parse_conllu_text(
    text: str, *, source: str = "<string>", max_sentences: int | None = None, seed: int = 0
) -> Corpus:
    """Parse CoNLL-U from a string (see :func:`read_conllu`)."""
    blocks = list(_blocks(text.splitlines(), source))
    if not blocks:
        raise InputError(f"{source} holds no CoNLL-U sentences")
    doc_of, headers = _scan_comments(blocks, source)
    has_entities = any(h is not None for h in headers) or "Entity=" in text
    sentences, unclosed = [], 0
    for i in _select_blocks(blocks, doc_of, max_sentences, seed):
        line0, block = blocks[i]
        tl = _parse_block(line0, block, source)
        ent = _entity_fields(headers[i]) if has_entities else None
        sent, unc = _build_sentence(tl, line0, block, source, doc_of[i], ent)
        sentences.append(sent)
        unclosed += unc
    return Corpus(sentences, source, len(blocks), unclosed, has_entities)
