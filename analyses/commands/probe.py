"""``depthscope probe``: Tenney-style probing at every residual site. The options are the fields of
:class:`~depthscope.analyses.jobs.configs.ProbeJobConfig` and the probe, extraction and data
configurations it holds; the work is :func:`~depthscope.analyses.jobs.probe.run_probe_job`."""

from __future__ import annotations

import typer
from rich.console import Console

from depthscope.analyses.commands.common import begin, loader, prepare_store, show
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import ProbeJobConfig
from depthscope.common.settings import build

PROBE = options(
    "task train test dev model device dtype stream probe probe_rank pooling sites max_train_sentences "
    "max_test_sentences max_dev_sentences context l2 max_epochs stack_draws stack_folds stack_l2 mix_folds mix_starts "
    "precision probe_device mdl overlap store_dir store_dtype bos shards engine workers seed threads plots out resume "
    "force",
    ProbeJobConfig,
)


def job_config(values) -> ProbeJobConfig:
    """The :class:`ProbeJobConfig` that the command's option ``values`` (by option name) describe."""
    return build(ProbeJobConfig, values)


@command("probe", PROBE)
def probe(o) -> None:
    """Probe which depth encodes which property (Tenney et al. 2019): per-site accuracy, control-task
    selectivity, scalar-mix E_s and cumulative-scoring E_Delta, for each TASK.

    Writes OUT/probes_by_site.csv|parquet, probes_summary.csv|parquet, probes_mixing.csv|parquet,
    probes_accuracy.png and probes_tenney.png.
    """
    from depthscope.analyses.jobs import probe as jobs  # lazy: the job imports torch

    cfg = begin(o, ProbeJobConfig, "probe", {"train": str(o.train), "test": str(o.test)})
    prepare_store(o.store_dir)
    result = jobs.run_probe_job(loader(o), cfg, Output(o.out), progress=True)  # loads once the data are checked
    summary = result.tables["probes_summary"]
    show(jobs.summary_table(summary))
    for line in jobs.convergence_warnings(summary):
        Console(stderr=True).print(f"[yellow]warning:[/] {line}")
    typer.echo(f"precision: {result.summary['precision']}")
    if result.summary["reused"]:
        typer.echo(
            f"reused from an earlier run in {o.out} (same model, data, settings and code): "
            f"{', '.join(result.summary['reused'])}; --no-resume computes them again"
        )
    show(None, result.files)
