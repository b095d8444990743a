"""``depthscope patch``: activation and attribution patching of a clean/corrupted prompt pair; the
options are the fields of :class:`~depthscope.analyses.jobs.configs.PatchConfig`."""

from __future__ import annotations

from depthscope.analyses.commands.common import begin, load_model, show
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import PatchConfig

PATCH = options(
    "clean corrupted target foil pairs method senders receivers freeze_mlps positions sites direction attribution "
    "batch_tokens threads plots model device dtype stream out force",
    PatchConfig,
)


@command("patch", PATCH)
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
    last), per-head points (heads, z, q...) to patching_by_head, the others
    to patching_by_site. --no-attribution leaves out the estimate.

    --pairs FILE.jsonl (a JSON object per line: clean, corrupted, target,
    foil, optional named positions) patches every pair: patching.parquet
    holds the means over pairs with bootstrap intervals, patching_pairs the
    rows per pair. --method path: path patching from --senders to
    --receivers, other heads frozen (path_patching[_pairs].parquet).
    --direction noise patches corrupted values into the clean run instead.
    """
    from depthscope.analyses.jobs.patch import patch_job, summary_table  # lazy: the job imports torch

    prompts = {"pairs": str(o.pairs)} if o.pairs is not None else {"clean": o.clean, "corrupted": o.corrupted}
    config = begin(o, PatchConfig, "patch", {"method": o.method, **prompts})
    m = load_model(o, show=True)
    result = patch_job(m, config, Output(o.out))
    show(summary_table(m.name, result.summary), result.files)
