"""The tables every patching method returns: one pair's rows, the loop over pairs, the means and their notes.

Activation, attribution and path patching measure different things but report them alike: one
row per patch with the shared site columns, the hook point, head (or SAE feature), the patched
position and its tokens, the patched value of the metric, the pair's clean and corrupted values,
the fraction recovered, the method and the direction. This module builds those rows once for
all of them.

======================  ==========================================================================
offers                  what
======================  ==========================================================================
PATCH_COLUMNS           the column order of a per-pair table without ``pair`` (datasets add
                        ``fraction_low``, ``fraction_high``, ``n_pairs``, ``ci_n``, ``ci_unit``,
                        ``ci_method`` to the means, ``pair`` to the per-pair rows)
FEATURE_COLUMNS         the same with ``feature`` after ``head``: tables that patch SAE features
PairResult              one pair's patches with their patched values and the pair's clean and
                        corrupted values, as the table reads them (clean and corrupted positions)
measure                 one pair through a method's per-pair function in the job's direction
pair_table              the tidy rows of one PairResult
run_pairs               a method over a dataset: per-pair tables with a ``pair`` column, progress,
                        the attrs every table carries
expect                  the progress bar's total from the first pair's patches, before its forwards
means                   the means over pairs of a per-pair table, with its notes
add_note                append a sentence to a table's ``attrs["notes"]`` (a list)
======================  ==========================================================================

Columns. ``label`` is the residual site's label like every depthscope table (for a point below
the stream, the site its write lands in: ``5.heads`` -> ``5.attn``), ``point`` the hook point
patched (``5.heads``), ``kind`` its kind (``resid`` for a residual site). ``position`` and
``clean_position`` are the corrupted and the clean prompt's indices of the patched cell, whatever
the direction. ``metric`` is the patched value: the base run's metric (the corrupted one for
``denoise``, the clean one for ``noise``) changed by the patch. ``fraction_recovered`` is always
``(metric - corrupted) / (clean - corrupted)``: where the patched run sits between the corrupted
(0) and the clean (1) behaviour. Denoising, it is the share of the clean behaviour one activation
restores; noising, 1 means the patch left the clean behaviour intact and values near 0 that the
clean run needs that activation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from depthscope.analyses.circuits.pairs import mean_over_pairs
from depthscope.analyses.circuits.patching import runs
from depthscope.analyses.circuits.prompts import TokenPair, describe_metrics, pair_fraction, token_texts
from depthscope.common.progress import progress_bar
from depthscope.hooks.sites import SITE_COLUMNS, site_frame

__all__ = [
    "PATCH_COLUMNS",
    "FEATURE_COLUMNS",
    "PairResult",
    "measure",
    "pair_table",
    "run_pairs",
    "expect",
    "means",
    "add_note",
    "UNDEFINED",
]

PATCH_COLUMNS = [
    *SITE_COLUMNS,
    "point",
    "kind",
    "head",
    "position",
    "clean_position",
    "position_name",
    "token",
    "clean_token",
    "metric",
    "clean_metric",
    "corrupted_metric",
    "fraction_recovered",
    "method",
    "direction",
]
FEATURE_COLUMNS = [
    *PATCH_COLUMNS[: PATCH_COLUMNS.index("head") + 1],
    "feature",
    *PATCH_COLUMNS[PATCH_COLUMNS.index("head") + 1 :],
]
#: the note of a table whose clean and corrupted metrics are equal (``{}``: "" or "mean ")
UNDEFINED = "{}clean and corrupted metrics are equal: fraction_recovered is undefined (NaN)"


@dataclass(frozen=True)
class PairResult:
    """One pair's patches (cells as (corrupted position, clean position), whatever the direction),
    their patched values, and the pair's clean and corrupted metric values."""

    pair: TokenPair
    patches: list[runs.Patch]
    values: np.ndarray
    clean_value: float
    corrupted_value: float


#: a method's work on one pair, written for ``denoise`` (see :mod:`~depthscope.analyses.circuits.patching.runs`):
#: ``(model, oriented pair, job, bar) -> (patches, values, source value, base value)``
PairFn = Callable[..., tuple[list, np.ndarray, float, float]]


def measure(model, tp: TokenPair, job: runs.Job, one: PairFn, bar) -> PairResult:
    """One pair through ``one`` in the job's direction: ``noise`` runs it on the flipped pair (its
    corrupted values into its clean run) and turns the cells and values back."""
    patches, values, source, base = one(model, job.oriented(tp), job, bar)
    if job.direction == "noise":
        patches = [replace(p, cell=p.cell.flipped()) for p in patches]
        return PairResult(tp, patches, values, clean_value=base, corrupted_value=source)
    return PairResult(tp, patches, values, clean_value=source, corrupted_value=base)


def pair_table(model, r: PairResult, method: str, direction: str, extra: dict | None = None) -> pd.DataFrame:
    """The tidy table of one pair: one row per patch, shared site columns first (the site a
    point's write lands in), then :data:`PATCH_COLUMNS` (:data:`FEATURE_COLUMNS` when a patch is
    an SAE feature) and the ``extra`` columns (name: one value for every row)."""
    patches = r.patches
    df = site_frame([p.point.site for p in patches], model.n_layers)
    df["point"] = [p.point.name for p in patches]
    df["kind"] = [p.point.kind for p in patches]
    is_feature = [p.point.kind == runs.FEATURES for p in patches]
    df["head"] = pd.array([None if f else p.head for p, f in zip(patches, is_feature)], dtype="Int64")
    df["feature"] = pd.array([p.head if f else None for p, f in zip(patches, is_feature)], dtype="Int64")
    df["position"] = pd.array([p.cell.pos for p in patches], dtype="Int64")
    df["clean_position"] = pd.array([p.cell.cpos for p in patches], dtype="Int64")
    df["position_name"] = [p.cell.name for p in patches]
    k_tok, c_tok = token_texts(model, r.pair.corrupted_ids), token_texts(model, r.pair.clean_ids)
    df["token"] = [k_tok(p.cell.pos) for p in patches]
    df["clean_token"] = [c_tok(p.cell.cpos) for p in patches]
    df["metric"] = np.asarray(r.values, dtype=float)
    df["clean_metric"], df["corrupted_metric"] = r.clean_value, r.corrupted_value
    df["fraction_recovered"] = pair_fraction(r.pair, r.clean_value, r.corrupted_value, df["metric"].to_numpy())
    df["method"], df["direction"] = method, direction
    for name, value in (extra or {}).items():
        df[name] = value
    columns = FEATURE_COLUMNS if any(is_feature) else PATCH_COLUMNS
    return df[[*columns, *(extra or {})]]


def run_pairs(model, tps: list[TokenPair], job: runs.Job, one: PairFn, method: str, *, total=None, extra=None):
    """``one`` over every pair (one after the other: memory holds one pair), the per-pair table
    with a ``pair`` column and the attrs every patching table carries (model, metric, positions,
    method, direction, n_pairs, notes). ``total``: patches per pair (None: counted on the first)."""
    tables = []
    with progress_bar(None if total is None else total * len(tps), desc=f"{method} patching", unit="patch") as bar:
        bar.n_pairs = len(tps)  # what :func:`expect` multiplies the first pair's patches by
        for tp in tps:
            r = measure(model, tp, job, one, bar)
            if getattr(bar, "total", 0) is None:  # the patches of every pair are those of the first
                bar.total = len(r.patches) * len(tps)
            t = pair_table(model, r, method, job.direction, extra)
            t.insert(0, "pair", tp.index)
            tables.append(t)
    out = pd.concat(tables, ignore_index=True)
    out.attrs.update(model=str(model.name), metric=describe_metrics(tps), positions=job.positions, method=method)
    out.attrs.update(direction=job.direction, n_pairs=len(tps), notes=[])
    return out


def expect(bar, n_patches: int) -> None:
    """Give the bar of :func:`run_pairs` its total once the first pair's patches are counted,
    before any patched forward: a long pair's bar then moves in percent from its first chunk
    (the patches of every pair are those of the first)."""
    if getattr(bar, "total", 0) is None and getattr(bar, "n_pairs", None):
        bar.total = n_patches * bar.n_pairs


def add_note(df: pd.DataFrame, sentence: str) -> pd.DataFrame:
    """Append ``sentence`` to ``df.attrs["notes"]`` (a list of sentences), once; returns ``df``."""
    notes = list(df.attrs.get("notes") or [])
    if sentence not in notes:
        notes.append(sentence)
    df.attrs["notes"] = notes
    return df


def means(per_pair: pd.DataFrame, keys) -> pd.DataFrame:
    """The means over pairs (:func:`~depthscope.analyses.circuits.pairs.mean_over_pairs`) with the
    per-pair table's attrs; notes: the per-pair table's, the interval's (too few pairs) and one
    when the mean clean and corrupted metrics are equal."""
    out = mean_over_pairs(per_pair, keys)
    interval_notes = out.attrs.get("notes", [])
    out.attrs.update(per_pair.attrs)
    out.attrs["notes"] = list(per_pair.attrs.get("notes") or [])
    for note in interval_notes:
        add_note(out, note)
    if out["fraction_recovered"].isna().all():
        add_note(out, UNDEFINED.format("mean "))
    return out
