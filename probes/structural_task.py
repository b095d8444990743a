"""One structural-probe task (``structural`` or ``depth``) at every site: tables in the probes' shape.

======================================  =======================================================
``fit_tree_task(got, task, config,      ``{"by_site", "summary", "mixing"}`` as
overlap_column=, progress=)``           :func:`~depthscope.probes.run_probes` collects them:
                                        per site the task's scores beside its baseline
                                        (:mod:`.structural`), one summary row, no mixing
``tree_site_rows(task, frame, ...)``    the ``by_site`` rows of one task
``task_probes(task, probe)``            the probe kinds a task is fitted with (tree tasks:
                                        linear only)
======================================  =======================================================

``by_site`` columns: the shared site columns, ``uuas`` (``structural``) or ``root_accuracy``
(``depth``), ``spearman``, the baseline's ``baseline_uuas`` / ``baseline_root_accuracy`` and
``baseline_spearman``, ``train_loss``, ``converged``, ``epochs``, ``probe`` (``linear``),
``probe_rank``, ``pooling``, ``n_train`` / ``n_test`` (words) and ``n_train_sentences`` /
``n_test_sentences``. The summary's ``best_metric`` names the main score and ``best_score`` is
its value at the best site; classification columns (accuracy, E_Delta, ...) are absent (NaN
beside other tasks).
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import torch

from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.probes.config import ProbeConfig, probe_kinds
from depthscope.probes.corpora.tasks import is_tree_task
from depthscope.probes.structural import (
    MAIN_SCORE,
    TreeSettings,
    baseline_scores,
    fit_tree_probe,
    tree_predictions,
    tree_scores,
    tree_split,
)

log = logging.getLogger("depthscope.probes")

#: the relative change of an epoch's loss below which a tree probe's fit has converged: minibatch
#: epochs of a few hundred sentences move by about 1e-4 once the step has been halved
TREE_TOL = 1e-4
#: memory for one group of sites' word features (read from the store a group at a time)
RESIDENT_BYTES = 1e9


def task_probes(task: str, probe: str) -> tuple:
    """The probe kinds ``task`` is fitted with under the ``probe`` setting
    (:func:`~depthscope.probes.config.probe_kinds`); the structural probes are linear maps by
    definition, so they take ``linear`` (also under ``both``) and refuse ``mlp``."""
    kinds = probe_kinds(probe)
    if not is_tree_task(task):
        return kinds
    if "linear" not in kinds:
        raise InputError(
            f"task {task!r} fits a linear (rank-limited) probe: use probe 'linear' or 'both', not {probe!r}"
        )
    return ("linear",)


def _site_feats(store, split, sites: slice) -> np.ndarray:
    """The split's word rows at ``sites``, ``[N, S', D]`` as stored (float16 or float32)."""
    return np.asarray(store.feats[split.rows, sites])


def _site_groups(splits: dict, store, resident_bytes: float) -> list:
    """Consecutive site ranges whose words (train and test, as float64 while scaled) fit in
    ``resident_bytes``, at least one site each."""
    words = sum(len(sp.rows) for sp in splits.values())
    step = max(1, int(resident_bytes // max(1, words * store.d_model * 8)))
    return [slice(a, min(a + step, store.n_sites)) for a in range(0, store.n_sites, step)]


def _scaler(train: np.ndarray, s: int) -> tuple:
    """Train's mean of site ``s`` per dimension, and ONE scale for the site: the root mean
    square of its centred dimensions (a per-dimension z-score would weight the stream's many
    low-variance dimensions as much as its informative ones; on EWT it lowered UUAS)."""
    x = train[:, s, :].astype(np.float64)
    mean = x.mean(0)
    scale = float(np.sqrt(((x - mean) ** 2).mean()))
    return mean, scale if scale > 0 else 1.0


def _site_x(raw: np.ndarray, s: int, stats: tuple) -> torch.Tensor:
    """Site ``s`` of ``raw`` centred and scaled with ``stats``, float32 ``[N, D]``."""
    mean, std = stats
    return torch.from_numpy(((raw[:, s, :].astype(np.float64) - mean) / std).astype(np.float32))


def _splits(got, task: str) -> dict:
    """``{split: TreeSplit}`` for train and test, refusing attention pooling and empty splits."""
    ext = got.for_task(task)
    if ext["train"].store.pooling == "attn":
        raise InputError(f"task {task!r} reads one vector per word: use pooling last, first or mean, not attn")
    out = {}
    for split in ("train", "test"):
        sp = tree_split(got.corpora[split], got.examples[task][split], ext[split])
        if len(sp) == 0:
            raise InputError(f"task {task!r}: no {split} sentence has a tree whose words all have activations")
        if sp.n_dropped:
            log.warning("task %r: %d %s sentence(s) left out: a word no subword covers", task, sp.n_dropped, split)
        out[split] = sp
    return out


def _fit_sites(splits: dict, ext: dict, settings: TreeSettings, resident_bytes: float, progress: bool) -> tuple:
    """``(scores, fits)``: each site's probe fitted on train and scored on test, the sites' rows
    read from the store a group at a time (:func:`_site_groups`)."""
    scores, fits = [], []
    store = ext["train"].store
    with progress_bar(store.n_sites, desc=f"{settings.kind} probes", unit="site", enabled=progress) as bar:
        for group in _site_groups(splits, store, resident_bytes):
            raw = {k: _site_feats(ext[k].store, sp, group) for k, sp in splits.items()}
            for s in range(raw["train"].shape[1]):
                stats = _scaler(raw["train"], s)
                fit = fit_tree_probe(_site_x(raw["train"], s, stats), splits["train"], settings)
                preds = tree_predictions(_site_x(raw["test"], s, stats), fit.B, splits["test"], settings.kind)
                scores.append(tree_scores(preds, splits["test"], settings.kind))
                fits.append(fit)
                bar.update(1)
    return scores, fits


def fit_tree_task(got, task: str, config: ProbeConfig, *, overlap_column: str, progress: bool = False) -> dict:
    """The task's tables from the extracted activations ``got`` (see the module docstring);
    ``overlap_column``: the summary column the number of train/test overlapping sentences goes in."""
    splits = _splits(got, task)
    ext = got.for_task(task)
    settings = TreeSettings(task, config.probe_rank, config.max_epochs, TREE_TOL, config.seed)
    scores, fits = _fit_sites(splits, ext, settings, RESIDENT_BYTES, progress)
    base = baseline_scores(splits["test"], task)
    df = tree_site_rows(task, got.frame, scores, base, fits)
    df["probe_rank"] = config.probe_rank
    df["pooling"] = ext["train"].store.pooling
    df["n_train"], df["n_test"] = len(splits["train"].rows), len(splits["test"].rows)
    df["n_train_sentences"], df["n_test_sentences"] = len(splits["train"]), len(splits["test"])
    summ = tree_summary(task, df, got.model.n_layers, config)
    summ[overlap_column] = got.n_overlap
    summ["context"] = got.context_of[task]
    summ["n_skipped_train"], summ["n_skipped_test"] = splits["train"].n_dropped, splits["test"].n_dropped
    return {"by_site": df, "summary": summ, "mixing": None}


def tree_site_rows(task: str, frame: pd.DataFrame, scores: list, base: dict, fits: list) -> pd.DataFrame:
    """One row per site: the task's scores, its baseline's, and how each site's probe trained."""
    df = frame.copy()
    df.insert(0, "task", task)
    for key in scores[0]:
        df[key] = [sc[key] for sc in scores]
    for key, v in base.items():
        df[f"baseline_{key}"] = v
    df["train_loss"] = [f.loss for f in fits]
    df["converged"] = [f.converged for f in fits]
    df["epochs"] = [f.epochs for f in fits]
    df["probe"] = "linear"
    return df


def tree_summary(task: str, df: pd.DataFrame, n_layers: int, config: ProbeConfig) -> dict:
    """The task's summary row: its best site by the main score, the score of the first site
    (the embedding) and of the baseline, training and data columns."""
    metric = MAIN_SCORE[task]
    score = df[metric].to_numpy(dtype=np.float64)
    best = int(np.nanargmax(score)) if np.isfinite(score).any() else 0
    conv = df["converged"].to_numpy(bool)
    return {
        "task": task,
        "kind": "tree",
        "best_metric": metric,
        "best_label": df["label"].iloc[best],
        "best_site": int(df["site"].iloc[best]),
        "best_depth": float(df["depth"].iloc[best]),
        "best_score": float(score[best]),
        "best_spearman": float(df["spearman"].iloc[best]),
        "first_site_score": float(score[0]),
        "baseline_score": float(df[f"baseline_{metric}"].iloc[0]),
        "baseline_spearman": float(df["baseline_spearman"].iloc[0]),
        "max_spearman": float(np.nanmax(df["spearman"])) if df["spearman"].notna().any() else float("nan"),
        "n_layers": n_layers,
        "relative_depth_best": float(df["depth"].iloc[best]) / n_layers,
        "n_train": int(df["n_train"].iloc[0]),
        "n_test": int(df["n_test"].iloc[0]),
        "n_train_sentences": int(df["n_train_sentences"].iloc[0]),
        "n_test_sentences": int(df["n_test_sentences"].iloc[0]),
        "probe": "linear",
        "probe_rank": config.probe_rank,
        "pooling": df["pooling"].iloc[0],
        "converged": bool(conv.all()),
        "hit_max_epochs": bool((~conv).any()),
        "n_not_converged": int((~conv).sum()),
        "max_epochs": config.max_epochs,
        "seed": config.seed,
        "solver": "adam",
    }
