"""Options shared by sub-commands."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

ModelOpt = typer.Option(None, "--model", "-m", help="Model spec: a folder, a .gguf, a cached hub id, or 'default' (SmolLM2-135M).")
OutOpt = typer.Option(Path("depthscope-out"), "--out", "-o", help="Output folder for tables and plots.")


def load(model: Optional[str]):
    from depthscope.hooks import load_model

    return load_model(model)
