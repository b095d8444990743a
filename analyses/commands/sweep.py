"""``depthscope sweep``: one analysis over a series of checkpoints."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.commands.common import DeviceOpt, DtypeOpt, SeedOpt, StackDrawsOpt, StackFoldsOpt, StackL2Opt
from depthscope.analyses.jobs.sweep import SweepJobConfig
from depthscope.probes.config import ProbeConfig

_S, _P = SweepJobConfig(), ProbeConfig()


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep_cmd(
        checkpoints_pos: list[str] | None = typer.Argument(
            None, metavar="[CHECKPOINT]...", help="Checkpoint folders, .gguf files or specs."
        ),
        checkpoints: list[str] | None = typer.Option(
            None, "--checkpoints", "-c", help="A checkpoint (repeatable; further paths may follow as arguments)."
        ),
        checkpoint_dir: Path | None = typer.Option(
            None, "--checkpoint-dir", help="A folder of step100/, checkpoint-200/ ... sub-folders, ordered by step."
        ),
        analysis: str = typer.Option(..., "--analysis", "-a", help="lens | norms | probe"),
        out: Path = typer.Option(..., "--out", "-o", help="Output folder (re-run the same command to resume)."),
        text: Path | None = typer.Option(
            None, "--text", help="Plain text for lens/norms (one document per line); default: the bundled EWT sample."
        ),
        max_docs: int = typer.Option(
            _S.max_docs, "--max-docs", min=1, help="Use at most this many documents of --text."
        ),
        task: str = typer.Option(",".join(_S.tasks), "--task", help="Probe tasks, comma-separated (probe)."),
        train: Path | None = typer.Option(
            None, "--train", help="CoNLL-U/JSONL train file (probe); default: bundled EWT sample."
        ),
        test: Path | None = typer.Option(
            None, "--test", help="CoNLL-U/JSONL test file (probe); default: bundled EWT sample."
        ),
        max_train_sentences: int | None = typer.Option(
            None, "--max-train-sentences", min=1, help="Cap probe train data at N sentences (probe)."
        ),
        max_test_sentences: int | None = typer.Option(
            None, "--max-test-sentences", min=1, help="Cap probe test data at N sentences (probe)."
        ),
        max_epochs: int = typer.Option(
            _P.max_epochs, "--max-epochs", min=1, help="Cap on passes over train for every probe (probe)."
        ),
        stack_draws: int = StackDrawsOpt,
        stack_folds: int = StackFoldsOpt,
        stack_l2: float = StackL2Opt,
        seed: int = SeedOpt,
        metric: str | None = typer.Option(
            None, "--metric", help="Metric for the checkpoint x depth heatmap (default per analysis)."
        ),
        allow_mixed: bool = typer.Option(
            False, "--allow-mixed", help="Allow checkpoints of different architectures or tokenizers."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace another sweep's results in --out."),
        device: str = DeviceOpt,
        dtype: str = DtypeOpt,
        engine: str = typer.Option(
            "local", "--engine", help="local (one checkpoint after another) or ray (one Ray task per checkpoint)."
        ),
        address: str | None = typer.Option(
            None, "--address", help="Ray cluster to join (host:port, ray://host:port or auto); default: a local Ray."
        ),
        workers: int = typer.Option(
            2, "--workers", min=1, help="CPUs of the local Ray (concurrent checkpoints); --engine ray."
        ),
        gpus_per_task: float = typer.Option(
            0.0,
            "--gpus-per-task",
            min=0.0,
            help="GPUs each Ray task reserves (0: none, CPU tasks; use with --device cuda); --engine ray.",
        ),
    ):
        """Run one analysis on each checkpoint; write one combined table (checkpoint, step columns) and plots.

        Each checkpoint's result is written atomically as it finishes; re-running the same command skips
        finished checkpoints (with either engine). --engine ray runs one Ray task per checkpoint on a local
        Ray with --workers CPUs, or on the cluster at --address. Checkpoints with identical weights are
        marked in the table's duplicate_of column. A checkpoint that fails to load is recorded
        (checkpoints/NAME.failed.json) and the sweep goes on; the exit status is 1 if any failed.
        """
        import functools

        from depthscope.analyses.commands.common import prepare_out
        from depthscope.analyses.jobs.sweep import SweepJobConfig, sweep_job
        from depthscope.analyses.sweep import discover_checkpoints
        from depthscope.hooks import load_model
        from depthscope.hooks.devices import resolve_dtype

        cfg = SweepJobConfig(
            analysis=analysis,
            text=text,
            max_docs=max_docs,
            tasks=[t.strip() for t in task.split(",") if t.strip()],
            train=train,
            test=test,
            max_train_sentences=max_train_sentences,
            max_test_sentences=max_test_sentences,
            probe=ProbeConfig(
                max_epochs=max_epochs,
                stack_draws=stack_draws,
                stack_folds=stack_folds,
                stack_l2=stack_l2,
                seed=seed,
            ),
            metric=metric,
            allow_mixed=allow_mixed,
            overwrite=overwrite,
        ).validate()
        _one_analysis_options(
            analysis,
            probe={
                "--task": task != ",".join(_S.tasks),
                "--train": train is not None,
                "--test": test is not None,
                "--max-train-sentences": max_train_sentences is not None,
                "--max-test-sentences": max_test_sentences is not None,
                "--max-epochs": max_epochs != _P.max_epochs,
                "--stack-draws": stack_draws != _P.stack_draws,
                "--stack-folds": stack_folds != _P.stack_folds,
                "--stack-l2": stack_l2 != _P.stack_l2,
                "--seed": seed != _P.seed,
            },
            text={"--text": text is not None, "--max-docs": max_docs != _S.max_docs},
        )
        if engine not in ("local", "ray"):
            raise typer.BadParameter(f"--engine must be local or ray, not {engine!r}")
        if engine == "local" and (address is not None or gpus_per_task):
            raise typer.BadParameter("--address and --gpus-per-task need --engine ray")
        run_on = None
        if engine == "ray":
            from depthscope.analyses.sweep_ray import RayEngine, require_ray

            require_ray()
            run_on = RayEngine(address=address, workers=workers, gpus_per_task=gpus_per_task)
        resolve_dtype(dtype)  # a bad name fails here, not once per checkpoint
        if engine == "local" or not gpus_per_task:  # Ray tasks see their GPUs only inside the task
            from depthscope.hooks.devices import resolve_device

            resolve_device(device)
        prepare_out(out, "sweep", None, overwrite)  # sweep() itself refuses another sweep's folder
        cks = discover_checkpoints([*(checkpoints or []), *(checkpoints_pos or [])], checkpoint_dir)
        load = functools.partial(load_model, device=device, dtype=dtype)
        res = sweep_job(cks, cfg, out, load=load, engine=run_on)
        s = res.summary
        typer.echo(
            f"{len(s['done'])} checkpoints done, {len(s['skipped'])} already finished, {len(s['failed'])} failed"
        )
        for name, err in s["failed"].items():
            typer.secho(f"  failed: {name}: {err}", fg=typer.colors.RED, err=True)
        typer.echo(f"tables: {out}/sweep_*.parquet|csv; plots: {', '.join(str(p) for p in res.files) or 'none'}")
        if s["failed"]:
            raise typer.Exit(1)

    @app.command("toy-series")
    def toy_series(
        out: Path = typer.Option(..., "--out", "-o", help="Folder for step0/, step50/, ... checkpoints."),
        steps: int = typer.Option(200, "--steps", min=1, help="Training steps."),
        save_every: int = typer.Option(50, "--save-every", min=1, help="Steps between saved checkpoints."),
        text: Path | None = typer.Option(None, "--text", help="Training text (default: the bundled EWT sample)."),
    ):
        """Train a tiny Llama on text with the default tokenizer, saving a checkpoint series to sweep over."""
        from depthscope.analyses.commands.common import prepare_out
        from depthscope.analyses.report import sample_texts
        from depthscope.analyses.text import read_documents
        from depthscope.hooks import load_model
        from depthscope.hooks.toy import train_tiny_series

        prepare_out(out, "toy-series", None)
        tok = load_model().tokenizer
        docs = read_documents(text) if text else sample_texts()
        paths = train_tiny_series(out, docs, tok, steps=steps, save_every=save_every)
        typer.echo("\n".join(str(p) for p in paths))


def _one_analysis_options(analysis: str, *, probe: dict, text: dict) -> None:
    """Refuse options of the other analyses (``{flag: given}``): none is silently ignored."""
    wrong = [f for f, given in (text if analysis == "probe" else probe).items() if given]
    if wrong:
        needs = "--analysis lens or norms" if analysis == "probe" else "--analysis probe"
        raise typer.BadParameter(f"{', '.join(wrong)} only apply to {needs} (this sweep runs {analysis})")
