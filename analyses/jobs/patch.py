"""The patching job: activation (and attribution) patching of one prompt pair, its tables and figures.

=========================  ======================================================================
:func:`patch_job`          tables ``patching_by_site`` (points patched whole: residual sites,
                           ``attn_out``, ``mlp_out``) and ``patching_by_head`` (per-head points:
                           ``heads``, ``z``), each with both methods (``method`` column) and each
                           written when it has rows; figures ``patching_sites`` (hook point x
                           position), ``patching_heads`` (layer x head) and
                           ``patching_attribution`` (attribution vs exact, every patch)
:func:`summary_table`      the console table of its summary (``depthscope patch`` prints it)
=========================  ======================================================================

What is patched by default (``sites=None``) is the IOI analysis of the README: every residual
site at each position (the last position only when the two prompts differ in token length) and
every attention head at the last position: one table and one heatmap each. Explicit ``sites``
are patched at ``positions`` (default ``last``), and their rows are split between the two tables.
Its settings are :class:`~depthscope.analyses.jobs.configs.PatchConfig` (default: the IOI example).
"""

from __future__ import annotations

import pandas as pd
from rich.table import Table
from scipy.stats import spearmanr

from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import PatchConfig
from depthscope.analyses.patching import activation_patching, attribution_patching, logit_diff, logprob
from depthscope.analyses.plots import patching as plots

#: table name per part: points patched whole, and per-head points
TABLES = {"sites": "patching_by_site", "heads": "patching_by_head"}
#: figure name per part
FIGURES = {"sites": "patching_sites", "heads": "patching_heads"}


def _plan(model, config: PatchConfig) -> tuple[list[tuple[str, str | None]], str]:
    """The activation_patching calls to make, as (sites, positions) pairs, and a note on what the
    default chose (empty when nothing to say)."""
    if config.sites is not None:
        return [(config.sites, config.positions or "last")], ""
    if config.positions is not None:
        return [("resid", config.positions), ("heads", config.positions)], ""
    n_clean = int(model.tokenize([config.clean])[0].shape[1])
    n_corrupted = int(model.tokenize([config.corrupted])[0].shape[1])
    if n_clean == n_corrupted:
        return [("resid", "each"), ("heads", "last")], ""
    note = (
        f"the prompts have {n_clean} and {n_corrupted} tokens: residual sites patched at the last position "
        f"only (each position needs prompts of the same token length)"
    )
    return [("resid", "last"), ("heads", "last")], note


def patch_job(model, config: PatchConfig, out: Output) -> JobResult:
    """Patch the clean prompt's activations into the corrupted run; writes the tables and figures
    named in the module doc. Summary: the metric, its clean and corrupted values, the number of
    patches, the five patches that recover most in each table, and (with attribution) the
    Spearman rank correlation of the estimate with exact patching in each table."""
    metric = logit_diff(config.target, config.foil) if config.foil is not None else logprob(config.target)
    args = (model, config.clean, config.corrupted, metric)
    calls, note = _plan(model, config)
    exact, estimate = [], []
    for sites, positions in calls:
        exact.append(activation_patching(*args, sites=sites, positions=positions, batch_tokens=config.batch_tokens))
        if config.attribution:
            estimate.append(attribution_patching(*args, sites=sites, positions=positions))
    attrs = dict(exact[0].attrs)
    attrs["positions"] = ", ".join(dict.fromkeys(e.attrs["positions"] for e in exact))
    everything = pd.concat(exact + estimate, ignore_index=True)
    everything.attrs.update(attrs)
    per_head = everything["head"].notna()
    parts = {part: rows for part, rows in (("sites", ~per_head), ("heads", per_head)) if rows.any()}
    tables = {}
    for part, rows in parts.items():
        t = everything[rows].reset_index(drop=True)
        t.attrs.update(attrs)
        tables[TABLES[part]] = t
        out.table(t, TABLES[part])
    summary = _summary(model, everything, parts, "; ".join(n for n in (note, attrs.get("notes", "")) if n))
    if config.attribution:
        summary["spearman_attribution_vs_exact"] = {part: _spearman(everything[rows]) for part, rows in parts.items()}
    if config.plots:
        for part in parts:
            plot = plots.plot_patching_sites if part == "sites" else plots.plot_patching_heads
            out.figure(plot, tables[TABLES[part]], name=FIGURES[part])
        rhos = summary.get("spearman_attribution_vs_exact") or {}
        if any(r is not None for r in rhos.values()):
            out.figure(plots.plot_attribution_vs_exact, everything, name="patching_attribution")
    return JobResult(tables=tables, summary=summary, files=list(out.written))


def _summary(model, everything, parts: dict, notes: str) -> dict:
    """The job's summary from the combined table; ``parts``: the non-empty tables' row masks."""
    exact_rows = everything["method"] == "activation"
    first = everything[exact_rows].iloc[0]
    return {
        "model": str(model.name),
        "metric": everything.attrs["metric"],
        "positions": {part: _positions(everything[rows & exact_rows]) for part, rows in parts.items()},
        "clean_metric": float(first["clean_metric"]),
        "corrupted_metric": float(first["corrupted_metric"]),
        "n_patches": int(exact_rows.sum()),
        "top": {
            part: [[_where(r), float(r.fraction_recovered)] for r in _top(everything[rows & exact_rows], 5)]
            for part, rows in parts.items()
        },
        "notes": notes,
    }


def _positions(df) -> str:
    """'each (14)', 'last' or 'all' for the rows of one table."""
    if df["position"].isna().all():
        return "all"
    n = int(df["position"].nunique())
    return "last" if n == 1 else f"each ({n})"


def _top(df, k: int):
    """The ``k`` rows with the largest |fraction recovered| (NaN last)."""
    return df.reindex(df["fraction_recovered"].abs().sort_values(ascending=False).index).head(k).itertuples()


def _spearman(df) -> float | None:
    """Rank correlation of the attribution estimate with exact patching over the same patches
    (None with fewer than 3 patches where both are defined)."""
    keys = ["point", "head", "position"]
    a = df[df["method"] == "activation"].set_index(keys)["fraction_recovered"]
    b = df[df["method"] == "attribution"].set_index(keys)["fraction_recovered"]
    both = pd.concat({"exact": a, "estimate": b}, axis=1, join="inner").dropna()
    if len(both) < 3:
        return None
    rho = float(spearmanr(both["exact"], both["estimate"]).statistic)
    return rho if rho == rho else None  # constant columns give NaN


def _where(r) -> str:
    """'14.attn, position 13 ' to'' (plus the head for per-head points)."""
    bits = [r.point] + ([] if pd.isna(r.head) else [f"head {int(r.head)}"])
    bits.append("all positions" if pd.isna(r.position) else f"position {int(r.position)} {r.token!r}")
    return ", ".join(bits)


def summary_table(name: str, s: dict) -> Table:
    """The console table of a patch job's summary (``depthscope patch`` prints it)."""
    t = Table("quantity", "value", title=f"patching {name}: {s['metric']}")
    t.add_row("clean / corrupted", f"{s['clean_metric']:.3f} / {s['corrupted_metric']:.3f}")
    positions = ", ".join(f"{part} at {where}" for part, where in s["positions"].items())
    t.add_row("patches", f"{s['n_patches']} ({positions})")
    for rows in s["top"].values():
        for where, frac in rows:
            t.add_row(where, f"{frac:+.3f} recovered")
    for part, rho in (s.get("spearman_attribution_vs_exact") or {}).items():
        if rho is not None:
            t.add_row(f"attribution vs exact, {part} (Spearman)", f"{rho:.3f}")
    if s["notes"]:
        t.add_row("note", s["notes"])
    return t
