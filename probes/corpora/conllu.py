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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from depthscope.common.errors import InputError

_ID_INT = re.compile(r"^[1-9]\d*$")
_ID_RANGE = re.compile(r"^([1-9]\d*)-([1-9]\d*)$")
_ID_EMPTY = re.compile(r"^(\d+)\.([1-9]\d*)$")


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
def _blocks(lines: list, source: str):
    """Validate lines; yield (first_line_no, [lines]) per sentence block (1-based numbers)."""
    block, start = [], 0
    word_ids: list = []
    heads: list = []

    def finish():
        if not word_ids:
            raise ConlluError(f"{source}:{start}: sentence block has comments but no word lines")
        n = len(word_ids)
        for i, (wid, ln) in enumerate(word_ids):
            if wid != i + 1:
                raise ConlluError(f"{source}:{ln}: word ID {wid} out of order (expected {i + 1})")
        for h, ln in heads:
            if h > n:
                raise ConlluError(f"{source}:{ln}: HEAD {h} points past the last word ({n})")

    for no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            if block:
                finish()
                yield start, block
            block, word_ids, heads, _range_end = [], [], [], 0
            continue
        if not block:
            start = no
        block.append(line)
        if line.startswith("#"):
            if word_ids:
                raise ConlluError(f"{source}:{no}: comment line inside a sentence (missing blank line?)")
            continue
        cols = line.split("\t")
        if len(cols) != 10:
            raise ConlluError(
                f"{source}:{no}: expected 10 tab-separated columns, found {len(cols)}"
                + (" (spaces instead of tabs?)" if len(cols) < 10 and "  " in line else "")
            )
        wid = cols[0]
        if _ID_INT.match(wid):
            if any(c == "" for c in cols):
                raise ConlluError(f"{source}:{no}: empty column (use '_' for no value)")
            if cols[1] == "":
                raise ConlluError(f"{source}:{no}: empty FORM")
            head = cols[6]
            if head == "_":
                pass  # unannotated trees are allowed; deprel tasks skip such words
            elif not head.isdigit():
                raise ConlluError(f"{source}:{no}: HEAD {head!r} is not a word ID")
            else:
                heads.append((int(head), no))
            word_ids.append((int(wid), no))
        elif _ID_RANGE.match(wid):
            a, b = map(int, _ID_RANGE.match(wid).groups())
            if b < a:
                raise ConlluError(f"{source}:{no}: multiword range {wid} ends before it starts")
            if a != len(word_ids) + 1:
                raise ConlluError(f"{source}:{no}: multiword range {wid} does not start at the next word")
        elif _ID_EMPTY.match(wid):
            pass
        else:
            raise ConlluError(f"{source}:{no}: bad ID {wid!r} (expected N, N-M or N.M)")
    if block:
        finish()
        yield start, block


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
    if not misc:
        return {}
    return {k: ("" if v is None else str(v)) for k, v in misc.items()}


def _build_sentence(tl, line0: int, block: list, source: str, doc_id, ent_fields) -> tuple[Sentence, int]:
    # map token order -> line numbers (word/mwt/empty lines, in block order)
    data_lines = [line0 + k for k, ln in enumerate(block) if not ln.startswith("#")]
    pieces: list = []  # surface pieces: (form, space_after, [word tokens])
    words_raw = []
    n_empty = n_mwt = 0
    pending_range = None
    for tok, ln in zip(tl, data_lines):
        tid = tok["id"]
        if isinstance(tid, tuple):
            if tid[1] == "-":
                n_mwt += 1
                misc = _misc_str(tok.get("misc"))
                pending_range = (tid[0], tid[2], tok["form"], misc.get("SpaceAfter") != "No", [])
                pieces.append(pending_range)
            else:
                n_empty += 1
            continue
        words_raw.append((tok, ln))
        if pending_range is not None and pending_range[0] <= tid <= pending_range[1]:
            pending_range[4].append(len(words_raw) - 1)
            if tid == pending_range[1]:
                pending_range = None
        else:
            misc = _misc_str(tok.get("misc"))
            pieces.append((tid, tid, tok["form"], misc.get("SpaceAfter") != "No", [len(words_raw) - 1]))
    spans = [None] * len(words_raw)
    text_parts, pos = [], 0
    for _, _, form, space, members in pieces:
        start = pos
        text_parts.append(form)
        pos += len(form)
        forms = [str(words_raw[m][0]["form"]) for m in members]
        if len(members) == 1:
            spans[members[0]] = (start, pos)
        elif "".join(forms) == form:
            p = start
            for m, f in zip(members, forms):
                spans[m] = (p, p + len(f))
                p += len(f)
        else:
            for m in members:
                spans[m] = (start, pos)
        if space:
            text_parts.append(" ")
            pos += 1
    text = "".join(text_parts).rstrip(" ")
    words = []
    for i, ((tok, ln), sp) in enumerate(zip(words_raw, spans)):
        head = tok.get("head")
        feats = tok.get("feats") or {}
        words.append(
            Word(
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
                start=sp[0],
                end=min(sp[1], len(text)),
                line=ln,
            )
        )
    md = dict(tl.metadata)
    sent = Sentence(
        text=text,
        words=words,
        sent_id=md.get("sent_id"),
        doc_id=doc_id,
        line=line0,
        source=source,
        metadata=md,
        n_empty=n_empty,
        n_multiword=n_mwt,
    )
    unclosed = 0
    if ent_fields is not None:
        gi, ti = ent_fields
        open_: list = []  # (cluster_raw, etype, start)
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
                    parts = ev[1].split("-")
                    cid = _cluster_key(parts[gi] if gi < len(parts) else parts[0])
                    etype = parts[ti] if ti < len(parts) else "_"
                    if ev[2]:
                        sent.mentions.append(Mention(w.index, w.index + 1, etype, f"{doc_id}#{cid}"))
                    else:
                        open_.append((cid, etype, w.index))
                else:
                    cid = _cluster_key(ev[1])
                    for k in range(len(open_) - 1, -1, -1):
                        if open_[k][0] == cid:
                            c, etype, st = open_.pop(k)
                            sent.mentions.append(Mention(st, w.index + 1, etype, f"{doc_id}#{c}"))
                            break
                    else:
                        unclosed += 1  # closes a mention opened in an earlier sentence
        unclosed += len(open_)
        sent.mentions.sort(key=lambda m: (m.start, -m.end))
    return sent, unclosed


def _select_blocks(blocks: list, doc_of: list, max_sentences: int | None, seed: int) -> list:
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
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConlluError(f"{path}:{line}: bytes that are not valid UTF-8 (byte {e.start})") from None
    return parse_conllu_text(text, source=str(path), max_sentences=max_sentences, seed=seed)


def parse_conllu_text(
    text: str, *, source: str = "<string>", max_sentences: int | None = None, seed: int = 0
) -> Corpus:
    """Parse CoNLL-U from a string (see :func:`read_conllu`)."""
    import conllu
    from conllu.exceptions import ParseException

    blocks = list(_blocks(text.splitlines(), source))
    if not blocks:
        raise InputError(f"{source} holds no CoNLL-U sentences")
    # document ids and the entity header, scanned from the comments (cheap)
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
    has_entities = any(h is not None for h in headers) or "Entity=" in text
    keep = _select_blocks(blocks, doc_of, max_sentences, seed)
    parsers = {"deps": lambda line, i: line[i]}
    sentences, unclosed = [], 0
    for i in keep:
        line0, block = blocks[i]
        try:
            tl = conllu.parse_token_and_metadata("\n".join(block), field_parsers=parsers)
        except (ParseException, ValueError, IndexError) as e:
            raise ConlluError(f"{source}:{line0}: sentence could not be parsed: {e}") from None
        ent = _entity_fields(headers[i]) if has_entities else None
        sent, unc = _build_sentence(tl, line0, block, source, doc_of[i], ent)
        sentences.append(sent)
        unclosed += unc
    return Corpus(sentences, source, len(blocks), unclosed, has_entities)
