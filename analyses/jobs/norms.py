"""The norms job: contribution norms, the prompt per position, DLA and head writes, with figures.

==========================  =====================================================================
:class:`NormsConfig`        settings of :func:`norms_job` (its defaults are the only defaults)
:func:`norms_job`           tables ``norms_by_site``, ``norms_by_position``, ``dla`` (decoders
                            with final norm -> unembedding), ``head_writes`` (``heads=True``);
                            figures (PNG and SVG) ``norms_stream_growth``, ``norms_update_norms``,
                            ``norms_relative_update``, ``norms_position_heatmap``, ``norms_dla``,
                            ``norms_head_writes``; ``norms_summary.json``
==========================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.lens import DEFAULT_PROMPT


@dataclass
class NormsConfig:
    """What :func:`norms_job` computes. ``target``/``contrast``: DLA tokens (single-token strings;
    target None: the model's top prediction); ``heads``: also per-head write norms (one more pass);
    ``source``: the text's name (recorded in the summary)."""

    prompt: str = DEFAULT_PROMPT
    target: str | None = None
    contrast: str | None = None
    max_tokens: int | None = None
    batch_size: int = 4
    window: int | None = None
    heads: bool = False
    progress: bool = False
    source: str | None = None

    def validate(self) -> NormsConfig:
        """Check the settings (before the model loads); returns self."""
        from depthscope.common.errors import InputError
        from depthscope.probes.config import check_number

        check_number("batch_size", self.batch_size)
        check_number("window", self.window, allow_none=True)
        check_number("max_tokens", self.max_tokens, allow_none=True)
        if not self.prompt:
            raise InputError("the prompt is empty")
        return self


def _summary(model, df, dla, heads_df, config: NormsConfig) -> dict:
    from depthscope.analyses.norms import norms_summary

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


def norms_job(model, docs: Sequence[str], config: NormsConfig, out: Output) -> JobResult:
    """Contribution norms over ``docs``, the prompt per position, DLA of the prompt's next token and
    (``heads``) per-head writes; writes the tables, figures and summary named in the module doc.
    The summary is :func:`~depthscope.analyses.norms.norms_summary` plus the DLA's and heads'
    headline numbers (``dla_target``, ``dla_logit``, ``dla_top``, ``top_head``, ...)."""
    from depthscope.analyses.norms import contribution_norms, direct_logit_attribution, norms_by_position
    from depthscope.analyses.plots import norms as plots

    config.validate()
    df = contribution_norms(
        model,
        docs,
        batch_size=config.batch_size,
        window=config.window,
        max_tokens=config.max_tokens,
        progress=config.progress,
    )
    pos = norms_by_position(model, [config.prompt])
    dla = heads_df = None
    if model.unembed.decodes_stream:
        dla = direct_logit_attribution(model, [config.prompt], config.target, config.contrast)
    if config.heads:
        from depthscope.analyses.heads import head_write_norms

        heads_df = head_write_norms(
            model, docs, batch_size=config.batch_size, window=config.window, max_tokens=config.max_tokens
        )
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
    return JobResult(tables=tables, summary=summary, files=list(out.written))
