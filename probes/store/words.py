"""Words to features: residual-stream vectors of every word, for your own probes.

>>> from depthscope.probes import word_features, sample_data
>>> wf = word_features(model, sample_data()["ewt_test"], sites=["embed", "10.mlp", "29.mlp"])
>>> wf.features.shape            # (3, n_words, 576) float32, raw (not standardised)
>>> wf.index.head()              # sentence, word, form, upos, xpos, lemma, feats, head, deprel
>>> from sklearn.linear_model import LogisticRegression
>>> LogisticRegression(max_iter=1000).fit(wf.features[1], wf.index["upos"])

``sentences`` is a CoNLL-U path, a parsed :class:`~depthscope.probes.corpora.conllu.Corpus` (or a
list of its :class:`Sentence` objects), or lists of words. The text the model reads is, for
CoNLL-U, each sentence rebuilt from its surface tokens and their ``SpaceAfter=No`` marks
(:attr:`Sentence.text`: "don't." stays unspaced, multiword tokens keep their surface form); for
lists of words, the words joined by single spaces (the index then has no gold columns). Each
sentence is one forward pass, exactly as the probes run it
(:func:`~depthscope.probes.corpora.spans.build_passages` in sentence context, the BOS token
prepended when the tokenizer adds none, words mapped to subwords by character offsets,
activations pooled over a word's subwords by
:func:`~depthscope.probes.store.activations.extract_spans`, ``pooling`` ``"last"`` / ``"first"`` /
``"mean"``). Words that no subword covers or that truncation cut off are left out
and counted in ``wf.n_skipped``. Features are float32 and raw unless ``standardize=True``
(each site and dimension z-scored over the words). The activations pass through the probes'
on-disk store (``store_dir``, default the depthscope cache), so a second call is free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from depthscope.common.errors import InputError
from depthscope.hooks.sites import parse_sites, site_frame
from depthscope.probes.corpora.conllu import Corpus, Sentence, Word
from depthscope.probes.corpora.spans import SpanTable, bos_id, build_passages, map_spans, tokenize_passages
from depthscope.probes.corpora.tasks import load_corpus
from depthscope.probes.store.activations import SpanExtraction, extract_spans

GOLD_COLUMNS = ["upos", "xpos", "lemma", "feats", "head", "deprel"]


class WordFeatures(NamedTuple):
    """``features`` float32 ``[sites, n_words, d_model]``; ``index`` one row per word (sentence,
    word, form and, from CoNLL-U, the gold columns); ``sites`` the shared site columns;
    ``n_skipped`` words left out (no subword covers them, or truncated)."""

    features: np.ndarray
    index: pd.DataFrame
    sites: pd.DataFrame
    n_skipped: int


def _words_sentence(words: Sequence[str], i: int) -> Sentence:
    """Sentence ``i`` from a list of word strings, joined by single spaces (no annotation)."""
    if isinstance(words, str) or not all(isinstance(w, str) and w and not w.isspace() for w in words):
        raise InputError(f"sentence {i}: give a list of non-empty word strings, got {words!r:.80}")
    out, pos = [], 0
    for k, form in enumerate(words):
        out.append(Word(k, k + 1, form, "_", "_", "_", {}, -1, "_", {}, pos, pos + len(form), 0))
        pos += len(form) + 1
    return Sentence(" ".join(words), out, sent_id=str(i))


def as_sentences(sentences) -> tuple[list, bool]:
    """(list of Sentence, has gold annotation) from any accepted ``sentences`` argument."""
    if isinstance(sentences, (str, Path)):
        return list(load_corpus(sentences).sentences), True
    if isinstance(sentences, Corpus):
        return list(sentences.sentences), True
    sentences = list(sentences)
    if not sentences:
        raise InputError("no sentences given")
    if all(isinstance(s, Sentence) for s in sentences):
        return sentences, True
    return [_words_sentence(s, i) for i, s in enumerate(sentences)], False


def _index(sents: list, gold: bool) -> pd.DataFrame:
    """One row per word: sentence, word, form and, with ``gold``, the CoNLL-U columns."""
    rows = []
    for si, s in enumerate(sents):
        for w in s.words:
            row = {"sentence": si, "word": w.index, "form": w.form}
            if gold:
                feats = "|".join(f"{k}={v}" for k, v in sorted(w.feats.items())) or "_"
                row.update(upos=w.upos, xpos=w.xpos, lemma=w.lemma, feats=feats, head=w.head, deprel=w.deprel)
            rows.append(row)
    cols = ["sentence", "word", "form"] + (GOLD_COLUMNS if gold else [])
    return pd.DataFrame(rows, columns=cols)


def _word_spans(model, sents: list, index: pd.DataFrame, bos: bool, max_tokens: int) -> tuple:
    """Each sentence as one passage, tokenized (the BOS token prepended when ``bos`` and the
    tokenizer adds none), and every word of ``index`` as a span: ``(tokenized, table)``."""
    passages, where = build_passages(sents, "sentence")
    sent_of, word_of = index["sentence"].to_numpy(), index["word"].to_numpy()
    pidx = np.array([where[s][0] for s in sent_of], dtype=np.int64)
    cs = np.array([sents[s].words[w].start for s, w in zip(sent_of, word_of)], dtype=np.int64)
    ce = np.array([sents[s].words[w].end for s, w in zip(sent_of, word_of)], dtype=np.int64)
    prepend = bos_id(model.tokenizer) if (bos and model.tokenizer is not None) else None
    tok = tokenize_passages(model.tokenizer, [p.text for p in passages], max_tokens=max_tokens, prepend=prepend)
    return tok, map_spans(tok, SpanTable(pidx, cs, ce))


def _word_matrix(store, ok: np.ndarray, standardize: bool) -> np.ndarray:
    """The usable words' rows as float32 ``[sites, words, d_model]``, z-scored per site and
    dimension over the words when ``standardize``."""
    feats = np.asarray(store.feats[store.row_start[ok]], dtype=np.float32).transpose(1, 0, 2)
    feats = np.ascontiguousarray(feats)
    if standardize:
        feats = (feats - feats.mean(1, keepdims=True)) / np.maximum(feats.std(1, keepdims=True), 1e-8)
    return feats


def word_features(
    model,
    sentences,
    settings: SpanExtraction | None = None,
    *,
    bos: bool = True,
    standardize: bool = False,
    progress: bool = False,
    **overrides,
) -> WordFeatures:
    """Residual-stream features of every word of ``sentences``; see the module docstring.
    ``settings``: a :class:`~depthscope.probes.store.activations.SpanExtraction` (``sites`` here
    also takes labels such as ``"10.mlp"``; ``pooling`` one of last, first, mean), or any of its
    fields by keyword (``overrides``). The store is always float32 (no ``dtype`` setting)."""
    if "dtype" in overrides:
        raise InputError("word features are stored as float32; dtype is not a word_features setting")
    cfg = replace(settings or SpanExtraction(), **overrides)
    if cfg.pooling not in ("last", "first", "mean"):
        raise InputError(f"pooling must be 'last', 'first' or 'mean' (one vector per word), got {cfg.pooling!r}")
    sents, gold = as_sentences(sentences)
    site_idx = parse_sites(cfg.sites, model.n_layers)
    max_tokens = cfg.max_tokens
    if model.max_context:
        max_tokens = min(int(max_tokens), int(model.max_context))
    index = _index(sents, gold)
    tok, table = _word_spans(model, sents, index, bos, max_tokens)
    cfg = replace(cfg, sites=site_idx, dtype="float32", max_tokens=max_tokens)
    store = extract_spans(model, tok, table, cfg, progress=progress, desc="word features")
    ok = ~store.skipped
    feats = _word_matrix(store, ok, standardize)
    return WordFeatures(feats, index[ok].reset_index(drop=True), site_frame(site_idx, model.n_layers), int((~ok).sum()))
