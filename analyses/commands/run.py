"""``depthscope run``: the main job (lens, norms, probes, one report)."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    ModelOpt,
    SeedOpt,
    StackDrawsOpt,
    StackFoldsOpt,
    StackL2Opt,
    ThreadsOpt,
    prepare_out,
    set_threads,
)
from depthscope.probes.config import DataConfig, ProbeConfig

_P, _D = ProbeConfig(), DataConfig()  # the option defaults: the only defaults


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        model: str | None = ModelOpt,
        device: str = DeviceOpt,
        dtype: str = DtypeOpt,
        data: list[Path] | None = typer.Option(
            None,
            "--data",
            "-d",
            help="CoNLL-U files: TRAIN [TEST [DEV]] (repeat --data). Default: the bundled UD English EWT sample.",
        ),
        out: Path = typer.Option(Path("depthscope-report"), "--out", "-o", help="Output folder."),
        task: str | None = typer.Option(
            None,
            "--task",
            "-t",
            help="Probe tasks, comma-separated (default: upos,deprel,feats:Number; +entity,coref with GUM data).",
        ),
        text: Path | None = typer.Option(
            None, "--text", help="Plain text for the lens and norms (default: the probe data's sentences)."
        ),
        prompt: str = typer.Option(
            "The capital of France is", "--prompt", help="Prompt for the per-token views and DLA."
        ),
        target: str = typer.Option(" Paris", "--target", help="Target token for DLA."),
        max_train_sentences: int | None = typer.Option(
            _D.max_train_sentences,
            "--max-train-sentences",
            min=1,
            help="Cap probe train data at N sentences (whole documents, seeded).",
        ),
        max_test_sentences: int | None = typer.Option(
            _D.max_test_sentences, "--max-test-sentences", min=1, help="Cap probe test data at N sentences."
        ),
        max_epochs: int = typer.Option(
            _P.max_epochs,
            "--max-epochs",
            min=1,
            help="Cap on passes over train for every probe (they train to convergence; as in depthscope probe).",
        ),
        stack_draws: int = StackDrawsOpt,
        stack_folds: int = StackFoldsOpt,
        stack_l2: float = StackL2Opt,
        seed: int = SeedOpt,
        threads: int | None = ThreadsOpt,
        lens_tokens: int = typer.Option(1500, "--lens-tokens", min=1, help="Tokens of text for the logit lens."),
        norms_tokens: int = typer.Option(4000, "--norms-tokens", min=1, help="Tokens of text for contribution norms."),
        force: bool = ForceOpt,
    ):
        """Run the logit lens, contribution norms and probes on one model and write tables, plots and
        a report (report.md, report.html) answering which depth encodes which property."""
        from depthscope.analyses.report import ReportConfig, run_report
        from depthscope.analyses.text import read_documents

        set_threads(threads)
        files = [str(p) for p in (data or [])]
        if len(files) == 1:
            raise typer.BadParameter("give at least a train and a test file: --data TRAIN --data TEST")
        if len(files) > 3:
            raise typer.BadParameter("at most three --data files: TRAIN TEST DEV")
        for f in files:
            if not Path(f).is_file():
                raise typer.BadParameter(f"no such file: {f}")
        _check_out(out, model, files, force)
        probe, data_cfg = (
            ProbeConfig(
                max_epochs=max_epochs, stack_draws=stack_draws, stack_folds=stack_folds, stack_l2=stack_l2, seed=seed
            ).validate(),
            DataConfig(max_train_sentences=max_train_sentences, max_test_sentences=max_test_sentences).validate(),
        )
        prepare_out(out, "run", None, force)
        cfg = ReportConfig(
            model=model,
            device=device,
            dtype=dtype,
            train=files[0] if files else None,
            test=files[1] if len(files) > 1 else None,
            dev=files[2] if len(files) > 2 else None,
            texts=read_documents(text) if text else None,
            tasks=[t.strip() for t in task.split(",") if t.strip()] if task else None,
            prompt=prompt,
            target=target,
            lens_tokens=lens_tokens,
            norms_tokens=norms_tokens,
            probe=probe,
            data=data_cfg,
        )
        path = run_report(out, cfg)
        typer.echo(f"report: {path}\nmarkdown: {out / 'report.md'}")


def _check_out(out: Path, model, files, force: bool) -> None:
    """Refuse to mix two runs' files in one folder: the folder must be new, empty, or hold a run
    of the same model and data."""
    import json

    from depthscope.common.errors import InputError

    run_json = out / "run.json"
    if out.exists() and not out.is_dir():
        return  # prepare_output says it is a file
    if not out.exists() or not any(not p.name.startswith(".depthscope") for p in out.iterdir()) or force:
        return
    if run_json.is_file():
        old = json.loads(run_json.read_text())
        same_model = (model or "default") in (old.get("model_source"), old.get("model")) or (
            model is None and old.get("model") == "smollm2-135m"
        )
        same_data = not files or (files[0] == old.get("train") and files[1] == old.get("test"))
        if same_model and same_data:
            return
        raise InputError(f"{out} holds the results of another run ({old.get('model')}); use another --out or --force")
    raise InputError(f"{out} is not empty and holds no depthscope run; use another --out or --force")
