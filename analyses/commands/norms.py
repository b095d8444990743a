"""``depthscope norms``: per-layer contribution norms over a text file, with tables and plots
(a thin wrapper of :func:`depthscope.analyses.jobs.norms.norms_job`)."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    ModelOpt,
    OutOpt,
    TextOpt,
    ThreadsOpt,
    prepare_out,
    set_threads,
)
from depthscope.analyses.jobs.norms import NormsConfig

_N = NormsConfig()


def _print_summary(model, summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("quantity", "value", title=f"contribution norms of {model.name} on {summary['n_tokens']} tokens")
    t.add_row("stream growth per block (fit)", f"x{summary['growth_rate']:.3f} (R² {summary['growth_r2']:.2f})")
    t.add_row("mean attention share", f"{summary['attn_share']:.3f}")
    t.add_row(
        "first-position / rest stream norm",
        f"{summary['sink_ratio']:.1f} (median over blocks; max {summary['sink_ratio_max']:.1f})",
    )
    if "massive_site" in summary:
        t.add_row(
            "largest |h|",
            f"{summary['massive_value']:.0f} at {summary['massive_site']}, "
            f"dim {summary['massive_dim']} ({summary['massive_positions']} position; "
            f"{summary['massive_over_median']:.0f}x median)",
        )
    if "dla_top" in summary:
        top = ", ".join(f"{lab} {v:+.2f}" for lab, v in summary["dla_top"][:3])
        t.add_row(f"DLA logit[{summary['dla_target']!r}]", f"{summary['dla_logit']:.2f}; top: {top}")
    if "top_head" in summary:
        t.add_row(
            "largest head write",
            f"{summary['top_head']} ({summary['top_head_write_norm']:.1f}); "
            f"mean heads coherence {summary['mean_heads_coherence']:.2f}",
        )
    Console().print(t)


def norms(
    text: Path = TextOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    out: Path = OutOpt,
    prompt: str = typer.Option(
        _N.prompt,
        "--prompt",
        "-p",
        help="Prompt for the per-position heatmap and the DLA bars.",
    ),
    target: str | None = typer.Option(
        _N.target,
        "--target",
        help="Target token of the DLA, a single token such as ' Paris' (mind the leading space); default: the "
        "model's top prediction.",
    ),
    contrast: str | None = typer.Option(
        _N.contrast,
        "--contrast",
        help="Optional contrast token: attribute logit\\[target] - logit\\[contrast].",
    ),
    max_tokens: int | None = typer.Option(
        _N.max_tokens,
        "--max-tokens",
        min=1,
        help="Stop after this many real tokens of the text.",
    ),
    batch_size: int = typer.Option(_N.batch_size, "--batch-size", min=1, help="Sequences per forward pass."),
    window: int | None = typer.Option(
        _N.window,
        "--window",
        min=1,
        help="Split documents into windows of at most this many tokens (default min(context, 512)).",
    ),
    whole_file: bool = typer.Option(
        False,
        "--whole-file",
        help="Read the file as one document instead of one per line.",
    ),
    heads: bool = typer.Option(
        _N.heads,
        "--heads",
        help="Also per-head attention write norms over the text (head_writes table and plot; one more pass).",
    ),
    threads: int | None = ThreadsOpt,
    force: bool = ForceOpt,
):
    """How much each sublayer writes into the residual stream, relative to it.

    Streams TEXT through the model and writes to OUT: norms_by_site (one row per site and
    position group 'rest'/'first'), norms_by_position (the PROMPT, per token), dla (direct
    logit attribution of TARGET after PROMPT) as Parquet and CSV, norms_summary.json, and the
    plots norms_stream_growth, norms_update_norms, norms_relative_update,
    norms_position_heatmap, norms_dla (with --heads also the head_writes table and
    norms_head_writes).
    """
    from rich.console import Console

    from depthscope.analyses.commands.common import load
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.norms import norms_job
    from depthscope.analyses.text import read_documents

    set_threads(threads)
    console = Console(stderr=True)
    docs = read_documents(text, per_line=not whole_file)
    cfg = NormsConfig(
        prompt=prompt,
        target=target,
        contrast=contrast,
        max_tokens=max_tokens,
        batch_size=batch_size,
        window=window,
        heads=heads,
        progress=True,
        source=str(text),
    ).validate()
    prepare_out(out, "norms", {"model": model or "default", "text": str(text)}, force)
    m = load(model, device, dtype)
    console.print(repr(m))
    if not m.unembed.decodes_stream:
        console.print(f"[yellow]no DLA: {m.name} is not a decoder with final norm -> unembedding[/yellow]")
    res = norms_job(m, docs, cfg, Output(out))
    _print_summary(m, res.summary)
    console.print("wrote " + ", ".join(p.name for p in res.files) + f" to {out}")


def register(app: typer.Typer) -> None:
    app.command("norms")(norms)
