"""``depthscope localize``: which depth carries a variable the model computes with: interchange
interventions or DAS per residual site and named position on counterfactual examples; the options
are the fields of :class:`~depthscope.analyses.causal.config.LocalizeConfig`, the work is
:func:`~depthscope.analyses.jobs.localize.localize_job`."""

from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console

from depthscope.analyses.causal.config import LocalizeConfig
from depthscope.analyses.commands import common
from depthscope.analyses.commands.common import prepare_out, set_threads
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.common.settings import build

LOCALIZE = options(
    "examples test train_fraction method dim boundless sites positions epochs lr batch_size seed probe_task "
    "probe_sentences model device dtype threads plots out force",
    LocalizeConfig,
    required="examples",
)


def localize(o) -> None:
    """Interchange intervention accuracy (IIA) per depth: at each residual site and named position,
    put the source's vector (--method interchange) or its part in a learned subspace (--method das,
    --dim directions; --boundless) into the base and count how often the prediction over the
    candidates becomes the label, on held-out examples (--test, or a seeded split).

    Writes OUT/localize.csv|parquet, localize_summary.json, localize_iia.png; DAS also
    subspaces.safetensors; --probe-task adds localize_probes.csv|parquet and
    localize_three_curves.png (decodable, needed, computed with).
    """
    from depthscope.analyses.jobs import localize as jobs  # lazy: the job imports torch

    set_threads(o.threads)
    cfg = build(LocalizeConfig, o)  # reads and checks every example before the model loads
    identity = {"model": o.model or "default", "examples": str(o.examples), "method": o.method}
    prepare_out(o.out, "localize", identity, o.force)
    loader = functools.partial(common.load, o.model, o.device, o.dtype)
    result = jobs.localize_job(loader, cfg, Output(o.out), progress=True)
    Console(width=None if sys.stdout.isatty() else 160).print(jobs.summary_table(result.tables[jobs.TABLE]))
    for p in result.files:
        typer.echo(f"wrote {p}")


def register(app: typer.Typer) -> None:
    command(app, "localize", LOCALIZE)(localize)
