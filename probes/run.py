"""``run_probes``: the whole probing method, tasks in, tidy tables out.

>>> from depthscope.probes import ProbeConfig, run_probes, sample_data
>>> paths = sample_data()
>>> res = run_probes(None, ["upos", "deprel"], paths["ewt_train"], paths["ewt_test"])
>>> res = run_probes(None, "upos", paths["ewt_train"], paths["ewt_test"], config=ProbeConfig(max_epochs=60))
>>> res = run_probes(None, "upos", paths["ewt_train"], paths["ewt_test"], max_epochs=60, pooling="mean")
>>> res.by_site.columns   # task, site, label, layer, sublayer, depth, accuracy, macro_f1, ...
>>> res.summary           # task, expected_layer_delta, expected_layer_mix, best_label, ...

Settings come in three configuration objects (:mod:`depthscope.probes.config`): ``config``
(:class:`ProbeConfig`), ``extraction`` (:class:`ExtractionConfig`) and ``data``
(:class:`DataConfig`); loose keyword settings (``max_epochs=60``, ``pooling="mean"``) override
their fields, and a name no config has is an :class:`InputError`. Writing the tables and
figures is the probe job's (``depthscope.analyses.jobs.probe``), not this package's.

Flow: corpora (CoNLL-U or jiant JSONL, capped by whole documents) -> task examples -> for
each split and context mode, the union of all tasks' spans -> ONE batched extraction into an
on-disk store (reused on re-runs; :mod:`.extraction`) -> per task: labels encoded and
features standardised (:mod:`.encoding`), per-site probes with the task's labels and its
control labels as two heads of one batched fit, then cumulative scoring (the per-site probes
stacked on out-of-fold predictions, a convex fit) giving Delta and E_Delta, and the all-sites
scalar mix giving E_s (:mod:`.fitting`, :mod:`.mixing`) -> tables
(:mod:`.summaries`).

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
  ``n_overlap_dropped``; ``"keep"`` only warns and reports ``n_overlap``; ``"error"`` raises;
* an unknown setting, or a value outside a setting's choices: :class:`InputError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd
import torch

from depthscope.common.errors import InputError
from depthscope.common.resume import Stages, file_digests, stage_key
from depthscope.common.runtime import release_memory
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig, override, probe_device
from depthscope.probes.corpora.tasks import is_tree_task, pipeline_rank
from depthscope.probes.encoding import TaskData, encode_task
from depthscope.probes.fitting import FitOptions, fit_task
from depthscope.probes.solvers.cpu import resolve_precision
from depthscope.probes.store.extraction import Splits, load_and_extract
from depthscope.probes.structural_task import fit_tree_task, task_probes
from depthscope.probes.summaries import tables

log = logging.getLogger("depthscope.probes")


@dataclass
class ProbeResults:
    """``by_site`` (one row per task and site), ``summary`` (one row per task), ``mixing``
    (one row per task and site: scalar-mix weight, cumulative score, Delta) and ``info``."""

    by_site: pd.DataFrame
    summary: pd.DataFrame
    mixing: pd.DataFrame
    info: dict = field(default_factory=dict)


def task_list(tasks) -> list:
    """Task names from a list or a comma-separated string, duplicates dropped, order kept."""
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    tasks = list(dict.fromkeys(tasks or []))
    if not tasks:
        raise InputError("no tasks given")
    return tasks


def resolve_configs(
    config: ProbeConfig | None = None,
    extraction: ExtractionConfig | None = None,
    data: DataConfig | None = None,
    **overrides,
) -> tuple:
    """``(ProbeConfig, ExtractionConfig, DataConfig)``: the given objects (defaults where
    None) with loose ``overrides`` applied to the fields they name, validated."""
    configs = [config or ProbeConfig(), extraction or ExtractionConfig(), data or DataConfig()]
    for c, cls in zip(configs, (ProbeConfig, ExtractionConfig, DataConfig)):
        if not isinstance(c, cls):
            raise InputError(f"expected a {cls.__name__}, got {type(c).__name__}")
    return tuple(c.validate() for c in override(configs, overrides))


def dropped_note(td, max_tokens: int) -> str | None:
    """One sentence on the data a task loses: spans no subword covers (or cut off by the
    ``max_tokens`` context) per split, and test examples whose label train never has (the probe
    cannot predict them: they count as errors). None when nothing is lost."""
    parts = []
    skipped = {s: n for s, n in td.skipped.items() if n}
    if skipped:
        where = ", ".join(f"{n} of {n + len(td.examples[s].labels)} {s}" for s, n in skipped.items())
        parts.append(f"{where} spans skipped (no subword covers them, or past the {max_tokens}-token context)")
    unseen = td.y["test"] >= td.n_classes
    if unseen.any():
        labels = sorted({str(x) for x in np.asarray(td.examples["test"].labels)[unseen]})
        shown = ", ".join(labels[:5]) + (", ..." if len(labels) > 5 else "")
        parts.append(
            f"{int(unseen.sum())} test example(s) carry {len(labels)} label(s) unseen in train ({shown}); "
            f"they count as errors"
        )
    return f"task {td.task!r}: " + "; ".join(parts) if parts else None


def run_probes(
    model,
    tasks,
    train,
    test,
    dev=None,
    *,
    config: ProbeConfig | None = None,
    extraction: ExtractionConfig | None = None,
    data: DataConfig | None = None,
    progress: bool = True,
    stages: Stages | None = None,
    **overrides,
) -> ProbeResults:
    """Probe every site of ``model`` for each task; see the module docstring.

    ``model``: a HookedModel or a spec for ``load_model`` (None = the default model).
    ``tasks``: names (``upos``, ``xpos``, ``feats:Number``, ``deprel``, ``deprel:base``,
    ``structural``, ``depth`` (:mod:`.structural`), ``entity``, ``coref``; any name for a jiant
    ``.jsonl``), a list or a comma-separated
    string. ``train``/``test``/``dev``: CoNLL-U or jiant JSONL paths, or parsed
    :class:`Corpus` objects. ``config`` / ``extraction`` / ``data``: the settings (None: the
    defaults); ``**overrides``: any of their fields by name. ``stages``: the records of an output
    folder (:class:`~depthscope.common.resume.Stages`): each task's tables are kept there as it
    finishes, and a task whose model, data, settings and code are those of a kept one is read
    back instead of fitted again (its ``seconds_fit`` is 0 and ``info["reused"]`` names it).
    """
    t_start = time.perf_counter()
    tasks = task_list(tasks)
    cfg, ext, dat = resolve_configs(config, extraction, data, **overrides)
    if cfg.l2 == "dev" and dev is None:
        raise InputError("l2='dev' picks the penalty on a dev split: pass dev=")
    run = _Run(cfg, ext, dat, resolve_precision(cfg.precision), progress, probe_device(cfg.device))
    kinds = {t: task_probes(t, cfg.probe) for t in tasks}  # probe="both": each task with each kind
    got = load_and_extract(model, tasks, Splits(train, test, dev), ext, dat, seed=cfg.seed, progress=progress)
    release_memory(collect=True)  # a model loaded from a spec or a loader is no longer held: its memory goes back
    by_site, summary, mixing = [], [], []
    fit_seconds, reused = {}, []
    stages = stages or Stages(None)
    sources = file_digests(Splits(train, test, dev)._asdict()) if stages else None  # None: nothing kept
    order = sorted(tasks, key=lambda t: (pipeline_rank(t), tasks.index(t)))
    for task, kind in [(t, k) for t in order for k in kinds[t]]:
        t0 = time.perf_counter()
        name = task if len(kinds[task]) == 1 else f"{task}/{kind}"
        rows, kept = _task_rows(replace(run, cfg=replace(cfg, probe=kind)), got, task, name, stages, sources)
        by_site.append(rows["by_site"])
        summary.append(rows["summary"])
        if rows["mixing"] is not None:
            mixing.append(rows["mixing"].assign(probe=kind))
        reused += [name] if kept else []
        fit_seconds[name] = 0.0 if kept else time.perf_counter() - t0
    info = {**_run_info(got, run, fit_seconds, t_start), "reused": reused}
    return ProbeResults(*tables(by_site, summary, mixing), info)


def _task_rows(run: _Run, got, task: str, name: str, stages: Stages, sources: dict | None) -> tuple:
    """``(rows, reused)``: one task's rows read back from ``stages`` when a run kept them with the
    same key (:func:`_task_key`), else fitted (:func:`_probe_task`) and kept there."""
    key = _task_key(run, got, task, sources) if sources is not None else None
    rows = _kept_rows(stages.tables(f"probes {name}", key)) if key else None
    if rows is not None:
        log.info("probes %s: reused from an earlier run in %s", name, stages.folder)
        return rows, True
    rows = _probe_task(run, got, task)
    if key:
        stages.keep_tables(f"probes {name}", key, _rows_tables(rows))
    return rows, False


def _task_key(run: _Run, got, task: str, sources: dict) -> str:
    """What one task's tables depend on: the data files' contents, the activation stores (each
    keyed by the model's weights, the token ids and the spans), the settings, the features'
    precision and device, and the code (:func:`~depthscope.common.resume.stage_key`)."""
    extractions = (
        got.extractions
        if task not in got.context_of
        else {(s, got.context_of[task]): ext for s, ext in got.for_task(task).items()}
    )
    stores = {f"{s}/{c}": ext.store.path.name for (s, c), ext in extractions.items()}
    return stage_key(
        task=task,
        sources=sources,
        stores=stores,
        model=got.model.name,
        probe=asdict(run.cfg),
        extraction=asdict(run.ext),
        data=asdict(run.dat),
        dtype=str(run.dtype),
        device=str(run.device),
    )


def _rows_tables(rows: dict) -> dict:
    """One task's rows as tables to keep: its summary (a dict) as a one-row table."""
    return {"by_site": rows["by_site"], "summary": pd.DataFrame([rows["summary"]]), "mixing": rows["mixing"]}


def _kept_rows(kept: dict | None) -> dict | None:
    """The rows :func:`_rows_tables` kept, as :func:`_probe_task` returns them."""
    if kept is None or kept.get("by_site") is None or kept.get("summary") is None or len(kept["summary"]) != 1:
        return None
    return {"by_site": kept["by_site"], "summary": kept["summary"].iloc[0].to_dict(), "mixing": kept.get("mixing")}


@dataclass(frozen=True)
class _Run:
    """The settings of one :func:`run_probes` call, resolved: the three configs, the features'
    precision, whether progress is shown and where the resident features live."""

    cfg: ProbeConfig
    ext: ExtractionConfig
    dat: DataConfig
    dtype: torch.dtype
    progress: bool
    device: torch.device = torch.device("cpu")


def _probe_task(run: _Run, got, task: str) -> dict:
    """One task's rows (:func:`~depthscope.probes.fitting.fit_task`) from the extracted
    activations ``got``: labels and features encoded, the data it loses announced, and the
    run-level columns (train/test overlap, context) added to its summary."""
    cfg, ext = run.cfg, run.ext
    if is_tree_task(task):  # Hewitt & Manning's structural probes: whole trees, their own fit
        overlap = "n_overlap_dropped" if run.dat.overlap == "drop" else "n_overlap"
        return fit_tree_task(got, task, cfg, overlap_column=overlap, progress=run.progress)
    by_split = got.for_task(task)
    td = encode_task(
        task,
        got.examples[task],
        by_split,
        seed=cfg.seed,
        resident_bytes=ext.resident_bytes,
        dtype=run.dtype,
        device=run.device,
        stream=("test",),  # only the final predictions read test: one pass over the store, no copy in memory
    )
    ctx = got.model.max_context  # passages were cut at the smaller of max_tokens and the model's context
    note = dropped_note(td, min(ext.max_tokens, ctx) if ctx else ext.max_tokens)
    if note:
        log.warning(note)
    options = FitOptions(
        pooling=by_split["train"].store.pooling,
        resident_bytes=ext.resident_bytes,
        dtype=run.dtype,
        progress=run.progress,
    )
    rows = fit_task(td, got.frame, got.model.n_layers, cfg, options)
    rows["summary"]["n_overlap_dropped" if run.dat.overlap == "drop" else "n_overlap"] = got.n_overlap
    rows["summary"]["context"] = got.context_of[task]
    return rows


def _run_info(got, run: _Run, fit_seconds: dict, t_start: float) -> dict:
    """``ProbeResults.info``: the model, its sites, the precision and device of the resident
    features, the activation stores (and whether they were reused), the extraction's size and
    the time each stage took."""
    stores = got.extractions.items()
    return {
        "model": got.model.name,
        "n_layers": got.model.n_layers,
        "sites": got.sites,
        "precision": str(run.dtype).replace("torch.", ""),
        "probe_device": str(run.device),
        "stores": {f"{k[0]}/{k[1]}": str(v.store.path) for k, v in stores},
        "stores_reused": {f"{k[0]}/{k[1]}": v.store.reused for k, v in stores},
        "extraction_tokens": {f"{k[0]}/{k[1]}": v.store.meta.get("n_tokens_run") for k, v in stores},
        "seconds_extract": got.seconds,
        "seconds_fit": fit_seconds,
        "seconds_total": time.perf_counter() - t_start,
        "n_sentences": {k: len(v) for k, v in got.corpora.items()},
    }


def prepare_task(
    model,
    task: str,
    train,
    test,
    dev=None,
    *,
    config: ProbeConfig | None = None,
    extraction: ExtractionConfig | None = None,
    data: DataConfig | None = None,
    progress: bool = True,
    stream: tuple = (),
    **overrides,
) -> TaskData:
    """One task's :class:`TaskData` (labels, control labels, standardised features per split)
    without fitting anything: for benchmarks and custom probes. Settings as in
    :func:`run_probes`; ``stream``: splits left in the store and read when used (as
    ``run_probes`` reads ``("test",)``), the others held in memory."""
    cfg, ext, dat = resolve_configs(config, extraction, data, **overrides)
    got = load_and_extract(model, [task], Splits(train, test, dev), ext, dat, seed=cfg.seed, progress=progress)
    return encode_task(
        task,
        got.examples[task],
        got.for_task(task),
        seed=cfg.seed,
        resident_bytes=ext.resident_bytes,
        dtype=resolve_precision(cfg.precision),
        device=probe_device(cfg.device),
        stream=tuple(stream),
    )
