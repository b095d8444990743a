"""``depthscope localize``: which depth carries a variable the model computes with: interchange
interventions or DAS per residual site and named position on counterfactual examples; the options
are the fields of :class:`~depthscope.analyses.causal.variables.config.LocalizeConfig`, the work is
:func:`~depthscope.analyses.jobs.localize.localize_job`."""

from __future__ import annotations

from depthscope.analyses.causal.variables.config import LocalizeConfig
from depthscope.analyses.commands.common import begin, loader, show
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output

LOCALIZE = options(
    "examples test train_fraction only_solved method dim boundless sites positions epochs lr batch_size seed "
    "probe_task probe_sentences model device dtype threads plots out force",
    LocalizeConfig,
    required="examples",
)


@command("localize", LOCALIZE)
def localize(o) -> None:
    """Interchange intervention accuracy (IIA) per depth: at each residual site and named position,
    put the source's vector (--method interchange) or its part in a learned subspace (--method das,
    --dim directions; --boundless) into the base and count how often the prediction over the
    candidates becomes the label, on held-out examples (--test, or a seeded split); --only-solved
    keeps the examples the model answers right without an intervention.

    Writes OUT/localize.csv|parquet, localize_summary.json, localize_iia.png; DAS also
    subspaces.safetensors; --probe-task adds localize_probes.csv|parquet and
    localize_three_curves.png (decodable, needed, computed with).
    """
    from depthscope.analyses.jobs import localize as jobs  # lazy: the job imports torch

    # the configuration reads and checks every example before the model loads
    cfg = begin(o, LocalizeConfig, "localize", {"examples": str(o.examples), "method": o.method})
    result = jobs.localize_job(loader(o), cfg, Output(o.out), progress=True)
    show(jobs.summary_table(result.tables[jobs.TABLE], result.summary), result.files)
