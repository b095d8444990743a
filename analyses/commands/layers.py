"""``depthscope layers``: every block skipped and every neighbouring pair swapped, scored by
next-token cross-entropy and top-1 agreement on a text; the options are the fields of
:class:`~depthscope.analyses.jobs.configs.LayersConfig`, the work is
:func:`depthscope.analyses.jobs.layers.layers_job`."""

from __future__ import annotations

from rich.console import Console

from depthscope.analyses.commands.common import begin, load_model
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import LayersConfig

LAYERS = options(
    "text model device dtype stream out batch_size window stride bos max_tokens max_docs threads force", LayersConfig
)


@command("layers", LAYERS)
def layers(o) -> None:
    """Skip each block (its output = its input) and swap each block with the next (Lad et al. 2024).

    Scores the model on TEXT (one document per non-blank line, the BOS token prepended to every
    window as the probes and the causal test do; --no-bos: the tokenizer's own tokens) with every
    intervention and writes to OUT: layers (one row per layer and intervention:
    skip, swap, and one 'none' row for the unmodified model; cross_entropy, top1_agreement) as
    Parquet and CSV, layers_summary.json and the plot layers_curves.
    """
    from depthscope.analyses.jobs.layers import layers_job, summary_table  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    docs = read_documents(o.text)
    cfg = begin(o, LayersConfig, "layers", {"text": str(o.text)}, progress=True, source=str(o.text))
    m = load_model(o, show=True)
    res = layers_job(m, docs, cfg, Output(o.out))
    Console().print(summary_table(m.name, res.summary))
    Console(stderr=True).print("wrote " + ", ".join(p.name for p in res.files) + f" to {o.out}")
