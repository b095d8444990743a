"""``depthscope patch``: activation and attribution patching of a clean/corrupted prompt pair."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from depthscope.analyses.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    ModelOpt,
    OutOpt,
    ThreadsOpt,
    prepare_out,
    set_threads,
)
from depthscope.analyses.jobs.patch import PatchConfig

_D = PatchConfig()


def register(app: typer.Typer) -> None:
    @app.command("patch")
    def patch(
        clean: str = typer.Option(
            _D.clean, "--clean", help="The clean prompt (default: the IOI example with 'John' as the giver)."
        ),
        corrupted: str = typer.Option(
            _D.corrupted, "--corrupted", help="The corrupted prompt (default: the same with 'Mary' as the giver)."
        ),
        target: str = typer.Option(
            _D.target,
            "--target",
            help="Token the clean prompt should predict next, one token (mind the leading space: ' Mary').",
        ),
        foil: str = typer.Option(
            _D.foil or "",
            "--foil",
            help="Contrast token: the metric is the target's logit minus the foil's at the last token; '' for "
            "the log-probability of the target.",
        ),
        positions: str | None = typer.Option(
            _D.positions,
            "--positions",
            help="Token positions to patch: last (the last token), all (every position at once) or each "
            "(one patch per position; prompts of the same token length). Default: each for the residual "
            "sites (last when the prompts differ in token length) and last for the heads; last with --sites.",
        ),
        sites: str | None = typer.Option(
            _D.sites,
            "--sites",
            help="Comma-separated hook points or group words (e.g. 'embed,10.attn,23.heads' or "
            "'resid,attn_out,mlp_out,heads,z'). Default: every residual site and every attention head "
            "('resid,heads'), as in the README's IOI example.",
        ),
        attribution: bool = typer.Option(
            _D.attribution,
            "--attribution/--no-attribution",
            help="Also the gradient (attribution patching) estimate of every patch, and its rank correlation "
            "with exact patching.",
        ),
        batch_tokens: int = typer.Option(
            _D.batch_tokens,
            "--batch-tokens",
            min=1,
            help="Tokens per forward pass (patched rows x recomputed positions).",
        ),
        threads: int | None = ThreadsOpt,
        plots: bool = typer.Option(
            _D.plots, "--plots/--no-plots", help="Draw the heatmaps (and the attribution-vs-exact scatter)."
        ),
        model: str | None = ModelOpt,
        device: str = DeviceOpt,
        dtype: str = DtypeOpt,
        out: Path = OutOpt,
        force: bool = ForceOpt,
    ):
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
        from rich.console import Console

        from depthscope.analyses.jobs import Output
        from depthscope.analyses.jobs.patch import patch_job
        from depthscope.hooks import load_model

        set_threads(threads)
        config = PatchConfig(
            clean=clean,
            corrupted=corrupted,
            target=target,
            foil=foil or None,
            sites=sites,
            positions=positions,
            attribution=attribution,
            batch_tokens=batch_tokens,
            plots=plots,
        ).validate()
        prepare_out(out, "patch", {"model": model or "default", "clean": clean, "corrupted": corrupted}, force)
        console = Console(stderr=True)
        m = load_model(model, device=device, dtype=dtype)
        console.print(repr(m))
        result = patch_job(m, config, Output(out))
        Console(width=None if sys.stdout.isatty() else 160).print(_summary_table(m.name, result.summary))
        for p in result.files:
            typer.echo(f"wrote {p}")


def _summary_table(name, s: dict):
    """The console table of a patch job's summary (logs get 160 columns: no 80-column squeeze)."""
    from rich.table import Table

    t = Table("quantity", "value", title=f"patching {name}: {s['metric']}")
    t.add_row("clean / corrupted", f"{s['clean_metric']:.3f} / {s['corrupted_metric']:.3f}")
    positions = ", ".join(f"{part} at {where}" for part, where in s["positions"].items())
    t.add_row("patches", f"{s['n_patches']} ({positions})")
    for rows in s["top"].values():
        for where, frac in rows:
            t.add_row(where, f"{frac:+.3f} recovered")
    for part, rho in (s.get("spearman_attribution_vs_exact") or {}).items():
        if rho is not None:
            t.add_row(f"attribution vs exact, {part} (Spearman)", f"{rho:.3f}")
    if s["notes"]:
        t.add_row("note", s["notes"])
    return t
