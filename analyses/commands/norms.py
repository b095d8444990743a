"""``depthscope norms``: per-layer contribution norms over a text file, with tables and plots; the
options are the fields of :class:`~depthscope.analyses.jobs.configs.NormsConfig`, the work is
:func:`depthscope.analyses.jobs.norms.norms_job`."""

from __future__ import annotations

from rich.console import Console

from depthscope.analyses.commands.common import begin, load_model
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import NormsConfig

NORMS = options(
    "text model device dtype stream out prompt target contrast max_tokens max_docs batch_size window stride bos "
    "whole_file heads threads force",
    NormsConfig,
)


@command("norms", NORMS)
def norms(o) -> None:
    """How much each sublayer writes into the residual stream, relative to it.

    Streams TEXT through the model and writes to OUT: norms_by_site (one row per site and
    position group 'rest'/'first'), norms_by_position (the PROMPT, per token), dla (direct
    logit attribution of TARGET after PROMPT) as Parquet and CSV, norms_summary.json, and the
    plots norms_stream_growth, norms_update_norms, norms_relative_update,
    norms_position_heatmap, norms_dla (with --heads also the head_writes table and
    norms_head_writes).
    """
    from depthscope.analyses.jobs.norms import norms_job, summary_table  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    console = Console(stderr=True)
    docs = read_documents(o.text, per_line=not o.whole_file)
    cfg = begin(o, NormsConfig, "norms", {"text": str(o.text)}, progress=True, source=str(o.text))
    m = load_model(o, show=True)
    if not m.unembed.decodes_stream:
        console.print(f"[yellow]no DLA: {m.name} is not a decoder with final norm -> unembedding[/yellow]")
    res = norms_job(m, docs, cfg, Output(o.out))
    Console().print(summary_table(m.name, res.summary))
    console.print("wrote " + ", ".join(p.name for p in res.files) + f" to {o.out}")
