"""``depthscope patch``: activation and attribution patching of a clean/corrupted prompt pair; the
options are the fields of :class:`~depthscope.analyses.jobs.configs.PatchConfig`."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from depthscope.analyses.commands.common import load_model, prepare_out, set_threads
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import PatchConfig
from depthscope.common.settings import build

PATCH = options(
    "clean corrupted target foil positions sites attribution batch_tokens threads plots model device dtype out force",
    PatchConfig,
)


def patch(o) -> None:
    """Which activations carry the difference between a clean and a corrupted prompt.

    Copies the CLEAN run's activation at each hook point (and position, and
    head) into the CORRUPTED run, many patches per forward pass, and measures
    the fraction of the clean-vs-corrupted metric gap each patch recovers.

    By default it patches every residual site at each position and every
    attention head at the last position (the README's IOI example), and
    writes to OUT:

      patching_by_site.parquet/.csv  residual sites x positions, both methods
      patching_sites.png             heatmap: hook point x position
      patching_by_head.parquet/.csv  layers x heads, both methods
      patching_heads.png             heatmap: layer x head
      patching_attribution.png       attribution estimate vs exact patching

    With --sites, the points named are patched at --positions (default:
    last): points patched whole (residual sites, attn_out, mlp_out) go to
    patching_by_site, per-head points (heads, z) to patching_by_head; a table
    and its heatmap are written when they have rows. --no-attribution leaves
    out the estimate, --no-plots the figures.
    """
    from depthscope.analyses.jobs.patch import patch_job, summary_table  # lazy: the job imports torch

    set_threads(o.threads)
    config = build(PatchConfig, o)
    prepare_out(o.out, "patch", {"model": o.model or "default", "clean": o.clean, "corrupted": o.corrupted}, o.force)
    m = load_model(o)
    Console(stderr=True).print(repr(m))
    result = patch_job(m, config, Output(o.out))
    Console(width=None if sys.stdout.isatty() else 160).print(summary_table(m.name, result.summary))
    for p in result.files:
        typer.echo(f"wrote {p}")


def register(app: typer.Typer) -> None:
    command(app, "patch", PATCH)(patch)
