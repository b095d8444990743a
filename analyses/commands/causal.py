"""``depthscope causal``: is what a site encodes used? LEACE erasure at every residual site, its effect
on linear probes and on the model's next-token loss. The options are the fields of
:class:`~depthscope.analyses.causal.config.CausalConfig` and the probe, extraction and data
configurations it holds; the work is :func:`~depthscope.analyses.jobs.causal.causal_job`."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import typer
from rich.console import Console

from depthscope.analyses.causal.config import CausalConfig
from depthscope.analyses.commands import common
from depthscope.analyses.commands.common import prepare_out, prepare_store, set_threads
from depthscope.analyses.commands.options import command, opt, options
from depthscope.analyses.jobs import Output
from depthscope.common.errors import InputError
from depthscope.common.settings import build

DATA = opt(
    "--data -d",
    None,
    "CoNLL-U files TRAIN TEST (repeat --data), as in 'depthscope run': the same as --train and --test.",
    list[Path] | None,
)
CAUSAL = options(
    "task data train test text model device dtype pooling sites max_train_sentences max_test_sentences "
    "max_text_tokens controls control bootstrap batch_size l2 max_epochs store_dir store_dtype bos seed threads plots "
    "out force",
    CausalConfig,
    extra=(DATA,),
)


def data_files(o) -> dict:
    """``{"train": ..., "test": ...}`` from ``--data TRAIN --data TEST`` (empty without ``--data``)."""
    if not o.data:
        return {}
    if len(o.data) != 2:
        raise InputError(f"--data takes two files, TRAIN and TEST (repeat --data); got {len(o.data)}")
    if o.train is not None or o.test is not None:
        raise InputError("give the data as --data TRAIN --data TEST or as --train/--test, not both")
    for p in o.data:
        if not Path(p).is_file():
            raise InputError(f"--data: no such file: {p}")
    return {"train": o.data[0], "test": o.data[1]}


def causal(o) -> None:
    """Encoded vs used, per depth: at each site, LEACE (concept-erasure) fitted on the train words'
    vectors removes every linear trace of TASK's labels; a probe on erased vectors falls to the
    majority class, and the same eraser applied inside the forward pass (every token of the
    held-out text) shows how much the model's next-token loss depends on it, against random
    erasures of the same rank.

    Writes OUT/causal.csv|parquet (one row per task and site), causal_summary.json and causal_encoded_used.png.
    """
    from depthscope.analyses.jobs import causal as jobs  # lazy: the job imports torch

    set_threads(o.threads)
    cfg = build(CausalConfig, o, **data_files(o))
    identity = {"model": o.model or "default", "train": str(cfg.train), "test": str(cfg.test), "text": str(o.text)}
    prepare_out(o.out, "causal", identity, o.force)
    prepare_store(o.store_dir)
    # the model loads (on --device, in --dtype) only once the data are read and checked
    loader = functools.partial(common.load, o.model, o.device, o.dtype)
    result = jobs.causal_job(loader, cfg, Output(o.out), progress=True)
    Console(width=None if sys.stdout.isatty() else 160).print(jobs.summary_table(result.tables[jobs.TABLE]))
    for note in result.summary.get("notes", []):
        typer.echo(f"note: {note}")
    for p in result.files:
        typer.echo(f"wrote {p}")


def register(app: typer.Typer) -> None:
    command(app, "causal", CAUSAL)(causal)
