"""Activation and attribution patching: how much of a clean run each site restores in a corrupted one.

Patching asks which activations carry the difference between two prompts. The *clean* prompt
("When Mary and John went to the store, John gave a drink to") makes the model prefer a target
(" Mary") over a foil (" John"); the *corrupted* prompt changes one detail so that it does not.
Copying the clean activation at one hook point (and position, and head) into the corrupted run
and measuring the metric again gives the *fraction recovered*
``(patched - corrupted) / (clean - corrupted)``: 1 means that activation alone restores the clean
behaviour, 0 that it carries none of the difference (NaN when clean and corrupted metrics are equal).

=========================  =====================================================================
offers                     what
=========================  =====================================================================
activation_patching        exact: every patch is one batch row of the corrupted prompt, many rows
                           per forward (chunked by a token budget), not one forward per site;
                           one pair, or a dataset of pairs (the means over pairs)
attribution_patching       first-order estimate ``(clean - corrupted) . d metric / d activation``
                           at the corrupted run: one forward and one backward per prompt pair
patch_pairs                either method over a dataset, one row per pair and patch (``pair``)
mean_over_pairs            that table's means over pairs, with a bootstrap interval
PromptPair, read_pairs     a pair with its metric tokens and named positions; a JSONL file of them
logit_diff, logit,         metric helpers (:class:`TokenMetric`); a ``(target, foil)`` pair means
prob, logprob              ``logit_diff(target, foil)``; any ``fn(logits) -> [batch]`` works too
PATCH_COLUMNS              the column order of the tables (datasets add ``fraction_low``,
                           ``fraction_high``, ``n_pairs`` to the means, ``pair`` to the per-pair rows)
FEATURE_COLUMNS            the same with ``feature`` after ``head``: tables that patch SAE features
SaeOptions                 the keywords ``saes=`` and ``features=`` that patch SAE features
=========================  =====================================================================

Datasets. ``activation_patching(model, pairs)`` takes a list of :class:`PromptPair` (or dicts
with ``clean``, ``corrupted``, ``target``, ``foil`` and optional ``positions``) or a ``.jsonl``
path; each pair is tokenized and measured with its own target and foil, pairs may differ in
length (the last positions are aligned; named positions align the others), and the table holds
the means over pairs with the IOI normalisation ``(mean patched - mean corrupted) / (mean clean -
mean corrupted)`` and a bootstrap interval over pairs (:mod:`depthscope.analyses.circuits.pairs`). Memory
is one pair's activations and one chunk of rows, whatever the number of pairs.

Hook points: every point of :mod:`depthscope.hooks.points` (read and replaced through
``model.run``): the 2L+1 residual sites (``embed``, ``l.attn``, ``l.mlp``; the default is all of
them), the writes ``l.attn_out``, ``l.mlp_out``, ``l.neurons``, and the per-head points (``l.z``,
``l.heads``, ``l.pattern``, ``l.q``/``k``/``v``, ``l.rot_q``/``rot_k``, ``l.scores`` where the
model offers them) patched one head at a time; TransformerLens aliases
(``blocks.l.hook_attn_out``, ``blocks.l.attn.hook_z``...), or a group word for every layer
(``resid`` or a kind: ``heads``, ``z``, ``attn_out``...). Patterns and scores are patched a query
row at a time and need prompts of the same length (their key axis).

SAE features: with ``saes={"6.mlp": sae}`` (spliced into every forward, as ``model.run`` splices
it) the sub-points ``6.mlp.sae.features``, ``.reconstruction`` and ``.error`` are sites too. The
features are patched one at a time, the feature axis taking the head's place (a ``feature`` column
holds the index, ``head`` is empty); ``features=[12, 40, 7]`` patches some, ``features="top:20"``
the 20 with the largest mean ``|attribution|`` over pairs (:class:`SaeOptions`). Attribution per
feature is AtP: ``(f_clean - f_corrupted) * d metric / d f``, the gradient through the decoder.

Positions: ``"last"`` patches the last token only (clean and corrupted may differ in length: their
last tokens are aligned), ``"all"`` every position at once, ``"each"`` one row per position
(prompts of the same token length), or per named position when the pairs name positions, and a
comma-separated list of names (``"S2,END"``) patches those only.

Tables are long, one row per patch, with the shared site columns (for a hook point below the
residual: the site its write lands in, e.g. ``5.heads`` -> site ``5.attn``) and
``point, kind, head, position, clean_position, position_name, token, clean_token, metric,
clean_metric, corrupted_metric, fraction_recovered, method``. ``metric`` is the patched value
(attribution: the corrupted value plus the estimate). A patch that copies a value equal to the
corrupted one gives exactly the corrupted metric (fraction 0); every other patched value is
measured against an unpatched row of its own forward. Metric functions receive logits
``[batch, pos, vocab]`` of unpadded runs of one prompt, so position -1 is the last real token.
Encoders (BERT-style) predict no next token and are refused with a clear message.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.circuits import runs
from depthscope.analyses.circuits.pairs import PromptPair, as_pairs, is_dataset, mean_over_pairs, read_pairs
from depthscope.analyses.circuits.prompts import (
    Prompt,
    TokenMetric,
    TokenPair,
    describe_metrics,
    logit,
    logit_diff,
    logprob,
    pair_fraction,
    prob,
    token_texts,
    tokenize_pairs,
)
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.common.settings import TOKENS, check_number
from depthscope.hooks.sites import SITE_COLUMNS, site_frame

__all__ = [
    "activation_patching",
    "attribution_patching",
    "patch_pairs",
    "mean_over_pairs",
    "PromptPair",
    "read_pairs",
    "TokenMetric",
    "logit_diff",
    "logit",
    "prob",
    "logprob",
    "PATCH_COLUMNS",
    "FEATURE_COLUMNS",
    "SaeOptions",
    "POSITIONS",
    "PAIR_KEYS",
]

POSITIONS = runs.POSITIONS
METHODS = ("activation", "attribution")
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
]
#: the columns of a table that patches SAE features: ``feature`` (the index) after ``head``
FEATURE_COLUMNS = [
    *PATCH_COLUMNS[: PATCH_COLUMNS.index("head") + 1],
    "feature",
    *PATCH_COLUMNS[PATCH_COLUMNS.index("head") + 1 :],
]
#: the columns naming one patch across pairs (what :func:`mean_over_pairs` groups by; ``feature``
#: only where the table has it)
PAIR_KEYS = ["point", "head", "feature", "position_name", "method"]
_TOP = "top:"


@dataclass(frozen=True)
class _Job:
    """What one call patches: the points, the positions mode, the token budget, prefix reuse, the
    SAEs spliced in and the features patched (``{point name: indices}``; None: every feature)."""

    points: list[runs.PatchPoint]
    positions: str
    batch_tokens: int = 2048
    reuse: bool = True
    saes: object = None
    features: dict | None = None


@dataclass(frozen=True)
class SaeOptions:
    """The keywords that patch SAE features (``**sae`` of the patching functions).

    ``saes``: ``{point: SAE}`` spliced into every forward (as ``model.run(saes=...)``), which makes
    ``<point>.sae.features`` (and ``.reconstruction``, ``.error``) patchable ``sites``.
    ``features``: which features of each ``sae.features`` site to patch: None (every one), a list
    of indices, or ``"top:N"``: the N with the largest mean ``|attribution|`` over pairs and
    positions (one forward and backward per pair first), largest first."""

    saes: object = None
    features: Sequence[int] | str | None = None

    @classmethod
    def of(cls, kw: dict) -> SaeOptions:
        extra = sorted(set(kw) - {"saes", "features"})
        if extra:
            raise InputError(
                f"unexpected keyword argument(s) {extra}: SAE features are patched with saes= and features="
            )
        return cls(**kw)


@dataclass(frozen=True)
class _Result:
    """One pair's patches, patched values and its clean and corrupted metric values."""

    pair: TokenPair
    patches: list[runs.Patch]
    values: np.ndarray
    clean_value: float
    corrupted_value: float


# ----------------------------------------------------------------------------- one pair
def _unchanged(patch: runs.Patch, clean: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
    """Whether a patch copies a value equal to the corrupted run's (so it changes nothing), as a
    0-d bool tensor on the activations' device (read back with the others by ``runs.to_host``)."""
    pt, c = patch.point, patch.cell
    a = runs.axes_first(clean, pt, batch=False)
    b = runs.axes_first(corrupted, pt, batch=False)
    if c.pos is not None:
        a, b = a[c.cpos], b[c.pos]
        if patch.head is not None:
            a, b = a[patch.head], b[patch.head]
    if a.shape != b.shape:
        return torch.zeros((), dtype=torch.bool, device=a.device)
    return (a == b).all()


def _activation_pair(model, tp: TokenPair, job: _Job, bar) -> _Result:
    """Exact patching of one pair: chunks of rows, each with an unpatched row 0 it is measured against."""
    fn, k_ids = tp.metric, tp.corrupted_ids
    with torch.no_grad():
        clean_acts, clean_logits, _ = runs.capture(model, tp.clean_ids, job.points, saes=job.saes)
        corrupted_acts, corrupted_logits, _ = runs.capture(model, k_ids, job.points, saes=job.saes)
        clean_value, corrupted_value = float(fn(clean_logits)[0]), float(fn(corrupted_logits)[0])
    cells = runs.pair_cells(tp.clean_ids, k_ids, job.positions, tp.positions)
    patches = runs.make_patches(job.points, cells, clean_acts, job.features)
    same = runs.to_host([_unchanged(p, clean_acts[p.point.name], corrupted_acts[p.point.name]) for p in patches])
    todo = [i for i, s in enumerate(same) if not s]
    values = np.full(len(patches), corrupted_value)
    reuse = job.reuse and model.is_decoder
    first = {i: runs.first_position(patches[i], reuse) for i in todo}
    order = sorted(todo, key=lambda i: -first[i])  # stable: forward order within a position
    n_pos = k_ids.shape[1]
    bar.update(len(patches) - len(todo))
    for rows, start in runs.plan([first[i] for i in order], n_pos, job.batch_tokens):
        chunk = [patches[order[r]] for r in rows]
        make = functools.partial(runs.hooks_for, chunk, clean_acts, n_pos)
        with torch.no_grad():
            lg = runs.patched_logits(model, k_ids, make, len(chunk) + 1, start, saes=job.saes)
            out = fn(lg).float().cpu().numpy()
        values[[order[r] for r in rows]] = corrupted_value + (out[1:] - out[0])
        bar.update(len(rows))
    return _Result(tp, patches, values, clean_value, corrupted_value)


def _attribution_pair(model, tp: TokenPair, job: _Job, bar) -> _Result:
    """The first-order estimate for one pair: one clean forward, one corrupted forward and backward."""
    with torch.no_grad():
        clean_acts, clean_logits, _ = runs.capture(model, tp.clean_ids, job.points, saes=job.saes)
        clean_value = float(tp.metric(clean_logits)[0])
    acts, logits, run = runs.capture(model, tp.corrupted_ids, job.points, grad=True, saes=job.saes)
    value = tp.metric(logits)[0]
    value.backward()
    cells = runs.pair_cells(tp.clean_ids, tp.corrupted_ids, job.positions, tp.positions)
    patches = runs.make_patches(job.points, cells, clean_acts, job.features)
    est = []  # 0-d tensors on the model's device, read back together
    for p in patches:
        pt, c = p.point, p.cell
        a = runs.axes_first(acts[pt.name].detach().float(), pt, batch=False)
        g = runs.axes_first(run.grad(pt.name)[0].float(), pt, batch=False)
        k = runs.axes_first(clean_acts[pt.name].float(), pt, batch=False)
        if c.pos is None:  # [pos, (head), ...]: every position at once
            delta, grad = k - a, g
            if p.head is not None:
                delta, grad = delta[:, p.head], grad[:, p.head]
        else:
            delta, grad = k[c.cpos] - a[c.pos], g[c.pos]
            if p.head is not None:
                delta, grad = delta[p.head], grad[p.head]
        est.append((delta * grad).sum())
    bar.update(len(patches))
    corrupted_value = float(value.detach())
    est = np.asarray(runs.to_host(est), dtype=np.float64)
    return _Result(tp, patches, corrupted_value + est, clean_value, corrupted_value)


# ----------------------------------------------------------------------------- tables
def _table(model, r: _Result, method: str) -> pd.DataFrame:
    """The tidy table of one pair: one row per patch, shared site columns first."""
    patches = r.patches
    df = site_frame([p.point.site for p in patches], model.n_layers)
    df["label"] = df["point"] = [p.point.name for p in patches]
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
    df["method"] = method
    return df[FEATURE_COLUMNS if any(is_feature) else PATCH_COLUMNS]


# ----------------------------------------------------------------------------- public API
def patch_pairs(
    model,
    pairs,
    sites=None,
    positions: str = "last",
    *,
    method: str = "activation",
    metric=None,
    batch_tokens: int = 2048,
    reuse_prefix: bool = True,
    **sae,
) -> pd.DataFrame:
    """Patching over a dataset of prompt pairs, one row per pair and patch (a ``pair`` column).

    ``pairs``: a list of :class:`PromptPair` / dicts / ``(clean, corrupted)`` tuples or a
    ``.jsonl`` path (:func:`~depthscope.analyses.circuits.pairs.as_pairs`); a pair's own ``target`` and
    ``foil`` make its metric, ``metric`` serves the pairs without a target. ``method``:
    ``activation`` (exact) or ``attribution`` (the estimate); the other arguments as in
    :func:`activation_patching`. Pairs run one after the other, so memory holds one pair's
    activations and one chunk of rows. :func:`mean_over_pairs` (``keys=PAIR_KEYS``) gives the means.
    ``saes=``, ``features=``: SAE features as patched sites (:class:`SaeOptions`)."""
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    check_number("batch_tokens", batch_tokens, maximum=TOKENS)
    runs.require_decoder(model)
    opts = SaeOptions.of(sae)
    points = runs.parse_patch_points(model, sites, opts.saes)
    job = _Job(points, str(positions), int(batch_tokens), bool(reuse_prefix), opts.saes)
    tps = tokenize_pairs(model, as_pairs(pairs), metric)
    if job.positions in ("each", "all") and len({(tp.corrupted_ids.shape[1], bool(tp.positions)) for tp in tps}) > 1:
        if not all(tp.positions for tp in tps) or job.positions == "all":
            raise InputError(
                f"positions={job.positions!r} (--positions) over pairs of different token lengths: name the "
                f"positions to patch in every pair (e.g. {{'S2': 9, 'END': -1}}) or patch the last position only"
            )
    job = replace(job, features=_features(model, tps, job, opts.features))
    one = _activation_pair if method == "activation" else _attribution_pair
    tables = []
    with progress_bar(None, desc=f"{method} patching", unit="patch") as bar:  # closed on error too
        for tp in tps:
            r = one(model, tp, job, bar)
            if getattr(bar, "total", 0) is None:  # the patches of every pair are those of the first
                bar.total = len(r.patches) * len(tps)
            t = _table(model, r, method)
            t.insert(0, "pair", tp.index)
            tables.append(t)
    out = pd.concat(tables, ignore_index=True)
    out.attrs.update(model=str(model.name), metric=describe_metrics(tps), positions=job.positions, method=method)
    out.attrs["n_pairs"] = len(tps)
    return out


class _Quiet:
    """A progress bar that shows nothing (the attribution pass that ranks features)."""

    total = 0

    def update(self, n: int) -> None:
        pass


def _features(model, tps: list[TokenPair], job: _Job, features) -> dict | None:
    """``{feature point: indices}`` of a ``features`` argument (None: every feature); ``"top:N"``
    ranks each point's features by their mean ``|attribution|`` over pairs and positions."""
    points = [p for p in job.points if p.kind == runs.FEATURES]
    if features is None:
        return None
    if not points:
        raise InputError("features= selects SAE features: name a site such as '6.mlp.sae.features' (and pass saes=)")
    if not (isinstance(features, str) and features.startswith(_TOP)):
        if isinstance(features, (str, int)) or not isinstance(features, Sequence):
            raise InputError(f"features must be a list of feature indices or 'top:N', got {features!r}")
        return {p.name: list(features) for p in points}
    n = features[len(_TOP) :]
    if not n.isdigit() or int(n) < 1:
        raise InputError(f"features={features!r}: 'top:N' needs a positive whole number N, e.g. 'top:20'")
    sub = replace(job, points=points, features=None)
    scores: dict[str, dict[int, float]] = {p.name: {} for p in points}
    for tp in tps:
        r = _attribution_pair(model, tp, sub, _Quiet())
        for p, v in zip(r.patches, r.values):
            got = scores[p.point.name]
            got[p.head] = got.get(p.head, 0.0) + abs(v - r.corrupted_value)
    return {name: sorted(got, key=lambda j: -got[j])[: int(n)] for name, got in scores.items()}


def _means(per_pair: pd.DataFrame) -> pd.DataFrame:
    """Means over pairs, with the per-pair table's attrs and a note when the gap is zero."""
    out = mean_over_pairs(per_pair, PAIR_KEYS)
    out.attrs.update(per_pair.attrs)
    if out["fraction_recovered"].isna().all():
        out.attrs["notes"] = "mean clean and corrupted metrics are equal: fraction_recovered is undefined (NaN)"
    return out


def _single(model, clean, corrupted, metric, **kw) -> pd.DataFrame:
    """One pair through :func:`patch_pairs`, returned without the ``pair`` column."""
    if corrupted is None:
        raise InputError("give a corrupted prompt (or a dataset of pairs as the first argument)")
    if metric is None:
        raise InputError("a metric is needed: a (target, foil) pair, a TokenMetric or a function of the logits")
    df = patch_pairs(model, [PromptPair(clean, corrupted)], metric=metric, **kw).drop(columns="pair")
    if df["fraction_recovered"].isna().all():
        df.attrs["notes"] = "clean and corrupted metrics are equal: fraction_recovered is undefined (NaN)"
    return df


def activation_patching(
    model,
    clean: Prompt | Sequence | str,
    corrupted: Prompt | None = None,
    metric=None,
    sites=None,
    positions: str = "last",
    *,
    batch_tokens: int = 2048,
    reuse_prefix: bool = True,
    **sae,
) -> pd.DataFrame:
    """Patch clean activations into the corrupted run, one hook point (position, head) at a time.

    One pair: ``activation_patching(model, clean, corrupted, metric, ...)``. A dataset:
    ``activation_patching(model, pairs, ...)`` with pairs as in :func:`patch_pairs` (``metric``
    for pairs without their own target); the table then holds the means over pairs with
    ``fraction_low``, ``fraction_high`` (95% bootstrap interval over pairs) and ``n_pairs``.

    Every patch is one batch row of the corrupted prompt; rows go through the model together,
    ``batch_tokens`` tokens per forward, with one editing hook per hook point that changes only
    its own rows, and row 0 of every forward left unpatched (each patched value is the corrupted
    metric plus its row's difference from that row). ``sites``: hook points (see the module
    docstring; default every residual site).

    ``reuse_prefix`` (decoders): a patch at position ``p`` leaves positions before ``p`` as in the
    corrupted run, so those are computed once (a key/value cache shared by the rows) and each row
    recomputes only positions ``p..`` (patches are grouped by position); the metric then receives
    logits for those positions only, so it must read the last position (as the token metrics do).
    Pass ``reuse_prefix=False`` for a metric that reads earlier positions. Returns the tidy table
    described in the module docstring (``method = "activation"``).

    SAE features: ``saes={"6.mlp": sae}`` splices the SAE into every forward and
    ``sites="6.mlp.sae.features"`` patches its features one at a time (a ``feature`` column);
    ``features=[12, 40, 7]`` or ``features="top:20"`` picks which (:class:`SaeOptions`).
    """
    kw = dict(sites=sites, positions=positions, batch_tokens=batch_tokens, reuse_prefix=reuse_prefix, **sae)
    if is_dataset(clean):
        if corrupted is not None:
            raise InputError("with a dataset of pairs as the first argument, give no corrupted prompt")
        return _means(patch_pairs(model, clean, metric=metric, **kw))
    return _single(model, clean, corrupted, metric, **kw)


def attribution_patching(
    model,
    clean: Prompt | Sequence | str,
    corrupted: Prompt | None = None,
    metric=None,
    sites=None,
    positions="last",
    **sae,
) -> pd.DataFrame:
    """The first-order estimate of :func:`activation_patching`, from gradients.

    One forward of the clean prompt (its activations), one forward and one backward of the
    corrupted prompt (its activations and the metric's gradient ``g`` there); each patch's effect
    is estimated as ``(clean - corrupted) . g`` summed over the patched cells (position, head).
    Same columns as :func:`activation_patching` with ``method = "attribution"`` and ``metric`` =
    corrupted value + estimate; a dataset of pairs gives the means over pairs in the same way.
    Exact for a metric linear in the activation; a screening tool otherwise: compare with exact
    patching on the sites that matter. ``saes=``, ``features=``: SAE features (AtP per feature:
    ``(f_clean - f_corrupted) * d metric / d f``), as in :func:`activation_patching`.
    """
    kw = dict(sites=sites, positions=positions, method="attribution", **sae)
    if is_dataset(clean):
        if corrupted is not None:
            raise InputError("with a dataset of pairs as the first argument, give no corrupted prompt")
        return _means(patch_pairs(model, clean, metric=metric, **kw))
    return _single(model, clean, corrupted, metric, **kw)
