"""Encoded vs used, per depth: LEACE concept erasure at each residual site, and what it costs the model.

>>> from depthscope.analyses.causal.erasure.used import causal_tests
>>> from depthscope.analyses.causal.erasure.config import CausalConfig
>>> res = causal_tests(model, CausalConfig(tasks=["upos"]))
>>> res.table[["label", "accuracy", "accuracy_erased", "majority", "used", "used_lo", "used_hi"]]

=====================================  ===========================================================
``causal_tests(model, config,          one row per task and site (:data:`COLUMNS`): a
progress=)``                           :class:`CausalResult`
``site_accuracy(td, x_train, x_test,   the project's linear probes (the L2 search of
cfg, l2=)``                            :func:`~depthscope.probes.fitting.choose_l2`, then
                                       :func:`~depthscope.probes.fitting.fit_sites`) on raw
                                       ``[N, sites, d]`` features: test accuracy per site, and L2
``word_matrix(features)``              the raw (unstandardised) word vectors ``[N, sites, d]`` of
                                       a split, read from the probes' activation store
=====================================  ===========================================================

Method, per task: the train and test words are extracted exactly as ``depthscope probe`` does
(:func:`~depthscope.probes.store.extraction.load_and_extract`: one vector per word, ``pooling``
last/first/mean of its subwords, in sentence context with the BOS token prepended). At each site:

1. ``accuracy``: a linear probe trained on the train words, scored on the test words
   (``majority``: always answering train's most frequent label);
2. LEACE (:mod:`depthscope.analyses.causal.erasure.erasers`) fitted on the train words' vectors and
   labels; ``accuracy_erased``: a linear probe trained on erased train vectors and scored on
   erased test vectors, at the L2 of step 1 (LEACE guarantees it cannot beat a constant on
   train, so it is at ``majority`` up to sampling);
3. the same eraser applied by a write hook at that site (``model.run(hooks={site: fn})``) to
   EVERY token position of the held-out text except the leading BOS token (the eraser is fitted
   on word vectors and applied to all subword tokens: the concept is removed wherever the model
   could read it from the stream); ``lm_loss`` (no hook), ``lm_loss_erased``, and
   ``lm_loss_control_mean`` / ``_std`` / ``_min`` / ``_max`` over ``controls`` random erasures of
   the same rank (:func:`~depthscope.analyses.causal.erasure.erasers.random_erasure`; ``control``
   ``raw``, the default: random directions removed orthogonally whose edit is as large as
   LEACE's in the stream's own units, or ``whitened``);
4. the edits' sizes: ``edit_rms`` (LEACE) and ``control_edit_rms`` (the controls' mean), the
   root mean square per word of ``||x - x'||`` on the fitting (train) words, equal for the raw
   control; ``edit_rms_text`` and ``control_edit_rms_text`` the same on the held-out text's
   tokens, where the model met them;
5. ``used = (lm_loss_erased - lm_loss_control_mean) / lm_loss`` with its interval ``used_lo``,
   ``used_hi``: a two-level bootstrap over held-out documents and the controls
   (:mod:`depthscope.analyses.causal.erasure.loss`), named by ``ci_n`` (documents), ``ci_unit`` and
   ``ci_method``; NaN below 10 documents, with a note in ``table.attrs["notes"]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.causal.erasure.config import CausalConfig
from depthscope.analyses.causal.erasure.erasers import EditMeter, edit_rms, fit_erasure, random_erasure
from depthscope.analyses.causal.erasure.loss import (
    BATCH_TOKENS,
    DocLoss,
    HeldOut,
    doc_nll,
    doc_nlls,
    held_out,
    used_interval,
    used_score,
)
from depthscope.analyses.causal.erasure.prefix import Prefixes, site_block
from depthscope.analyses.intervals import provenance, too_few, too_few_note
from depthscope.analyses.text import read_documents
from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text
from depthscope.common.progress import track
from depthscope.common.resume import sealed, unsealed
from depthscope.hooks.sites import site_labels
from depthscope.probes import sample_data
from depthscope.probes.config import ProbeConfig
from depthscope.probes.encoding import TaskData, encode_task
from depthscope.probes.fitting import choose_l2, fit_sites
from depthscope.probes.run import task_list
from depthscope.probes.store.extraction import Splits, load_and_extract
from depthscope.probes.store.features import Features

log = logging.getLogger("depthscope")

DEFAULT_TASKS = ("upos",)
#: the table's columns after the shared site columns
COLUMNS = (
    "task",
    "accuracy",
    "majority",
    "accuracy_erased",
    "rank",
    "edit_rms",
    "control_edit_rms",
    "lm_loss",
    "lm_loss_erased",
    "lm_loss_control_mean",
    "lm_loss_control_std",
    "lm_loss_control_min",
    "lm_loss_control_max",
    "used",
    "used_lo",
    "used_hi",
    "edit_rms_text",
    "control_edit_rms_text",
)


@dataclass
class CausalResult:
    """``table``: one row per task and site (the shared site columns, then :data:`COLUMNS` and the
    counts ``n_train, n_test, n_lm_docs, n_lm_tokens``, ``controls``, ``control``, ``pooling``,
    ``l2``, and the interval's ``ci_n, ci_unit, ci_method``); ``table.attrs["notes"]``: sentences
    about the interval (why it is NaN); ``info``: the model, the data, the notes, the timing."""

    table: pd.DataFrame
    info: dict = field(default_factory=dict)


def word_matrix(features: Features) -> torch.Tensor:
    """The raw word vectors ``[N, sites, d]`` (float32) of ``features``' examples (one span each)."""
    rows = features.store.row_start[features.span_ids[:, 0]]
    return torch.from_numpy(np.asarray(features.store.feats[rows], dtype=np.float32))


def _resident(like: Features, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, seed: int) -> Features:
    """``x [N, S, d]`` standardised with ``mean``/``std`` ``[S, d]`` as resident probe features,
    feature-major and in a seeded shuffled order, as :meth:`Features.make_resident` lays them out."""
    f = Features(like.store, like.span_ids)
    order = np.random.default_rng(seed).permutation(len(x))
    n, s, d = x.shape
    xt = torch.empty(s, d, n)
    idx = torch.from_numpy(order)
    for k in range(s):
        xt[k] = ((x[idx, k] - mean[k]) / std[k]).T
    f.order, f.resident = order, xt.transpose(1, 2)
    return f


def _standardiser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-site, per-dimension mean and std over the rows of ``x [N, S, d]`` (a constant
    dimension gets std 1, as :meth:`Features.fit_standardiser`)."""
    mean, std = x.mean(0), x.std(0, unbiased=False)
    return mean, torch.where(std > 1e-6 * (mean.abs() + 1), std, torch.ones_like(std))


def site_accuracy(
    td: TaskData, x_train: torch.Tensor, x_test: torch.Tensor, cfg: ProbeConfig, l2: float | None = None
) -> tuple[np.ndarray, float]:
    """Test accuracy per site of linear probes trained on ``x_train`` (standardised with its own
    statistics, ``x_test`` likewise) with ``td``'s labels, and the L2 used (None: chosen as
    ``depthscope probe`` chooses it)."""
    mean, std = _standardiser(x_train)
    feats = {
        "train": _resident(td.feats["train"], x_train, mean, std, cfg.seed),
        "test": _resident(td.feats["test"], x_test, mean, std, cfg.seed),
    }
    data = replace(td, feats=feats)
    cfg = replace(cfg, control=False)
    if l2 is None:
        l2 = choose_l2(data, cfg).l2
    fit = fit_sites(data, replace(cfg, l2=l2), l2)
    y = torch.from_numpy(td.y["test"])
    return (fit.test == y).double().mean(1).numpy(), float(l2)


def _inputs(cfg: CausalConfig) -> tuple:
    """``(tasks, train, test, texts or None)``: the defaults filled in, the text read."""
    tasks = task_list(cfg.tasks) if cfg.tasks else list(DEFAULT_TASKS)
    sample = sample_data()
    train, test = cfg.train or sample["ewt_train"], cfg.test or sample["ewt_test"]
    texts = read_documents(cfg.text) if cfg.text is not None else None
    return tasks, train, test, texts


@dataclass(frozen=True)
class _Held:
    """The held-out text and its clean loss, shared by every task and site; ``prefixes``: the clean
    stream entering a block, where the sites' forwards start; ``records``: the folder
    of finished sites' records (None: none kept), ``fingerprint``: what a record must match."""

    text: HeldOut
    clean: DocLoss
    prefixes: Prefixes
    records: Path | None = None
    fingerprint: str = ""


def _site_effect(model, held: _Held, site: int, erasers: list, cfg: CausalConfig) -> dict:
    """The loss columns of one site: ``erasers[0]`` the LEACE eraser, the rest its controls; and
    the rms of the edits each made on the text (real tokens after the leading BOS). The forwards
    start at the site's block from the clean stream there (``held.prefixes``, advanced to it)."""
    start = held.text.start
    label = site_labels(model.n_layers)[site]
    held.prefixes.advance(site_block(site))
    meters = [EditMeter() for _ in erasers]
    hooks = [{label: e.hook(start, meter)} for e, meter in zip(erasers, meters)]
    losses = doc_nlls(model, held.text, hooks, prefixes=held.prefixes)  # one pass: each block read once
    erased, controls = losses[0], losses[1:]
    c = np.array([x.mean for x in controls])
    lo, hi = used_interval(held.clean, erased, controls, cfg.bootstrap, seed=cfg.probe.seed)
    return {
        "lm_loss": held.clean.mean,
        "lm_loss_erased": erased.mean,
        "lm_loss_control_mean": float(c.mean()),
        "lm_loss_control_std": float(c.std(ddof=1)) if len(c) > 1 else 0.0,
        "lm_loss_control_min": float(c.min()),
        "lm_loss_control_max": float(c.max()),
        "used": used_score(held.clean, erased, controls),
        "used_lo": lo,
        "used_hi": hi,
        "edit_rms_text": meters[0].rms,
        "control_edit_rms_text": float(np.mean([m.rms for m in meters[1:]])),
    }


def _resumed_effect(model, held: _Held, task: str, site: int, erasers: list, cfg: CausalConfig) -> dict:
    """:func:`_site_effect`, or its record from an earlier run of the same model, settings, text and
    eraser (``records/<task>/<label>.json``, written atomically when a site finishes)."""
    if held.records is None:
        return _site_effect(model, held, site, erasers, cfg)
    label = site_labels(model.n_layers)[site]
    digest = hashlib.sha256()
    for e in erasers:  # the erasers themselves: fitted on the same words, they are the same bytes
        for t in (e.left, e.right, e.bias):
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    key = f"{held.fingerprint}|{task}|{label}|{digest.hexdigest()}"
    path = held.records / task.replace("/", "_").replace(":", "_") / f"{label}.json"
    try:
        record = unsealed(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError):
        record = None
    if record is None:  # there, but edited, truncated or corrupted: never served
        log.warning("%s %s: %s fails its digest (edited or corrupted); computing it again", task, label, path)
    elif record.get("key") == key and isinstance(record.get("effect"), dict):
        return record["effect"]
    effect = _site_effect(model, held, site, erasers, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_text(path, json.dumps(sealed({"key": key, "effect": effect})))
    return effect


def _erasers(td: TaskData, x_train: torch.Tensor, cfg: CausalConfig) -> tuple[list, list]:
    """Per site: ``[LEACE eraser, control 1, ..., control n]``, and the rms of their edits on the
    fitting words (``edit_rms``; ``control_edit_rms``: the controls' mean)."""
    out, sizes = [], []
    for s in range(x_train.shape[1]):
        er, fitter = fit_erasure(x_train[:, s], td.y["train"], td.n_classes)
        target = edit_rms(er, fitter=fitter)
        seeds = [cfg.probe.seed * 100_003 + 1009 * s + j for j in range(cfg.controls)]
        ctrl = [random_erasure(fitter, er.rank, sd, control=cfg.control, target_rms=target) for sd in seeds]
        out.append([er, *ctrl])
        sizes.append(
            {"edit_rms": target, "control_edit_rms": float(np.mean([edit_rms(c, fitter=fitter) for c in ctrl]))}
        )
    return out, sizes


def _erase_inplace(x: torch.Tensor, erasers: list) -> None:
    """``x[:, s] = erasers[s][0](x[:, s])`` for every site ``s``."""
    for s, es in enumerate(erasers):
        x[:, s] = es[0](x[:, s])


def _task_table(model, got, task: str, held: _Held, cfg: CausalConfig, progress: bool) -> pd.DataFrame:
    """One task's rows: probes before and after erasure, then the loss of each site's edit."""
    td = encode_task(task, got.examples[task], got.for_task(task), seed=cfg.probe.seed, resident_bytes=0)
    if td.feats["train"].n_spans != 1:
        raise InputError(f"task {task!r} labels pairs of spans: causal erasure needs a word task (one span)")
    x_train, x_test = word_matrix(td.feats["train"]), word_matrix(td.feats["test"])
    acc, l2 = site_accuracy(td, x_train, x_test, cfg.probe)
    erasers, sizes = _erasers(td, x_train, cfg)
    _erase_inplace(x_train, erasers)
    _erase_inplace(x_test, erasers)
    acc_erased, _ = site_accuracy(td, x_train, x_test, cfg.probe, l2)
    del x_train, x_test
    pairs = track(list(zip(got.sites, erasers)), desc=f"{task}: erase per site", unit="site", enabled=progress)
    effects = [_resumed_effect(model, held, task, int(site), es, cfg) for site, es in pairs]
    df = got.frame.copy()
    df.insert(0, "task", task)
    df["accuracy"], df["majority"], df["accuracy_erased"] = acc, td.majority_accuracy, acc_erased
    df["rank"] = [es[0].rank for es in erasers]
    df = pd.concat([df.reset_index(drop=True), pd.DataFrame(sizes), pd.DataFrame(effects)], axis=1)
    n_train, n_test = len(td.y["train"]), len(td.y["test"])
    return df.assign(n_train=n_train, n_test=n_test, controls=cfg.controls, control=cfg.control, l2=l2)


def causal_tests(
    model, config: CausalConfig | None = None, *, progress: bool = False, records: Path | None = None
) -> CausalResult:
    """Encoded vs used at every site of ``model`` (a HookedModel, a spec, or a loader called once
    the data are checked) for each task; see the module docstring. ``records``: a folder where
    each finished site's losses are kept, so that a rerun (after an interruption) computes only
    the sites not finished (:func:`_resumed_effect`)."""
    t0 = time.perf_counter()
    cfg = config or CausalConfig()
    tasks, train, test, texts = _inputs(cfg)
    got = load_and_extract(
        model,
        tasks,
        Splits(train, test),
        cfg.extraction,
        cfg.data,
        seed=cfg.probe.seed,
        progress=progress,
        keep_model=True,
    )
    m = got.loaded  # the loss under erasure runs the model again
    if texts is None:
        texts = [s.text for s in got.corpora["test"].sentences]
    window = min(int(cfg.extraction.max_tokens), int(m.max_context or cfg.extraction.max_tokens))
    text = held_out(m, texts, window=window, bos=cfg.extraction.bos, max_tokens=cfg.max_text_tokens)
    prefixes = Prefixes(m, text, cfg.batch_size, BATCH_TOKENS)
    t_clean = time.perf_counter()
    clean = doc_nll(m, text, prefixes=prefixes)
    t_clean = time.perf_counter() - t_clean
    fingerprint = json.dumps([m.name, cfg.to_dict(), text.n_tokens, float(clean.nll.sum())], default=str)
    held = _Held(text, clean, prefixes, Path(records) if records is not None else None, fingerprint)
    depth = [1 - site_block(s) / m.n_layers if prefixes.enabled else 1.0 for s in got.sites]
    passes = len(tasks) * ((1 + cfg.controls) * sum(depth) + 1)  # + advancing the streams: one clean forward
    expected = _announce(passes, t_clean, text.n_tokens, progress)
    tables = [_task_table(m, got, task, held, cfg, progress) for task in tasks]
    table = pd.concat(tables, ignore_index=True)
    table = table.assign(n_lm_docs=text.n_docs, n_lm_tokens=text.n_tokens, pooling=cfg.extraction.pooling)
    table = table.assign(**provenance(text.n_docs, "documents", interval_method(cfg)))
    notes = interval_notes(text.n_docs, cfg)
    table.attrs["notes"] = notes
    info = {
        "model": m.name,
        "tasks": tasks,
        "train": str(train),
        "test": str(test),
        "text": str(cfg.text) if cfg.text is not None else "test sentences",
        "notes": notes,
        "seconds": time.perf_counter() - t0,
        "expected_seconds_erasure": expected,
    }
    return CausalResult(table, info)


def _announce(passes: float, seconds_per_pass: float, tokens: int, progress: bool) -> float:
    """The erasure stage's expected seconds (``passes`` passes over the held-out text, each as long
    as the clean one was), said on stderr before the stage starts when ``progress``."""
    expected = passes * seconds_per_pass
    if progress:
        print(
            f"causal: the work of {passes:.0f} passes over the held-out text ({tokens} tokens; tasks x sites x "
            f"(LEACE + controls), each from its site's block on), {seconds_per_pass:.1f} s per pass: about "
            f"{expected / 60:.0f} min "
            f"(sites finished are kept: a rerun into the same --out resumes)",
            file=sys.stderr,
            flush=True,
        )
    return expected


def interval_method(cfg: CausalConfig) -> str:
    """The ``ci_method`` of ``used_lo``/``used_hi`` (:func:`~depthscope.analyses.causal.erasure.loss.used_interval`)."""
    if cfg.bootstrap <= 0:
        return "none (--bootstrap 0)"
    many = "s" if cfg.controls != 1 else ""
    return (
        f"two-level percentile bootstrap, {cfg.bootstrap} resamples: documents and the {cfg.controls} "
        f"control{many} drawn with replacement"
    )


def interval_notes(n_docs: int, cfg: CausalConfig) -> list[str]:
    """The table's notes about the interval of ``used``: withheld below
    :data:`~depthscope.analyses.intervals.MIN_UNITS` documents, blind to the controls' spread with one."""
    notes = []
    if cfg.bootstrap > 0 and too_few(n_docs):
        notes.append(too_few_note(n_docs, "documents", "the interval of used (used_lo, used_hi)"))
    if cfg.controls < 2:
        notes.append(
            "one random control: the interval of used cannot include how much one random erasure's loss "
            "differs from another's (use --controls 2 or more)"
        )
    return notes
