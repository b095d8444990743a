"""``depthscope attribute``: one prompt's attribution graph over a transcoder set; the options are
the fields of :class:`~depthscope.analyses.circuits.features.config.AttributeConfig`."""

from __future__ import annotations

from depthscope.analyses.circuits.features.config import AttributeConfig
from depthscope.analyses.commands.common import begin, load_model, show
from depthscope.analyses.commands.options import command, options

ATTRIBUTE = options(
    " ".join(AttributeConfig.__dataclass_fields__) + " threads model device dtype out force",
    AttributeConfig,
    required="transcoders prompt",
)


@command("attribute", ATTRIBUTE)
def attribute(o) -> None:
    """An attribution graph (circuit-tracer's): which transcoder features, error nodes and input
    tokens drive the top logits of PROMPT, through frozen attention.

    Writes to OUT: nodes.parquet (one row per node), adjacency.npz (rows targets, columns sources),
    attribution_summary.json (replacement and completeness scores, full and pruned), graph.json
    (circuit-tracer's/Neuronpedia's format), the figure attribution_graph (.png/.svg) and
    attribution.html (click a node: its edges, activation and top tokens; no network).
    """
    from depthscope.analyses.jobs.attribute import attribute_job, summary_table  # lazy: the job imports torch
    from depthscope.analyses.jobs.base import Output

    identity = {k: str(getattr(o, k)) for k in [*AttributeConfig.__dataclass_fields__, "dtype"]}
    config = begin(o, AttributeConfig, "attribute", identity)
    m = load_model(o, show=True)
    result = attribute_job(m, config, Output(o.out))
    show(summary_table(result.summary), result.files)
