"""Options shared by sub-commands."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.probes.config import ProbeConfig

ModelOpt = typer.Option(
    None, "--model", "-m", help="Model spec: a folder, a .gguf, a cached hub id, or 'default' (SmolLM2-135M)."
)
OutOpt = typer.Option(Path("depthscope-out"), "--out", "-o", help="Output folder for tables and plots.")


TextOpt = typer.Option(
    ...,
    "--text",
    "-t",
    help="Plain-text file (UTF-8): one document per non-blank line, or the whole file as one (--whole-file); "
    "a .conllu file gives its sentences (e.g. $(depthscope data ewt_test)).",
)
ForceOpt = typer.Option(False, "--force", help="Write into an output folder that holds another run.")


_CLAIMS: list = []


def prepare_out(out: Path, command: str, identity: dict | None = None, force: bool = False) -> None:
    """Check and claim ``out`` before any compute (:func:`~depthscope.analyses.jobs.base.prepare_output`);
    the claim is released when the command ends (:func:`release_outputs`, called by the CLI)."""
    from depthscope.analyses.jobs.base import prepare_output

    _CLAIMS.append(prepare_output(out, command, identity, force=force))


def release_outputs() -> None:
    """Release the output folders this command claimed (the CLI calls it when a command ends)."""
    while _CLAIMS:
        _CLAIMS.pop().release()


DeviceOpt = typer.Option(
    "cpu", "--device", help="Where the model runs: cpu, cuda, cuda:N, mps, or auto (a GPU when torch sees one)."
)
DtypeOpt = typer.Option(
    "float32",
    "--dtype",
    help="Precision of the model's weights: float32, bfloat16 or float16 (metrics are reduced in float32).",
)


def load(model: str | None, device: str = "cpu", dtype: str = "float32"):
    """``load_model(model, device=device, dtype=dtype)``: bad names and absent devices are clear errors."""
    from depthscope.hooks import load_model

    return load_model(model, device=device, dtype=dtype)


_PROBE = ProbeConfig()

ThreadsOpt = typer.Option(
    None,
    "--threads",
    min=1,
    help="torch CPU threads (default: torch's choice; 1 is often faster on a busy shared machine).",
)
SeedOpt = typer.Option(0, "--seed", min=0, help="Seed for sampling, control tasks and training (an integer >= 0).")
# the cumulative probes' stacking (E_Delta), the same options on probe, run and sweep
StackDrawsOpt = typer.Option(
    _PROBE.stack_draws,
    "--stack-draws",
    min=1,
    help="Fold draws the cumulative probes (E_Delta) are stacked on; their accuracies are averaged and "
    "the interval resamples them. Each draw refits every site probe on each fold.",
)
StackFoldsOpt = typer.Option(
    _PROBE.stack_folds,
    "--stack-folds",
    min=2,
    help="Folds of train each fold draw's out-of-fold predictions come from (more folds: less noise "
    "per draw in E_Delta, one more refit of every site probe each).",
)
StackL2Opt = typer.Option(
    _PROBE.stack_l2,
    "--stack-l2",
    help="Ridge (> 0; 0 is refused) on the cumulative probes' stacking weights (stronger: weight spread "
    "over more sites; E_Delta depends on it, see docs/tenney_comparison.md).",
)


def positive(value: float | None):
    """Option callback: a float that is finite and greater than 0 (learning rates)."""
    import math

    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a number greater than 0")
    return value


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given."""
    if threads:
        import torch

        torch.set_num_threads(threads)
