"""The probe job: run the probes from one configuration and write their tables and figures, once each.

=================================  ===========================================================
``ProbeJobConfig``                 (in :mod:`depthscope.analyses.jobs.configs`) tasks and data
                                   files (None: the defaults below) plus the probe, extraction
                                   and data settings of :mod:`depthscope.probes.config` (their
                                   defaults are the only defaults) and whether to draw figures
``run_probe_job(model, config,     runs :func:`depthscope.probes.run_probes` and writes
out, progress=)``                  ``probes_by_site``, ``probes_summary``, ``probes_mixing``
                                   (Parquet + CSV) and ``probes_overview.png``,
                                   ``probes_accuracy.png``, ``probes_tenney.png`` through ``out``; a :class:`JobResult`;
                                   each task's tables are kept in ``out`` as it finishes and reused
                                   by a rerun with the same inputs (``config.resume``)
``write_outputs(results, out,      the writing half: the three tables and two figures of a
plots=)``                          :class:`~depthscope.probes.ProbeResults` (the only writer)
``resolve_inputs(config)``         the tasks and files a config means
``summary_table(summary)``,        the console table of ``probes_summary`` and the warnings
``convergence_warnings(summary)``  of probes stopped at the epoch cap (``depthscope probe``)
=================================  ===========================================================

Defaults: tasks ``upos, deprel, feats:Number``, plus ``entity, coref`` when train and test carry
GUM ``Entity=`` annotation; data: the bundled sample (GUM when entity or coref is asked for,
else EWT). ``depthscope probe`` and ``depthscope run`` both call :func:`run_probe_job`.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import ProbeJobConfig
from depthscope.analyses.probing.plots import plot_overview, plot_probe_curves, plot_tenney
from depthscope.common.resume import Stages
from depthscope.probes import run_probes, sample_data
from depthscope.probes.run import task_list

DEFAULT_TASKS = ("upos", "deprel", "feats:Number")
ENTITY_TASKS = ("entity", "coref")
TABLES = ("probes_by_site", "probes_summary", "probes_mixing")
FIGURES = ("probes_overview", "probes_accuracy", "probes_tenney")


def has_entities(path: str | Path) -> bool:
    """True when a CoNLL-U file carries GUM ``Entity=`` annotation (in its first 5000 lines)."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if "Entity=" in line:
                return True
            if i > 5000:
                return False
    return False


def resolve_inputs(config: ProbeJobConfig) -> tuple:
    """``(tasks, train, test)`` with the defaults of the module docstring filled in."""
    tasks = task_list(config.tasks) if config.tasks else None
    train, test = config.train, config.test
    if train is None or test is None:
        sample = sample_data()
        gum = tasks is not None and any(t.split(":")[0] in ENTITY_TASKS for t in tasks)
        train = train or sample["gum_train" if gum else "ewt_train"]
        test = test or sample["gum_test" if gum else "ewt_test"]
    if tasks is None:
        tasks = list(DEFAULT_TASKS)
        if all(isinstance(p, (str, Path)) and Path(p).is_file() and has_entities(p) for p in (train, test)):
            tasks += list(ENTITY_TASKS)
    return tasks, train, test


def write_outputs(results, out: Output, *, plots: bool = True) -> dict:
    """Write ``results``' tables (:data:`TABLES`) and, with ``plots``, figures (:data:`FIGURES`)
    through ``out``; returns the tables by name."""
    tables = dict(zip(TABLES, (results.by_site, results.summary, results.mixing)))
    for name, df in tables.items():
        out.table(df, name)
    if plots:
        out.figure(plot_overview, results.summary, name="probes_overview")
        out.figure(plot_probe_curves, results.by_site, name="probes_accuracy")
        out.figure(plot_tenney, results.summary, results.mixing, name="probes_tenney")
    else:  # an earlier run's figures must not pass for this run's
        out.drop("probes_overview", "probes_accuracy", "probes_tenney")
    return tables


def run_probe_job(
    model, config: ProbeJobConfig | None = None, out: Output | None = None, *, progress: bool = True
) -> JobResult:
    """Probe every site of ``model`` (a HookedModel or a spec) and write the probe tables and
    figures; ``out`` None (or ``Output(None)``) computes without writing. Each task's tables are
    kept in ``out``'s folder as it finishes; with ``config.resume`` (the default) those an earlier
    run kept with the same inputs are reused (:mod:`depthscope.common.resume`)."""
    cfg = config or ProbeJobConfig()
    out = out if out is not None else Output(None)
    stages = Stages(out.folder, reuse=cfg.resume)
    tasks, train, test = resolve_inputs(cfg)
    n_before = len(out.written)
    res = run_probes(
        model,
        tasks,
        train,
        test,
        cfg.dev,
        config=cfg.probe,
        extraction=cfg.extraction,
        data=cfg.data,
        progress=progress,
        stages=stages,
    )
    tables = write_outputs(res, out, plots=cfg.plots)
    info = res.info
    summary = {
        "tasks": tasks,
        "train": str(train) if isinstance(train, (str, Path)) else repr(train),
        "test": str(test) if isinstance(test, (str, Path)) else repr(test),
        "model": info.get("model"),
        "precision": info.get("precision"),
        "probe_device": info.get("probe_device"),
        "seconds_extract": info.get("seconds_extract"),
        "seconds_total": info.get("seconds_total"),
        "reused": info.get("reused", []),
    }
    return JobResult(tables=tables, summary=summary, files=list(out.written[n_before:]))


SUMMARY_COLUMNS = (
    "task",
    "n_train",
    "n_test",
    "best site",
    "best acc",
    "max sel. (pts)",
    "E_Delta [95%]",
    "argmax E_Delta",
    "E_s",
    "L2",
    "converged",
)


def _tree_row(r) -> list[str]:
    """A structural-probe task's row of :func:`summary_table`: its main score (UUAS or root
    accuracy) at the best site, beside the baseline's, where the accuracy columns are."""
    conv = "yes" if r.converged else f"NO ({r.n_not_converged} at max_epochs={r.max_epochs})"
    score = f"{r.best_metric} {r.best_score:.3f} (baseline {r.baseline_score:.3f})"
    return [r.task, str(r.n_train), str(r.n_test), str(r.best_label), score, "", "", "", "", "", conv]


def _summary_row(r) -> list[str]:
    """One task's row of :func:`summary_table`."""
    if getattr(r, "kind", "") == "tree":
        return _tree_row(r)
    lo, hi = r.expected_layer_delta_lo, r.expected_layer_delta_hi  # always in a fresh summary
    e = f"{r.expected_layer_delta:.2f} [{lo:.1f}-{hi:.1f}]"
    e += "" if r.expected_layer_delta_meaningful else " (gain too small)"
    conv = "yes" if r.converged else f"NO ({r.n_not_converged} at max_epochs={r.max_epochs})"
    return [
        r.task if getattr(r, "probe", "linear") == "linear" else f"{r.task} ({r.probe})",
        str(r.n_train),
        str(r.n_test),
        str(r.best_label),
        f"{r.best_accuracy:.3f}",
        f"{100 * r.max_selectivity:.1f}",
        e,
        f"{getattr(r, 'expected_layer_delta_hard', float('nan')):.2f}",
        f"{r.expected_layer_mix:.2f}",
        f"{r.l2:g}",
        conv,
    ]


def summary_table(summary) -> Table:
    """The console table of ``probes_summary``, one row per task (``depthscope probe`` prints it)."""
    table = Table(*SUMMARY_COLUMNS)
    for col in table.columns:
        col.no_wrap = True
    for r in summary.itertuples():
        table.add_row(*_summary_row(r))
    return table


def convergence_warnings(summary) -> list[str]:
    """One line per task whose probes stopped at the epoch cap before converging."""
    return [
        f"{r.task}: {r.n_not_converged} probe(s) stopped at --max-epochs {r.max_epochs} before converging; "
        f"raise --max-epochs"
        for r in summary.itertuples()
        if not r.converged
    ]
