"""Options shared by sub-commands."""

from __future__ import annotations

from pathlib import Path

import typer

ModelOpt = typer.Option(
    None, "--model", "-m", help="Model spec: a folder, a .gguf, a cached hub id, or 'default' (SmolLM2-135M)."
)
OutOpt = typer.Option(Path("depthscope-out"), "--out", "-o", help="Output folder for tables and plots.")


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


ThreadsOpt = typer.Option(
    None, "--threads", help="torch CPU threads (default: torch's choice; 1 is often faster on a busy shared machine)."
)
SeedOpt = typer.Option(0, "--seed", help="Seed for sampling, control tasks and training.")


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given."""
    if threads:
        import torch

        torch.set_num_threads(threads)
