"""``depthscope sweep``: one analysis over a series of checkpoints (the options are the fields of
:class:`~depthscope.analyses.jobs.configs.SweepJobConfig` and of the Ray engine), and
``depthscope toy-series``: a tiny checkpoint series to sweep over."""

from __future__ import annotations

import functools
from pathlib import Path

import typer

from depthscope.analyses.commands import common
from depthscope.analyses.commands.options import Opt, command, opt, options
from depthscope.analyses.jobs.configs import SweepJobConfig
from depthscope.analyses.samples import sample_texts
from depthscope.common.settings import Limit, build

#: a toy series trains a 2-layer model on a small text: it is learnt in hundreds of steps
TOY_STEPS = Limit(100_000, "a toy series is learnt in hundreds of steps; 100000 already take hours")

EXTRA = (
    Opt(
        "checkpoints_pos",
        list[str] | None,
        None,
        help="Checkpoint folders, .gguf files or specs.",
        argument=True,
        metavar="[CHECKPOINT]...",
    ),
    opt(
        "--checkpoints -c",
        None,
        "A checkpoint (repeatable; further paths may follow as arguments).",
        list[str] | None,
    ),
    opt(
        "--checkpoint-dir",
        None,
        "A folder of step100/, checkpoint-200/ ... sub-folders, ordered by step.",
        Path | None,
    ),
)
SWEEP = options(
    "checkpoints_pos checkpoints checkpoint_dir analysis out text max_docs task train test max_train_sentences "
    "max_test_sentences max_epochs stack_draws stack_folds stack_l2 seed metric allow_mixed overwrite device dtype "
    "engine address workers gpus_per_task",
    SweepJobConfig,
    extra=EXTRA,
    helps={
        "max_epochs": "Cap on passes over train for every probe (probe).",
        "out": "Output folder (re-run the same command to resume).",
    },
    required="analysis out",
)
TOY = options(
    "out steps save_every text",
    helps={"out": "Folder for step0/, step50/, ... checkpoints."},
    required="out",
    extra=(
        opt("--steps", 200, "Training steps.", min=1, max=TOY_STEPS),
        opt("--save-every", 50, "Steps between saved checkpoints.", min=1, max=TOY_STEPS),
        opt("--text", None, "Training text (default: the bundled EWT sample).", Path | None),
    ),
)


@command("sweep", SWEEP)
def sweep_cmd(o) -> None:
    """Run one analysis on each checkpoint; write one combined table (checkpoint, step columns) and plots.

    Each checkpoint's result is written atomically as it finishes; re-running the same command skips
    finished checkpoints (with either engine). --engine ray runs one Ray task per checkpoint on a local
    Ray with --workers CPUs, or on the cluster at --address. Checkpoints with identical weights are
    marked in the table's duplicate_of column. A checkpoint that fails to load is recorded
    (checkpoints/NAME.failed.json) and the sweep goes on; the exit status is 1 if any failed.
    """
    from depthscope.analyses.jobs.sweep import sweep_job  # lazy: the job imports torch
    from depthscope.analyses.sweeps.series import discover_checkpoints  # lazy: imports pandas, --help must not
    from depthscope.hooks import load_model  # lazy: imports torch
    from depthscope.hooks.devices import resolve_device, resolve_dtype  # lazy: imports torch

    cfg = build(SweepJobConfig, o)
    resolve_dtype(o.dtype)  # a bad name fails here, not once per checkpoint
    if cfg.engine == "local" or not cfg.ray.gpus_per_task:  # Ray tasks see their GPUs only inside the task
        resolve_device(o.device)
    common.prepare_out(o.out, "sweep", None, o.overwrite)  # sweep() itself refuses another sweep's folder
    cks = discover_checkpoints([*(o.checkpoints or []), *(o.checkpoints_pos or [])], o.checkpoint_dir)
    res = sweep_job(cks, cfg, o.out, load=functools.partial(load_model, device=o.device, dtype=o.dtype))
    s = res.summary
    typer.echo(f"{len(s['done'])} checkpoints done, {len(s['skipped'])} already finished, {len(s['failed'])} failed")
    for name, err in s["failed"].items():
        typer.secho(f"  failed: {name}: {err}", fg=typer.colors.RED, err=True)
    typer.echo(f"tables: {o.out}/sweep_*.parquet|csv; plots: {', '.join(str(p) for p in res.files) or 'none'}")
    if s["failed"]:
        raise typer.Exit(1)


@command("toy-series", TOY)
def toy_series(o) -> None:
    """Train a tiny Llama on text with the default tokenizer, saving a checkpoint series to sweep over."""
    from depthscope.analyses.text import read_documents  # lazy: imports torch
    from depthscope.hooks.toy import train_tiny_series  # lazy: imports torch

    common.prepare_out(o.out, "toy-series", None)
    tok = common.load(None).tokenizer
    docs = read_documents(o.text) if o.text else sample_texts()
    paths = train_tiny_series(o.out, docs, tok, steps=o.steps, save_every=o.save_every)
    typer.echo("\n".join(str(p) for p in paths))
