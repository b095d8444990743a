"""``depthscope run``: the main job (lens, norms, probes, one report). The probe options are the
fields of :class:`~depthscope.probes.config.ProbeConfig` and :class:`~depthscope.probes.config.DataConfig`."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.commands.common import prepare_out, set_threads
from depthscope.analyses.commands.options import SHARED, command, opt, options
from depthscope.analyses.jobs.base import check_report_folder
from depthscope.common.settings import build, comma_list
from depthscope.probes.config import DataConfig, ProbeConfig

EXTRA = (
    opt(
        "--data -d",
        None,
        "CoNLL-U files: TRAIN [TEST [DEV]] (repeat --data). Default: the bundled UD English EWT sample.",
        list[Path] | None,
    ),
    SHARED["out"].but(default=Path("depthscope-report"), help="Output folder."),
    opt(
        "--task -t",
        None,
        "Probe tasks, comma-separated (default: upos,deprel,feats:Number; +entity,coref with GUM data).",
        str | None,
    ),
    opt("--text", None, "Plain text for the lens and norms (default: the probe data's sentences).", Path | None),
    opt("--prompt", "The capital of France is", "Prompt for the per-token views and DLA."),
    opt("--target", " Paris", "Target token for DLA."),
    opt("--lens-tokens", 1500, "Tokens of text for the logit lens.", min=1),
    opt("--norms-tokens", 4000, "Tokens of text for contribution norms.", min=1),
)
RUN = options(
    "model device dtype data out task text prompt target max_train_sentences max_test_sentences max_epochs "
    "stack_draws stack_folds stack_l2 seed threads lens_tokens norms_tokens force",
    ProbeConfig,
    DataConfig,
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


def run(o) -> None:
    """Run the logit lens, contribution norms and probes on one model and write tables, plots and
    a report (report.md, report.html) answering which depth encodes which property."""
    from depthscope.analyses.report import ReportConfig, run_report  # lazy: it imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    set_threads(o.threads)
    files = data_files(o.data)
    check_report_folder(o.out, o.model, files, o.force)
    probe, data = build(ProbeConfig, o), build(DataConfig, o)
    prepare_out(o.out, "run", None, o.force)
    train, test, dev = (files + [None] * 3)[:3]
    cfg = ReportConfig(
        model=o.model,
        device=o.device,
        dtype=o.dtype,
        train=train,
        test=test,
        dev=dev,
        texts=read_documents(o.text) if o.text else None,
        tasks=comma_list(o.task),
        prompt=o.prompt,
        target=o.target,
        lens_tokens=o.lens_tokens,
        norms_tokens=o.norms_tokens,
        probe=probe,
        data=data,
    )
    path = run_report(o.out, cfg)
    typer.echo(f"report: {path}\nmarkdown: {o.out / 'report.md'}")


def register(app: typer.Typer) -> None:
    command(app, "run", RUN)(run)
