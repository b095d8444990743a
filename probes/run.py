"""``run_probes``: the whole probing method, tasks in, tidy tables out.

>>> from depthscope.probes import run_probes, sample_data
>>> paths = sample_data()
>>> res = run_probes(None, ["upos", "deprel"], paths["ewt_train"], paths["ewt_test"])
>>> res.by_site.columns   # task, site, label, layer, sublayer, depth, accuracy, macro_f1, ...
>>> res.summary           # task, expected_layer_delta, expected_layer_mix, best_label, ...
>>> res.write("out/")     # probes_by_site / probes_summary / probes_mixing .csv + .parquet

Flow: corpora (CoNLL-U or jiant JSONL, capped by whole documents) -> task examples -> for
each split and context mode, the union of all tasks' spans -> ONE batched extraction into an
on-disk store (reused on re-runs) -> per task: per-site probes with the task's labels and its
control labels as two heads of one batched fit, then the cumulative prefix mixes (one more
batched fit) giving Delta, E_Delta and the scalar-mix E_s -> tables.

Documented handling of bad input
--------------------------------
* malformed CoNLL-U / JSONL: :class:`InputError` with file and line;
* a test label never seen in train: kept as an example the probe cannot get right (counted as
  an error in accuracy, a class with F1 0 in macro-F1) and reported as
  ``n_test_unseen_labels``;
* a span no subword covers (or cut off by ``max_tokens``): the example is dropped and counted
  in ``n_skipped_train`` / ``n_skipped_test``;
* a task with no examples (after filtering) in train or test, or a single train label:
  :class:`InputError` naming the task and the split;
* train/test overlap (a test sentence whose text also occurs in train): ``overlap="drop"``
  (default) removes those sentences from test with a warning and reports
  ``n_overlap_dropped``; ``"keep"`` only warns and reports ``n_overlap``; ``"error"`` raises.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from depthscope.hooks.errors import InputError
from depthscope.hooks.sites import parse_sites, site_frame

from .activations import ATTN_MAX_TOKENS, POOLINGS, SpanStore, extract_spans
from .classifiers import (
    DEFAULT_BATCH,
    DEFAULT_EPOCHS,
    DEFAULT_HIDDEN,
    DEFAULT_L2,
    DEFAULT_LR,
    DEFAULT_MIN_STEPS,
    PROBES,
    BatchedProbe,
    Features,
    accuracy,
    macro_f1,
    predict,
    train_probe,
)
from .conllu_io import Corpus
from .mixing import expected_layer_delta, expected_layer_delta_interval, expected_layer_mix, fit_cumulative
from .spans import SpanTable, bos_id, build_passages, map_spans, tokenize_passages
from .tasks import TaskExamples, build_task, control_labels, default_context, load_corpus, pipeline_rank

log = logging.getLogger("depthscope.probes")

L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2)
OVERLAP = ("drop", "keep", "error")
BY_SITE_FIRST = ["task", "site", "label", "layer", "sublayer", "depth", "accuracy", "macro_f1", "control_accuracy", "selectivity"]
SUMMARY_FIRST = ["task", "expected_layer_delta", "expected_layer_mix", "best_label", "best_accuracy", "n_train", "n_test"]


@dataclass
class ProbeResults:
    """``by_site`` (one row per task and site), ``summary`` (one row per task), ``mixing``
    (one row per task and site: scalar-mix weight, cumulative score, Delta) and ``info``."""

    by_site: pd.DataFrame
    summary: pd.DataFrame
    mixing: pd.DataFrame
    info: dict = field(default_factory=dict)

    def write(self, out_dir, *, plots: bool = True) -> list:
        """Write the three tables (CSV + Parquet) and, with ``plots``, the figures."""
        from depthscope.analyses.tables import write_table

        out = Path(out_dir)
        paths = []
        paths += write_table(self.by_site, out, "probes_by_site")
        paths += write_table(self.summary, out, "probes_summary")
        if len(self.mixing):
            paths += write_table(self.mixing, out, "probes_mixing")
        if plots:
            from depthscope.analyses.plots.probes import plot_probe_curves, plot_tenney

            paths.append(plot_probe_curves(self.by_site, out / "probes_by_site.png"))
            if len(self.mixing):
                paths.append(plot_tenney(self.summary, self.mixing, out / "probes_tenney.png"))
        return paths


# ----------------------------------------------------------------------------- helpers
def _as_corpus(source, max_sentences, seed, what) -> Corpus:
    if source is None:
        raise InputError(f"no {what} data given")
    try:
        return load_corpus(source, max_sentences=max_sentences, seed=seed)
    except InputError:
        raise
    except FileNotFoundError as e:
        raise InputError(f"{what}: {e}") from None


def _drop_overlap(train: Corpus, test: Corpus, mode: str) -> tuple:
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
    keys = [np.column_stack([ex.sent1, ex.span1])]
    if ex.span2 is not None:
        keys.append(np.column_stack([ex.sent2, ex.span2]))
    return keys


@dataclass
class _Extraction:
    store: SpanStore
    lookup: dict  # (sent, start, end) -> span id


def _extract_split(model, corpus: Corpus, tasks_ex: list, context: str, *, sites, pooling, store_dir, dtype,
                   batch_tokens, max_tokens, progress, desc, prepend=None) -> _Extraction:
    keys = np.concatenate([k for ex in tasks_ex for k in _span_keys(ex)]) if tasks_ex else np.zeros((0, 3), np.int64)
    uniq = np.unique(keys, axis=0) if len(keys) else keys.reshape(0, 3)
    passages, where = build_passages(corpus.sentences, context, tokenizer=model.tokenizer, max_tokens=max_tokens)
    pidx = np.array([where[s][0] for s in uniq[:, 0]], dtype=np.int64)
    off = np.array([where[s][1] for s in uniq[:, 0]], dtype=np.int64)
    sents = corpus.sentences
    cs = np.array([sents[s].words[a].start for s, a in zip(uniq[:, 0], uniq[:, 1])], dtype=np.int64) + off
    ce = np.array([sents[s].words[b - 1].end for s, b in zip(uniq[:, 0], uniq[:, 2])], dtype=np.int64) + off
    tok = tokenize_passages(model.tokenizer, [p.text for p in passages], max_tokens=max_tokens, prepend=prepend)
    table = map_spans(tok, SpanTable(pidx, cs, ce))
    store = extract_spans(model, tok, table, sites=sites, pooling=pooling, store_dir=store_dir, dtype=dtype,
                          batch_tokens=batch_tokens, max_tokens=max_tokens, progress=progress, desc=desc)
    lookup = {tuple(int(v) for v in k): i for i, k in enumerate(uniq)}
    return _Extraction(store, lookup)


def _span_ids(ex: TaskExamples, ext: _Extraction) -> tuple:
    cols = [np.array([ext.lookup[tuple(int(v) for v in k)] for k in keys], dtype=np.int64) for keys in _span_keys(ex)]
    ids = np.stack(cols, 1) if cols else np.zeros((0, 1), np.int64)
    ok = ~ext.store.skipped[ids].any(1) if len(ids) else np.zeros(0, bool)
    return ids, ok


def _resolve_model(model):
    from depthscope.hooks import HookedModel, load_model

    return model if isinstance(model, HookedModel) else load_model(model)


def _load_and_extract(model, tasks, train, test, dev, *, pooling, sites, max_train_sentences, max_test_sentences,
                      max_dev_sentences, context, overlap, coref_window, coref_neg_ratio, store_dir, dtype, batch_tokens,
                      max_tokens, seed, progress, bos=True):
    """Model, corpora, task examples and one extraction per split x context."""
    m = _resolve_model(model)
    if m.max_context:
        max_tokens = min(int(max_tokens), int(m.max_context))
    site_idx = parse_sites(sites, m.n_layers)
    frame = site_frame(site_idx, m.n_layers)

    prepend = bos_id(m.tokenizer) if (bos and m.tokenizer is not None) else None
    corpora = {"train": _as_corpus(train, max_train_sentences, seed, "train")}
    corpora["test"] = _as_corpus(test, max_test_sentences, seed, "test")
    if dev is not None:
        corpora["dev"] = _as_corpus(dev, max_dev_sentences, seed, "dev")
    corpora["test"], n_overlap = _drop_overlap(corpora["train"], corpora["test"], overlap)

    # ---------------------------------------------------------------- examples per task
    examples: dict = {}
    ctx_of: dict = {}
    for task in tasks:
        ctx_of[task] = context or default_context(task)
        examples[task] = {}
        for split, corpus in corpora.items():
            ex = build_task(corpus, task, context=ctx_of[task], seed=seed, coref_window=coref_window,
                            coref_neg_ratio=coref_neg_ratio)
            if len(ex) == 0:
                raise InputError(f"task {task!r} has no examples in {split} ({corpus.source}, {len(corpus)} sentences)")
            examples[task][split] = ex

    # ---------------------------------------------------------------- one extraction per split x context
    extractions: dict = {}
    t_ex = time.perf_counter()
    for split, corpus in corpora.items():
        for ctx in sorted(set(ctx_of.values())):
            group = [examples[t][split] for t in tasks if ctx_of[t] == ctx]
            extractions[(split, ctx)] = _extract_split(
                m, corpus, group, ctx, sites=site_idx, pooling=pooling, store_dir=store_dir, dtype=dtype,
                batch_tokens=batch_tokens, max_tokens=max_tokens, progress=progress,
                desc=f"{split} activations ({ctx})", prepend=prepend,
            )
    t_extract = time.perf_counter() - t_ex

    return m, site_idx, frame, corpora, n_overlap, examples, ctx_of, extractions, t_extract


def prepare_task(
    model,
    task: str,
    train,
    test,
    dev=None,
    *,
    pooling: str = "last",
    sites=None,
    max_train_sentences: Optional[int] = None,
    max_test_sentences: Optional[int] = None,
    max_dev_sentences: Optional[int] = None,
    context: Optional[str] = None,
    overlap: str = "drop",
    coref_window: int = 2,
    coref_neg_ratio: float = 1.0,
    store_dir=None,
    dtype: str = "float16",
    batch_tokens: int = 2048,
    max_tokens: int = 512,
    bos: bool = True,
    resident_bytes: float = 4e9,
    seed: int = 0,
    progress: bool = True,
) -> TaskData:
    """One task's standardised features and labels per split, for your own probes (the same
    loading, extraction and store as :func:`run_probes`)."""
    _, _, _, _, _, examples, ctx_of, extractions, _ = _load_and_extract(
        model, [task], train, test, dev, pooling=pooling, sites=sites, max_train_sentences=max_train_sentences,
        max_test_sentences=max_test_sentences, max_dev_sentences=max_dev_sentences, context=context, overlap=overlap,
        coref_window=coref_window, coref_neg_ratio=coref_neg_ratio, store_dir=store_dir, dtype=dtype,
        batch_tokens=batch_tokens, max_tokens=max_tokens, seed=seed, progress=progress, bos=bos)
    exts = {s: extractions[(s, ctx_of[task])] for s in examples[task]}
    return _prepare(task, examples[task], exts, seed=seed, resident_bytes=resident_bytes)



# ----------------------------------------------------------------------------- main entry
def run_probes(
    model,
    tasks: Union[str, Sequence[str]],
    train,
    test,
    dev=None,
    *,
    probe: str = "linear",
    pooling: str = "last",
    sites=None,
    max_train_sentences: Optional[int] = None,
    max_test_sentences: Optional[int] = None,
    max_dev_sentences: Optional[int] = None,
    context: Optional[str] = None,
    l2: Union[float, str] = DEFAULT_L2,
    epochs: int = DEFAULT_EPOCHS,
    min_steps: int = DEFAULT_MIN_STEPS,
    lr: float = DEFAULT_LR,
    batch_size: Optional[int] = DEFAULT_BATCH,
    hidden: int = DEFAULT_HIDDEN,
    control: bool = True,
    cumulative: bool = True,
    mdl: bool = False,
    overlap: str = "drop",
    coref_window: int = 2,
    coref_neg_ratio: float = 1.0,
    store_dir=None,
    dtype: str = "float16",
    batch_tokens: int = 2048,
    max_tokens: int = 512,
    bos: bool = True,
    resident_bytes: float = 4e9,
    seed: int = 0,
    progress: bool = True,
) -> ProbeResults:
    """Probe every site of ``model`` for each task; see the module docstring.

    ``model``: a HookedModel or a spec for ``load_model`` (None = the default model).
    ``tasks``: names (``upos``, ``xpos``, ``feats:Number``, ``deprel``, ``deprel:base``,
    ``entity``, ``coref``; any name for a jiant ``.jsonl``), a list or a comma-separated
    string. ``train``/``test``/``dev``: CoNLL-U or jiant JSONL paths, or parsed
    :class:`Corpus` objects. ``probe``: ``linear`` (softmax regression) or ``mlp`` (one
    hidden ReLU layer of ``hidden`` units). ``pooling``: ``last`` | ``first`` | ``mean`` |
    ``attn``. ``sites``: indices/labels (default all 2L+1). ``context``: ``sentence`` or
    ``document`` for every task (default: document for coref, sentence otherwise).
    ``l2``: the penalty on mean cross-entropy (default 1e-3, i.e. scikit-learn
    ``C = 1 / (2e-3 * n_train)``: the value EWT dev picked at most sites for upos on the
    default model, 2000 train sentences, grid ``L2_GRID``), or ``"dev"`` to pick it per
    site from ``L2_GRID`` by dev accuracy (needs ``dev``; ties go to the strongest L2). ``mdl``: add online codelengths (costly: ten more fits).
    ``store_dir``: activation store (default ``<cache>/activations``). ``bos``: when the
    tokenizer adds no special token at the start (SmolLM2, GPT-2), prepend its BOS (else EOS)
    token, as TransformerLens does by default, so the first word of a sentence is not the
    model's attention sink. Without it, from the sublayer where SmolLM2-135M's massive
    activations appear (11.mlp) the first word's state is the sink: its upos accuracy falls
    from ~0.80 to ~0.67 and overall accuracy dips by up to 5 points (EWT, 600 train
    sentences); with it the curve stays flat there. ``bos=False`` runs the bare text.
    """
    t_start = time.perf_counter()
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    tasks = list(dict.fromkeys(tasks))
    if not tasks:
        raise InputError("no tasks given")
    if probe not in PROBES:
        raise InputError(f"probe must be one of {PROBES}, got {probe!r}")
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if overlap not in OVERLAP:
        raise InputError(f"overlap must be one of {OVERLAP}, got {overlap!r}")
    if l2 == "dev" and dev is None:
        raise InputError("l2='dev' picks the penalty on a dev split: pass dev=")
    if not (l2 == "dev" or isinstance(l2, (int, float))):
        raise InputError(f"l2 must be a number or 'dev', got {l2!r}")

    m, site_idx, frame, corpora, n_overlap, examples, ctx_of, extractions, t_extract = _load_and_extract(
        model, tasks, train, test, dev, pooling=pooling, sites=sites, max_train_sentences=max_train_sentences,
        max_test_sentences=max_test_sentences, max_dev_sentences=max_dev_sentences, context=context, overlap=overlap,
        coref_window=coref_window, coref_neg_ratio=coref_neg_ratio, store_dir=store_dir, dtype=dtype,
        batch_tokens=batch_tokens, max_tokens=max_tokens, seed=seed, progress=progress, bos=bos)
    depths = frame["depth"].to_numpy()

    # ---------------------------------------------------------------- probes per task
    by_site, summary, mixing = [], [], []
    fit_seconds = {}
    for task in sorted(tasks, key=lambda t: (pipeline_rank(t), tasks.index(t))):
        t0 = time.perf_counter()
        rows = _probe_task(
            task, examples[task], {s: extractions[(s, ctx_of[task])] for s in corpora}, frame, depths, m.n_layers,
            probe=probe, l2=l2, epochs=epochs, min_steps=min_steps, lr=lr, batch_size=batch_size, hidden=hidden, control=control,
            cumulative=cumulative, mdl=mdl, seed=seed, progress=progress, resident_bytes=resident_bytes,
        )
        rows["summary"]["n_overlap_dropped" if overlap == "drop" else "n_overlap"] = n_overlap
        rows["summary"]["context"] = ctx_of[task]
        by_site.append(rows["by_site"])
        summary.append(rows["summary"])
        if rows["mixing"] is not None:
            mixing.append(rows["mixing"])
        fit_seconds[task] = time.perf_counter() - t0

    by_site_df = pd.concat(by_site, ignore_index=True)
    by_site_df = by_site_df[[c for c in BY_SITE_FIRST if c in by_site_df] + [c for c in by_site_df if c not in BY_SITE_FIRST]]
    summary_df = pd.DataFrame(summary)
    summary_df = summary_df[[c for c in SUMMARY_FIRST if c in summary_df] + [c for c in summary_df if c not in SUMMARY_FIRST]]
    mixing_df = pd.concat(mixing, ignore_index=True) if mixing else pd.DataFrame(
        columns=["task", "site", "label", "layer", "sublayer", "depth", "mix_weight", "cumulative_score", "delta"])
    info = {
        "model": m.name,
        "n_layers": m.n_layers,
        "sites": site_idx,
        "stores": {f"{k[0]}/{k[1]}": str(v.store.path) for k, v in extractions.items()},
        "stores_reused": {f"{k[0]}/{k[1]}": v.store.reused for k, v in extractions.items()},
        "extraction_tokens": {f"{k[0]}/{k[1]}": v.store.meta.get("n_tokens_run") for k, v in extractions.items()},
        "seconds_extract": t_extract,
        "seconds_fit": fit_seconds,
        "seconds_total": time.perf_counter() - t_start,
        "n_sentences": {k: len(v) for k, v in corpora.items()},
    }
    return ProbeResults(by_site_df, summary_df, mixing_df, info)


@dataclass
class TaskData:
    """A task ready for probes: labels as class indices (``y``; test labels unseen in train get
    indices >= ``n_classes``), control labels (``ctrl``) and standardised :class:`Features` per
    split, plus the examples and counts of skipped spans."""

    task: str
    classes: list
    n_eval_classes: int
    y: dict
    ctrl: dict
    feats: dict
    examples: dict
    skipped: dict
    counts: np.ndarray

    @property
    def n_classes(self) -> int:
        return len(self.classes)


def _prepare(task, ex_by_split, ext_by_split, *, seed, resident_bytes) -> TaskData:
    data = {}
    skipped = {}
    for split, ex in ex_by_split.items():
        ids, ok = _span_ids(ex, ext_by_split[split])
        skipped[split] = int((~ok).sum())
        sub = ex.subset(ok)
        if len(sub) == 0:
            raise InputError(
                f"task {task!r}: no {split} examples left: all {len(ex)} spans are uncovered by subwords "
                f"(text longer than max_tokens, or a tokenizer without offsets)"
            )
        data[split] = (sub, ids[ok])
    tr_ex, tr_ids = data["train"]
    classes = sorted(set(tr_ex.labels.tolist()))
    if len(classes) < 2:
        raise InputError(f"task {task!r}: train has a single label ({classes[0]!r}); nothing to probe")
    C = len(classes)
    index = {c: i for i, c in enumerate(classes)}
    unseen: dict = {}

    def encode(labels, allow_unseen):
        out = np.empty(len(labels), dtype=np.int64)
        for i, lab in enumerate(labels):
            j = index.get(lab)
            if j is None:
                if not allow_unseen:
                    raise AssertionError(lab)
                j = unseen.setdefault(lab, C + len(unseen))
            out[i] = j
        return out

    y = {s: encode(d[0].labels, s != "train") for s, d in data.items()}
    counts = np.bincount(y["train"], minlength=C).astype(np.float64)
    probs = counts / counts.sum()
    ctrl = {s: control_labels(d[0].keys, classes, probs, seed=seed) for s, d in data.items()}

    max_len = ATTN_MAX_TOKENS if ext_by_split["train"].store.pooling == "attn" else 1
    feats = {}
    for s, (ex, ids) in data.items():
        feats[s] = Features(ext_by_split[s].store, ids, max_len=max_len)
    feats["train"].fit_standardiser()
    for s in feats:
        if s != "train":
            feats[s].standardise_like(feats["train"])
        feats[s].make_resident(max_bytes=resident_bytes, seed=seed)
    return TaskData(task, classes, C + len(unseen), y, ctrl, feats, {k: v[0] for k, v in data.items()}, skipped, counts)


def _pick_l2(acc_dev: torch.Tensor) -> torch.Tensor:
    """Per site, the L2 strength (column of ``acc_dev [S, len(L2_GRID)]``, grid ascending)
    with the best dev accuracy; ties go to the strongest L2, the simplest probe."""
    n = acc_dev.shape[1]
    return (n - 1) - acc_dev.flip(1).argmax(1)


def _probe_task(task, ex_by_split, ext_by_split, frame, depths, n_layers, *, probe, l2, epochs, min_steps, lr, batch_size, hidden,
                control, cumulative, mdl, seed, progress, resident_bytes) -> dict:
    td = _prepare(task, ex_by_split, ext_by_split, seed=seed, resident_bytes=resident_bytes)
    classes, C, n_eval, y, ctrl, feats, skipped, counts = (
        td.classes, td.n_classes, td.n_eval_classes, td.y, td.ctrl, td.feats, td.skipped, td.counts)
    data = {k: (v, None) for k, v in td.examples.items()}
    tr_ex = td.examples["train"]

    S = feats["train"].n_sites
    l2_values = list(L2_GRID) if l2 == "dev" else [float(l2)]
    n_sets = 2 if control else 1
    heads_l2 = [v for _ in range(n_sets) for v in l2_values]
    G = len(heads_l2)
    Y = [y["train"]] + ([ctrl["train"]] if control else [])
    y_heads = np.stack([Y[k // len(l2_values)] for k in range(G)], 1)
    p = BatchedProbe(n_sites=S, d=feats["train"].d, n_spans=feats["train"].n_spans, n_classes=C, n_heads=G, kind=probe,
                     hidden=hidden, attn_pool=feats["train"].tokens, l2=heads_l2, seed=seed)
    train_probe(p, feats["train"], torch.from_numpy(y_heads), epochs=epochs, min_steps=min_steps, lr=lr,
                batch_size=batch_size, seed=seed,
                progress=progress, desc=f"{task} probes")
    pred_te, _ = predict(p, feats["test"])
    pred_tr, _ = predict(p, feats["train"])
    nl = len(l2_values)
    if l2 == "dev":
        pred_dev, _ = predict(p, feats["dev"])
        acc_dev_real = torch.stack([accuracy(pred_dev[:, :, k], torch.from_numpy(y["dev"])) for k in range(nl)], 1)
        pick_real = _pick_l2(acc_dev_real)  # [S]
        if control:
            acc_dev_ctrl = torch.stack([accuracy(pred_dev[:, :, nl + k], torch.from_numpy(ctrl["dev"])) for k in range(nl)], 1)
            pick_ctrl = _pick_l2(acc_dev_ctrl) + nl
    else:
        pick_real = torch.zeros(S, dtype=torch.long)
        pick_ctrl = torch.full((S,), nl, dtype=torch.long) if control else None
    ar = torch.arange(S)
    real_te = pred_te[ar, :, pick_real]  # [S, N]
    real_tr = pred_tr[ar, :, pick_real]
    yte = torch.from_numpy(y["test"])
    acc = accuracy(real_te, yte).numpy()
    f1 = macro_f1(real_te, yte, n_eval).numpy()
    acc_tr = accuracy(real_tr, torch.from_numpy(y["train"])).numpy()
    df = frame.copy()
    df.insert(0, "task", task)
    df["accuracy"] = acc
    df["macro_f1"] = f1
    if control:
        ctrl_te = pred_te[ar, :, pick_ctrl]
        cacc = accuracy(ctrl_te, torch.from_numpy(ctrl["test"])).numpy()
        df["control_accuracy"] = cacc
        df["selectivity"] = acc - cacc
    else:
        df["control_accuracy"] = np.nan
        df["selectivity"] = np.nan
    df["train_accuracy"] = acc_tr
    df["l2"] = np.asarray(l2_values)[pick_real.numpy()]
    df["probe"] = probe
    df["pooling"] = ext_by_split["train"].store.pooling
    df["n_train"] = len(tr_ex)
    df["n_test"] = len(data["test"][0])
    del p

    summ = {"task": task}
    mix_df = None
    if cumulative and S >= 2:
        l2_mix = float(np.median(df["l2"])) if l2 == "dev" else float(l2)
        cum = fit_cumulative(feats["train"], y["train"], feats["test"], y["test"], n_classes=C, n_eval_classes=n_eval,
                             kind=probe, l2=l2_mix, epochs=epochs, min_steps=min_steps, lr=lr, batch_size=batch_size,
                             hidden=hidden,
                             seed=seed, progress=progress, desc=f"{task} cumulative")
        e_delta = expected_layer_delta(depths, cum.accuracy)
        e_mix = expected_layer_mix(depths, cum.mix_weights)
        mix_df = frame.copy()
        mix_df.insert(0, "task", task)
        mix_df["mix_weight"] = cum.mix_weights
        mix_df["cumulative_score"] = cum.accuracy
        mix_df["cumulative_macro_f1"] = cum.macro_f1
        mix_df["delta"] = cum.delta
        mix_df["gamma"] = cum.gamma
        summ["expected_layer_delta"] = e_delta
        lo, hi = expected_layer_delta_interval(depths, cum.correct, seed=seed)
        summ["expected_layer_delta_lo"], summ["expected_layer_delta_hi"] = lo, hi
        summ["total_delta"] = float(cum.accuracy[-1] - cum.accuracy[0])
        summ["expected_layer_mix"] = e_mix
        summ["mix_accuracy"] = float(cum.accuracy[-1])
    else:
        summ["expected_layer_delta"] = np.nan
        summ["expected_layer_delta_lo"] = summ["expected_layer_delta_hi"] = summ["total_delta"] = np.nan
        summ["expected_layer_mix"] = np.nan
    best = int(np.argmax(acc))
    summ.update({
        "best_label": df["label"].iloc[best],
        "best_site": int(df["site"].iloc[best]),
        "best_depth": float(df["depth"].iloc[best]),
        "best_accuracy": float(acc[best]),
        "best_macro_f1": float(f1[best]),
        "best_selectivity": float(df["selectivity"].iloc[best]) if control else np.nan,
        "max_selectivity": float(np.nanmax(df["selectivity"])) if control else np.nan,
        "n_layers": n_layers,
        "relative_depth_delta": summ["expected_layer_delta"] / n_layers,
        "relative_depth_mix": summ["expected_layer_mix"] / n_layers,
        "relative_depth_best": float(df["depth"].iloc[best]) / n_layers,
        "majority_accuracy": float((y["test"] == int(np.argmax(counts))).mean()),
        "n_train": len(tr_ex),
        "n_test": len(data["test"][0]),
        "n_classes": C,
        "n_test_unseen_labels": int((y["test"] >= C).sum()),
        "n_skipped_train": skipped["train"],
        "n_skipped_test": skipped["test"],
        "kind": tr_ex.kind,
        "probe": probe,
        "pooling": ext_by_split["train"].store.pooling,
    })
    if mdl:
        from .mdl import online_codelength

        res = online_codelength(feats["train"], y["train"], n_classes=C, kind=probe,
                                l2=float(np.median(df["l2"])), epochs=epochs, lr=lr, batch_size=batch_size,
                                hidden=hidden, seed=seed, max_bytes=resident_bytes, progress=progress)
        df["mdl_online_bits"] = res.online_bits
        df["mdl_uniform_bits"] = res.uniform_bits
        df["mdl_compression"] = res.compression
    for f in feats.values():
        f.resident = None
    return {"by_site": df, "summary": summ, "mixing": mix_df}
