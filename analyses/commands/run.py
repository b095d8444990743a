"""``depthscope run``: the main job (lens, norms, probes, one report). The options are the fields
of :class:`~depthscope.analyses.jobs.configs.ReportConfig` and the probe and data settings it holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from depthscope.analyses.commands.common import begin, prepare_store
from depthscope.analyses.commands.options import SHARED, command, opt, options
from depthscope.analyses.jobs.base import check_report_folder
from depthscope.analyses.jobs.configs import ReportConfig

EXTRA = (
    opt(
        "--data -d",
        None,
        "CoNLL-U files: TRAIN [TEST [DEV]] (repeat --data). Default: the bundled UD English EWT sample.",
        list[Path] | None,
    ),
    SHARED["out"].but(default=Path("depthscope-report"), help="Output folder."),
    opt("--text", None, "Plain text for the lens and norms (default: the probe data's sentences).", Path | None),
)
RUN = options(
    "model device dtype stream data out task text prompt target max_train_sentences max_test_sentences max_epochs "
    "stack_draws stack_folds stack_l2 precision probe_device seed threads lens_tokens norms_tokens causal "
    "causal_tokens resume force",
    ReportConfig,
    extra=EXTRA,
    helps={
        "max_train_sentences": "Cap probe train data at N sentences (whole documents, seeded).",
        "max_test_sentences": "Cap probe test data at N sentences.",
        "max_epochs": "Cap on passes over train for every probe (they train to convergence; as in depthscope probe).",
    },
)


def data_files(data: list[Path] | None) -> list[str]:
    """The ``--data`` files (TRAIN TEST [DEV], or none), each an existing file."""
    files = [str(p) for p in (data or [])]
    if len(files) == 1:
        raise typer.BadParameter("give at least a train and a test file: --data TRAIN --data TEST")
    if len(files) > 3:
        raise typer.BadParameter("at most three --data files: TRAIN TEST DEV")
    for f in files:
        if not Path(f).is_file():
            raise typer.BadParameter(f"no such file: {f}")
    return files


@command("run", RUN)
def run(o) -> None:
    """Run the logit lens, contribution norms and probes on one model and write tables, plots and
    a report (report.md, report.html) answering which depth encodes which property."""
    from depthscope.analyses.report.main_job import run_report  # lazy: it imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    files = data_files(o.data)
    check_report_folder(o.out, o.model, files, o.force)
    train, test, dev = (files + [None] * 3)[:3]
    model = {"model": o.model, "device": o.device, "dtype": o.dtype, "stream": o.stream}
    # a killed run's folder takes only a run of the same model and data
    identity = {"train": train or "bundled", "test": test or "bundled"}
    cfg = begin(o, ReportConfig, "run", identity, **model, train=train, test=test, dev=dev)
    prepare_store()  # the probes' activation store in the cache
    if o.text:
        cfg = dataclasses.replace(cfg, texts=read_documents(o.text))
    path = run_report(o.out, cfg)
    typer.echo(f"report: {path}\nmarkdown: {o.out / 'report.md'}")
