"""The circuit job (``depthscope circuit``): every edge scored, the top circuits' faithfulness, the circuit drawn.

=========================  ======================================================================
:func:`circuit_job`        a pairs file in; written: ``edges`` (one row per edge, mean score over
                           pairs, ``in_circuit`` marking the drawn circuit), ``faithfulness`` (f
                           per size k with the random circuits' mean and spread and the top
                           circuits' stability), ``circuit_summary.json``, ``circuit_graph.json``
                           (the drawn circuit: nodes, edges, scores), ``circuit_mib.json`` (the
                           whole graph in EAP-IG's ``Graph`` JSON, the drawn circuit in it),
                           figures ``faithfulness_curve`` and ``circuit`` (PNG and SVG) and
                           ``circuit.html`` (interactive, self-contained)
:func:`split_of`           the pairs that score, the pairs that judge, and the split named
:func:`summary_table`      the console table of its summary (``depthscope circuit`` prints it)
=========================  ======================================================================

The edges are scored on one part of the pairs and every faithfulness number is computed on the
other (:func:`split_of`: a seeded split by ``train_fraction``, or ``eval_pairs``; ``in_sample``
judges on the scoring pairs and the summary says so). The edges are scored with the differences
the evaluation puts in (``ablation``: corrupted, mean or zero writes); the mean is that of the
clean prompts of ``mean_pairs`` or of the scoring pairs (the summary's ``split.mean_source``).
The drawn circuit is the top ``draw_edges`` edges by |score|, pruned as MIB prunes; by default
the smallest circuit of the curve with f >= ``threshold`` when it has at most
:data:`DRAW_AUTO_MAX` edges after pruning, else the top :data:`DRAW_FALLBACK` edges. Its settings
are :class:`~depthscope.analyses.jobs.configs.CircuitConfig`.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from rich.markup import escape
from rich.table import Table

from depthscope.analyses.circuits.edges.ablation import sender_means
from depthscope.analyses.circuits.edges.eap import edge_frame, score_edges
from depthscope.analyses.circuits.edges.evaluate import CircuitEvaluator
from depthscope.analyses.circuits.edges.faithfulness import (
    MIB_SIGN,
    circuit_stability,
    faithfulness_curve,
    smallest_faithful,
    top_circuit,
)
from depthscope.analyses.circuits.edges.graph import mib_graph
from depthscope.analyses.circuits.edges.html import circuit_html, circuit_json
from depthscope.analyses.circuits.edges.plots import plot_circuit, plot_faithfulness
from depthscope.analyses.circuits.pairs import check_contrasts, read_pairs, split_pairs
from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import CircuitConfig

__all__ = ["circuit_job", "split_of", "summary_table", "DRAW_AUTO_MAX", "DRAW_FALLBACK"]

DRAW_AUTO_MAX, DRAW_FALLBACK = 500, 100


def _drawn(curve: pd.DataFrame, config: CircuitConfig) -> tuple[int, str]:
    """How many top edges the drawn circuit takes, and why."""
    if config.draw_edges is not None:
        return config.draw_edges, "--draw-edges"
    best = smallest_faithful(curve, config.threshold)
    if best is not None and int(best["n_edges_pruned"]) <= DRAW_AUTO_MAX:
        return int(best["n_edges"]), f"the smallest circuit with f >= {config.threshold:g}"
    # else the most faithful size that still holds edges after pruning (the top few edges of a
    # deep model often join no path from the input to the logits, and prune to nothing)
    small = curve[(curve["n_edges_pruned"] > 0) & (curve["n_edges_pruned"] <= DRAW_AUTO_MAX) & curve["f"].notna()]
    if len(small):
        row = small.loc[small["f"].idxmax()]
        return int(row["n_edges"]), (
            f"the most faithful circuit of at most {DRAW_AUTO_MAX} edges (f {row['f']:.2f}; "
            f"none with f >= {config.threshold:g})"
        )
    return (
        DRAW_FALLBACK,
        f"the top {DRAW_FALLBACK} edges (no circuit with f >= {config.threshold:g} of at most {DRAW_AUTO_MAX} edges)",
    )


def _with_stability(curve: pd.DataFrame, es, config: CircuitConfig) -> pd.DataFrame:
    """The curve with the top circuits' stability (``jaccard``, ``jaccard_low``, ``jaccard_high``;
    NaN where not measured: sizes 0 and 100 %, one pair, ``bootstrap`` 0)."""
    cols = ["jaccard", "jaccard_low", "jaccard_high"]
    if config.bootstrap and es.per_pair.shape[0] > 1:
        st = circuit_stability(es.per_pair, n_boot=config.bootstrap, seed=config.seed)
        out = curve.merge(st[["fraction", *cols]], on="fraction", how="left")
    else:
        out = curve.assign(**{c: np.nan for c in cols})
    out["n_boot"] = config.bootstrap if config.bootstrap and es.per_pair.shape[0] > 1 else 0
    out["method"] = es.method
    out.attrs.update(curve.attrs)
    return out


def split_of(pairs: list, config: CircuitConfig) -> tuple[list, list, dict]:
    """(the pairs that score the edges, the pairs that judge the circuits, the split as the summary
    names it): ``eval_pairs`` when given, else a seeded split of ``pairs`` by ``train_fraction``,
    or (``in_sample``) every pair for both."""
    if config.eval_pairs is not None:
        held = check_contrasts(read_pairs(config.eval_pairs))
        train, mode = pairs, f"held out: the pairs of {config.eval_pairs}"
    elif config.in_sample:
        train, held, mode = pairs, pairs, "in-sample: judged on the pairs that scored the edges (optimistic)"
    else:
        train, held = split_pairs(pairs, config.train_fraction, config.seed)
        mode = f"held out: a seeded split of the pairs (train fraction {config.train_fraction:g}, seed {config.seed})"
    split = {"mode": mode, "in_sample": bool(config.in_sample), "n_train": len(train), "n_eval": len(held)}
    return train, held, split


def _ablation(model, train: list, config: CircuitConfig):
    """What ``--ablation`` puts in, for the scores and the evaluation alike: the kind, or under
    mean ablation the :class:`~depthscope.analyses.circuits.edges.ablation.SenderMeans` of
    ``--mean-pairs`` or of the scoring pairs (never the judged ones, unless in-sample)."""
    if config.ablation != "mean":
        return config.ablation
    if config.mean_pairs is not None:
        pairs, source = read_pairs(config.mean_pairs), f"the clean prompts of {config.mean_pairs}"
    else:
        pairs, source = (
            train,
            "the clean prompts of the scoring pairs"
            + (" (in-sample: the judged pairs too)" if config.in_sample else ""),
        )
    return sender_means(model, pairs, source=source, batch_tokens=config.batch_tokens)


def circuit_job(model, config: CircuitConfig, out: Output) -> JobResult:
    """Score, evaluate and draw (module docstring); the summary holds CPR and CMD of the top and
    the random circuits, the smallest faithful circuit and its heads, and the top edges."""
    train, held, split = split_of(check_contrasts(read_pairs(config.pairs)), config)
    ablation = _ablation(model, train, config)
    split["mean_source"] = getattr(ablation, "source", None)
    # the evaluator first: its memory is checked too before the scoring's minutes
    ev = CircuitEvaluator(model, held, ablation, batch_tokens=config.batch_tokens)
    t0 = time.perf_counter()
    es = score_edges(model, train, config.method, config.steps, ablation=ablation, batch_tokens=config.batch_tokens)
    scored = time.perf_counter() - t0
    edges = edge_frame(es, model.name)
    curve = faithfulness_curve(ev, es.mean, random_draws=config.random_draws, seed=config.seed)
    curve.attrs.update(model=str(model.name), method=es.method, split=split["mode"], in_sample=split["in_sample"])
    curve = _with_stability(curve, es, config)
    n_draw, why = _drawn(curve, config)
    kept = top_circuit(es.graph, es.mean, n_draw)
    s, r = es.graph.edge_index
    edges["in_circuit"] = kept[s, r]
    out.table(edges, "edges")
    out.table(curve, "faithfulness")
    summary = _summary(model, es, edges, curve, config, (n_draw, why, int(kept.sum())), scored)
    summary["split"] = split
    out.json(summary, "circuit_summary")
    out.json(circuit_json(edges), "circuit_graph")
    out.json(mib_graph(es.graph, MIB_SIGN * es.matrix(), kept, model.d_model), "circuit_mib")
    if config.plots:
        out.figure(plot_faithfulness, curve, name="faithfulness_curve", threshold=config.threshold)
        out.figure(plot_circuit, edges, name="circuit")
        if out.folder is not None:
            out.written.append(circuit_html(edges, out.folder / "circuit.html"))
    else:  # an earlier run's figures must not pass for this run's
        out.drop("faithfulness_curve", "circuit", "circuit.html")
    return JobResult(tables={"edges": edges, "faithfulness": curve}, summary=summary, files=list(out.written))


def _heads(edges: pd.DataFrame) -> list[str]:
    """The heads of the drawn circuit (``layer.head``), in forward order."""
    on = edges[edges["in_circuit"]]
    names = set(on["sender"]) | {
        f"{x.split('.')[0]}.heads.{x.split('.')[2]}" for x in on["receiver"] if x.count(".") == 2
    }
    heads = sorted((int(n.split(".")[0]), int(n.split(".")[2])) for n in names if ".heads." in n)
    return [f"{layer}.{h}" for layer, h in heads]


#: the areas the summary reports (faithfulness.py's ``attrs``): CPR from the signed ranking, CMD
#: from the |score| ranking (MIB's conventions), the other two, the random circuits', the small sizes'
_AREAS = (
    "cpr",
    "cpr_low",
    "cpr_high",
    "cmd",
    "cmd_low",
    "cmd_high",
    "cpr_abs",
    "cmd_signed",
    "cpr_random",
    "cmd_random",
    "cpr_5pct",
    "cpr_5pct_abs",
    "cpr_5pct_random",
)


def _summary(model, es, edges, curve, config, drawn, scored: float) -> dict:
    best = smallest_faithful(curve, config.threshold)
    a = curve.attrs
    top = edges.reindex(edges["score"].abs().sort_values(ascending=False, kind="stable").index[:10])
    n_draw, why, n_kept = drawn
    return {
        "model": str(model.name),
        "method": es.method,
        "steps": es.steps,
        "ablation": config.ablation,
        "metric": es.metric,
        "n_pairs": int(es.per_pair.shape[0]),
        "n_edges": int(es.graph.n_edges),
        "clean_metric": float(es.clean.mean()),
        "corrupted_metric": float(es.corrupted.mean()),
        "empty_metric": a["empty_metric"],
        "n_eval_pairs": int(curve["n_pairs"].iloc[0]),
        **{k: a[k] for k in _AREAS},
        "ci_n": int(curve["ci_n"].iloc[0]),
        "ci_method": str(curve["ci_method"].iloc[0]),
        "notes": list(a.get("notes", [])),
        "score_sign": "depthscope's score: the change of the metric when the edge is corrupted (an edge that "
        "supports the target scores negative); circuit_mib.json and the signed ranking use MIB's sign (positive)",
        "random_draws": config.random_draws,
        "threshold": config.threshold,
        "smallest_faithful": None
        if best is None
        else {
            "k": float(best["k"]),
            "n_edges": int(best["n_edges"]),
            "n_edges_pruned": int(best["n_edges_pruned"]),
            "f": float(best["f"]),
        },
        "drawn": {"top_edges": n_draw, "n_edges_pruned": n_kept, "why": why, "heads": _heads(edges)},
        "top_edges": [[x.sender, x.receiver, float(x.score)] for x in top.itertuples()],
        "scoring_seconds": round(scored, 2),
        "warning": a.get("warning"),  # the clean-empty gap within the dtype's rounding (else None)
    }


def summary_table(name: str, s: dict) -> Table:
    """The console table of a circuit job's summary (``depthscope circuit`` prints it)."""
    t = Table("quantity", "value", title=f"circuit of {name}: {s['method']}, {s['ablation']} ablation")
    sp = s["split"]
    t.add_row("pairs: scored / judged", f"{sp['n_train']} / {sp['n_eval']} ({escape(sp['mode'])})")
    if sp.get("mean_source"):
        t.add_row("mean ablation: the mean of", escape(sp["mean_source"]))
    t.add_row("edges", f"{s['n_edges']}")
    t.add_row("clean / corrupted", f"{s['clean_metric']:.3f} / {s['corrupted_metric']:.3f} ({escape(s['metric'])})")
    t.add_row(
        "CPR (signed) / CMD (|score|)",
        f"{s['cpr']:.3f} [{s['cpr_low']:.3f}, {s['cpr_high']:.3f}] / {s['cmd']:.3f} [{s['cmd_low']:.3f}, "
        f"{s['cmd_high']:.3f}] ({s['ci_n']} pairs)",
    )
    t.add_row("CPR (|score|) / mean f up to 5 %", f"{s['cpr_abs']:.3f} / {s['cpr_5pct']:.3f}")
    t.add_row(
        "random circuits: CPR / CMD", f"{s['cpr_random']:.3f} / {s['cmd_random']:.3f} ({s['random_draws']} draws)"
    )
    best = s["smallest_faithful"]
    t.add_row(
        f"smallest circuit with f >= {s['threshold']:g}",
        "none"
        if best is None
        else f"{best['k']:g}% ({best['n_edges']} edges, {best['n_edges_pruned']} after pruning): f {best['f']:.3f}",
    )
    d = s["drawn"]
    t.add_row("drawn", f"{d['n_edges_pruned']} edges ({d['why']}); heads {', '.join(d['heads'][:12]) or 'none'}")
    for sender, receiver, score in s["top_edges"][:5]:
        t.add_row(f"{sender} -> {receiver}", f"{score:+.4f}")
    for note in s.get("notes", []):
        t.add_row("note", escape(note))
    if s.get("warning"):
        t.add_row("[bold red]warning[/]", escape(s["warning"]))
    return t
