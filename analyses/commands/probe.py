"""``depthscope probe``: Tenney-style probing at every residual site (the probe job, from options)."""

from __future__ import annotations

import functools
from pathlib import Path

import typer

from depthscope.analyses.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    ModelOpt,
    OutOpt,
    SeedOpt,
    StackDrawsOpt,
    StackFoldsOpt,
    StackL2Opt,
    ThreadsOpt,
    prepare_out,
    set_threads,
)
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

_P, _E, _D = ProbeConfig(), ExtractionConfig(), DataConfig()  # the option defaults: the only defaults


def job_config(o: dict):
    """The :class:`ProbeJobConfig` that the command's options ``o`` (by parameter name) describe."""
    import math

    from depthscope.analyses.jobs.probe import ProbeJobConfig
    from depthscope.common.errors import InputError

    try:
        l2 = o["l2"] if o["l2"] in ("auto", "dev") else float(o["l2"])
    except ValueError:
        raise InputError(f"--l2 must be a number, 'auto' or 'dev', got {o['l2']!r}") from None
    if l2 not in ("dev", "auto") and not (math.isfinite(l2) and l2 >= 0):
        raise InputError(f"--l2 must be a finite number >= 0 (0: no penalty), 'auto' or 'dev', got {o['l2']!r}")
    return ProbeJobConfig(
        tasks=[t.strip() for t in o["task"].split(",") if t.strip()] if o["task"] else None,
        train=o["train"],
        test=o["test"],
        dev=o["dev"],
        plots=o["plots"],
        probe=ProbeConfig(
            probe=o["probe_kind"],
            l2=l2,
            max_epochs=o["max_epochs"],
            stack_draws=o["stack_draws"],
            stack_folds=o["stack_folds"],
            stack_l2=o["stack_l2"],
            mdl=o["mdl"],
            seed=o["seed"],
            precision=o["precision"],
        ),
        extraction=ExtractionConfig(
            pooling=o["pooling"],
            context=o["context"],
            store_dir=o["store"],
            bos=o["bos"],
            sites=[s.strip() for s in o["sites"].split(",")] if o["sites"] else None,
            store_dtype="float32" if o["float32"] else "float16",
            shards=o["shards"],
            engine=o["engine"],
            workers=o["workers"],
        ),
        data=DataConfig(
            max_train_sentences=o["max_train_sentences"],
            max_test_sentences=o["max_test_sentences"],
            max_dev_sentences=o["max_dev_sentences"],
            overlap=o["overlap"],
        ),
    ).validate()


def print_summary(summary) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(
        "task",
        "n_train",
        "n_test",
        "best site",
        "best acc",
        "max sel. (pts)",
        "E_Delta [95%]",
        "argmax E_Delta",
        "E_s",
        "L2",
        "converged",
    )
    for col in table.columns:
        col.no_wrap = True
    for r in summary.itertuples():
        lo, hi = r.expected_layer_delta_lo, r.expected_layer_delta_hi  # always in a fresh summary
        e = f"{r.expected_layer_delta:.2f} [{lo:.1f}-{hi:.1f}]"
        e += "" if r.expected_layer_delta_meaningful else " (gain too small)"
        conv = "yes" if r.converged else f"NO ({r.n_not_converged} at max_epochs={r.max_epochs})"
        table.add_row(
            r.task,
            str(r.n_train),
            str(r.n_test),
            str(r.best_label),
            f"{r.best_accuracy:.3f}",
            f"{100 * r.max_selectivity:.1f}",
            e,
            f"{getattr(r, 'expected_layer_delta_hard', float('nan')):.2f}",
            f"{r.expected_layer_mix:.2f}",
            f"{r.l2:g}",
            conv,
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # logs: no 80-column squeeze
    for r in summary.itertuples():
        if not r.converged:
            Console(stderr=True).print(
                f"[yellow]warning:[/] {r.task}: {r.n_not_converged} probe(s) stopped at "
                f"--max-epochs {r.max_epochs} before converging; raise --max-epochs"
            )


def register(app: typer.Typer) -> None:
    @app.command("probe")
    def probe(
        task: str | None = typer.Option(
            None,
            "--task",
            "-t",
            help="Comma-separated tasks: upos, xpos, feats:Number, "
            "feats:Tense, ..., deprel, deprel:base, entity, coref (GUM), or any name with a "
            "jiant edge-probing .jsonl. Default: upos,deprel,feats:Number (+entity,coref "
            "with GUM data).",
        ),
        train: Path | None = typer.Option(
            None, "--train", help="Train file (CoNLL-U or jiant .jsonl). Default: the bundled sample."
        ),
        test: Path | None = typer.Option(
            None, "--test", help="Test file (CoNLL-U or jiant .jsonl). Default: the bundled sample."
        ),
        dev: Path | None = typer.Option(
            None, "--dev", help="Dev file, used to choose the L2 penalty per task (--l2 auto); else folds of train."
        ),
        model: str | None = ModelOpt,
        device: str = DeviceOpt,
        dtype: str = DtypeOpt,
        probe_kind: str = typer.Option(
            _P.probe, "--probe", help="linear (softmax regression) or mlp (one hidden layer)."
        ),
        pooling: str = typer.Option(
            _E.pooling,
            "--pooling",
            help="Span pooling: last (default for decoders), first, mean, attn (self-attentive).",
        ),
        sites: str | None = typer.Option(
            None, "--sites", help="Comma-separated sites (labels or indices); default all 2L+1."
        ),
        max_train_sentences: int | None = typer.Option(
            _D.max_train_sentences,
            "--max-train-sentences",
            min=1,
            help="Cap train at N sentences (whole documents, seeded).",
        ),
        max_test_sentences: int | None = typer.Option(
            _D.max_test_sentences, "--max-test-sentences", min=1, help="Cap test at N sentences."
        ),
        max_dev_sentences: int | None = typer.Option(
            _D.max_dev_sentences, "--max-dev-sentences", min=1, help="Cap dev at N sentences."
        ),
        context: str | None = typer.Option(
            _E.context, "--context", help="sentence or document for every task (default: document for coref only)."
        ),
        l2: str = typer.Option(
            str(_P.l2),
            "--l2",
            help="L2 penalty on mean cross-entropy (sklearn C = 1/(2*l2*n); 0: none), or 'auto': one per task from "
            "the grid 3e-3 .. 1e-1 (L2_GRID, grown by half-decades from 1e-4 to 3 while the best is at its end) "
            "by held-out accuracy (on --dev when given, else on folds of train).",
        ),
        max_epochs: int = typer.Option(
            _P.max_epochs,
            "--max-epochs",
            min=1,
            help="Cap on passes over train: probes train until they converge; "
            "hitting the cap warns and is recorded (converged=False).",
        ),
        stack_draws: int = StackDrawsOpt,
        stack_folds: int = StackFoldsOpt,
        stack_l2: float = StackL2Opt,
        precision: str = typer.Option(
            _P.precision,
            "--precision",
            help="Feature precision: float32 (the default on every machine), bfloat16, or auto "
            "(bfloat16 only on CPUs with native bf16, see depthscope.probes.solvers.cpu).",
        ),
        mdl: bool = typer.Option(
            _P.mdl, "--mdl/--no-mdl", help="Also compute MDL online codelength (Voita & Titov 2020); costly."
        ),
        overlap: str = typer.Option(
            _D.overlap, "--overlap", help="Test sentences also in train: drop (default), keep, or error."
        ),
        store: Path | None = typer.Option(
            _E.store_dir, "--store", help="Activation store folder (default: <cache>/activations); reused on re-runs."
        ),
        float32: bool = typer.Option(
            _E.store_dtype == "float32", "--float32/--float16", help="Store activations as float32 (default float16)."
        ),
        bos: bool = typer.Option(
            _E.bos,
            "--bos/--no-bos",
            help="Prepend the BOS (else EOS) token when the tokenizer adds none, so no word is the attention sink.",
        ),
        shards: int = typer.Option(
            _E.shards,
            "--shards",
            min=1,
            help="Write the activation store as N shards (a re-run redoes only missing ones; 1: one store).",
        ),
        engine: str = typer.Option(
            _E.engine, "--engine", help="Extraction engine: local, or ray (one Ray task per shard)."
        ),
        workers: int = typer.Option(_E.workers, "--workers", min=1, help="CPUs of the local Ray (--engine ray)."),
        seed: int = SeedOpt,
        threads: int | None = ThreadsOpt,
        plots: bool = typer.Option(True, "--plots/--no-plots", help="Draw the figures."),
        out: Path = OutOpt,
        force: bool = ForceOpt,
    ):
        """Probe which depth encodes which property (Tenney et al. 2019): per-site accuracy, control-task
        selectivity, scalar-mix E_s and cumulative-scoring E_Delta, for each TASK.

        Writes OUT/probes_by_site.csv|parquet, probes_summary.csv|parquet, probes_mixing.csv|parquet,
        probes_accuracy.png and probes_tenney.png.
        """
        from depthscope.analyses.jobs import Output
        from depthscope.analyses.jobs.probe import run_probe_job

        set_threads(threads)
        cfg = job_config(dict(locals()))  # every option by its parameter name
        prepare_out(out, "probe", {"model": model or "default", "train": str(train), "test": str(test)}, force)
        from depthscope.analyses.commands.common import load

        # the model loads (on --device, in --dtype) only once the data are read and checked
        loader = functools.partial(load, model, device, dtype)
        result = run_probe_job(loader, cfg, Output(out), progress=True)
        print_summary(result.tables["probes_summary"])
        typer.echo(f"precision: {result.summary['precision']}")
        for p in result.files:
            typer.echo(f"wrote {p}")
