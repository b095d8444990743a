"""Corpora and task examples in, one activation extraction per split and context out.

===================================  ============================================================
``load_and_extract(model, tasks,     the model's name and size (the model itself only with
splits, extraction, data, seed=,     ``keep_model``), corpora (capped, test/train overlap
progress=, keep_model=)``            handled), each task's examples per split, and ONE
                                     extraction per split x context for the union of the tasks'
                                     spans: an :class:`Extracted` (``splits``: :class:`Splits`)
``span_ids(examples, extraction)``   each example's span rows in the store, and which are usable
===================================  ============================================================

Tasks that share a context share an extraction: the union of their spans is extracted once
per split into the on-disk store (reused on re-runs).
"""

from __future__ import annotations

import functools
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from depthscope import hooks
from depthscope.common.errors import InputError
from depthscope.common.files import check_writable_dir
from depthscope.hooks.sites import parse_sites, site_frame
from depthscope.probes.config import DataConfig, ExtractionConfig
from depthscope.probes.corpora.conllu import Corpus
from depthscope.probes.corpora.spans import SpanTable, bos_id, build_passages, map_spans, tokenize_passages
from depthscope.probes.corpora.tasks import TaskExamples, build_task, default_context, load_corpus
from depthscope.probes.store.activations import SpanStore, extract_spans
from depthscope.probes.store.shards import extract_sharded


class Splits(NamedTuple):
    """The data of one run by split: a CoNLL-U or jiant path, or a parsed
    :class:`~depthscope.probes.corpora.conllu.Corpus`, each (``dev`` optional)."""

    train: object
    test: object
    dev: object = None


@dataclass
class Extraction:
    """One split x context: the span store and the map ``(sent, start, end) -> span id``."""

    store: SpanStore
    lookup: dict


class ModelInfo(NamedTuple):
    """What the fitting reads of the model once its activations are extracted: its name, its
    layers, its context (None: unbounded)."""

    name: str
    n_layers: int
    max_context: int | None


@dataclass
class Extracted:
    """What :func:`load_and_extract` hands to the fitting: the model's :class:`ModelInfo` and its
    sites (``frame``: the tidy site columns), corpora by split, test sentences that overlapped
    train, examples ``[task][split]``, each task's context, extractions ``[(split, context)]``,
    and ``loaded``: the model itself only when the caller asked to keep it (``keep_model``), so
    that otherwise a model loaded from a spec or a loader is freed before the probes train (half
    a gigabyte for the default model)."""

    model: ModelInfo
    sites: list
    frame: pd.DataFrame
    corpora: dict
    n_overlap: int
    examples: dict
    context_of: dict
    extractions: dict
    seconds: float
    loaded: object = None

    def for_task(self, task: str) -> dict:
        """The extraction of each split in ``task``'s context."""
        return {s: self.extractions[(s, self.context_of[task])] for s in self.corpora}


def _as_corpus(source, max_sentences, seed, what) -> Corpus:
    """One split's corpus, capped; a missing source or file is an :class:`InputError`."""
    if source is None:
        raise InputError(f"no {what} data given")
    try:
        return load_corpus(source, max_sentences=max_sentences, seed=seed)
    except InputError:
        raise
    except FileNotFoundError as e:
        raise InputError(f"{what}: {e}") from None


def drop_overlap(train: Corpus, test: Corpus, mode: str) -> tuple:
    """``(test, n)``: test without (``drop``) or with (``keep``) the ``n`` sentences whose text
    also occurs in train, warning either way; ``error`` raises."""
    seen = {s.text for s in train.sentences}
    hit = [s.text in seen for s in test.sentences]
    n = int(sum(hit))
    if not n:
        return test, 0
    msg = f"{n} of {len(test)} test sentences also occur in train ({test.source} vs {train.source})"
    if mode == "error":
        raise InputError(msg + "; remove them or pass overlap='drop' / 'keep'")
    if mode == "keep":
        warnings.warn(msg + "; kept (overlap='keep')", stacklevel=4)
        return test, n
    warnings.warn(msg + "; dropped from test (overlap='drop')", stacklevel=4)
    kept = [s for s, h in zip(test.sentences, hit) if not h]
    if not kept:
        raise InputError(msg + ": nothing is left to test on (are train and test the same file?)")
    return Corpus(kept, test.source, test.n_sentences_in_file, test.n_unclosed_mentions, test.has_entities), n


def _span_keys(ex: TaskExamples) -> list:
    """``[N, 3]`` arrays ``(sentence, start, end)``: the examples' first spans, then their second."""
    keys = [np.column_stack([ex.sent1, ex.span1])]
    if ex.span2 is not None:
        keys.append(np.column_stack([ex.sent2, ex.span2]))
    return keys


@dataclass(frozen=True)
class _RunSettings:
    """What the extractions of one run share, resolved once by :func:`load_and_extract`: the
    extraction config, the site indices, the token limit (the model's context at most), whether
    to show progress, and the token to prepend to every passage (None: none)."""

    ext: ExtractionConfig
    sites: list
    max_tokens: int
    progress: bool
    prepend: int | None


def _unique_spans(tasks_ex: list) -> np.ndarray:
    """``[n, 3]`` the distinct ``(sentence, start, end)`` spans of the tasks' examples, sorted."""
    keys = np.concatenate([k for ex in tasks_ex for k in _span_keys(ex)]) if tasks_ex else np.zeros((0, 3), np.int64)
    return np.unique(keys, axis=0) if len(keys) else keys.reshape(0, 3)


def _span_table(model, corpus: Corpus, uniq: np.ndarray, context: str, run: _RunSettings) -> tuple:
    """The corpus' passages in ``context``, tokenized, and the spans ``uniq`` as a
    :class:`SpanTable` mapped to subwords: ``(tokenized, table)``."""
    passages, where = build_passages(corpus.sentences, context, tokenizer=model.tokenizer, max_tokens=run.max_tokens)
    pidx = np.array([where[s][0] for s in uniq[:, 0]], dtype=np.int64)
    off = np.array([where[s][1] for s in uniq[:, 0]], dtype=np.int64)
    sents = corpus.sentences
    cs = np.array([sents[s].words[a].start for s, a in zip(uniq[:, 0], uniq[:, 1])], dtype=np.int64) + off
    ce = np.array([sents[s].words[b - 1].end for s, b in zip(uniq[:, 0], uniq[:, 2])], dtype=np.int64) + off
    tok = tokenize_passages(model.tokenizer, [p.text for p in passages], max_tokens=run.max_tokens, prepend=run.prepend)
    return tok, map_spans(tok, SpanTable(pidx, cs, ce))


def _extract_split(model, corpus: Corpus, tasks_ex: list, context: str, run: _RunSettings, desc: str) -> Extraction:
    """The union of ``tasks_ex``' spans in ``corpus``, extracted into one store (sharded when
    the config asks for shards or Ray)."""
    uniq = _unique_spans(tasks_ex)
    tok, table = _span_table(model, corpus, uniq, context, run)
    ext = run.ext
    kw = dict(
        sites=run.sites,
        pooling=ext.pooling,
        dtype=ext.store_dtype,
        batch_tokens=ext.batch_tokens,
        max_tokens=run.max_tokens,
    )
    if ext.shards > 1 or ext.engine == "ray":
        store = _extract_sharded(model, tok, table, ext, **kw)
    else:
        store = extract_spans(model, tok, table, store_dir=ext.store_dir, progress=run.progress, desc=desc, **kw)
    lookup = {tuple(int(v) for v in k): i for i, k in enumerate(uniq)}
    return Extraction(store, lookup)


def _extract_sharded(model, tok, table, ext: ExtractionConfig, **kw):
    """The store as ``ext.shards`` shards, here or as Ray tasks that load the model from its source."""
    where = "--store" if ext.store_dir else "DEPTHSCOPE_CACHE"
    store_dir = check_writable_dir(Path(ext.store_dir or hooks.cache_dir() / "activations"), where)
    engine, load = None, None
    if ext.engine == "ray":
        if not model.source or model.source in ("in-memory", "TransformerBridge"):
            raise InputError("engine='ray' loads the model in each worker: pass a model spec (a path), not a model")
        engine = types.SimpleNamespace(workers=ext.workers, address=None, gpus_per_task=0.0, max_retries=1)
        spec = model.source.removeprefix("hf-cache:")
        load = functools.partial(hooks.load_model, spec, dtype=model.dtype, device=str(model.device))
    return extract_sharded(model, tok, table, n_shards=ext.shards, store_dir=store_dir, engine=engine, load=load, **kw)


def span_ids(ex: TaskExamples, ext: Extraction) -> tuple:
    """``(ids [N, n_spans], ok [N])``: each example's span ids in ``ext``'s store, and whether
    all its spans are covered by subwords."""
    cols = [np.array([ext.lookup[tuple(int(v) for v in k)] for k in keys], dtype=np.int64) for keys in _span_keys(ex)]
    ids = np.stack(cols, 1) if cols else np.zeros((0, 1), np.int64)
    ok = ~ext.store.skipped[ids].any(1) if len(ids) else np.zeros(0, bool)
    return ids, ok


def resolve_model(model):
    """A HookedModel as is; a loader (a function of no arguments, e.g. ``functools.partial(load_model,
    spec, device=..., dtype=...)``) called; anything else through ``load_model`` (None: the default
    model). Callers validate their data first, so a loader runs only once the inputs are known good."""
    if isinstance(model, hooks.HookedModel):
        return model
    if callable(model):
        return model()
    return hooks.load_model(model)


def _examples(tasks, corpora, data: DataConfig, context_of, seed) -> dict:
    """``[task][split]``: each task's examples on each corpus; a task with none in a split fails."""
    examples: dict = {}
    for task in tasks:
        examples[task] = {}
        for split, corpus in corpora.items():
            ex = build_task(
                corpus,
                task,
                context=context_of[task],
                seed=seed,
                coref_window=data.coref_window,
                coref_neg_ratio=data.coref_neg_ratio,
            )
            if len(ex) == 0:
                raise InputError(f"task {task!r} has no examples in {split} ({corpus.source}, {len(corpus)} sentences)")
            examples[task][split] = ex
        kinds = {split: (ex.kind, ex.n_spans) for split, ex in examples[task].items()}
        if len(set(kinds.values())) > 1:  # e.g. CoNLL-U train (one word) and a jiant edge test (two spans)
            got = ", ".join(f"{split}: {k} ({n} span{'s' * (n > 1)})" for split, (k, n) in kinds.items())
            raise InputError(
                f"task {task!r} is not the same kind of task in every split ({got}): give train and test files of "
                f"one format (CoNLL-U or jiant) and task"
            )
    return examples


def _corpora(splits: Splits, data: DataConfig, seed: int) -> dict:
    """``{split: corpus}``: the splits read and capped (dev only when given)."""
    corpora = {"train": _as_corpus(splits.train, data.max_train_sentences, seed, "train")}
    corpora["test"] = _as_corpus(splits.test, data.max_test_sentences, seed, "test")
    if splits.dev is not None:
        corpora["dev"] = _as_corpus(splits.dev, data.max_dev_sentences, seed, "dev")
    return corpora


def _run_settings(m, extraction: ExtractionConfig, progress: bool) -> _RunSettings:
    """The run-wide extraction settings for the loaded model ``m``."""
    max_tokens = min(int(extraction.max_tokens), int(m.max_context)) if m.max_context else int(extraction.max_tokens)
    site_idx = parse_sites(extraction.sites, m.n_layers)
    prepend = bos_id(m.tokenizer) if (extraction.bos and m.tokenizer is not None) else None
    return _RunSettings(extraction, site_idx, max_tokens, progress, prepend)


def load_and_extract(
    model,
    tasks,
    splits: Splits,
    extraction: ExtractionConfig,
    data: DataConfig,
    *,
    seed: int = 0,
    progress: bool = True,
    keep_model: bool = False,
) -> Extracted:
    """Model, corpora, task examples and one extraction per split x context. The data are read
    and checked (files, tasks, labels) before the model loads: bad data fail fast.
    ``keep_model``: the result holds the model (``loaded``), for callers that run it again."""
    corpora = _corpora(splits, data, seed)
    # here, not in a helper: the overlap warning points at the caller of run_probes (stacklevel)
    corpora["test"], n_overlap = drop_overlap(corpora["train"], corpora["test"], data.overlap)
    context_of = {task: extraction.context or default_context(task) for task in tasks}
    examples = _examples(tasks, corpora, data, context_of, seed)

    m = resolve_model(model)
    run = _run_settings(m, extraction, progress)
    frame = site_frame(run.sites, m.n_layers)
    extractions: dict = {}
    t_ex = time.perf_counter()
    for split, corpus in corpora.items():
        for ctx in sorted(set(context_of.values())):
            group = [examples[t][split] for t in tasks if context_of[t] == ctx]
            desc = f"{split} activations ({ctx})"
            extractions[(split, ctx)] = _extract_split(m, corpus, group, ctx, run, desc)
    info = ModelInfo(m.name, m.n_layers, m.max_context)
    seconds = time.perf_counter() - t_ex
    loaded = m if keep_model else None
    return Extracted(info, run.sites, frame, corpora, n_overlap, examples, context_of, extractions, seconds, loaded)
