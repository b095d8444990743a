"""Probing tasks: labelled word, span and edge examples from CoNLL-U or jiant JSONL.

Task names
----------
``upos``, ``xpos``
    one example per word (words labelled ``_`` are left out).
``feats:<Feature>`` (``feats:Number``, ``feats:Tense``, ...)
    one example per word that carries the feature; the label is its value.
``deprel`` (``deprel:base`` keeps only the universal relation, ``nmod:poss`` -> ``nmod``)
    edge task: span1 = the dependent word, span2 = its head word (the root: itself),
    label = the relation.
``entity``
    GUM mention spans (MISC ``Entity=``), labelled with their entity type.
``structural``, ``depth``
    Hewitt and Manning's structural probes (:mod:`depthscope.probes.structural`): one example
    per word of each sentence whose CoNLL-U HEADs form a tree (the label: its head's 0-based
    word index, ``-1`` for the root); the probes read the whole tree of each sentence.
``coref``
    edge task over GUM mentions of one document: pairs (m1 before m2, not overlapping, m1 at
    most ``coref_window`` sentences before m2), label ``1`` if both belong to the same
    cluster else ``0``. Every positive pair is kept; negatives are sampled without
    replacement with a seeded generator, ``coref_neg_ratio`` negatives per positive. Run
    with document context (the passage holds the preceding sentences).
any other name, with a jiant edge-probing JSONL file
    one example per target: ``{"text": "...", "targets": [{"span1": [s, e], "span2": [s, e],
    "label": "X"}]}`` with whitespace-token spans, end exclusive. A list label of one element
    is that label; a longer list is joined with ``+`` (multi-label is treated as one class).
    The file is read as every data file is (:func:`~depthscope.probes.corpora.conllu.read_utf8`:
    a byte-order mark dropped, non-UTF-8 bytes refused); a record of the wrong shape (a target
    that is not an object, a null label, text that is not a string) is an error with ``file:line``.

Control tasks (Hewitt & Liang 2019): every example gets a *control key*, the lowercased word
(for spans: the span's last word, the word last-subword pooling sees; for edges: the pair of
keys), and :func:`control_labels` maps each key to a fixed label drawn from the train label
distribution with a generator seeded by (seed, key), so the mapping is the same for train and
test, independent of example order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from depthscope.common.errors import InputError
from depthscope.probes.corpora.conllu import Corpus, Sentence, Word, read_conllu, read_utf8

WORD_TASKS = ("upos", "xpos")
#: the structural probes' tasks: whole dependency trees, fitted by :mod:`depthscope.probes.structural`
TREE_TASKS = ("structural", "depth")
PIPELINE_ORDER = ["upos", "xpos", "feats", "deprel", "structural", "depth", "entity", "coref"]


@dataclass
class TaskExamples:
    """Examples of one task on one corpus. ``sent1[i]``, ``span1[i] = (start, end)`` (word
    indices, end exclusive); ``sent2``/``span2`` for edge tasks (None otherwise)."""

    task: str
    kind: str  # "word", "span" or "edge"
    context: str  # "sentence" or "document"
    sent1: np.ndarray
    span1: np.ndarray
    labels: np.ndarray  # object array of str
    keys: list
    sent2: np.ndarray | None = None
    span2: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def n_spans(self) -> int:
        return 1 if self.span2 is None else 2

    def subset(self, keep: np.ndarray) -> TaskExamples:
        keep = np.asarray(keep)
        return TaskExamples(
            self.task,
            self.kind,
            self.context,
            self.sent1[keep],
            self.span1[keep],
            self.labels[keep],
            [self.keys[i] for i in np.nonzero(keep)[0]] if keep.dtype == bool else [self.keys[i] for i in keep],
            None if self.sent2 is None else self.sent2[keep],
            None if self.span2 is None else self.span2[keep],
        )


def task_family(task: str) -> str:
    """The task name before any ``:`` argument (``feats:Number`` -> ``feats``)."""
    return task.split(":", 1)[0]


def default_context(task: str) -> str:
    """``document`` for coreference (its pairs cross sentences), else ``sentence``."""
    return "document" if task_family(task) == "coref" else "sentence"


def pipeline_rank(task: str) -> int:
    """Position of the task's family in the classical NLP pipeline (unknown tasks last)."""
    fam = task_family(task)
    return PIPELINE_ORDER.index(fam) if fam in PIPELINE_ORDER else len(PIPELINE_ORDER)


def _key(word: Word) -> str:
    """A word's control key: its lowercased form."""
    return word.form.lower()


def _span_array(starts, ends) -> np.ndarray:
    """``[N, 2]`` int64 ``(start, end)`` word spans."""
    return np.stack([np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)], 1).reshape(-1, 2)


def _examples(task, kind, context, rows, edge: bool) -> TaskExamples:
    """:class:`TaskExamples` from row tuples ``(sent, start, end, label, key)`` or, for edges,
    ``(sent1, start1, end1, sent2, start2, end2, label, key)``."""
    if edge:
        s1, a1, b1, s2, a2, b2, lab, key = zip(*rows) if rows else ([],) * 8
        second = dict(sent2=np.asarray(s2, dtype=np.int64), span2=_span_array(a2, b2))
    else:
        s1, a1, b1, lab, key = zip(*rows) if rows else ([],) * 5
        second = {}
    sent1, span1 = np.asarray(s1, dtype=np.int64), _span_array(a1, b1)
    return TaskExamples(task, kind, context, sent1, span1, np.asarray(lab, dtype=object), list(key), **second)


def word_task(corpus: Corpus, task: str, context: str) -> TaskExamples:
    """One example per word labelled with its UPOS, XPOS or feature value (``_`` left out)."""
    fam, _, arg = task.partition(":")
    rows = []
    for si, s in enumerate(corpus.sentences):
        for w in s.words:
            if fam == "upos":
                lab = w.upos
            elif fam == "xpos":
                lab = w.xpos
            elif fam == "feats":
                lab = w.feats.get(arg, "_")
            else:
                raise AssertionError(fam)
            if lab in ("_", "", None):
                continue
            rows.append((si, w.index, w.index + 1, lab, _key(w)))
    return _examples(task, "word", context, rows, edge=False)


def deprel_task(corpus: Corpus, task: str, context: str) -> TaskExamples:
    """Edges dependent -> head (the root: itself) labelled with the relation (``deprel:base``:
    without its subtype); words without a HEAD or relation are left out."""
    base = task == "deprel:base"
    rows = []
    for si, s in enumerate(corpus.sentences):
        by_id = {w.id: w for w in s.words}
        for w in s.words:
            if w.deprel in ("_", "") or w.head < 0:
                continue
            head = w if w.head == 0 else by_id.get(w.head)
            if head is None:
                continue
            lab = w.deprel.split(":", 1)[0] if base else w.deprel
            rows.append((si, w.index, w.index + 1, si, head.index, head.index + 1, lab, f"{_key(w)}|{_key(head)}"))
    return _examples(task, "edge", context, rows, edge=True)


def tree_heads(sentence) -> np.ndarray | None:
    """``[n]`` int64: each word's head as a 0-based word index, -1 for the root; None when a
    word has no HEAD, a HEAD names no word of the sentence, there is not exactly one root, or
    the HEADs contain a cycle (no tree to probe)."""
    words = sentence.words
    index = {w.id: w.index for w in words}
    heads = np.empty(len(words), dtype=np.int64)
    for k, w in enumerate(words):
        if w.head == 0:
            heads[k] = -1
        elif w.head in index:
            heads[k] = index[w.head]
        else:
            return None
    if len(words) == 0 or int((heads < 0).sum()) != 1:
        return None
    return heads if _acyclic(heads) else None


def _acyclic(heads: np.ndarray) -> bool:
    """Every word reaches the root by following heads (in at most ``n`` steps)."""
    n = len(heads)
    for k in range(n):
        j, steps = k, 0
        while j >= 0 and steps <= n:
            j, steps = int(heads[j]), steps + 1
        if j >= 0:
            return False
    return True


def is_tree_task(task: str) -> bool:
    """True for the structural probes' tasks (:data:`TREE_TASKS`)."""
    return task in TREE_TASKS


def tree_task(corpus: Corpus, task: str, context: str) -> TaskExamples:
    """One example per word of each sentence whose HEADs form a tree
    (:func:`tree_heads`), in sentence and word order, labelled
    with its head's word index (``-1``: the root); sentences without a tree are left out."""
    rows = []
    for si, s in enumerate(corpus.sentences):
        heads = tree_heads(s)
        if heads is None:
            continue
        for w, h in zip(s.words, heads):
            rows.append((si, w.index, w.index + 1, str(int(h)), _key(w)))
    return _examples(task, "word", context, rows, edge=False)


def entity_task(corpus: Corpus, task: str, context: str) -> TaskExamples:
    """One example per entity mention, labelled with its entity type."""
    if not corpus.has_entities:
        raise InputError(f"{corpus.source}: task {task!r} needs GUM-style Entity= annotation in MISC; none found")
    rows = []
    for si, s in enumerate(corpus.sentences):
        for m in s.mentions:
            rows.append((si, m.start, m.end, m.etype, _key(s.words[m.end - 1])))
    return _examples(task, "span", context, rows, edge=False)


def _document_mentions(sents: list) -> list:
    """Mentions grouped by document (consecutive sentences of one ``doc_id``), in order:
    ``(sentence, start, end, cluster)`` each."""
    doc_mentions: list = []
    cur_doc, cur = object(), []
    for si, s in enumerate(sents):
        if s.doc_id != cur_doc:
            if cur:
                doc_mentions.append(cur)
            cur_doc, cur = s.doc_id, []
        for m in s.mentions:
            cur.append((si, m.start, m.end, m.cluster))
    if cur:
        doc_mentions.append(cur)
    return doc_mentions


def _mention_pairs(ms: list, sents: list, window: int) -> tuple[list, list]:
    """Positive (same cluster) and negative edge rows of one document's mentions: each mention
    paired with the earlier ones at most ``window`` sentences back, skipping nested or
    overlapping mentions and, within a sentence, pairs whose first mention starts later."""
    pos, neg = [], []
    for j, (s2, a2, b2, c2) in enumerate(ms):
        for i in range(j - 1, -1, -1):
            s1, a1, b1, c1 = ms[i]
            if s2 - s1 > window:
                break
            if s1 == s2 and not (b1 <= a2 or b2 <= a1):
                continue  # nested or overlapping mentions
            if s1 == s2 and a1 > a2:
                continue
            k1, k2 = _key(sents[s1].words[b1 - 1]), _key(sents[s2].words[b2 - 1])
            row = (s1, a1, b1, s2, a2, b2, "1" if c1 == c2 else "0", f"{k1}|{k2}")
            (pos if c1 == c2 else neg).append(row)
    return pos, neg


def coref_task(
    corpus: Corpus, task: str, context: str, *, window: int = 2, neg_ratio: float = 1.0, seed: int = 0
) -> TaskExamples:
    """Mention-pair coreference examples (see the module docstring): every positive pair, and
    ``neg_ratio`` negatives per positive sampled with a seeded generator."""
    if not corpus.has_entities:
        raise InputError(f"{corpus.source}: task {task!r} needs GUM-style Entity= annotation in MISC; none found")
    sents = corpus.sentences
    pos, neg = [], []
    for ms in _document_mentions(sents):
        p, n = _mention_pairs(ms, sents, window)
        pos += p
        neg += n
    n_neg = min(len(neg), int(round(neg_ratio * len(pos))))
    if n_neg < len(neg):
        rng = np.random.default_rng([seed, 7919])
        pick = np.sort(rng.choice(len(neg), size=n_neg, replace=False))
        neg = [neg[i] for i in pick]
    rows = sorted(pos + neg, key=lambda r: (r[3], r[4], r[0], r[1]))
    return _examples(task, "edge", context, rows, edge=True)


# ----------------------------------------------------------------------------- jiant JSONL
def _check_span(sp, key: str, n_tokens: int, where: str) -> None:
    """A target span is ``[start, end)`` of ints within the record's tokens."""
    if (
        not isinstance(sp, (list, tuple))
        or len(sp) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in sp)
        or not 0 <= sp[0] < sp[1] <= n_tokens
    ):
        raise InputError(f"{where}: {key} {sp!r} is not [start, end) within the {n_tokens} tokens")


def _is_label(lab) -> bool:
    """A jiant label: a string or number, or a list of them (multi-label)."""
    one = (str, int, float)
    if isinstance(lab, list):
        return all(isinstance(x, one) and not isinstance(x, bool) for x in lab)
    return isinstance(lab, one) and not isinstance(lab, bool)


def _check_targets(targets, n_tokens: int, where: str) -> None:
    """Targets are a list of objects, each with a valid ``span1``, an optional valid ``span2``
    and a label (a string or number, or a list of them)."""
    if not isinstance(targets, list):
        raise InputError(f"{where}: 'targets' must be a list of objects, got {_json_type(targets)}")
    for i, t in enumerate(targets):
        if not isinstance(t, dict):
            raise InputError(f"{where}: target {i} is {_json_type(t)}, not an object with span1 and label")
        if "span1" not in t:
            raise InputError(f"{where}: target {i} has no span1")
        for key in ("span1", "span2"):
            if key in t:
                _check_span(t[key], key, n_tokens, where)
        if "label" not in t:
            raise InputError(f"{where}: target {i} has no label")
        if not _is_label(t["label"]):
            raise InputError(
                f"{where}: target {i}: a label must be a string or a number, or a list of them, "
                f"got {json.dumps(t['label'])}"
            )


def _json_type(v) -> str:
    """The JSON name of a decoded value's type (for messages)."""
    names = {type(None): "null", bool: "a boolean", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _document_id(rec: dict, where: str):
    """The record's ``info.document_id`` (a string or number), or None."""
    info = rec.get("info")
    if info is None:
        return None
    if not isinstance(info, dict):
        raise InputError(f"{where}: 'info' must be an object, got {_json_type(info)}")
    doc = info.get("document_id")
    if doc is not None and (not isinstance(doc, (str, int)) or isinstance(doc, bool)):
        raise InputError(f"{where}: info.document_id must be a string or a number, got {_json_type(doc)}")
    return doc


def _json_problem(e: Exception) -> str:
    """What is wrong with a JSON text that did not parse as JSON errors do (huge integers, deep nesting)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e)[:100]


def _jiant_sentence(line: str, no: int, path: Path) -> Sentence:
    """The :class:`Sentence` of one JSONL record (line ``no``): whitespace tokens as words, the
    targets checked and kept in ``metadata``, the record's ``info.document_id`` as document."""
    where = f"{path}:{no}"
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:  # bad JSON, an integer past 4300 digits, nesting past the stack
        raise InputError(f"{where}: not valid JSON ({getattr(e, 'msg', None) or _json_problem(e)})") from None
    if not isinstance(rec, dict) or "text" not in rec or "targets" not in rec:
        raise InputError(f"{where}: a jiant record needs 'text' and 'targets'")
    if not isinstance(rec["text"], str):
        raise InputError(f"{where}: 'text' must be a string, got {_json_type(rec['text'])}")
    toks = rec["text"].split()
    if not toks:
        raise InputError(f"{where}: empty text")
    words, pos = [], 0
    for i, t in enumerate(toks):
        words.append(Word(i, i + 1, t, t, "_", "_", {}, -1, "_", {}, pos, pos + len(t), no))
        pos += len(t) + 1
    targets = rec["targets"]
    _check_targets(targets, len(toks), where)
    doc = _document_id(rec, where)
    return Sentence(
        " ".join(toks),
        words,
        doc_id=doc if doc is not None else f"{path}#{no}",
        line=no,
        source=str(path),
        metadata={"targets": targets},
    )


def read_jiant(path: str | Path, *, max_sentences: int | None = None, seed: int = 0) -> Corpus:
    """Read a jiant edge-probing JSONL file into a :class:`Corpus` (targets kept in metadata)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such JSONL file: {path}")
    lines = read_utf8(path).split("\n")  # not splitlines: JSON strings may hold U+2028 and the like
    sents = [_jiant_sentence(line, no, path) for no, line in enumerate(lines, 1) if line.strip()]
    if not sents:
        raise InputError(f"{path} holds no records")
    corpus = Corpus(sents, str(path), len(sents))
    return read_conllu(corpus, max_sentences=max_sentences, seed=seed) if max_sentences else corpus


def _label_str(lab) -> str:
    """A jiant label as one class name: a list joined with ``+`` in sorted order, empty -> ``_``."""
    if isinstance(lab, (list, tuple)):
        return "+".join(sorted(str(x) for x in lab)) if lab else "_"
    return str(lab)


def jiant_task(corpus: Corpus, task: str, context: str) -> TaskExamples:
    """One example per jiant target: edges when the targets have ``span2``, spans otherwise
    (a file mixing both is refused)."""
    rows, edge = [], None
    for si, s in enumerate(corpus.sentences):
        for t in s.metadata.get("targets", []):
            has2 = "span2" in t
            if edge is None:
                edge = has2
            elif edge != has2:
                raise InputError(f"{s.source}:{s.line}: mixes targets with and without span2")
            a1, b1 = t["span1"]
            k1 = s.words[b1 - 1].form.lower()
            if has2:
                a2, b2 = t["span2"]
                rows.append((si, a1, b1, si, a2, b2, _label_str(t["label"]), f"{k1}|{s.words[b2 - 1].form.lower()}"))
            else:
                rows.append((si, a1, b1, _label_str(t["label"]), k1))
    edge = bool(edge)
    return _examples(task, "edge" if edge else "span", context, rows, edge=edge)


# ----------------------------------------------------------------------------- entry points
def load_corpus(source, *, max_sentences: int | None = None, seed: int = 0) -> Corpus:
    """A CoNLL-U path, a jiant ``.jsonl``/``.json`` path, or a :class:`Corpus`."""
    if isinstance(source, Corpus):
        return read_conllu(source, max_sentences=max_sentences, seed=seed)
    p = Path(source)
    if p.suffix.lower() in (".jsonl", ".json"):
        return read_jiant(p, max_sentences=max_sentences, seed=seed)
    return read_conllu(p, max_sentences=max_sentences, seed=seed)


def is_jiant(corpus: Corpus) -> bool:
    """True for a corpus read from jiant JSONL (its sentences carry targets)."""
    return bool(corpus.sentences) and "targets" in corpus.sentences[0].metadata


def build_task(
    corpus: Corpus,
    task: str,
    *,
    context: str | None = None,
    seed: int = 0,
    coref_window: int = 2,
    coref_neg_ratio: float = 1.0,
) -> TaskExamples:
    """Examples of ``task`` on ``corpus`` (see the module docstring for task names)."""
    context = context or default_context(task)
    fam = task_family(task)
    if is_tree_task(task):
        if is_jiant(corpus):
            raise InputError(f"{corpus.source}: task {task!r} reads dependency trees: give CoNLL-U files with HEADs")
        return tree_task(corpus, task, context)
    if is_jiant(corpus):
        return jiant_task(corpus, task, context)
    if fam in WORD_TASKS or fam == "feats":
        if fam == "feats" and ":" not in task:
            raise InputError("feats tasks name a feature: feats:Number, feats:Tense, ...")
        return word_task(corpus, task, context)
    if fam == "deprel":
        return deprel_task(corpus, task, context)
    if fam == "entity":
        return entity_task(corpus, task, context)
    if fam == "coref":
        return coref_task(corpus, task, context, window=coref_window, neg_ratio=coref_neg_ratio, seed=seed)
    raise InputError(
        f"unknown task {task!r}: use upos, xpos, feats:<Feature>, deprel, deprel:base, structural, depth, entity, "
        f"coref, "
        f"or any name with a jiant edge-probing .jsonl file"
    )


def _stable_seed(seed: int, key: str) -> int:
    """A 64-bit number from (seed, key), the same in every process (unlike ``hash``)."""
    h = hashlib.blake2b(f"{seed}\x1f{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def control_labels(keys: Sequence[str], classes: Sequence[str], probs: np.ndarray, seed: int = 0) -> np.ndarray:
    """Hewitt & Liang control labels: each key gets a fixed class index drawn from ``probs``
    (the train label distribution) by a generator seeded with (seed, key)."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs / probs.sum())
    out = np.empty(len(keys), dtype=np.int64)
    cache: dict = {}
    for i, k in enumerate(keys):
        v = cache.get(k)
        if v is None:
            u = (_stable_seed(seed, k) >> 11) / float(1 << 53)
            v = cache[k] = int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))
        out[i] = v
    return out
