"""``depthscope circuit``: every edge scored (EAP, EAP-IG), the top circuits' faithfulness; the
options are the fields of :class:`~depthscope.analyses.jobs.configs.CircuitConfig`."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from depthscope.analyses.commands.common import load_model, prepare_out, set_threads
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import CircuitConfig
from depthscope.common.settings import build

CIRCUIT = options(
    "pairs method steps ablation random_draws bootstrap seed threshold draw_edges batch_tokens plots "
    "threads model device dtype out force",
    CircuitConfig,
    required="pairs",
)


def circuit(o) -> None:
    """A circuit as a set of edges: every edge scored (EAP, EAP-IG), the top circuits judged.

    Scores every edge of MIB's graph over the pairs, runs the top 0.1% ...
    100% of edges as circuits (every other edge ablated, exactly) and
    writes to OUT: edges and faithfulness (.parquet/.csv), circuit_summary,
    circuit_graph and circuit_mib (.json), the faithfulness curve (faithfulness_curve) and the
    circuit drawn (.png/.svg), circuit.html (interactive, no network).
    """
    from depthscope.analyses.jobs.circuit import circuit_job, summary_table  # lazy: the job imports torch

    set_threads(o.threads)
    config = build(CircuitConfig, o)
    prepare_out(o.out, "circuit", {"model": o.model or "default", "pairs": str(o.pairs), "method": o.method}, o.force)
    m = load_model(o)
    Console(stderr=True).print(repr(m))
    result = circuit_job(m, config, Output(o.out))
    Console(width=None if sys.stdout.isatty() else 160).print(summary_table(m.name, result.summary))
    for p in result.files:
        typer.echo(f"wrote {p}")


def register(app: typer.Typer) -> None:
    command(app, "circuit", CIRCUIT)(circuit)
