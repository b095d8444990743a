"""``depthscope info``: a model's sites and, for a prompt, a per-site summary."""

from __future__ import annotations

import typer

from depthscope.analyses.commands.common import DeviceOpt, DtypeOpt, ModelOpt


def register(app: typer.Typer) -> None:
    @app.command("info")
    def info(
        model: str | None = ModelOpt,
        device: str = DeviceOpt,
        dtype: str = DtypeOpt,
        prompt: str = typer.Option("The capital of France is", "--prompt", "-p", help="Text to run."),
    ):
        """Show the model's residual sites and, for PROMPT, each site's stream norm and logit-lens top token."""
        import torch
        from rich.console import Console
        from rich.table import Table

        from depthscope.hooks import load_model

        m = load_model(model, device=device, dtype=dtype)
        console = Console()
        console.print(repr(m))
        rs = m.residual_stream([prompt])
        table = Table("site", "label", "depth", "||h|| (last token)", "lens top-1 (last token)")
        frame = rs.site_frame()
        with torch.no_grad():
            last = rs.resid[:, 0, int(rs.mask[0].sum()) - 1]
            tops = m.decode(last).argmax(-1).tolist() if m.can_decode else [None] * len(last)
        for row, h, t in zip(frame.itertuples(), last, tops):
            tok = repr(m.tokenizer.decode([t])) if t is not None and m.tokenizer is not None else "-"
            table.add_row(str(row.site), row.label, f"{row.depth:g}", f"{float(h.norm()):.1f}", tok)
        console.print(table)
