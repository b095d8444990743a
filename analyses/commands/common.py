"""Options shared by sub-commands."""

from __future__ import annotations

from pathlib import Path

import typer

ModelOpt = typer.Option(
    None, "--model", "-m", help="Model spec: a folder, a .gguf, a cached hub id, or 'default' (SmolLM2-135M)."
)
OutOpt = typer.Option(Path("depthscope-out"), "--out", "-o", help="Output folder for tables and plots.")


def load(model: str | None):
    from depthscope.hooks import load_model

    return load_model(model)


ThreadsOpt = typer.Option(
    None, "--threads", help="torch CPU threads (default: torch's choice; 1 is often faster on a busy shared machine)."
)
SeedOpt = typer.Option(0, "--seed", help="Seed for sampling, control tasks and training.")


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given."""
    if threads:
        import torch

        torch.set_num_threads(threads)
