"""The layers job: every block skipped and every neighbouring pair swapped, scored on a text.

==========================  =====================================================================
:func:`layers_job`          table ``layers`` (:func:`~depthscope.analyses.causal.erasure.layers.layer_interventions`),
                            figure ``layers_curves`` (PNG and SVG), ``layers_summary.json``
:func:`summary_table`       the console table of its summary (``depthscope layers`` prints it)
==========================  =====================================================================

Its settings are :class:`~depthscope.analyses.jobs.configs.LayersConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from depthscope.analyses.causal.erasure.layer_plots import plot_layers
from depthscope.analyses.causal.erasure.layers import layer_interventions
from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import LayersConfig


def _summary(model, df, config: LayersConfig) -> dict:
    """The unmodified cross-entropy and, per intervention, the block that hurts most and least."""
    base = df[df["intervention"] == "none"].iloc[0]
    summary = {
        "model": str(model.name),
        "text": config.source,
        "n_docs": int(df.attrs["n_docs"]),
        "n_windows": int(df.attrs["n_windows"]),
        "n_predictions": int(base["n_predictions"]),
        "cross_entropy": float(base["cross_entropy"]),
    }
    for kind in ("skip", "swap"):
        part = df[df["intervention"] == kind]
        if len(part):
            worst, best = part.loc[part["cross_entropy"].idxmax()], part.loc[part["cross_entropy"].idxmin()]
            summary[f"{kind}_worst"] = [int(worst["layer"]), float(worst["cross_entropy"])]
            summary[f"{kind}_mildest"] = [int(best["layer"]), float(best["cross_entropy"])]
            summary[f"{kind}_mean_agreement"] = float(part["top1_agreement"].mean())
    return summary


def summary_table(name: str, summary: dict) -> Table:
    """The console table of a layers job's summary (``depthscope layers`` prints it)."""
    t = Table("quantity", "value", title=f"layer interventions of {name} on {summary['n_predictions']} predictions")
    t.add_row("cross-entropy, unmodified", f"{summary['cross_entropy']:.3f}")
    for kind in ("skip", "swap"):
        if f"{kind}_worst" in summary:
            (lw, cw), (lb, cb) = summary[f"{kind}_worst"], summary[f"{kind}_mildest"]
            t.add_row(f"{kind}: worst block", f"{lw} (cross-entropy {cw:.3f})")
            t.add_row(f"{kind}: mildest block", f"{lb} (cross-entropy {cb:.3f})")
            t.add_row(f"{kind}: mean top-1 agreement", f"{summary[f'{kind}_mean_agreement']:.3f}")
    return t


def layers_job(model, docs: Sequence[str], config: LayersConfig, out: Output) -> JobResult:
    """Skip and swap every block of ``model`` on ``docs`` read under ``config.text``; writes the
    table ``layers``, the figure ``layers_curves`` and ``layers_summary.json``."""
    cfg = config
    df = layer_interventions(model, list(docs), batch_size=cfg.batch_size, text=cfg.text, progress=cfg.progress)
    out.table(df, "layers")
    summary = _summary(model, df, config)
    out.json(summary, "layers_summary")
    out.figure(plot_layers, df, name="layers_curves", title=f"{model.name}: blocks skipped and swapped")
    return JobResult(tables={"layers": df}, summary=summary, files=list(out.written))
