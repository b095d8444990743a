"""The norms job: contribution norms, the prompt per position, DLA and head writes, with figures.

==========================  =====================================================================
:func:`norms_job`           tables ``norms_by_site``, ``norms_by_position``, ``dla`` (decoders
                            with final norm -> unembedding), ``head_writes`` (``heads=True``);
                            figures (PNG and SVG) ``norms_stream_growth``, ``norms_update_norms``,
                            ``norms_relative_update``, ``norms_position_heatmap``, ``norms_dla``,
                            ``norms_head_writes``; ``norms_summary.json``
:func:`summary_table`       the console table of its summary (``depthscope norms`` prints it)
==========================  =====================================================================

Its settings are :class:`~depthscope.analyses.jobs.configs.NormsConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import NormsConfig
from depthscope.analyses.norms import (
    contribution_norms,
    direct_logit_attribution,
    norms_by_position,
    norms_summary,
    plots,
)
from depthscope.analyses.norms.heads import head_write_norms


def _summary(model, df, dla, heads_df, config: NormsConfig) -> dict:
    summary = norms_summary(df)
    summary.update(
        model=str(model.name),
        text=config.source,
        n_tokens=int(df.groupby("positions")["n_tokens"].first().sum()),
        notes=df.attrs.get("notes", ""),
    )
    if dla is not None:
        parts = dla[dla["site"] >= 0].sort_values("contribution", ascending=False)
        summary["dla_target"] = str(dla["target"].iloc[0])
        summary["dla_logit"] = float(dla["logit"].iloc[0])
        summary["dla_top"] = [[r.label, float(r.contribution)] for r in parts.head(5).itertuples()]
    if heads_df is not None:
        r = heads_df[heads_df["positions"] == "rest"]
        top = r.loc[r["write_norm"].idxmax()]
        summary["top_head"] = f"L{int(top['layer'])}H{int(top['head'])}"
        summary["top_head_write_norm"] = float(top["write_norm"])
        summary["mean_heads_coherence"] = float(r.groupby("layer")["heads_coherence"].first().mean())
    return summary


def summary_table(name: str, summary: dict) -> Table:
    """The console table of a norms job's summary (``depthscope norms`` prints it)."""
    t = Table("quantity", "value", title=f"contribution norms of {name} on {summary['n_tokens']} tokens")
    t.add_row("stream growth per block (fit)", f"x{summary['growth_rate']:.3f} (R² {summary['growth_r2']:.2f})")
    t.add_row("mean attention share", f"{summary['attn_share']:.3f}")
    t.add_row(
        "first-position / rest stream norm",
        f"{summary['sink_ratio']:.1f} (median over blocks; max {summary['sink_ratio_max']:.1f})",
    )
    if "massive_site" in summary:
        t.add_row(
            "largest |h|",
            f"{summary['massive_value']:.0f} at {summary['massive_site']}, "
            f"dim {summary['massive_dim']} ({summary['massive_positions']} position; "
            f"{summary['massive_over_median']:.0f}x median)",
        )
    if "dla_top" in summary:
        top = ", ".join(f"{lab} {v:+.2f}" for lab, v in summary["dla_top"][:3])
        t.add_row(f"DLA logit[{summary['dla_target']!r}]", f"{summary['dla_logit']:.2f}; top: {top}")
    if "top_head" in summary:
        t.add_row(
            "largest head write",
            f"{summary['top_head']} ({summary['top_head_write_norm']:.1f}); "
            f"mean heads coherence {summary['mean_heads_coherence']:.2f}",
        )
    return t


def norms_job(model, docs: Sequence[str], config: NormsConfig, out: Output) -> JobResult:
    """Contribution norms over ``docs``, the prompt per position, DLA of the prompt's next token and
    (``heads``) per-head writes; writes the tables, figures and summary named in the module doc.
    The summary is :func:`~depthscope.analyses.norms.norms_summary` plus the DLA's and heads'
    headline numbers (``dla_target``, ``dla_logit``, ``dla_top``, ``top_head``, ...)."""
    df = contribution_norms(model, docs, batch_size=config.batch_size, text=config.text, progress=config.progress)
    pos = norms_by_position(model, [config.prompt])
    dla = heads_df = None
    if model.unembed.decodes_stream:
        dla = direct_logit_attribution(model, [config.prompt], config.target, config.contrast)
    if config.heads:
        heads_df = head_write_norms(model, docs, batch_size=config.batch_size, text=config.text)
    tables = {"norms_by_site": df, "norms_by_position": pos, "dla": dla, "head_writes": heads_df}
    tables = {k: v for k, v in tables.items() if v is not None}
    for name, t in tables.items():
        out.table(t, name)
    summary = _summary(model, df, dla, heads_df, config)
    out.json(summary, "norms_summary")
    out.figure(plots.plot_stream_growth, df, name="norms_stream_growth")
    out.figure(plots.plot_update_norms, df, name="norms_update_norms")
    out.figure(plots.plot_relative_update, df, name="norms_relative_update")
    out.figure(plots.plot_position_heatmap, pos, name="norms_position_heatmap")
    if dla is not None:
        out.figure(plots.plot_dla, dla, name="norms_dla")
    if heads_df is not None:
        out.figure(plots.plot_head_writes, heads_df, name="norms_head_writes")
    # an earlier run's optional parts (--heads, DLA) must not pass for this run's
    optional = {"dla": "norms_dla", "head_writes": "norms_head_writes"}
    out.drop_tables(*(t for t in optional if t not in tables))
    out.drop(*(f for t, f in optional.items() if t not in tables))
    return JobResult(tables=tables, summary=summary, files=list(out.written))
