"""``depthscope info``: a model's sites and, for a prompt, a per-site summary."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from depthscope.analyses.commands.common import load_model
from depthscope.analyses.commands.options import command, opt, options

INFO = options(
    "model device dtype stream prompt",
    extra=(opt("--prompt -p", "The capital of France is", "Text to run."),),
)


@command("info", INFO)
def info(o) -> None:
    """Show the model's residual sites and, for PROMPT, each site's stream norm and logit-lens top token."""
    import torch  # lazy: --help must not import torch

    from depthscope.hooks.stream_choice import paper_plan
    from depthscope.hooks.streaming import expected_peak

    if o.stream and (plan := paper_plan(o.model, o.dtype)) is not None:
        return Console().print(plan)  # a config.json without weights: the 70B plan on paper
    m = load_model(o)
    console = Console()
    console.print(repr(m))
    console.print(expected_peak(m, len(m.tokenize([o.prompt])[0][0]) if m.tokenizer is not None else 16))
    rs = m.residual_stream([o.prompt])
    table = Table("site", "label", "depth", "||h|| (last token)", "lens top-1 (last token)")
    frame = rs.site_frame()
    with torch.no_grad():
        last = rs.resid[:, 0, int(rs.mask[0].sum()) - 1]
        tops = m.decode(last).argmax(-1).tolist() if m.can_decode else [None] * len(last)
    for row, h, t in zip(frame.itertuples(), last, tops):
        tok = repr(m.tokenizer.decode([t])) if t is not None and m.tokenizer is not None else "-"
        table.add_row(str(row.site), row.label, f"{row.depth:g}", f"{float(h.norm()):.1f}", tok)
    console.print(table)
