"""``depthscope circuit``: every edge scored (EAP, EAP-IG), the top circuits' faithfulness; the
options are the fields of :class:`~depthscope.analyses.jobs.configs.CircuitConfig`."""

from __future__ import annotations

from depthscope.analyses.commands.common import begin, load_model, show
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import CircuitConfig

CIRCUIT = options(
    " ".join(CircuitConfig.__dataclass_fields__) + " threads model device dtype out force",  # every field an option
    CircuitConfig,
    required="pairs",
)


@command("circuit", CIRCUIT)
def circuit(o) -> None:
    """A circuit as a set of edges: every edge scored (EAP, EAP-IG), the top circuits judged.

    Scores every edge of MIB's graph over half the pairs (or all, with --eval-pairs), runs the top
    0.1% ... 100% of edges as circuits on the others (every other edge ablated, exactly) and
    writes to OUT: edges and faithfulness (.parquet/.csv), circuit_summary,
    circuit_graph and circuit_mib (.json), the faithfulness curve (faithfulness_curve) and the
    circuit drawn (.png/.svg), circuit.html (interactive, no network).
    """
    from depthscope.analyses.jobs.circuit import circuit_job, summary_table  # lazy: the job imports torch

    named = [k for k in [*CircuitConfig.__dataclass_fields__, "dtype"] if k not in ("batch_tokens", "plots")]
    config = begin(o, CircuitConfig, "circuit", {k: str(getattr(o, k)) for k in named})
    m = load_model(o, show=True)
    result = circuit_job(m, config, Output(o.out))
    show(summary_table(m.name, result.summary), result.files)
