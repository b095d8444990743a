"""``depthscope norms``: per-layer contribution norms over a text file, with tables and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .common import ModelOpt, OutOpt


def register(app: typer.Typer) -> None:
    @app.command("norms")
    def norms(
        text: Path = typer.Option(..., "--text", "-t", help="Plain-text file: one document per non-blank line (see --whole-file)."),
        model: Optional[str] = ModelOpt,
        out: Path = OutOpt,
        prompt: str = typer.Option("The capital of France is", "--prompt", "-p", help="Prompt for the per-position heatmap and the DLA bars."),
        target: Optional[str] = typer.Option(None, "--target", help="Target token of the DLA, a single token such as ' Paris' (mind the leading space); default: the model's top prediction."),
        contrast: Optional[str] = typer.Option(None, "--contrast", help="Optional contrast token: attribute logit[target] - logit[contrast]."),
        max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Stop after this many real tokens of the text."),
        batch_size: int = typer.Option(4, "--batch-size", help="Sequences per forward pass."),
        window: Optional[int] = typer.Option(None, "--window", help="Split documents into windows of at most this many tokens (default min(context, 512))."),
        whole_file: bool = typer.Option(False, "--whole-file", help="Read the file as one document instead of one per line."),
        heads: bool = typer.Option(False, "--heads", help="Also per-head attention write norms over the text (head_writes table and plot; one more pass)."),
    ):
        """How much each sublayer writes into the residual stream, relative to it.

        Streams TEXT through the model and writes to OUT: norms_by_site (one row per site and
        position group 'rest'/'first'), norms_by_position (the PROMPT, per token), dla (direct
        logit attribution of TARGET after PROMPT) as Parquet and CSV, summary.json, and the plots
        stream_growth.png, update_norms.png, relative_update.png, position_heatmap.png, dla.png
        (with --heads also head_writes table and head_writes.png).
        """
        from rich.console import Console
        from rich.table import Table

        from depthscope.analyses.norms import contribution_norms, direct_logit_attribution, norms_by_position, norms_summary
        from depthscope.analyses.plots import norms as plots
        from depthscope.analyses.tables import write_table
        from depthscope.analyses.text import read_documents
        from depthscope.hooks import load_model
        from depthscope.hooks.errors import InputError

        console = Console(stderr=True)
        docs = read_documents(text, per_line=not whole_file)
        if not prompt:
            raise InputError("--prompt is empty")
        m = load_model(model)
        console.print(repr(m))
        df = contribution_norms(m, docs, batch_size=batch_size, window=window, max_tokens=max_tokens, progress=True)
        pos = norms_by_position(m, [prompt])
        out.mkdir(parents=True, exist_ok=True)
        written = []
        written += write_table(df, out, "norms_by_site")
        written += write_table(pos, out, "norms_by_position")
        dla = None
        if m.is_decoder and m.can_decode and m.arch.unembed is not None and m.arch.final_norm is not None:
            dla = direct_logit_attribution(m, [prompt], target, contrast)  # None: the top-1 prediction
            written += write_table(dla, out, "dla")
        else:
            console.print(f"[yellow]no DLA: {m.name} is not a decoder with final norm -> unembedding[/yellow]")
        summary = norms_summary(df)
        summary.update(model=str(m.name), text=str(text), n_tokens=int(df.groupby("positions")["n_tokens"].first().sum()),
                       notes=df.attrs.get("notes", ""))
        if dla is not None:
            parts = dla[dla["site"] >= 0].sort_values("contribution", ascending=False)
            summary["dla_target"] = str(dla["target"].iloc[0])
            summary["dla_logit"] = float(dla["logit"].iloc[0])
            summary["dla_top"] = [[r.label, float(r.contribution)] for r in parts.head(5).itertuples()]
        heads_df = None
        if heads:
            from depthscope.analyses.heads import head_write_norms

            heads_df = head_write_norms(m, docs, batch_size=batch_size, window=window, max_tokens=max_tokens)
            written += write_table(heads_df, out, "head_writes")
            r = heads_df[heads_df["positions"] == "rest"]
            top = r.loc[r["write_norm"].idxmax()]
            summary["top_head"] = f"L{int(top['layer'])}H{int(top['head'])}"
            summary["top_head_write_norm"] = float(top["write_norm"])
            summary["mean_heads_coherence"] = float(r.groupby("layer")["heads_coherence"].first().mean())
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        written.append(out / "summary.json")
        figs = [
            plots.plot_stream_growth(df, out / "stream_growth.png"),
            plots.plot_update_norms(df, out / "update_norms.png"),
            plots.plot_relative_update(df, out / "relative_update.png"),
            plots.plot_position_heatmap(pos, out / "position_heatmap.png"),
        ]
        if dla is not None:
            figs.append(plots.plot_dla(dla, out / "dla.png"))
        if heads_df is not None:
            figs.append(plots.plot_head_writes(heads_df, out / "head_writes.png"))

        t = Table("quantity", "value", title=f"contribution norms of {m.name} on {summary['n_tokens']} tokens")
        t.add_row("stream growth per block (fit)", f"x{summary['growth_rate']:.3f} (R² {summary['growth_r2']:.2f})")
        t.add_row("mean attention share", f"{summary['attn_share']:.3f}")
        t.add_row("first-position / rest stream norm", f"{summary['sink_ratio']:.1f} (median over blocks; max {summary['sink_ratio_max']:.1f})")
        if "massive_site" in summary:
            t.add_row("largest |h|", f"{summary['massive_value']:.0f} at {summary['massive_site']}, dim {summary['massive_dim']} "
                      f"({summary['massive_positions']} position; {summary['massive_over_median']:.0f}x median)")
        if dla is not None:
            top = ", ".join(f"{lab} {v:+.2f}" for lab, v in summary["dla_top"][:3])
            t.add_row(f"DLA logit[{summary['dla_target']!r}]", f"{summary['dla_logit']:.2f}; top: {top}")
        if heads_df is not None:
            t.add_row("largest head write", f"{summary['top_head']} ({summary['top_head_write_norm']:.1f}); "
                      f"mean heads coherence {summary['mean_heads_coherence']:.2f}")
        Console().print(t)
        console.print("wrote " + ", ".join(str(p.name) for p in written + figs) + f" to {out}")
