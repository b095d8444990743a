"""The report's sentences, computed from the tidy tables: one pure function per section.

Each ``*_findings`` function takes the tables a run wrote (as DataFrames) and the model's depth in
blocks, and returns the section's findings as plain sentences; :func:`probe_table` is the probe
summary as the report shows it. Nothing here reads files or knows about HTML or markdown: the
same sentences feed both pages (:mod:`depthscope.analyses.report.data` assembles them).
Numbers are written by :func:`fmt` ("n/a" for a missing value); intervals by
:func:`interval_text`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from depthscope.analyses.intervals import MIN_UNITS, too_few
from depthscope.analyses.norms.growth import fit_growth_rate

#: blocks by which the argmax-accuracy E_Delta must differ from the soft one (and lie outside its interval) for the
#: report to say so
SCORES_DISAGREE = 1.0

#: a write whose cosine to the stream is below this counts as writing against the stream
ERASING_COSINE = -0.2

__all__ = [
    "SCORES_DISAGREE",
    "causal_findings",
    "fmt",
    "interval_text",
    "lens_findings",
    "norm_findings",
    "probe_findings",
    "probe_table",
]


def fmt(x, nd: int = 2) -> str:
    """``x`` with ``nd`` decimals, or "n/a" when it is missing (None or NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def interval_text(row, col: str, nd: int = 2, scale: float = 1.0) -> str:
    """The text `` (95% interval [lo, hi])`` for ``row[col]`` (times ``scale``), empty when the
    table has no interval for it."""
    lo, hi = row.get(f"{col}_lo", float("nan")), row.get(f"{col}_hi", float("nan"))
    try:
        ok = np.isfinite(lo) and np.isfinite(hi)
    except TypeError:  # a missing bound read as None or text
        ok = False
    return f" (95% interval [{fmt(lo * scale, nd)}, {fmt(hi * scale, nd)}])" if ok else ""


# ---------------------------------------------------------------------------- probes
def probe_table(summary: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    """The probe summary as the report shows it: readable column names, the E_Δ interval, the
    scalar-mix E_s, selectivity in points, the chosen penalty and convergence."""
    s = summary

    def g(c):  # a summary column, or NaN where this summary lacks it
        return s[c] if c in s else pd.Series([np.nan] * len(s), index=s.index)

    names = s["task"].astype(str)
    if "probe" in s:  # --probe both: the MLP probe's rows read "task (mlp)"
        names = [n if p in (None, "linear") or p != p else f"{n} ({p})" for n, p in zip(names, s["probe"])]
    t = pd.DataFrame({"task": list(names)}, index=s.index)
    t["E_Δ (blocks)"] = g("expected_layer_delta")
    t["E_Δ 95% interval"] = [
        f"[{fmt(a, 1)}, {fmt(b, 1)}]" for a, b in zip(g("expected_layer_delta_lo"), g("expected_layer_delta_hi"))
    ]
    t["E_Δ / depth"] = g("expected_layer_delta") / n_layers
    t["E_Δ argmax accuracy (blocks)"] = g("expected_layer_delta_hard")
    t["E_s (blocks)"] = g("expected_layer_mix")
    t["E_s spread (sites)"] = g("mix_spread")
    t["total gain (soft, points)"] = 100 * g("total_delta")
    t["best site"] = g("best_label")
    t["best accuracy (%)"] = 100 * g("best_accuracy")
    t["majority (%)"] = 100 * g("majority_accuracy")
    t["max selectivity (points)"] = 100 * g("max_selectivity")
    t["L2"] = [f"{v:g}" if np.isfinite(v) else "n/a" for v in g("l2").astype(float)]
    t["converged"] = ["yes" if v is True or v == 1 else "no" for v in g("converged")]
    t["n train"] = g("n_train")
    t["n test"] = g("n_test")
    return t.reset_index(drop=True)


def probe_findings(summary: pd.DataFrame, by_site: pd.DataFrame, n_layers: int) -> list[str]:
    """The probe section's sentences: the order in which the properties emerge, warnings about
    E_Δ values not to read as depths, where the argmax score disagrees, unconverged probes, the
    earliest and latest property, and each task's best site."""
    if summary is None or not len(summary):
        return []
    s = summary.sort_values("expected_layer_delta")
    return [
        _emergence_order(s),
        *_unstable_intervals(s, n_layers),
        *_small_gains(s),
        *_score_disagreements(s),
        *_unconverged(s),
        *_earliest_and_latest(s, n_layers),
        *_best_sites(s, by_site),
    ]


def _emergence_order(s: pd.DataFrame) -> str:
    """Every task with its E_Δ (and interval), in the order of ``s``."""

    def interval(r):
        lo = getattr(r, "expected_layer_delta_lo", float("nan"))
        hi = getattr(r, "expected_layer_delta_hi", float("nan"))
        return f", 95% interval [{fmt(lo)}, {fmt(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else ""

    parts = [f"{r.task} (E_Δ = {fmt(r.expected_layer_delta)}{interval(r)})" for r in s.itertuples()]
    return (
        "Ordered by the expected layer of their cumulative gains, the properties emerge as: " + ", ".join(parts) + "."
    )


def _unstable_intervals(s: pd.DataFrame, n_layers: int) -> list[str]:
    """A warning naming the tasks whose E_Δ interval spans more than a quarter of the depth."""
    if "expected_layer_delta_lo" not in s:
        return []
    wide = s[(s["expected_layer_delta_hi"] - s["expected_layer_delta_lo"]) > 0.25 * n_layers]
    if not len(wide):
        return []
    return [
        "E_Δ is unstable for " + ", ".join(wide["task"]) + ": its bootstrap interval over the test "
        "examples spans more than a quarter of the depth (small total gain against noisy per-site gains); "
        "read the per-site accuracies instead."
    ]


def _small_gains(s: pd.DataFrame) -> list[str]:
    """One sentence per task whose total cumulative gain is too small for E_Δ to mean a depth."""
    if "expected_layer_delta_meaningful" not in s:
        return []
    weak = s[~s["expected_layer_delta_meaningful"].astype(bool)]
    return [
        f"{r.task}: the total cumulative gain is {fmt(100 * r.total_delta, 1)} points, too small for "
        "E_Δ to mean a depth (the embedding already decodes most of it)."
        for r in weak.itertuples()
    ]


def _score_disagreements(s: pd.DataFrame) -> list[str]:
    """One sentence per task whose argmax-accuracy E_Δ lies at least :data:`SCORES_DISAGREE`
    blocks from the soft one and outside the soft one's interval."""
    if not {"expected_layer_delta_hard", "expected_layer_delta_lo", "expected_layer_delta_hi"} <= set(s.columns):
        return []
    out = []
    for r in s.itertuples():
        soft, hard = r.expected_layer_delta, r.expected_layer_delta_hard
        if not (np.isfinite(soft) and np.isfinite(hard)) or abs(hard - soft) < SCORES_DISAGREE:
            continue
        lo, hi = r.expected_layer_delta_lo, r.expected_layer_delta_hi
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo <= hard <= hi:
            continue  # inside the interval, or no interval (too few test examples) to be outside of
        when = "earlier" if hard < soft else "later"
        why = " (later sites make the probe surer without changing many of its decisions)" if hard < soft else ""
        out.append(
            f"{r.task}: scored on the argmax accuracy (Tenney's score), E_Δ is {fmt(hard)} blocks against "
            f"{fmt(soft)} on the soft accuracy: the decisions are settled {when} than the probability of the "
            f"gold label{why}."
        )
    return out


def _unconverged(s: pd.DataFrame) -> list[str]:
    """A warning naming the tasks whose probes stopped at max_epochs."""
    if "converged" not in s or s["converged"].astype(bool).all():
        return []
    return [
        "Some probes stopped at max_epochs before converging ("
        + ", ".join(s[~s["converged"].astype(bool)]["task"])
        + "): raise --max-epochs before reading these numbers."
    ]


def _earliest_and_latest(s: pd.DataFrame, n_layers: int) -> list[str]:
    """The first and last task of ``s`` (sorted by E_Δ) as fractions of the depth, when there are two."""
    if len(s) <= 1:
        return []
    first, last = s.iloc[0], s.iloc[-1]
    gap = last.expected_layer_delta - first.expected_layer_delta
    return [
        f"{first.task} is resolved earliest, at "
        f"{fmt(first.expected_layer_delta / n_layers * 100, 0)}% of the depth; "
        f"{last.task} latest, at {fmt(last.expected_layer_delta / n_layers * 100, 0)}% "
        f"({fmt(gap)} blocks later)."
    ]


def _best_sites(s: pd.DataFrame, by_site: pd.DataFrame) -> list[str]:
    """Per task: its best site's accuracy and selectivity, and what the embedding alone gives."""
    out = []
    for r in s.itertuples():
        t = by_site[by_site["task"] == r.task]
        if "probe" in t and getattr(r, "probe", None) is not None:
            t = t[t["probe"] == r.probe]  # --probe both: each probe kind has its own rows
        if not len(t) or not t["accuracy"].notna().any():
            continue  # tree tasks (structural, depth) score UUAS / root accuracy, not accuracy
        best = t.loc[t["accuracy"].idxmax()]
        emb = t[t["site"] == 0]["accuracy"]
        sel = best.get("selectivity", float("nan"))
        line = (
            f"{r.task}: best accuracy {fmt(best['accuracy'] * 100, 1)}% at {best['label']} (depth {best['depth']:g}), "
            f"selectivity there {fmt(sel * 100, 1)} points"
        )
        if len(emb):
            line += f"; the embedding alone gives {fmt(float(emb.iloc[0]) * 100, 1)}%"
        out.append(line + ".")
    return out


# ---------------------------------------------------------------------------- logit lens
def lens_findings(lens_by_site: pd.DataFrame | None, n_layers: int) -> list[str]:
    """The lens section's sentences: how far the embedding is from the final prediction, where
    the lens first agrees with the model on half the tokens, the state half-way, and the site
    whose write lowers KL most."""
    if lens_by_site is None or not len(lens_by_site):
        return []
    d = lens_by_site.sort_values("site")
    emb = d.iloc[0]
    out = [
        f"Decoded directly, the embedding is far from the final prediction: KL = {fmt(emb['kl_to_final'])} nats"
        f"{interval_text(emb, 'kl_to_final')}, top-1 agreement {fmt(emb['top1_agreement'] * 100, 0)}%"
        f"{interval_text(emb, 'top1_agreement', 0, 100)}."
    ]
    half = d[d["top1_agreement"] >= 0.5]
    if len(half):
        h = half.iloc[0]
        out.append(
            f"The lens first agrees with the model's own top-1 on half the tokens at {h['label']} "
            f"(depth {h['depth']:g} of {n_layers}; {fmt(h['top1_agreement'] * 100, 0)}%"
            f"{interval_text(h, 'top1_agreement', 0, 100)})."
        )
    mid = d.iloc[len(d) // 2]
    out.append(
        f"Half-way ({mid['label']}), KL to the final distribution is {fmt(mid['kl_to_final'])} nats"
        f"{interval_text(mid, 'kl_to_final')} and the next-token cross-entropy {fmt(mid['cross_entropy'])} nats"
        f"{interval_text(mid, 'cross_entropy')}, against {fmt(d.iloc[-1]['cross_entropy'])} at the output"
        f"{interval_text(d.iloc[-1], 'cross_entropy')}."
    )
    return out + _largest_kl_drop(d)


def _largest_kl_drop(d: pd.DataFrame) -> list[str]:
    """The site after the largest fall in KL between consecutive sites of ``d`` (sorted by site)."""
    drops = d["kl_to_final"].diff(-1)  # how much KL falls from each site to the next
    if not drops.notna().any():
        return []
    i = drops.idxmax()
    at = d.index.get_loc(i) + 1
    if at >= len(d):
        return []
    nxt = d.loc[d.index[at]]
    return [
        f"The largest single drop in KL ({fmt(drops[i])} nats) comes from {nxt['label']} ({nxt['sublayer']} write)."
    ]


# ---------------------------------------------------------------------------- contribution norms
def norm_findings(norms: pd.DataFrame, n_layers: int) -> list[str]:
    """The norms section's sentences: the stream's growth, attention's share of the updates,
    the largest relative write, writes against the stream, and the first position's norm."""
    if norms is None or not len(norms):
        return []
    d = norms[norms["positions"] == "rest"] if "positions" in norms.columns else norms
    d = d.sort_values("site")
    upd = d.dropna(subset=["relative_update"])
    return [
        *_stream_growth(norms, d),
        *_attention_share(d),
        *_largest_write(upd),
        *_erasing_writes(d, upd),
        *_attention_sink(norms, d),
    ]


def _stream_growth(norms: pd.DataFrame, d: pd.DataFrame) -> list[str]:
    """The stream's norm at the embedding, after block 0 and after the last block, and the
    log-linear growth rate per block (over ``norms``, the whole table)."""
    e, f = d.iloc[0]["stream_norm"], d.iloc[-1]["stream_norm"]
    if not (e > 0 and f > 0):
        return []
    fit = fit_growth_rate(norms)
    b0 = d[d["label"] == "0.mlp"]["stream_norm"]
    line = f"The stream's norm goes from {fmt(e)} at the embedding"
    if len(b0):
        line += f" to {fmt(float(b0.iloc[0]))} after block 0"
    line += (
        f" and {fmt(f)}{interval_text(d.iloc[-1], 'stream_norm')} after the last block; a log-linear fit over the "
        f"block outputs gives ×{fmt(fit['rate'], 3)} per block (R² {fmt(fit['r2'])})."
    )
    return [line]


def _attention_share(d: pd.DataFrame) -> list[str]:
    """Attention's and the MLPs' mean shares of the per-layer update norm."""
    if "attn_share" not in d.columns:
        return []
    share = d[d["sublayer"] == "attn"]["attn_share"].mean()
    return [
        f"Attention writes {fmt(share * 100, 0)}% of the per-layer update norm on average, "
        f"MLPs {fmt((1 - share) * 100, 0)}%."
    ]


def _largest_write(upd: pd.DataFrame) -> list[str]:
    """The sublayer whose write is largest relative to the stream."""
    if not len(upd):
        return []
    big = upd.loc[upd["relative_update"].idxmax()]
    return [
        f"The largest write relative to the stream is {big['label']} (‖u‖/‖h‖ = {fmt(big['relative_update'])}"
        f"{interval_text(big, 'relative_update')})."
    ]


def _erasing_writes(d: pd.DataFrame, upd: pd.DataFrame) -> list[str]:
    """How many sublayers write against the stream (cosine below :data:`ERASING_COSINE`), and
    which most strongly."""
    if "cos_update_stream" not in d.columns:
        return []
    erase = upd[upd["cos_update_stream"] < ERASING_COSINE]
    if not len(erase):
        return []
    many = len(erase) != 1
    return [
        f"{len(erase)} sublayer{'s' if many else ''} write{'' if many else 's'} "
        f"against the stream (cosine < {ERASING_COSINE}), most strongly "
        f"{erase.loc[erase['cos_update_stream'].idxmin(), 'label']}."
    ]


def _attention_sink(norms: pd.DataFrame, d: pd.DataFrame) -> list[str]:
    """How much larger the first position's stream norm is than the other tokens' (``d``)."""
    if "positions" not in norms.columns or not (norms["positions"] == "first").any():
        return []
    first = norms[norms["positions"] == "first"].sort_values("site")
    ratio = first["stream_norm"].to_numpy()[-1] / max(d["stream_norm"].to_numpy()[-1], 1e-9)
    mx = first["stream_norm"].max() / max(d["stream_norm"].max(), 1e-9)
    return [
        f"The first position (attention sink) reaches up to {fmt(mx, 1)}× the norm of other tokens "
        f"(×{fmt(ratio, 1)} after the last block)."
    ]


def causal_findings(causal: pd.DataFrame | None) -> list[str]:
    """The "Encoded vs used" section (``depthscope run --causal``, table ``causal``): per task, where a
    linear probe reads the concept best, how close the probe is to the majority baseline after LEACE
    erasure (its check), and where erasing the concept costs the model most beyond random erasures of
    the same rank and size (``used`` with its 95% interval, its n and method, or why it has none),
    with the number of sites whose interval lies above 0."""
    if causal is None or not len(causal):
        return []
    out = []
    for task, d in causal.groupby("task", sort=False):
        best = d.loc[d["accuracy"].idxmax()]
        gap = float((d["accuracy_erased"] - d["majority"]).abs().max())
        top = d.loc[d["used"].idxmax()]
        out.append(
            f"{task}: encoded best at {best['label']} (probe accuracy {fmt(best['accuracy'], 3)}, majority "
            f"{fmt(best['majority'], 3)}); after LEACE the probe is within {fmt(gap, 3)} of the majority at every site."
        )
        out.append(
            f"{task}: used most at {top['label']}: erasing it raises the loss from {fmt(top['lm_loss'], 3)} to "
            f"{fmt(top['lm_loss_erased'], 3)} nats against {fmt(top['lm_loss_control_mean'], 3)} for random erasures "
            f"of rank {int(top['rank'])}{_control_size(top)} (used {fmt(top['used'], 3)}{_used_interval(top, d)}."
        )
    return out


def _control_size(row) -> str:
    """How large the edits were, in the stream's units, when the table says."""
    if not np.isfinite(row.get("edit_rms", float("nan"))):
        return ""
    return f" removing as much of the stream (rms edit {fmt(row['edit_rms'], 2)} on the fitting words)"


def _used_interval(top, d: pd.DataFrame) -> str:
    """``used``'s interval at the most-used site with its n and method, and at how many sites it lies
    above 0; or why there is no interval."""
    n = int(top["ci_n"]) if "ci_n" in top and top["ci_n"] == top["ci_n"] else int(top.get("n_lm_docs", 0))
    if not (np.isfinite(top["used_lo"]) and np.isfinite(top["used_hi"])):
        why = f"fewer than {MIN_UNITS}" if too_few(n) else "no bootstrap"
        return f"; no interval: {n} held-out documents, {why})"
    method = top.get("ci_method", "bootstrap over documents")
    return (
        f", 95% interval {fmt(top['used_lo'], 3)} to {fmt(top['used_hi'], 3)} over {n} documents, {method}); "
        f"the interval lies above 0 at {int((d['used_lo'] > 0).sum())} of {len(d)} sites"
    )
