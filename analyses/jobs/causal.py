"""The causal job: LEACE erasure at every site, its effect on probes and on the model's loss, written once.

=================================  ===========================================================
``CausalConfig``                   (in :mod:`depthscope.analyses.causal.erasure.config`) tasks, data,
                                   held-out text, controls, bootstrap and the probe settings
``causal_job(model, config, out,   runs :func:`~depthscope.analyses.causal.erasure.used.causal_tests` and
progress=)``                       writes ``causal`` (Parquet + CSV), ``causal_summary.json``
                                   (with the table's notes) and ``causal_encoded_used.png``
                                   through ``out``; a :class:`JobResult`;
                                   each finished site's losses are kept in
                                   ``causal_sites/`` (a rerun resumes)
``report_causal(model, probe_job,   the report's causal section (``depthscope run --causal``):
max_text_tokens, out, progress=)`` :func:`causal_job` on the probe job's data and its
                                   one-span tasks, loss on ``max_text_tokens`` test tokens
``summary_table(table)``           the console table (``depthscope causal``): per task the
                                   sites where the concept is most encoded and most used (its
                                   interval and n, or why there is none), and the worst gap
                                   between erased accuracy and majority
=================================  ===========================================================

``depthscope causal`` and ``depthscope run --causal`` both call :func:`causal_job`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from rich.table import Table

from depthscope.analyses.causal.erasure.config import WORD_POOLINGS, CausalConfig
from depthscope.analyses.causal.erasure.plots import plot_causal
from depthscope.analyses.causal.erasure.used import causal_tests
from depthscope.analyses.intervals import too_few
from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import ProbeJobConfig
from depthscope.analyses.jobs.probe import resolve_inputs
from depthscope.probes.corpora.tasks import task_family

TABLE = "causal"
FIGURE = "causal_encoded_used"
#: task families with one span per example (LEACE erases one label per word vector)
WORD_FAMILIES = ("upos", "xpos", "feats", "entity")


def causal_job(
    model, config: CausalConfig | None = None, out: Output | None = None, *, progress: bool = True
) -> JobResult:
    """Encoded vs used at every site of ``model`` (a HookedModel, a spec, or a loader); ``out``
    None (or ``Output(None)``) computes without writing."""
    cfg = config or CausalConfig()
    out = out if out is not None else Output(None)
    n_before = len(out.written)
    records = out.folder / "causal_sites" if out.folder is not None else None  # a rerun resumes
    res = causal_tests(model, cfg, progress=progress, records=records)
    out.table(res.table, TABLE)
    summary = {**res.info, "config": cfg.to_dict()}
    out.json(summary, "causal_summary")
    if cfg.plots:
        out.figure(plot_causal, res.table, name=FIGURE)
    else:  # an earlier run's figure must not pass for this run's
        out.drop(FIGURE)
    return JobResult(tables={TABLE: res.table}, summary=summary, files=list(out.written[n_before:]))


def report_causal(
    model, probe_job: ProbeJobConfig, max_text_tokens: int, out: Output, *, progress: bool = True
) -> JobResult | None:
    """:func:`causal_job` for the report: the probe job's data files and settings (a linear probe),
    its one-span tasks (:data:`WORD_FAMILIES`; None when it has none; an ``attn`` pooling read as
    ``last``), the loss on the first ``max_text_tokens`` predicted tokens of the test sentences."""
    tasks, train, test = resolve_inputs(probe_job)
    words = [t for t in tasks if task_family(t) in WORD_FAMILIES]
    if not words:
        return None
    ext = probe_job.extraction
    cfg = CausalConfig(
        tasks=words,
        train=train,
        test=test,
        max_text_tokens=max_text_tokens,
        probe=replace(probe_job.probe, probe="linear"),
        extraction=ext if ext.pooling in WORD_POOLINGS else replace(ext, pooling="last"),
        data=probe_job.data,
    )
    return causal_job(model, cfg, out, progress=progress)


def summary_table(table) -> Table:
    """Per task: the best-probed site, the most-used site (with its interval), and the largest
    ``|accuracy_erased - majority|`` over sites (LEACE's check)."""
    t = Table("task", "sites", "best acc (site)", "most used (site) [95%]", "max |erased - majority|")
    for task, d in table.groupby("task", sort=False):
        best = d.loc[d["accuracy"].idxmax()]
        used = d.loc[d["used"].idxmax()]
        gap = (d["accuracy_erased"] - d["majority"]).abs().max()
        t.add_row(
            str(task),
            str(len(d)),
            f"{best['accuracy']:.3f} ({best['label']})",
            f"{used['used']:+.4f} ({used['label']}) {_interval(used)}",
            f"{gap:.3f}",
        )
    return t


def _interval(row) -> str:
    """``[lo, hi] (n documents)``, or why there is none (no brackets: rich reads ``[word...]`` as markup)."""
    n = row.get("ci_n", row.get("n_lm_docs"))
    if np.isfinite(row["used_lo"]) and np.isfinite(row["used_hi"]):
        return f"[{row['used_lo']:+.4f}, {row['used_hi']:+.4f}] ({n} documents)"
    return f"no interval ({n} documents)" if n is not None and too_few(int(n)) else "no interval"
