"""The probing tables' rows: per-site scores, Tenney's cumulative summary, one summary per task.

===========================================  ================================================
``site_rows(task, frame, td, scores, l2)``   ``by_site`` rows of one task (shared site columns)
``cumulative_summary(depths, cum, seed)``    E_Delta with its bootstrap interval, E_s, gains,
                                             and whether the total gain makes E_Delta meaningful
``mixing_rows(task, frame, cum)``            ``mixing`` rows: mix weight, cumulative score, Delta
``summary_row(task, by_site, td, ...)``      the task's ``summary`` row
``tables(by_site, summary, mixing)``         the three DataFrames, columns in reading order
===========================================  ================================================
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from depthscope.common.ci import add_notes, provenance, too_few, too_few_note
from depthscope.probes.mixing import expected_layer_delta, expected_layer_delta_interval, expected_layer_mix, mix_spread

#: E_Delta is read as a depth only when the total gain sum Delta(s>=1) is at least this (soft accuracy)
#: and at least ``GAIN_SE`` standard errors of that gain over test examples
MIN_GAIN = 0.02
GAIN_SE = 3.0
#: bootstrap resamples of E_Delta's interval (:func:`~depthscope.probes.mixing.expected_layer_delta_interval`)
N_BOOT = 1000

BY_SITE_FIRST = [
    "task",
    "site",
    "label",
    "layer",
    "sublayer",
    "depth",
    "accuracy",
    "macro_f1",
    "control_accuracy",
    "selectivity",
]
SUMMARY_FIRST = [
    "task",
    "expected_layer_delta",
    "expected_layer_mix",
    "best_label",
    "best_accuracy",
    "n_train",
    "n_test",
]
MIXING_COLUMNS = ["task", "site", "label", "layer", "sublayer", "depth", "mix_weight", "cumulative_score", "delta"]


def site_rows(task: str, frame: pd.DataFrame, td, scores: dict, l2, *, probe: str, pooling: str) -> pd.DataFrame:
    """``scores``: ``accuracy``, ``macro_f1``, ``control_accuracy`` (NaN without control) and
    ``train_accuracy`` per site."""
    df = frame.copy()
    df.insert(0, "task", task)
    df["accuracy"] = scores["accuracy"]
    df["macro_f1"] = scores["macro_f1"]
    df["control_accuracy"] = scores["control_accuracy"]
    df["selectivity"] = scores["accuracy"] - scores["control_accuracy"]
    df["train_accuracy"] = scores["train_accuracy"]
    df["l2"] = l2
    df["probe"] = probe
    df["pooling"] = pooling
    df["n_train"] = len(td.examples["train"])
    df["n_test"] = len(td.examples["test"])
    df["majority_accuracy"] = td.majority_accuracy
    return df


def cumulative_summary(depths, cum, seed: int) -> dict:
    """Summary values of a cumulative fit (all NaN when ``cum`` is None).

    The interval (``expected_layer_delta_lo/_hi``) is a 95% two-level bootstrap over test
    examples and the fold draws the cumulative probes are stacked on. It covers training
    randomness: every probe is trained to convergence from zero weights, so what the seed
    still changes is the control labels, the folds that choose the penalty and the stacking's
    fold draws (whose spread the bootstrap resamples); the stability test and
    ``docs/tenney_comparison.md`` measure the residual shift (seed, doubled ``max_epochs``).
    ``expected_layer_delta_meaningful`` is False when the total gain is below ``MIN_GAIN`` or
    ``GAIN_SE`` standard errors (the note says why). E_Delta, its interval and the gain are in
    the soft accuracy (:mod:`~depthscope.probes.mixing`); ``expected_layer_delta_hard`` (with
    ``_lo/_hi``) is the same from the argmax accuracy, Tenney's score. ``ci_n`` (test examples),
    ``ci_unit`` and ``ci_method`` name both intervals; below 10 test examples they are NaN and
    ``ci_note`` says why. ``expected_layer_mix_lo/_hi`` is the range of E_s over the mix's refits
    without each fold, named by ``expected_layer_mix_ci_n`` (refits), ``_ci_unit``, ``_ci_method``."""
    if cum is None:
        keys = [
            "expected_layer_delta",
            "expected_layer_delta_lo",
            "expected_layer_delta_hi",
            "total_delta",
            "total_delta_se",
            "expected_layer_mix",
            "expected_layer_mix_lo",
            "expected_layer_mix_hi",
            "mix_spread",
            "expected_layer_delta_hard",
            "expected_layer_delta_hard_lo",
            "expected_layer_delta_hard_hi",
        ]
        out = {k: np.nan for k in keys}
        out.update(expected_layer_delta_meaningful=False, expected_layer_delta_note="no cumulative scoring")
        return {**out, **_delta_provenance(0, 0), **_mix_provenance(None)}
    R, _, N = np.shape(cum.score_draws)
    lo, hi = expected_layer_delta_interval(depths, cum.score_draws, n_boot=N_BOOT, seed=seed)
    hard_lo, hard_hi = expected_layer_delta_interval(depths, cum.correct, n_boot=N_BOOT, seed=seed)
    if too_few(N):  # withheld: a bootstrap over so few test examples understates the uncertainty
        lo = hi = hard_lo = hard_hi = np.nan
    score = cum.score
    return {
        "expected_layer_delta": expected_layer_delta(depths, score),
        "expected_layer_delta_lo": lo,
        "expected_layer_delta_hi": hi,
        **_total_gain(cum),
        **_mix_summary(depths, cum),
        "expected_layer_delta_hard": expected_layer_delta(depths, cum.accuracy),
        "expected_layer_delta_hard_lo": hard_lo,
        "expected_layer_delta_hard_hi": hard_hi,
        "mix_accuracy": float(cum.accuracy[-1]),
        "mix_soft_accuracy": float(score[-1]),
        **_delta_provenance(N, R),
        **_mix_provenance(cum.mix_draws),
    }


def _delta_provenance(n_test: int, draws: int) -> dict:
    """``ci_n, ci_unit, ci_method`` of E_Delta's interval (and of the argmax one's: the same
    method), and ``ci_note``: why it is NaN ("" when it is given)."""
    if not n_test:
        return {**provenance(0, "test examples", "none (no cumulative scoring)"), "ci_note": ""}
    method = f"percentile bootstrap over test examples (Poisson(1) weights; one fold draw), {N_BOOT} resamples"
    if draws > 1:
        method = (
            f"two-level percentile bootstrap over test examples (Poisson(1) weights) and the {draws} fold "
            f"draws (with replacement), {N_BOOT} resamples"
        )
    note = too_few_note(n_test, "test examples", "the interval of E_Delta") if too_few(n_test) else ""
    return {**provenance(n_test, "test examples", method), "ci_note": note}


def _mix_provenance(mix_draws) -> dict:
    """The ``expected_layer_mix_ci_*`` columns: E_s's ``_lo/_hi`` is the range over the refits of
    the mix without each fold (a description of the refits' spread, not a confidence interval)."""
    k = 0 if mix_draws is None else len(mix_draws)
    method = f"range (min to max) of E_s over {k} refits of the mix, each without one fold of train"
    method += " (the refits' spread, not a confidence interval)"
    return {
        "expected_layer_mix_ci_n": k,
        "expected_layer_mix_ci_unit": "fold refits",
        "expected_layer_mix_ci_method": method if k else "none (mix_folds < 2)",
    }


def _total_gain(cum) -> dict:
    """The soft score's gain from the first prefix to the last, its paired standard error over
    test examples, and whether it is large enough for E_Delta to be read as a depth (why not)."""
    score = cum.score
    gain = float(score[-1] - score[0])
    per_example = cum.score_mean  # [S, N], mean over the fold draws
    diff = per_example[-1] - per_example[0]  # paired, per test example
    se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")
    ok = bool(gain >= MIN_GAIN and gain >= GAIN_SE * se)
    note = (
        ""
        if ok
        else (
            f"total gain {gain:.3f} (SE {se:.3f}) is below max({MIN_GAIN}, {GAIN_SE:g} SE): "
            "the embedding already decodes the property, E_Delta is not a meaningful depth"
        )
    )
    return {
        "total_delta": gain,
        "total_delta_se": se,
        "expected_layer_delta_meaningful": ok,
        "expected_layer_delta_note": note,
    }


def _mix_summary(depths, cum) -> dict:
    """E_s, its range over the refits without each fold (NaN unless ``mix_folds >= 2``) and the
    spread of the weights in sites (exp entropy)."""
    lo, hi = cum.mix_range(depths)
    return {
        "expected_layer_mix": expected_layer_mix(depths, cum.mix_weights),
        "expected_layer_mix_lo": lo,
        "expected_layer_mix_hi": hi,
        "mix_spread": mix_spread(cum.mix_weights),
    }


def mixing_rows(task: str, frame: pd.DataFrame, cum) -> pd.DataFrame:
    df = frame.copy()
    df.insert(0, "task", task)
    df["mix_weight"] = cum.mix_weights
    df["cumulative_score"] = cum.score
    df["cumulative_accuracy"] = cum.accuracy
    df["cumulative_macro_f1"] = cum.macro_f1
    df["delta"] = cum.delta
    df["gamma"] = cum.gamma
    return df


def summary_row(
    task: str, by_site: pd.DataFrame, td, n_layers: int, cum_summary: dict, *, probe: str, pooling: str, control: bool
) -> dict:
    acc = by_site["accuracy"].to_numpy()
    best = int(np.argmax(acc))
    summ = {"task": task, **cum_summary}
    summ.update(
        {
            "best_label": by_site["label"].iloc[best],
            "best_site": int(by_site["site"].iloc[best]),
            "best_depth": float(by_site["depth"].iloc[best]),
            "best_accuracy": float(acc[best]),
            "best_macro_f1": float(by_site["macro_f1"].iloc[best]),
            "best_selectivity": float(by_site["selectivity"].iloc[best]) if control else np.nan,
            "max_selectivity": float(np.nanmax(by_site["selectivity"])) if control else np.nan,
            "n_layers": n_layers,
            "relative_depth_delta": summ["expected_layer_delta"] / n_layers,
            "relative_depth_mix": summ["expected_layer_mix"] / n_layers,
            "relative_depth_best": float(by_site["depth"].iloc[best]) / n_layers,
            "majority_accuracy": td.majority_accuracy,
            "n_train": len(td.examples["train"]),
            "n_test": len(td.examples["test"]),
            "n_classes": td.n_classes,
            "n_test_unseen_labels": int((td.y["test"] >= td.n_classes).sum()),
            "n_skipped_train": td.skipped["train"],
            "n_skipped_test": td.skipped["test"],
            "kind": td.examples["train"].kind,
            "probe": probe,
            "pooling": pooling,
        }
    )
    return summ


def _first(df: pd.DataFrame, first: list) -> pd.DataFrame:
    return df[[c for c in first if c in df] + [c for c in df if c not in first]]


def tables(by_site: list, summary: list, mixing: list) -> tuple:
    """``(by_site, summary, mixing)`` DataFrames from per-task parts, columns in reading order."""
    by_site_df = _first(pd.concat(by_site, ignore_index=True), BY_SITE_FIRST)
    summary_df = _first(pd.DataFrame(summary), SUMMARY_FIRST)
    if "ci_note" in summary_df:
        add_notes(summary_df, [f"{t}: {n}" for t, n in zip(summary_df["task"], summary_df["ci_note"]) if n])
    mixing_df = pd.concat(mixing, ignore_index=True) if mixing else pd.DataFrame(columns=MIXING_COLUMNS)
    return by_site_df, summary_df, mixing_df
