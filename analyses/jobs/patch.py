"""The patching job: activation (and attribution) patching of one prompt pair, its table and figures.

=========================  ======================================================================
:class:`PatchConfig`       settings of :func:`patch_job` (its defaults are the only defaults: the
                           ``depthscope patch`` options read them); default: the IOI example
:func:`patch_job`          table ``patching`` (both methods, ``method`` column); figures
                           ``patching_sites`` (hook point x position), ``patching_heads`` (layer x
                           head, when per-head points are patched), ``patching_attribution``
                           (attribution vs exact, when both are computed)
=========================  ======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import JobResult, Output

IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


@dataclass
class PatchConfig:
    """What :func:`patch_job` computes: the prompt pair, the metric ``logit[target] -
    logit[foil]`` at the last token (``foil`` None: ``logprob[target]``), the hook points
    (comma-separated names or group words, None: every residual site), the positions mode
    (``last`` | ``all`` | ``each``), whether to add the attribution estimate, the tokens per
    forward and the figures."""

    clean: str = IOI_CLEAN
    corrupted: str = IOI_CORRUPTED
    target: str = " Mary"
    foil: str | None = " John"
    sites: str | None = None
    positions: str = "last"
    attribution: bool = True
    batch_tokens: int = 2048
    plots: bool = True

    def validate(self) -> PatchConfig:
        """Check the settings (before the model loads); returns self."""
        from depthscope.hooks.errors import InputError
        from depthscope.probes.config import check_number

        check_number("batch_tokens", self.batch_tokens)
        if self.positions not in ("last", "all", "each"):
            raise InputError(f"positions must be one of last, all, each, got {self.positions!r}")
        if not self.clean or not self.corrupted:
            raise InputError("the clean and the corrupted prompt must not be empty")
        return self


def patch_job(model, config: PatchConfig, out: Output) -> JobResult:
    """Patch the clean prompt's activations into the corrupted run at every hook point; writes the
    table and figures named in the module doc. Summary: the metric, its clean and corrupted values,
    the number of patches, the five points that recover most, and (with attribution) the Spearman
    rank correlation of the estimate with exact patching."""
    import pandas as pd
    from scipy.stats import spearmanr

    from depthscope.analyses.patching import activation_patching, attribution_patching, logit_diff, logprob
    from depthscope.analyses.plots import patching as plots

    config.validate()
    metric = logit_diff(config.target, config.foil) if config.foil is not None else logprob(config.target)
    args = (model, config.clean, config.corrupted, metric)
    kw = dict(sites=config.sites, positions=config.positions)
    exact = activation_patching(*args, batch_tokens=config.batch_tokens, **kw)
    parts = [exact]
    if config.attribution:
        parts.append(attribution_patching(*args, **kw))
    table = pd.concat(parts, ignore_index=True)
    table.attrs.update(exact.attrs)
    out.table(table, "patching")
    top = exact.reindex(exact["fraction_recovered"].abs().sort_values(ascending=False).index).head(5)
    summary = {
        "model": str(model.name),
        "metric": exact.attrs["metric"],
        "positions": config.positions,
        "clean_metric": float(exact["clean_metric"].iloc[0]),
        "corrupted_metric": float(exact["corrupted_metric"].iloc[0]),
        "n_patches": int(len(exact)),
        "top": [[_where(r), float(r.fraction_recovered)] for r in top.itertuples()],
        "notes": exact.attrs.get("notes", ""),
    }
    if config.attribution:
        est = parts[1]["fraction_recovered"].to_numpy()
        ok = pd.notna(est) & pd.notna(exact["fraction_recovered"].to_numpy())
        summary["spearman_attribution_vs_exact"] = (
            float(spearmanr(exact["fraction_recovered"][ok], est[ok]).statistic) if ok.sum() > 2 else None
        )
    if config.plots:
        if exact["head"].isna().any():
            out.figure(plots.plot_patching_sites, table, name="patching_sites")
        if exact["head"].notna().any():
            out.figure(plots.plot_patching_heads, table, name="patching_heads")
        if config.attribution and summary["spearman_attribution_vs_exact"] is not None:
            out.figure(plots.plot_attribution_vs_exact, table, name="patching_attribution")
    return JobResult(tables={"patching": table}, summary=summary, files=list(out.written))


def _where(r) -> str:
    """'14.attn, position 13 ' to'' (plus the head for per-head points)."""
    import pandas as pd

    bits = [r.point] + ([] if pd.isna(r.head) else [f"head {int(r.head)}"])
    bits.append("all positions" if pd.isna(r.position) else f"position {int(r.position)} {r.token!r}")
    return ", ".join(bits)
