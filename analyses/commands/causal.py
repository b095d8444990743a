"""``depthscope causal``: is what a site encodes used? LEACE erasure at every residual site, its effect
on linear probes and on the model's next-token loss. The options are the fields of
:class:`~depthscope.analyses.causal.erasure.config.CausalConfig` and the probe, extraction and data
configurations it holds; the work is :func:`~depthscope.analyses.jobs.causal.causal_job`."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.causal.erasure.config import CausalConfig
from depthscope.analyses.commands.common import begin, loader, prepare_store, show
from depthscope.analyses.commands.options import command, opt, options
from depthscope.analyses.jobs import Output
from depthscope.common.errors import InputError

DATA = opt(
    "--data -d",
    None,
    "CoNLL-U files TRAIN TEST (repeat --data), as in 'depthscope run': the same as --train and --test.",
    list[Path] | None,
)
CAUSAL = options(
    "task data train test text model device dtype stream pooling sites max_train_sentences max_test_sentences "
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


@command("causal", CAUSAL)
def causal(o) -> None:
    """Encoded vs used, per depth: at each site, LEACE (concept-erasure) fitted on the train words'
    vectors removes every linear trace of TASK's labels; a probe on erased vectors falls to the
    majority class, and the same eraser applied inside the forward pass (every token of the
    held-out text) shows how much the model's next-token loss depends on it, against random
    erasures of the same rank.

    Writes OUT/causal.csv|parquet (one row per task and site), causal_summary.json and causal_encoded_used.png.
    """
    from depthscope.analyses.jobs import causal as jobs  # lazy: the job imports torch

    files = data_files(o)
    identity = {"train": str(files.get("train", o.train)), "test": str(files.get("test", o.test)), "text": str(o.text)}
    cfg = begin(o, CausalConfig, "causal", identity, **files)
    prepare_store(o.store_dir)
    result = jobs.causal_job(loader(o), cfg, Output(o.out), progress=True)  # loads once the data are checked
    show(jobs.summary_table(result.tables[jobs.TABLE]))
    for note in result.summary.get("notes", []):
        typer.echo(f"note: {note}")
    show(None, result.files)
