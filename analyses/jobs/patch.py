"""The patching job: activation (and attribution) patching of a prompt pair or a dataset of
pairs, or path patching; its tables and figures.

=========================  ======================================================================
:func:`patch_job`          one pair: tables ``patching_by_site`` (points patched whole: residual
                           sites, ``attn_out``, ``mlp_out``...) and ``patching_by_head`` (per-head
                           points: ``heads``, ``z``...), each with both methods (``method`` column)
                           and each written when it has rows; figures ``patching_sites`` (hook
                           point x position), ``patching_heads`` (layer x head) and
                           ``patching_attribution`` (attribution vs exact, every patch).
                           A pairs file (``--pairs``): ``patching`` (means over pairs with
                           bootstrap intervals, both methods) and ``patching_pairs`` (per pair),
                           the same figures drawn from the means. ``--method path``:
                           ``path_patching``, ``path_patching_pairs`` and the ``path_patching_heads``
                           heatmap (sender head x layer)
:func:`summary_table`      the console table of its summary (``depthscope patch`` prints it)
=========================  ======================================================================

What is patched by default (``sites=None``) is the IOI analysis of the README: every residual
site at each position (the last position only when the two prompts differ in token length; for a
dataset, each position the pairs name, else the last) and every attention head at the last
position: one table and one heatmap each. Explicit ``sites`` are patched at ``positions``
(default ``last``). Its settings are :class:`~depthscope.analyses.jobs.configs.PatchConfig`
(default: the IOI example).
"""

from __future__ import annotations

import pandas as pd
from rich.table import Table
from scipy.stats import spearmanr

from depthscope.analyses.circuits.pairs import PromptPair, read_pairs
from depthscope.analyses.circuits.patching import plots
from depthscope.analyses.circuits.patching.activation import (
    PAIR_KEYS,
    activation_patching,
    attribution_patching,
    check_patching,
    logit_diff,
    logprob,
    patch_pairs,
)
from depthscope.analyses.circuits.patching.results import add_note
from depthscope.analyses.circuits.patching.results import means as pair_means
from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import PatchConfig

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
    Spearman rank correlation of the estimate with exact patching in each table. With
    ``config.pairs``, the same over a dataset (:func:`_dataset_job`); with ``method="path"``,
    path patching (:func:`_path_job`)."""
    if config.method == "path":
        return _path_job(model, config, out)
    if config.pairs is not None:
        return _dataset_job(model, config, out)
    return _pair_job(model, config, out)


def _pair_job(model, config: PatchConfig, out: Output) -> JobResult:
    """One prompt pair: the tables ``patching_by_site`` and ``patching_by_head``."""
    metric = logit_diff(config.target, config.foil) if config.foil is not None else logprob(config.target)
    args = (model, config.clean, config.corrupted, metric)
    calls, note = _plan(model, config)
    _check_calls(model, [PromptPair(config.clean, config.corrupted)], metric, calls, config)
    exact, estimate = [], []
    for sites, positions in calls:
        kw = dict(sites=sites, positions=positions, direction=config.direction)
        exact.append(activation_patching(*args, batch_tokens=config.batch_tokens, **kw))
        if config.attribution:
            estimate.append(attribution_patching(*args, **kw))
    attrs = dict(exact[0].attrs)
    attrs["positions"] = ", ".join(dict.fromkeys(e.attrs["positions"] for e in exact))
    attrs["notes"] = list(dict.fromkeys(n for t in exact + estimate for n in t.attrs.get("notes", [])))
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
    summary = _summary(model, everything, parts, "; ".join(n for n in (note, *attrs["notes"]) if n))
    if config.attribution:
        summary["spearman_attribution_vs_exact"] = {part: _spearman(everything[rows]) for part, rows in parts.items()}
    if config.plots:
        for part in parts:
            plot = plots.plot_patching_sites if part == "sites" else plots.plot_patching_heads
            out.figure(plot, tables[TABLES[part]], name=FIGURES[part])
        rhos = summary.get("spearman_attribution_vs_exact") or {}
        if any(r is not None for r in rhos.values()):
            out.figure(plots.plot_attribution_vs_exact, everything, name="patching_attribution")
    else:  # an earlier run's figures must not pass for this run's
        out.drop(*FIGURES.values(), "patching_attribution")
    return JobResult(tables=tables, summary=summary, files=list(out.written))


def _check_calls(model, pairs, metric, calls, config: PatchConfig) -> None:
    """Every patching call of the job checked before the first runs (the memory of its largest
    pair included): a call that cannot run is refused before the others' minutes."""
    for sites, positions in calls:
        kw = dict(sites=sites, positions=positions, metric=metric, direction=config.direction)
        check_patching(model, pairs, batch_tokens=config.batch_tokens, **kw)
        if config.attribution:
            check_patching(model, pairs, method="attribution", **kw)


def _summary(model, everything, parts: dict, notes: str) -> dict:
    """The job's summary from the combined table; ``parts``: the non-empty tables' row masks."""
    methods = list(dict.fromkeys(everything["method"]))
    exact_rows = everything["method"] == ("activation" if "activation" in methods else methods[0])
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
    """'each (14)', 'last', 'all' or a position's name for the rows of one table."""
    names = list(dict.fromkeys(df["position_name"]))
    return str(names[0]) if len(names) == 1 else f"each ({len(names)})"


def _top(df, k: int):
    """The ``k`` rows with the largest |fraction recovered| (NaN last)."""
    return df.reindex(df["fraction_recovered"].abs().sort_values(ascending=False).index).head(k).itertuples()


def _spearman(df) -> float | None:
    """Rank correlation of the attribution estimate with exact patching over the same patches
    (None with fewer than 3 patches where both are defined)."""
    keys = ["point", "head", "position_name"]
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
    if r.position_name == "all":
        bits.append("all positions")
    elif pd.isna(r.position):
        bits.append(f"position {r.position_name}")
    else:
        bits.append(f"position {int(r.position)} {r.token!r}")
    return ", ".join(bits)


def summary_table(name: str, s: dict) -> Table:
    """The console table of a patch job's summary (``depthscope patch`` prints it)."""
    t = Table("quantity", "value", title=f"patching {name}: {s['metric']}")
    over = f" (means over {s['n_pairs']} pairs)" if s.get("n_pairs") else ""
    t.add_row("clean / corrupted", f"{s['clean_metric']:.3f} / {s['corrupted_metric']:.3f}{over}")
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


# ----------------------------------------------------------------------------- datasets
def _dataset_calls(config: PatchConfig, pairs) -> list[tuple[str, str]]:
    """(sites, positions) of each patch_pairs call: explicit sites at ``positions`` (default
    last); by default every residual site (at each named position when every pair names
    positions, else the last) and every head at the last position."""
    if config.sites is not None:
        return [(config.sites, config.positions or "last")]
    if config.positions is not None:
        return [("resid", config.positions), ("heads", config.positions)]
    named = all(p.positions for p in pairs)
    return [("resid", "each" if named else "last"), ("heads", "last")]


def _dataset_job(model, config: PatchConfig, out: Output) -> JobResult:
    """A JSONL dataset of pairs: ``patching`` (means over pairs with bootstrap intervals, both
    methods) and ``patching_pairs`` (one row per pair and patch), the heatmaps of the means and
    the attribution-vs-exact scatter; the Spearman correlation goes to the table's notes."""
    pairs = read_pairs(config.pairs)
    _check_calls(model, pairs, None, _dataset_calls(config, pairs), config)
    per = []
    for sites, positions in _dataset_calls(config, pairs):
        kw = dict(sites=sites, positions=positions, direction=config.direction)
        per.append(patch_pairs(model, pairs, batch_tokens=config.batch_tokens, **kw))
        if config.attribution:
            per.append(patch_pairs(model, pairs, method="attribution", **kw))
    per_pair = pd.concat(per, ignore_index=True)
    per_pair.attrs.update(per[0].attrs, positions=", ".join(dict.fromkeys(p.attrs["positions"] for p in per)))
    means = pair_means(per_pair, PAIR_KEYS)
    per_head = means["head"].notna()
    parts = {part: rows for part, rows in (("sites", ~per_head), ("heads", per_head)) if rows.any()}
    rhos = {part: _spearman(means[rows]) for part, rows in parts.items()} if config.attribution else {}
    for part, rho in rhos.items():
        if rho is not None:
            add_note(means, f"attribution vs exact, {part}: Spearman {rho:.3f}")
    out.table(means, "patching")
    out.table(per_pair, "patching_pairs")
    summary = _summary(model, means, parts, "; ".join(means.attrs["notes"]))
    summary["n_pairs"] = len(pairs)
    if rhos:
        summary["spearman_attribution_vs_exact"] = rhos
    if config.plots:
        _figures(out, means, parts, rhos)
    else:  # an earlier run's figures must not pass for this run's
        out.drop(*FIGURES.values(), "patching_attribution")
    return JobResult(tables={"patching": means, "patching_pairs": per_pair}, summary=summary, files=list(out.written))


def _figures(out: Output, table, parts: dict, rhos: dict) -> None:
    """The heatmap of each non-empty part and, with attribution rows, the scatter."""
    for part, rows in parts.items():
        plot = plots.plot_patching_sites if part == "sites" else plots.plot_patching_heads
        t = table[rows].reset_index(drop=True)
        t.attrs.update(table.attrs)
        out.figure(plot, t, name=FIGURES[part])
    if any(r is not None for r in rhos.values()):
        out.figure(plots.plot_attribution_vs_exact, table, name="patching_attribution")


# ----------------------------------------------------------------------------- path patching
def _path_job(model, config: PatchConfig, out: Output) -> JobResult:
    """Path patching from ``senders`` to ``receivers`` over the pairs file (or the one prompt
    pair): ``path_patching`` (means over pairs) and ``path_patching_pairs``, and its heatmap."""
    from depthscope.analyses.circuits.patching.path_plots import plot_path_patching
    from depthscope.analyses.circuits.patching.paths import (  # lazy: optional part of the job
        PATH_KEYS,
        path_patch_pairs,
    )

    if config.pairs is not None:
        pairs = read_pairs(config.pairs)
    else:
        pairs = [PromptPair(config.clean, config.corrupted, config.target, config.foil)]
    kw = dict(positions=config.positions or "all", batch_tokens=config.batch_tokens, direction=config.direction)
    per_pair = path_patch_pairs(model, pairs, config.senders, config.receivers, config.freeze_mlps, **kw)
    means = pair_means(per_pair, PATH_KEYS)
    out.table(means, "path_patching")
    out.table(per_pair, "path_patching_pairs")
    summary = _summary(model, means, {"senders": means["method"].notna()}, "; ".join(means.attrs["notes"]))
    summary["n_pairs"], summary["receivers"] = len(pairs), config.receivers
    if config.plots and means["head"].notna().any():
        out.figure(plot_path_patching, means, name="path_patching_heads")
    return JobResult(
        tables={"path_patching": means, "path_patching_pairs": per_pair}, summary=summary, files=list(out.written)
    )
