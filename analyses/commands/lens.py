"""``depthscope lens`` (logit lens / tuned lens over a text file: tables and plots) and
``depthscope lens-train`` (train a tuned lens on a text file): the options are the fields of
:class:`LensConfig` and :class:`LensTrainConfig`; the work is :mod:`depthscope.analyses.jobs.lens`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from depthscope.analyses.commands.common import begin, load_model, show
from depthscope.analyses.commands.options import SHARED, command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import LensConfig, LensTrainConfig

LENS = options(
    "text model device dtype stream prompt out per_line max_tokens max_docs batch_size window stride bos tuned sites "
    "first_position top_k threads force",
    LensConfig,
)
LENS_TRAIN = options(
    "text out model device dtype steps tokens_per_step cache_tokens lr weight_lr per_line sites resume "
    "checkpoint_every eval_tokens threads",
    LensTrainConfig,
    extra=(
        SHARED["text"].but(help="Plain-text training file (UTF-8)."),
        SHARED["out"].but(default=Path("tuned-lens"), help="Folder for the tuned lens and its training checkpoint."),
        SHARED["per_line"].but(help="One document per line (default) or the whole file."),
    ),
)


@command("lens", LENS)
def lens(o) -> None:
    """Logit lens at every sublayer over TEXT: per-site table (KL to the final distribution,
    cross-entropy, entropy, top-1 agreement/accuracy, next-token rank), the prompt's per-token
    table, and plots (metrics vs depth, top-1 heatmap, rank trajectories), written to OUT."""
    from depthscope.analyses.jobs.lens import lens_job, sites_table  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    console = Console(stderr=True)
    docs = read_documents(o.text, per_line=o.per_line)
    cfg = begin(o, LensConfig, "lens", {"text": str(o.text)}, source=o.text.name, progress=True)
    m = load_model(o)
    m.unembed.check()
    tuned = f"; tuned lens: {o.tuned}" if o.tuned else ""
    console.print(f"logit lens: {m.name}, {len(docs)} document(s) from {o.text}{tuned}")
    res = lens_job(m, docs, cfg, Output(o.out))
    if res.summary.get("split_note"):
        console.print(res.summary["split_note"])
    show(sites_table(res.tables["lens_by_site"]), res.files)


@command("lens-train", LENS_TRAIN)
def lens_train(o) -> None:
    """Train a tuned lens (Belrose et al. 2023) at every sublayer site on TEXT, on the CPU:
    bounded steps, a progress bar, checkpoints every --checkpoint-every steps (rerun to resume).
    Then compare its KL to the final distribution with the plain logit lens on held-out text."""
    from depthscope.analyses.jobs.lens import lens_train_job, train_lines  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    docs = read_documents(o.text, per_line=o.per_line)
    cfg = begin(o, LensTrainConfig, "lens-train")  # any lens-train may reuse the folder: it may hold a checkpoint
    m = load_model(o)
    m.unembed.check()
    Console(stderr=True).print(
        f"training a tuned lens for {m.name} on {o.text}; {o.steps} steps x {o.tokens_per_step} tokens; "
        f"checkpoints in {o.out}"
    )
    res = lens_train_job(m, docs, cfg, o.out)
    for line in train_lines(res.summary, o.out):
        typer.echo(line)
    show(None, res.files)
