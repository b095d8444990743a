"""The probing tables' rows: per-site scores, Tenney's cumulative summary, one summary per task.

===========================================  ================================================
``site_rows(task, frame, td, scores, l2)``   ``by_site`` rows of one task (shared site columns)
``cumulative_summary(depths, cum, seed)``    E_Delta with its bootstrap interval, E_s, gains
``mixing_rows(task, frame, cum)``            ``mixing`` rows: mix weight, cumulative score, Delta
``summary_row(task, by_site, td, ...)``      the task's ``summary`` row
``tables(by_site, summary, mixing)``         the three DataFrames, columns in reading order
===========================================  ================================================
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .mixing import expected_layer_delta, expected_layer_delta_interval, expected_layer_mix

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
    return df


def cumulative_summary(depths, cum, seed: int) -> dict:
    """Summary values of a cumulative fit (all NaN when ``cum`` is None)."""
    if cum is None:
        keys = [
            "expected_layer_delta",
            "expected_layer_delta_lo",
            "expected_layer_delta_hi",
            "total_delta",
            "expected_layer_mix",
        ]
        return {k: np.nan for k in keys}
    lo, hi = expected_layer_delta_interval(depths, cum.correct, seed=seed)
    return {
        "expected_layer_delta": expected_layer_delta(depths, cum.accuracy),
        "expected_layer_delta_lo": lo,
        "expected_layer_delta_hi": hi,
        "total_delta": float(cum.accuracy[-1] - cum.accuracy[0]),
        "expected_layer_mix": expected_layer_mix(depths, cum.mix_weights),
        "mix_accuracy": float(cum.accuracy[-1]),
    }


def mixing_rows(task: str, frame: pd.DataFrame, cum) -> pd.DataFrame:
    df = frame.copy()
    df.insert(0, "task", task)
    df["mix_weight"] = cum.mix_weights
    df["cumulative_score"] = cum.accuracy
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
    mixing_df = pd.concat(mixing, ignore_index=True) if mixing else pd.DataFrame(columns=MIXING_COLUMNS)
    return by_site_df, summary_df, mixing_df
