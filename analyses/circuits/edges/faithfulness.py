"""Faithfulness of the top-scored circuits (MIB's circuit track): f(k), CPR, CMD, random circuits, stability.

=====================  =========================================================================
offers                 what
=====================  =========================================================================
circuit_faithfulness   the curve: one row per size k (percent of the graph's edges) with f(k),
                       the same for seeded random circuits (mean and spread), and in ``attrs``
                       CPR and CMD of both
faithfulness_curve     the same from a prepared :class:`~depthscope.analyses.circuits.edges.evaluate.CircuitEvaluator`
areas                  (CPR, CMD) of a curve, as MIB computes them
circuit_stability      the Jaccard overlap of top-k circuits over bootstrap resamples of the pairs
smallest_faithful      the smallest circuit on a curve with f >= a threshold (None: none)
top_circuit            the in-circuit matrix of the top n edges by |score| or by MIB's signed
                       score (pruned as MIB does)
random_circuit         a random circuit of a given size after pruning
small_area             the mean f over the sizes up to 5 %
FRACTIONS              k = 0, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100 % (as fractions)
=====================  =========================================================================

For the circuit ``C_k`` of the top ``k`` percent of edges (``floor(k / 100 * E)`` edges of the
``E`` real ones, then pruned as MIB prunes: edges of nodes without an incoming or an outgoing
edge dropped), its faithfulness is

    f(k) = (m(C_k) - m(empty)) / (m(full) - m(empty))

with each ``m`` the mean over pairs of the metric (a ratio of means, as MIB): ``m(full)`` the
clean runs, ``m(empty)`` the circuit without edges (under counterfactual ablation, the corrupted
runs). Two rankings, MIB's conventions: ``f`` for the top edges by ``|score|`` and ``f_signed``
for the top edges by MIB's signed score (``MIB_SIGN * score``: depthscope's score is the change
of the metric when the edge is corrupted, negative for an edge that supports the target; MIB's
is the change of the loss, positive for it). **CPR** is the area under ``f_signed`` and **CMD**
the area under ``|1 - f|``, both by the trapezoidal rule over the ten sizes 0.1 % ... 100 % on a
linear axis of fractions (MIB's ``evaluate_area_under_curve``; ``k = 0`` is shown, not
integrated); ``cpr_abs`` and ``cmd_signed`` are the other two areas, ``cpr_5pct`` the mean of
``f_signed`` over the sizes up to 5 % (:func:`small_area`). The random baseline draws
``random_draws`` circuits per size holding as many edges *after pruning* as the top ``|score|``
circuit (:func:`random_circuit`); its curve is the mean of the draws (``f_random``) with their
standard deviation, minimum, maximum and sizes, and its CPR and CMD are those of the mean curve.
Intervals: percentile bootstrap over the evaluated pairs (``CI_BOOT`` resamples, seeded), NaN
below ``MIN_UNITS`` pairs with a note (:mod:`depthscope.analyses.intervals`). Stability: for
``n_boot`` resamples of the pairs (with replacement, seeded), the Jaccard overlap of each
resample's top-k edge set (by the mean score over the resample, unpruned) with the whole
dataset's.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from depthscope.analyses.circuits.edges.evaluate import BATCH_TOKENS, CircuitEvaluator
from depthscope.analyses.circuits.edges.graph import CircuitGraph, circuit_graph, prune_circuit
from depthscope.analyses.intervals import provenance, too_few, too_few_note
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.common.settings import check_number

log = logging.getLogger("depthscope")

__all__ = [
    "circuit_faithfulness",
    "faithfulness_curve",
    "areas",
    "circuit_stability",
    "smallest_faithful",
    "top_circuit",
    "random_circuit",
    "small_area",
    "edge_scores_of",
    "MIB_SIGN",
    "FRACTIONS",
]

#: circuit sizes as fractions of the graph's edges: k = 0, then MIB's ten sizes
FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
MAX_DRAWS, MAX_BOOT = 100, 100_000
#: MIB's edge score is ``MIB_SIGN`` times depthscope's: depthscope scores the change of the metric
#: (logit[target] - logit[foil]) when the edge is corrupted, MIB the change of the loss (its negation),
#: so an edge that supports the target scores negative here and positive in MIB
MIB_SIGN = -1
#: edges a random circuit skips (each would pass the size it is drawn at) before it keeps the closest
SKIPS = 50
#: the faithfulness intervals: percentile bootstrap over the evaluated pairs
CI_BOOT, CI_LEVEL = 1000, 0.95
#: the sizes the small-circuit area covers (fractions of the edges)
SMALL_UPTO = 0.05


def n_of(fraction: float, n_edges: int) -> int:
    """Edges in a circuit of ``fraction`` of the graph (MIB: ``int(fraction * n)``)."""
    return int(fraction * n_edges)


def edge_scores_of(graph: CircuitGraph, edges: pd.DataFrame) -> np.ndarray:
    """Each real edge's score, in ``graph.edge_index`` order, from a table with ``sender``,
    ``receiver`` and ``score`` covering every edge of the graph once (an
    :func:`~depthscope.analyses.circuits.edges.eap.edge_attribution` result)."""
    missing = [c for c in ("sender", "receiver", "score") if c not in getattr(edges, "columns", ())]
    if missing:
        raise InputError(f"faithfulness needs a table of edge scores (sender, receiver, score); it has no {missing}")
    si, ri = graph.sender_index, graph.receiver_index
    try:
        s = np.array([si[x] for x in edges["sender"]], dtype=np.int64)
        r = np.array([ri[x] for x in edges["receiver"]], dtype=np.int64)
    except KeyError as e:
        raise InputError(
            f"the edge table names {e.args[0]!r}, which is no sender or receiver of this model's graph"
        ) from None
    scores = np.asarray(edges["score"], dtype=np.float64)
    if not np.isfinite(scores).all():
        raise InputError("the edge table has scores that are NaN or infinite")
    full = np.full(graph.mask.shape, np.nan)
    full[s, r] = scores
    es, er = graph.edge_index
    out = full[es, er]
    if len(edges) != graph.n_edges or np.isnan(out).any() or not graph.mask[s, r].all():
        raise InputError(
            f"the edge table must score each of the graph's {graph.n_edges} edges once (an edge_attribution "
            f"result for this model); it has {len(edges)} rows"
        )
    return out


def top_circuit(
    graph: CircuitGraph, scores: np.ndarray, n: int, *, pruned: bool = True, signed: bool = False
) -> np.ndarray:
    """The in-circuit matrix ``[senders, receivers]`` of the ``n`` edges with the largest
    ``|score|`` (``signed``: the largest score in MIB's sign, ``MIB_SIGN * score``: the edges that
    support the target most), ``scores`` per edge in ``graph.edge_index`` order (ties in that
    order), pruned (:func:`~depthscope.analyses.circuits.edges.graph.prune_circuit`) unless
    ``pruned`` is False."""
    key = MIB_SIGN * np.asarray(scores) if signed else np.abs(scores)
    order = np.argsort(-key, kind="stable")[:n]
    return _matrix(graph, order, pruned)


def random_circuit(graph: CircuitGraph, size: int, rng: np.random.Generator, *, skips: int = SKIPS) -> np.ndarray:
    """A random circuit of ``size`` edges *after pruning* (pruned, ``[senders, receivers]``).

    The edges of a uniformly random order are taken until the pruned circuit holds at least
    ``size`` (the pruned size only grows as edges are added, so a binary search finds the shortest
    such prefix). When the last edge taken passes ``size`` (it joins several edges into paths at
    once), that edge is skipped and the order goes on from the circuit before it, up to ``skips``
    times; then the circuit closest to ``size`` is kept (its size is reported beside f). Redrawing
    this way, not drawing at the unpruned size: a random set of the top circuit's unpruned size
    prunes to far fewer edges (to none on deep models), and f_random would be 0 by construction."""
    order, base, best = rng.permutation(graph.n_edges), np.zeros(0, dtype=np.int64), None
    for _ in range(skips + 1):
        lo, hi = 0, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            if _matrix(graph, np.concatenate([base, order[:mid]]), True).sum() >= size:
                hi = mid
            else:
                lo = mid + 1
        kept = _matrix(graph, np.concatenate([base, order[:lo]]), True)
        if best is None or abs(int(kept.sum()) - size) < abs(int(best.sum()) - size):
            best = kept
        if int(kept.sum()) <= size or lo == 0:  # the size, or the most the remaining edges reach
            break
        base, order = np.concatenate([base, order[: lo - 1]]), order[lo:]
    return best


def _matrix(graph: CircuitGraph, edge_ids: np.ndarray, pruned: bool) -> np.ndarray:
    kept = np.zeros(graph.mask.shape, dtype=bool)
    s, r = graph.edge_index
    kept[s[edge_ids], r[edge_ids]] = True
    return prune_circuit(graph, kept) if pruned else kept


def areas(fractions, f) -> tuple[float, float]:
    """(CPR, CMD): the trapezoidal areas under ``f`` and under ``|1 - f|`` over the sizes with
    fraction > 0 (MIB's ``evaluate_area_under_curve``, linear axis); NaN when ``f`` is."""
    x, y = np.asarray(fractions, dtype=float), np.asarray(f, dtype=float)
    keep = x > 0
    x, y = x[keep], y[keep]
    if len(x) < 2 or not np.isfinite(y).all():
        return float("nan"), float("nan")
    dx = np.diff(x)
    cpr = float(np.sum(dx * (y[1:] + y[:-1]) / 2))
    gap = np.abs(1 - y)
    return cpr, float(np.sum(dx * (gap[1:] + gap[:-1]) / 2))


def _f(values: float, full: float, empty: float) -> float:
    gap = full - empty
    return float((values - empty) / gap) if gap != 0 else float("nan")


def small_area(fractions, f, upto: float = SMALL_UPTO) -> float:
    """The trapezoidal area under ``f`` over the sizes with fraction in (0, ``upto``], divided by
    their width: the mean faithfulness of the small circuits (the linear CPR is dominated by the
    sizes of 10 to 100 %, where most circuits are faithful); NaN when ``f`` is there."""
    x, y = np.asarray(fractions, dtype=float), np.asarray(f, dtype=float)
    keep = (x > 0) & (x <= upto + 1e-12)
    x, y = x[keep], y[keep]
    if len(x) < 2 or not np.isfinite(y).all():
        return float("nan")
    return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))


def faithfulness_curve(
    ev: CircuitEvaluator, scores: np.ndarray, *, random_draws: int = 5, seed: int = 0, fractions=FRACTIONS
) -> pd.DataFrame:
    """The faithfulness table (:func:`circuit_faithfulness`) of per-edge ``scores`` on a prepared evaluator."""
    check_number("random_draws", random_draws, minimum=0, maximum=MAX_DRAWS)
    graph = ev.graph
    E = graph.n_edges
    ends = ev.clean(), _metrics(ev, np.zeros(graph.mask.shape, dtype=bool))
    full, empty = float(ends[0].mean()), float(ends[1].mean())
    warning = gap_warning(full, empty, getattr(ev.model, "dtype", None))
    rng = np.random.default_rng(seed)
    rows, per_pair = [], {"f": [], "f_signed": []}
    todo = sum(2 + random_draws for f in fractions if 0 < n_of(f, E) < E)
    with progress_bar(todo, desc="faithfulness", unit="circuit") as bar:
        for frac in fractions:
            n = n_of(frac, E)
            kept, signed = top_circuit(graph, scores, n), top_circuit(graph, scores, n, signed=True)
            value, value_s = _evaluate(ev, kept, n, E, ends), _evaluate(ev, signed, n, E, ends)
            per_pair["f"].append(value)
            per_pair["f_signed"].append(value_s)
            if 0 < n < E:
                draws = [random_circuit(graph, int(kept.sum()), rng) for _ in range(random_draws)]
                rand = [(float(_evaluate(ev, d, n, E, ends).mean()), int(d.sum())) for d in draws]
                bar.update(2 + random_draws)
            else:  # the empty and the full circuit: every draw is that circuit
                rand = [(float(value.mean()), int(kept.sum()))] * random_draws
            row = _row(frac, n, int(kept.sum()), float(value.mean()), rand, full, empty)
            row.update(n_edges_pruned_signed=int(signed.sum()), metric_signed=float(value_s.mean()))
            row["f_signed"] = _f(row["metric_signed"], full, empty)
            rows.append(row)
    df = pd.DataFrame(rows)
    df["n_pairs"] = ev.n_pairs
    df["ablation"] = ev.ablation
    df.attrs.update(_summaries(df, random_draws))
    df.attrs.update(
        full_metric=full,
        empty_metric=empty,
        ablation=ev.ablation,
        metric=ev.what,
        n_edges=E,
        random_draws=int(random_draws),
        seed=int(seed),
        warning=warning,
    )
    _intervals(df, {k: np.stack(v, axis=1) for k, v in per_pair.items()}, ends, seed)
    return df


def _summaries(df: pd.DataFrame, random_draws: int) -> dict:
    """CPR from the signed ranking and CMD from the |score| ranking (MIB's conventions), the other
    two areas named, the random circuits' areas and the small-circuit areas."""
    cpr, cmd_signed = areas(df["fraction"], df["f_signed"])
    cpr_abs, cmd = areas(df["fraction"], df["f"])
    nan = float("nan")
    cpr_r, cmd_r = areas(df["fraction"], df["f_random"]) if random_draws else (nan, nan)
    return {
        "cpr": cpr,
        "cmd": cmd,
        "cpr_abs": cpr_abs,
        "cmd_signed": cmd_signed,
        "cpr_random": cpr_r,
        "cmd_random": cmd_r,
        "cpr_5pct": small_area(df["fraction"], df["f_signed"]),
        "cpr_5pct_abs": small_area(df["fraction"], df["f"]),
        "cpr_5pct_random": small_area(df["fraction"], df["f_random"]) if random_draws else nan,
    }


def _intervals(df: pd.DataFrame, per_pair: dict, ends: tuple, seed: int) -> None:
    """Percentile bootstrap intervals over the evaluated pairs (``CI_BOOT`` resamples, seeded): the
    columns ``f_low``, ``f_high``, ``f_signed_low``, ``f_signed_high`` and ``ci_n``, ``ci_unit``,
    ``ci_method``; ``attrs`` ``cpr_low`` ... ``cmd_high`` and ``notes``. NaN below ``MIN_UNITS``
    pairs, with a note saying why (:mod:`depthscope.analyses.intervals`)."""
    full, empty = ends
    n = len(full)
    method = f"percentile bootstrap over pairs, {CI_BOOT} resamples, seed {seed}"
    bounds = {}
    if too_few(n):
        nan = np.full(len(df), np.nan)
        for k in per_pair:
            bounds[k] = (nan, nan)
        areas_ci = dict.fromkeys(("cpr_low", "cpr_high", "cmd_low", "cmd_high"), float("nan"))
        df.attrs["notes"] = [too_few_note(n, "pairs", "the faithfulness intervals (f, CPR, CMD)")]
    else:
        w = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=CI_BOOT) / n
        lo_q, hi_q = (1 - CI_LEVEL) / 2, (1 + CI_LEVEL) / 2
        gap = (w @ full - w @ empty)[:, None]
        fb = {k: (w @ m - (w @ empty)[:, None]) / np.where(gap == 0, np.nan, gap) for k, m in per_pair.items()}
        for k, v in fb.items():
            bounds[k] = tuple(np.nanquantile(v, [lo_q, hi_q], axis=0))
        x = df["fraction"].to_numpy()
        cpr = np.array([areas(x, row)[0] for row in fb["f_signed"]])
        cmd = np.array([areas(x, row)[1] for row in fb["f"]])
        (c_lo, c_hi), (m_lo, m_hi) = np.nanquantile(cpr, [lo_q, hi_q]), np.nanquantile(cmd, [lo_q, hi_q])
        areas_ci = {"cpr_low": c_lo, "cpr_high": c_hi, "cmd_low": m_lo, "cmd_high": m_hi}
        df.attrs["notes"] = []
    for k, (lo, hi) in bounds.items():
        df[f"{k}_low"], df[f"{k}_high"] = lo, hi
    for k, v in provenance(n, "pairs", method).items():
        df[k] = v
    df.attrs.update({k: float(v) for k, v in areas_ci.items()})


def gap_warning(full: float, empty: float, dtype) -> str | None:
    """A warning when the clean-empty gap f divides by is within a few roundings of the model's
    ``dtype`` (bfloat16 keeps 8 bits: a gap of 0.03 on metrics near 2 is rounding, and every f
    is noise); None when it is not."""
    import torch  # lazy: the module's other functions need no torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None
    rounding = 4 * torch.finfo(dtype).eps * max(abs(full), abs(empty), 1.0)
    if abs(full - empty) > rounding:
        return None
    msg = (
        f"the gap between the full ({full:.4g}) and the empty circuit ({empty:.4g}) is within the rounding of "
        f"{str(dtype).replace('torch.', '')} ({rounding:.2g}): faithfulness is noise; use --dtype float32"
    )
    log.warning(msg)
    return msg


def check_edge_model(edges: pd.DataFrame, model, graph: CircuitGraph) -> None:
    """Refuse an edge table another model scored: its ``attrs`` name another model, or a graph of
    another shape (layers, heads)."""
    a = getattr(edges, "attrs", {}) or {}
    theirs = a.get("model")
    shape = {k: a.get(k) for k in ("n_layers", "n_heads") if a.get(k) is not None}
    ours = {"n_layers": graph.n_layers, "n_heads": graph.n_heads}
    other = {k: v for k, v in shape.items() if int(v) != ours[k]}
    if (theirs is not None and str(theirs) != str(model.name)) or other:
        got = ", ".join(f"{k} {v}" for k, v in shape.items())
        raise InputError(
            f"the edge table was scored on another model ({theirs}{'; ' + got if got else ''}), not on "
            f"{model.name} ({graph.n_layers} layers, {graph.n_heads} heads): score the edges on this model"
        )


def _metrics(ev: CircuitEvaluator, kept: np.ndarray) -> np.ndarray:
    """Each pair's metric with the circuit ``kept``, run through the model."""
    return np.asarray(ev.metrics(kept), dtype=float)


def _evaluate(ev: CircuitEvaluator, kept: np.ndarray, n: int, E: int, ends: tuple) -> np.ndarray:
    """Each pair's metric with one circuit (the full and the empty circuit: the runs already made)."""
    if n >= E:
        return ends[0]
    if not kept.any():
        return ends[1]
    return _metrics(ev, kept)


def _row(frac: float, n: int, kept: int, value: float, rand: list, full: float, empty: float) -> dict:
    """One size's row; ``rand``: each random circuit's (mean metric, pruned size)."""
    fr = np.array([_f(v, full, empty) for v, _ in rand])
    sizes = np.array([k for _, k in rand])
    some = len(fr) > 0
    return {
        "k": 100 * frac,
        "fraction": frac,
        "n_edges": n,
        "n_edges_pruned": kept,
        "metric": value,
        "f": _f(value, full, empty),
        "f_random": float(fr.mean()) if some else float("nan"),
        "f_random_std": float(fr.std(ddof=1)) if len(fr) > 1 else float("nan"),
        "f_random_min": float(fr.min()) if some else float("nan"),
        "f_random_max": float(fr.max()) if some else float("nan"),
        "n_random": len(fr),
        "n_random_pruned_min": int(sizes.min()) if some else 0,
        "n_random_pruned_max": int(sizes.max()) if some else 0,
    }


def circuit_faithfulness(
    model,
    pairs,
    edges: pd.DataFrame,
    ablation="counterfactual",
    *,
    random_draws: int = 5,
    seed: int = 0,
    metric=None,
    batch_tokens: int = BATCH_TOKENS,
) -> pd.DataFrame:
    """The faithfulness curve of the circuits made of the top-scored ``edges`` (module docstring).

    ``edges``: the table of :func:`~depthscope.analyses.circuits.edges.eap.edge_attribution` (every edge,
    with ``score``); ``pairs``, ``ablation``, ``metric``, ``batch_tokens`` as in
    :func:`~depthscope.analyses.circuits.edges.evaluate.evaluate_circuit`.

    Pass held-out ``pairs`` (not those that scored ``edges``:
    :func:`~depthscope.analyses.circuits.pairs.split_pairs`) for numbers that do not flatter the
    circuit. Returns one row per size in :data:`FRACTIONS`: ``k`` (percent), ``fraction``,
    ``n_edges`` (the top edges taken), ``n_edges_pruned`` (what remains after pruning), ``metric``
    (mean over pairs), ``f`` with ``f_low``, ``f_high``; the same for the signed ranking
    (``n_edges_pruned_signed``, ``metric_signed``, ``f_signed`` ...); ``f_random`` with
    ``f_random_std``, ``f_random_min``, ``f_random_max`` over ``n_random`` draws and their sizes
    ``n_random_pruned_min`` / ``_max``; ``n_pairs``, ``ablation``, ``ci_n``, ``ci_unit``,
    ``ci_method``. ``attrs``: ``cpr``, ``cmd`` (with ``_low`` / ``_high``), ``cpr_abs``,
    ``cmd_signed``, ``cpr_random``, ``cmd_random``, ``cpr_5pct`` (``_abs``, ``_random``),
    ``full_metric``, ``empty_metric``, ``notes``."""
    check_edge_model(edges, model, circuit_graph(model))
    ev = CircuitEvaluator(model, pairs, ablation, metric=metric, batch_tokens=batch_tokens)
    df = faithfulness_curve(ev, edge_scores_of(ev.graph, edges), random_draws=random_draws, seed=seed)
    df.attrs.update(model=str(model.name), method=edges.attrs.get("method"))
    return df


def circuit_stability(per_pair: np.ndarray, fractions=FRACTIONS, *, n_boot: int = 100, seed: int = 0) -> pd.DataFrame:
    """How stable the top-k edge sets are across the pairs: for ``n_boot`` bootstrap resamples of
    the pairs (rows of ``per_pair`` ``[pairs, edges]``), the Jaccard overlap of the resample's top-k
    set by ``|mean score|`` with the whole dataset's. One row per fraction > 0 and < 1: ``k``,
    ``fraction``, ``n_edges``, ``jaccard`` (mean over resamples), ``jaccard_low`` and
    ``jaccard_high`` (2.5 and 97.5 percentiles), ``n_boot``."""
    check_number("n_boot", n_boot, minimum=1, maximum=MAX_BOOT)
    per_pair = np.asarray(per_pair, dtype=np.float64)
    n, E = per_pair.shape
    sizes = [(f, n_of(f, E)) for f in fractions if 0 < n_of(f, E) < E]
    whole = np.argsort(-np.abs(per_pair.mean(axis=0)), kind="stable")
    ref = {k: np.isin(np.arange(E), whole[:k]) for _, k in sizes}
    rng = np.random.default_rng(seed)
    jac = np.zeros((n_boot, len(sizes)))
    for b in range(n_boot):
        w = rng.multinomial(n, np.full(n, 1.0 / n)) / n
        order = np.argsort(-np.abs(w @ per_pair), kind="stable")
        for j, (_, k) in enumerate(sizes):
            mine = np.zeros(E, dtype=bool)
            mine[order[:k]] = True
            jac[b, j] = (mine & ref[k]).sum() / (mine | ref[k]).sum()
    return pd.DataFrame(
        {
            "k": [100 * f for f, _ in sizes],
            "fraction": [f for f, _ in sizes],
            "n_edges": [k for _, k in sizes],
            "jaccard": jac.mean(axis=0),
            "jaccard_low": np.quantile(jac, 0.025, axis=0),
            "jaccard_high": np.quantile(jac, 0.975, axis=0),
            "n_boot": n_boot,
        }
    )


def smallest_faithful(curve: pd.DataFrame, threshold: float = 0.8):
    """The row of the smallest circuit on ``curve`` (a :func:`circuit_faithfulness` table) whose ``f``
    is at least ``threshold`` (a ``pandas.Series``), or None when there is none."""
    ok = curve[(curve["f"] >= threshold) & (curve["n_edges"] > 0)].sort_values("n_edges")
    return ok.iloc[0] if len(ok) else None
