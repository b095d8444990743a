"""``depthscope probe``: Tenney-style probing at every residual site."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import ModelOpt, OutOpt


def register(app: typer.Typer) -> None:
    @app.command("probe")
    def probe(
        task: str = typer.Option(..., "--task", "-t", help="Comma-separated tasks: upos, xpos, feats:Number, feats:Tense, ..., "
                                 "deprel, deprel:base, entity, coref (GUM), or any name with a jiant edge-probing .jsonl."),
        train: Optional[Path] = typer.Option(None, "--train", help="Train file (CoNLL-U or jiant .jsonl). Default: the bundled sample."),
        test: Optional[Path] = typer.Option(None, "--test", help="Test file (CoNLL-U or jiant .jsonl). Default: the bundled sample."),
        dev: Optional[Path] = typer.Option(None, "--dev", help="Dev file, used to pick the L2 penalty per site (with --l2 dev)."),
        model: Optional[str] = ModelOpt,
        probe_kind: str = typer.Option("linear", "--probe", help="linear (softmax regression) or mlp (one hidden layer)."),
        pooling: str = typer.Option("last", "--pooling", help="Span pooling: last (default for decoders), first, mean, attn (self-attentive)."),
        sites: Optional[str] = typer.Option(None, "--sites", help="Comma-separated sites (labels or indices); default all 2L+1."),
        max_train_sentences: Optional[int] = typer.Option(None, "--max-train-sentences", help="Cap train at N sentences (whole documents, seeded)."),
        max_test_sentences: Optional[int] = typer.Option(None, "--max-test-sentences", help="Cap test at N sentences."),
        max_dev_sentences: Optional[int] = typer.Option(None, "--max-dev-sentences", help="Cap dev at N sentences."),
        context: Optional[str] = typer.Option(None, "--context", help="sentence or document for every task (default: document for coref only)."),
        l2: str = typer.Option("1e-3", "--l2", help="L2 penalty on mean cross-entropy (sklearn C = 1/(2*l2*n)), or 'dev' to choose per site on --dev."),
        epochs: int = typer.Option(12, "--epochs", help="Training epochs of every probe."),
        mdl: bool = typer.Option(False, "--mdl/--no-mdl", help="Also compute MDL online codelength (Voita & Titov 2020); costly."),
        overlap: str = typer.Option("drop", "--overlap", help="Test sentences also in train: drop (default), keep, or error."),
        store: Optional[Path] = typer.Option(None, "--store", help="Activation store folder (default: <cache>/activations); reused on re-runs."),
        float32: bool = typer.Option(False, "--float32/--float16", help="Store activations as float32 (default float16)."),
        bos: bool = typer.Option(True, "--bos/--no-bos", help="Prepend the BOS (else EOS) token when the tokenizer adds none, so no word is the attention sink."),
        seed: int = typer.Option(0, "--seed", help="Seed for sampling, control tasks and training."),
        plots: bool = typer.Option(True, "--plots/--no-plots", help="Draw the figures."),
        out: Path = OutOpt,
    ):
        """Probe which depth encodes which property (Tenney et al. 2019): per-site accuracy, control-task
        selectivity, scalar-mix E_s and cumulative-scoring E_Delta, for each TASK.

        Writes OUT/probes_by_site.csv|parquet, probes_summary.csv|parquet, probes_mixing.csv|parquet,
        probes_by_site.png and probes_tenney.png.
        """
        from rich.console import Console
        from rich.table import Table

        from depthscope.hooks import load_model
        from depthscope.hooks.errors import InputError
        from depthscope.probes import run_probes, sample_data

        tasks = [t.strip() for t in task.split(",") if t.strip()]
        if train is None or test is None:
            paths = sample_data()
            gum = any(t.split(":")[0] in ("entity", "coref") for t in tasks)
            train = train or paths["gum_train" if gum else "ewt_train"]
            test = test or paths["gum_test" if gum else "ewt_test"]
        try:
            l2v = l2 if l2 == "dev" else float(l2)
        except ValueError:
            raise InputError(f"--l2 must be a number or 'dev', got {l2!r}") from None
        m = load_model(model)
        site_list = [s.strip() for s in sites.split(",")] if sites else None
        res = run_probes(
            m, tasks, train, test, dev, probe=probe_kind, pooling=pooling, sites=site_list,
            max_train_sentences=max_train_sentences, max_test_sentences=max_test_sentences,
            max_dev_sentences=max_dev_sentences, context=context, l2=l2v, epochs=epochs, mdl=mdl, overlap=overlap,
            store_dir=store, dtype="float32" if float32 else "float16", bos=bos, seed=seed, progress=True,
        )
        paths = res.write(out, plots=plots)
        console = Console()
        table = Table("task", "n_train", "n_test", "best site", "best acc", "max selectivity", "E_Delta [95%]", "E_s")
        for col in table.columns:
            col.no_wrap = True
        for r in res.summary.itertuples():
            lo, hi = r.expected_layer_delta_lo, r.expected_layer_delta_hi  # always in a fresh summary
            table.add_row(r.task, str(r.n_train), str(r.n_test), str(r.best_label), f"{r.best_accuracy:.3f}",
                          f"{r.max_selectivity:.3f}", f"{r.expected_layer_delta:.2f} [{lo:.1f}-{hi:.1f}]",
                          f"{r.expected_layer_mix:.2f}")
        console.print(table)
        for p in paths:
            console.print(f"wrote {p}")
