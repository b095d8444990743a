"""Interchange interventions per site and position: put the source's vector into the base and check
that the output changes as the variable's new value predicts (Geiger et al. 2021).

>>> from depthscope.analyses import interchange
>>> t = interchange(model, "agreement.jsonl", sites="resid", positions="SUBJ,END")
>>> t[["label", "position", "iia", "iia_low", "iia_high", "logit_diff"]]

=============================  ================================================================
:func:`interchange`            full-vector interchange at each residual site and named position:
                               one row per (site, position), :data:`COLUMNS`
:func:`iia_columns`            IIA, its 95% interval (Wilson score over examples; NaN below
                               :data:`~depthscope.analyses.intervals.MIN_UNITS`) and the mean logit
                               difference, from per-example hits and logit differences
:func:`parse_positions`        a positions argument (``"SUBJ,END"``, a list) as names
:func:`resid_sites`            a sites argument (``"resid"``, labels, indices) as site indices
=============================  ================================================================

IIA (interchange intervention accuracy) is the fraction of examples whose intervened prediction,
the argmax of the candidates' logits at the base's last position, equals the example's ``label``
(the argmax over the candidates only: a model whose top token is another word still counts).
``iia_token`` is the stricter output-token variant: the model's output token (the argmax over the
whole vocabulary) after the intervention is the label's token (the counterfactual's output).
``logit_diff`` is the mean over examples of the label's logit minus the mean logit of the other
candidates (for two candidates: their difference). ``iia_unchanged`` is the same IIA without an
intervention (how often the base already predicts the label: the floor an intervention that moves
nothing scores). The interval is Wilson's score interval for a proportion over ``n_test``
independent examples; examples generated from a few templates are not independent draws of
language, so read it as the uncertainty over this set's sampling, not over templates.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.causal.variables.config import LocalizeConfig
from depthscope.analyses.causal.variables.counterfactuals import (
    END,
    TokenExample,
    as_counterfactuals,
    tokenize_examples,
)
from depthscope.analyses.causal.variables.swaps import Runner, candidate_scores, make_batches, site_vectors
from depthscope.analyses.intervals import MIN_UNITS, provenance, too_few, too_few_note
from depthscope.common.errors import InputError
from depthscope.common.progress import track
from depthscope.hooks.interventions import Intervention, Unchanged, VectorSwap
from depthscope.hooks.model_checks import require_decoder
from depthscope.hooks.sites import SITE_COLUMNS, parse_sites, site_frame

__all__ = ["interchange", "iia_columns", "parse_positions", "resid_sites", "COLUMNS", "CI_METHOD"]

#: the table's columns after the shared site columns
COLUMNS = [
    "position",
    "method",
    "dim",
    "iia",
    "iia_low",
    "iia_high",
    "iia_token",
    "iia_random",
    "iia_random_min",
    "iia_random_max",
    "n_random",
    "iia_unchanged",
    "logit_diff",
    "n_train",
    "n_test",
    "ci_n",
    "ci_unit",
    "ci_method",
    "variable",
]
CI_METHOD = "Wilson score interval over examples (95%)"
_Z = 1.959963984540054


def parse_positions(positions) -> list[str]:
    """Position names from ``"SUBJ,END"`` or a list of names (default ``END``)."""
    if positions is None:
        return [END]
    names = [p.strip() for p in positions.split(",")] if isinstance(positions, str) else [str(p) for p in positions]
    names = list(dict.fromkeys(n for n in names if n))
    if not names:
        raise InputError("positions is empty: give names of the examples' positions (END: the last token)")
    return names


def resid_sites(model, sites) -> list[int]:
    """Residual site indices from ``"resid"`` (every site), labels (``"embed,3.mlp"``), indices or a list."""
    if sites is None or sites == "resid":
        return parse_sites(None, model.n_layers)
    if isinstance(sites, str):
        sites = [s.strip() for s in sites.split(",") if s.strip()]
    try:
        return parse_sites(sites, model.n_layers)
    except (KeyError, IndexError) as e:
        raise InputError(f"sites: {e.args[0]}") from None


def iia_columns(hits: np.ndarray, diffs: np.ndarray, tokens: np.ndarray | None = None) -> dict:
    """``iia``, ``iia_low``, ``iia_high`` (Wilson's 95% score interval; NaN below ``MIN_UNITS``
    examples), ``iia_token`` (the share of ``tokens``: the output-token variant; NaN without),
    ``logit_diff`` (the mean) and the interval's provenance columns."""
    n = len(hits)
    p = float(np.mean(hits)) if n else math.nan
    lo = hi = math.nan
    if n and not too_few(n):
        denom = 1 + _Z**2 / n
        centre = (p + _Z**2 / (2 * n)) / denom
        half = _Z / denom * math.sqrt(p * (1 - p) / n + _Z**2 / (4 * n * n))
        lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    return {
        "iia": p,
        "iia_low": lo,
        "iia_high": hi,
        "iia_token": float(np.mean(tokens)) if n and tokens is not None else math.nan,
        "logit_diff": float(np.mean(diffs)) if n else math.nan,
        **provenance(n, "examples", CI_METHOD),
    }


def _variable(examples) -> str | None:
    names = {e.variable for e in examples}
    return names.pop() if len(names) == 1 else None


def _scores(runner: Runner, site: int, intervention: Intervention, source=None) -> tuple[np.ndarray, ...]:
    """Per-example hits, logit differences and output-token hits over every batch of ``runner``
    (in the examples' order) with ``intervention`` at ``site``; ``source``: every example's source
    vector ``[n, d]``."""
    n = sum(len(b.rows) for b in runner.batches)
    hits, diffs, tokens = np.zeros(n, dtype=bool), np.zeros(n), np.zeros(n, dtype=bool)
    for i, b in enumerate(runner.batches):
        logits = runner.logits(i, site, intervention, None if source is None else source[b.rows])
        hits[b.rows], diffs[b.rows], tokens[b.rows] = candidate_scores(logits, b)
    return hits, diffs, tokens


def unchanged(runner: Runner) -> float:
    """IIA without an intervention: how often the base already predicts the label."""
    return float(_scores(runner, 0, Unchanged())[0].mean())


def _position_rows(model, tex: list[TokenExample], sites: list[int], position: str, cfg: LocalizeConfig) -> list:
    runner = Runner(model, make_batches(model, tex, position, cfg.batch_size))
    _, source = site_vectors(model, tex, sites, position, cfg.batch_size)
    floor = unchanged(runner)
    rows = []
    for j, site in enumerate(track(sites, desc=f"interchange at {position}", unit="site", enabled=cfg.progress)):
        scores = _scores(runner, site, VectorSwap(), source[j])
        rows.append({"site": site, "position": position, "iia_unchanged": floor, **iia_columns(*scores)})
    return rows


def finish(rows: list[dict], n_layers: int, **const) -> pd.DataFrame:
    """The table: the shared site columns, then :data:`COLUMNS` (``const`` fills columns every row
    shares), and the note on an interval withheld for too few examples in ``attrs["notes"]``."""
    df = pd.DataFrame(rows)
    sites = site_frame(df["site"].to_numpy(), n_layers)
    df = pd.concat([sites, df.drop(columns="site")], axis=1)
    for k, v in const.items():
        df[k] = v
    df = df[[*SITE_COLUMNS, *COLUMNS]]
    n = int(df["ci_n"].min()) if len(df) else 0
    df.attrs["notes"] = [too_few_note(n, "examples", "iia_low/iia_high")] if n < MIN_UNITS else []
    return df


def interchange(model, examples, sites="resid", positions="END", *, config: LocalizeConfig | None = None):
    """Full-vector interchange at every residual site of ``sites`` and named position of
    ``positions`` on the counterfactual ``examples`` (a ``.jsonl`` path or a list): one row per
    (site, position) with IIA, its interval, ``logit_diff`` and ``iia_unchanged`` (see the module
    docstring). ``config``: batch size and progress (:class:`LocalizeConfig`)."""
    cfg = config or LocalizeConfig()
    require_decoder(model, "an interchange intervention")
    exs = as_counterfactuals(examples)
    names = parse_positions(positions)
    tex = tokenize_examples(model, exs, names)
    site_ids = resid_sites(model, sites)
    rows = []
    with torch.no_grad():
        for position in names:
            rows += _position_rows(model, tex, site_ids, position, cfg)
    const = {"method": "interchange", "dim": model.d_model, "n_train": 0, "n_random": 0}
    const.update(iia_random=math.nan, iia_random_min=math.nan, iia_random_max=math.nan)
    return finish(rows, model.n_layers, **const, n_test=len(tex), variable=_variable(exs))
