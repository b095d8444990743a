"""Datasets of prompt pairs for patching: reading them, tokenizing them, averaging over them.

Circuit results (IOI, greater-than, docstring) are means over many clean/corrupted prompt pairs
of different templates and lengths. A pair is a :class:`PromptPair`: the ``clean`` prompt, the
``corrupted`` one, the ``target`` token the clean prompt should predict next and a ``foil``
(the metric is then ``logit[target] - logit[foil]`` at the last token; no foil:
``logprob[target]``), and optionally named positions, e.g. ``{"S2": 9, "END": -1}`` (an index
into both prompts, negative from the end) or ``{"S2": [9, 10]}`` (clean index, corrupted index).

======================  ==========================================================================
offers                  what
======================  ==========================================================================
PromptPair              one pair; ``PromptPair.from_dict`` checks a JSON object's fields
read_pairs              a JSONL file, one JSON object per line (errors name the file and line)
check_contrasts         refuse pairs that contrast nothing (the same prompts, the target its own
                        foil), naming each pair's line and the reason
as_pairs                pairs from a list (of PromptPair, dicts or ``(clean, corrupted)`` tuples),
                        one PromptPair, or a ``.jsonl`` path
split_pairs             a seeded split of a dataset into the pairs that score and the held-out
                        pairs that judge (``depthscope circuit``'s default)
is_dataset              whether a patching argument is a dataset rather than one prompt
mean_over_pairs         a per-pair table (``pair`` column) to its means over pairs, with the IOI
                        normalisation and a bootstrap interval over pairs
======================  ==========================================================================

Averaging. For a patch with per-pair patched values ``p_i`` and the pairs' clean and corrupted
values ``c_i`` and ``k_i``, the dataset's fraction recovered is
``(mean p - mean k) / (mean c - mean k)`` (Wang et al. 2022's normalisation: a ratio of means,
robust to pairs with a small gap, unlike the mean of per-pair ratios). Its interval is the
percentile bootstrap over pairs (``BOOTSTRAP`` resamples, seed 0: the same table twice gives
the same interval): pairs are resampled whole, so every patch of a resample uses the same pairs.
Following :mod:`depthscope.analyses.intervals`, the interval names its n and method (``ci_n``,
``ci_unit``, ``ci_method``) and is NaN below :data:`~depthscope.analyses.intervals.MIN_UNITS`
pairs, with a sentence in ``df.attrs["notes"]`` that says why: a bootstrap over a handful of
pairs can only resample those few and understates the uncertainty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from depthscope.analyses.intervals import provenance, too_few, too_few_note
from depthscope.common.errors import InputError
from depthscope.common.jsonl import read_jsonl

__all__ = [
    "PromptPair",
    "read_pairs",
    "check_contrasts",
    "split_pairs",
    "as_pairs",
    "is_dataset",
    "mean_over_pairs",
    "BOOTSTRAP",
]

#: bootstrap resamples of the interval over pairs, and its level
BOOTSTRAP, LEVEL = 1000, 0.95
#: the interval's method, as its ``ci_method`` column names it
CI_METHOD = f"percentile bootstrap over pairs, {BOOTSTRAP} resamples, seed 0"
#: the columns a means table adds after the per-pair table's (the interval, its n and method)
MEAN_COLUMNS = ["fraction_low", "fraction_high", "n_pairs", "ci_n", "ci_unit", "ci_method"]
#: the most pairs one call reads (a bound on what a typed path can make depthscope hold)
MAX_PAIRS = 1_000_000
_FIELDS = ("clean", "corrupted", "target", "foil", "positions")


@dataclass(frozen=True)
class PromptPair:
    """One clean/corrupted prompt pair with its metric tokens and optional named positions;
    ``where`` (not compared) says where it was read from, for messages (``pairs.jsonl:5``)."""

    clean: str | Sequence[int]
    corrupted: str | Sequence[int]
    target: str | int | None = None
    foil: str | int | None = None
    positions: Mapping[str, int | Sequence[int]] | None = field(default=None, hash=False)
    where: str | None = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "a pair") -> PromptPair:
        """A pair from a JSON object; unknown or missing fields raise :class:`InputError` naming ``where``."""
        if not isinstance(d, Mapping):
            raise InputError(
                f"{where}: expected a JSON object with fields {', '.join(_FIELDS)}, got {type(d).__name__}"
            )
        extra = sorted(set(d) - set(_FIELDS))
        if extra:
            raise InputError(f"{where}: unknown field(s) {extra}; a pair has {', '.join(_FIELDS)}")
        for key in ("clean", "corrupted"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise InputError(f"{where}: {key!r} must be a non-empty string, got {d.get(key)!r}")
        for key in ("target", "foil"):
            if d.get(key) is not None and not isinstance(d[key], (str, int)):
                raise InputError(f"{where}: {key!r} must be a token (a string or an id), got {d[key]!r}")
        pos = d.get("positions")
        if pos is not None and not isinstance(pos, Mapping):
            raise InputError(f"{where}: 'positions' must be an object of name: index, got {pos!r}")
        return cls(d["clean"], d["corrupted"], d.get("target"), d.get("foil"), dict(pos) if pos else None)


def read_pairs(path) -> list[PromptPair]:
    """Pairs from a JSONL file (one JSON object per line, blank lines skipped; each line checked:
    :func:`~depthscope.common.jsonl.read_jsonl`)."""

    def parse(obj, where: str) -> PromptPair:
        return replace(PromptPair.from_dict(obj, where), where=f"{Path(where).name}")

    return read_jsonl(path, parse, what="pairs", limit=MAX_PAIRS)


def check_contrasts(pairs: Sequence[PromptPair], what: str = "a circuit") -> list[PromptPair]:
    """``pairs`` unchanged, or :class:`InputError` naming the first pair (its file and line when read
    from one) that contrasts nothing: clean and corrupted prompts the same (every edge's effect
    and the clean-corrupted gap are zero), or a ``target`` equal to its ``foil`` (the metric is zero
    on every run). ``what`` names what needs the contrast, for the message."""
    for i, p in enumerate(pairs):
        where = p.where or f"pair {i}"
        if p.clean == p.corrupted:
            raise InputError(
                f"{where}: the clean and corrupted prompts are the same ({p.clean!r}); {what} is what differs "
                f"between them: corrupt the prompt (e.g. swap a name) or drop the pair"
            )
        if p.target is not None and p.foil is not None and p.target == p.foil:
            raise InputError(
                f"{where}: the target and the foil are the same token ({p.target!r}); the metric logit[target] - "
                f"logit[foil] is zero on every run: give the foil the corrupted prompt predicts, or drop the pair"
            )
    return list(pairs)


def split_pairs(pairs, train_fraction: float = 0.5, seed: int = 0) -> tuple[list[PromptPair], list[PromptPair]]:
    """(train, held out): a seeded random split of the pairs (any dataset :func:`as_pairs` reads),
    ``round(train_fraction * n)`` of them to train on (at least one, and at least one held out),
    each part in the dataset's order. Scores fitted on the train part and judged on the held-out
    part are not judged on the pairs that chose them (``depthscope circuit``'s default)."""
    pairs = as_pairs(pairs)
    if not 0 < train_fraction < 1:
        raise InputError(f"train_fraction must be between 0 and 1 (exclusive), got {train_fraction!r}")
    n = len(pairs)
    if n < 2:
        raise InputError(
            f"a held-out split needs at least 2 pairs, got {n}: give more pairs, a separate evaluation "
            f"file (--eval-pairs), or judge on the scoring pairs (--in-sample)"
        )
    k = min(max(round(train_fraction * n), 1), n - 1)
    train = np.sort(np.random.default_rng(seed).permutation(n)[:k])
    mask = np.zeros(n, dtype=bool)
    mask[train] = True
    return [p for p, m in zip(pairs, mask) if m], [p for p, m in zip(pairs, mask) if not m]


def is_dataset(obj) -> bool:
    """True for what :func:`as_pairs` reads as a dataset: a PromptPair, a ``.jsonl`` path, or a
    list of pairs (PromptPair, dicts or 2-tuples of prompts) — not one prompt or one token list."""
    if isinstance(obj, PromptPair | os.PathLike):
        return True
    if isinstance(obj, str):
        return obj.endswith(".jsonl") and "\n" not in obj
    if isinstance(obj, (list, tuple)) and obj:
        return all(isinstance(x, (PromptPair, Mapping)) or (isinstance(x, tuple) and len(x) == 2) for x in obj)
    return False


def as_pairs(obj) -> list[PromptPair]:
    """The pairs of a dataset argument (see :func:`is_dataset`)."""
    if isinstance(obj, PromptPair):
        return [obj]
    if isinstance(obj, (str, os.PathLike)):
        return read_pairs(obj)
    if not isinstance(obj, (list, tuple)) or not obj:
        raise InputError(f"pairs must be a non-empty list of pairs or a .jsonl path, got {type(obj).__name__}")
    out = []
    for i, x in enumerate(obj):
        if isinstance(x, PromptPair):
            out.append(x)
        elif isinstance(x, Mapping):
            out.append(PromptPair.from_dict(x, f"pair {i}"))
        elif isinstance(x, tuple) and len(x) == 2:
            out.append(PromptPair(*x))
        else:
            raise InputError(f"pair {i}: expected a PromptPair, a dict or a (clean, corrupted) tuple, got {x!r}")
    return out


def _bootstrap(patched: np.ndarray, clean: np.ndarray, corrupted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of ``(mean p - mean k) / (mean c - mean k)`` per column of ``patched``
    ``[pairs, patches]``, resampling pairs (rows; seed 0); NaN with fewer than two pairs."""
    n, m = patched.shape
    lo, hi = np.full(m, np.nan), np.full(m, np.nan)
    if n < 2:
        return lo, hi
    w = np.random.default_rng(0).multinomial(n, np.full(n, 1.0 / n), size=BOOTSTRAP) / n  # [B, pairs]
    mk, gap = w @ corrupted, w @ (clean - corrupted)
    frac = (w @ patched - mk[:, None]) / np.where(gap == 0, np.nan, gap)[:, None]  # [B, patches]
    ok = np.isfinite(frac).any(axis=0)
    if ok.any():
        lo[ok], hi[ok] = np.nanquantile(frac[:, ok], [(1 - LEVEL) / 2, (1 + LEVEL) / 2], axis=0)
    return lo, hi


_MEANS = ("metric", "clean_metric", "corrupted_metric", "fraction_recovered")


def _common(s: pd.Series):
    """The value all rows share, or None (missing) when they differ."""
    return s.iloc[0] if s.nunique(dropna=False) == 1 else None


def mean_over_pairs(per_pair: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Means over pairs of a per-pair table (one row per pair and patch, a ``pair`` column).

    ``keys``: the columns naming a patch (e.g. ``point, head, position_name``). ``metric``,
    ``clean_metric`` and ``corrupted_metric`` become means over pairs, ``fraction_recovered``
    the ratio of means, ``fraction_low`` / ``fraction_high`` its bootstrap interval (NaN below
    ``MIN_UNITS`` pairs, with a sentence in ``attrs["notes"]``), ``n_pairs`` the number of pairs
    and ``ci_n``, ``ci_unit``, ``ci_method`` the interval's provenance; NaN patched values (not
    measured) stay NaN. Every other column keeps the value all pairs share (the
    site columns, a position index or token when every pair has the same), missing otherwise.
    Rows come in the order of the patches' first appearance. Every patch must have exactly one
    row per pair (it raises otherwise). Keys the table does not have are left out (``feature``
    exists only in tables that patch SAE features)."""
    keys = [k for k in keys if k in per_pair.columns]
    df = per_pair.reset_index(drop=True)
    patch = df.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()
    pairs, pair_row = np.unique(df["pair"].to_numpy(), return_inverse=True)
    n_patches = int(patch.max()) + 1 if len(df) else 0
    if len(df) != len(pairs) * n_patches or pd.Series(patch * len(pairs) + pair_row).duplicated().any():
        raise InputError("every patch needs exactly one row per pair to be averaged over pairs")
    patched = np.empty((len(pairs), n_patches))
    patched[pair_row, patch] = df["metric"].to_numpy(float)
    per = df.groupby(pair_row, sort=True)[["clean_metric", "corrupted_metric"]].first()
    clean, corrupted = per["clean_metric"].to_numpy(float), per["corrupted_metric"].to_numpy(float)
    rest = [c for c in df.columns if c not in {*keys, "pair", *_MEANS}]
    out = df.groupby(patch, sort=True).agg({**{k: "first" for k in keys}, **{c: _common for c in rest}})
    for c in rest:  # keep the per-pair table's dtypes where the value was shared
        out[c] = out[c].astype(df[c].dtype) if out[c].notna().all() else out[c].astype(object)
        if df[c].dtype.name == "Int64":
            out[c] = pd.array(out[c], dtype="Int64")
    out["metric"] = patched.mean(axis=0)
    out["clean_metric"], out["corrupted_metric"] = clean.mean(), corrupted.mean()
    gap = clean.mean() - corrupted.mean()
    out["fraction_recovered"] = (out["metric"] - corrupted.mean()) / gap if gap != 0 else np.nan
    n = len(pairs)
    withheld = too_few(n)
    nan = np.full(n_patches, np.nan)
    out["fraction_low"], out["fraction_high"] = (nan, nan) if withheld else _bootstrap(patched, clean, corrupted)
    out["n_pairs"] = n
    for k, v in provenance(n, "pairs", CI_METHOD).items():
        out[k] = v
    order = [c for c in df.columns if c != "pair"] + MEAN_COLUMNS
    out = out[order].reset_index(drop=True)
    what = "the interval over pairs (fraction_low, fraction_high)"
    out.attrs["notes"] = [too_few_note(n, "pairs", what)] if withheld else []
    return out
