"""Activation and attribution patching: how much of a clean run each site restores in a corrupted one.

Patching asks which activations carry the difference between two prompts. The *clean* prompt
("When Mary and John went to the store, John gave a drink to") makes the model prefer a target
(" Mary") over a foil (" John"); the *corrupted* prompt changes one detail so that it does not.
Copying the clean activation at one hook point (and position, and head) into the corrupted run
and measuring the metric again gives the *fraction recovered*
``(patched - corrupted) / (clean - corrupted)``: 1 means that activation alone restores the clean
behaviour, 0 that it carries none of the difference (NaN when clean and corrupted metrics are equal).
That is *denoising*; ``direction="noise"`` does the converse, copying the corrupted activation into
the clean run: a fraction near 0 then says the clean behaviour needs that activation, 1 that it
does not (Wang et al.'s path patching noises; both directions answer different questions).

=========================  =====================================================================
offers                     what
=========================  =====================================================================
activation_patching        exact: every patch is one batch row of the corrupted prompt, many rows
                           per forward (chunked by a token budget), not one forward per site;
                           one pair, or a dataset of pairs (the means over pairs)
attribution_patching       first-order estimate ``(clean - corrupted) . d metric / d activation``
                           at the corrupted run: one forward and one backward per prompt pair
patch_pairs                either method over a dataset, one row per pair and patch (``pair``)
check_patching             what patch_pairs checks before its first forward (the memory too),
                           without running it
mean_over_pairs            that table's means over pairs, with a bootstrap interval
PromptPair, read_pairs     a pair with its metric tokens and named positions; a JSONL file of them
logit_diff, logit,         metric helpers (:class:`TokenMetric`); a ``(target, foil)`` pair means
prob, logprob              ``logit_diff(target, foil)``; any ``fn(logits) -> [batch]`` works too
last_position              marks a metric function as reading the last position only
PATCH_COLUMNS              the column order of the tables (datasets add ``fraction_low``,
                           ``fraction_high``, ``n_pairs``, ``ci_n``, ``ci_unit``, ``ci_method`` to
                           the means, ``pair`` to the per-pair rows)
FEATURE_COLUMNS            the same with ``feature`` after ``head``: tables that patch SAE features
PatchOptions               the keyword options: ``direction``, ``batch_tokens``, ``reuse_prefix``,
                           ``saes=`` and ``features=`` (SAE features)
=========================  =====================================================================

Datasets. ``activation_patching(model, pairs)`` takes a list of :class:`PromptPair` (or dicts
with ``clean``, ``corrupted``, ``target``, ``foil`` and optional ``positions``) or a ``.jsonl``
path; each pair is tokenized and measured with its own target and foil, pairs may differ in
length (the last positions are aligned; named positions align the others), and the table holds
the means over pairs with the IOI normalisation ``(mean patched - mean corrupted) / (mean clean -
mean corrupted)`` and a bootstrap interval over pairs (:mod:`depthscope.analyses.circuits.pairs`; NaN
below 10 pairs, with a note). Memory is one pair's activations and one chunk of rows, whatever the
number of pairs. Before the first forward, the pair that needs the most memory is checked against
the memory free (:mod:`depthscope.analyses.circuits.memory`): a pair too long for this machine is
refused, naming the estimate and what helps.

Hook points: every point of :mod:`depthscope.hooks.points` (read and replaced through
``model.run``): the 2L+1 residual sites (``embed``, ``l.attn``, ``l.mlp``, also named
``l.resid_pre``, ``l.resid_mid``, ``l.resid_post``; the default is all of them), the writes
``l.attn_out``, ``l.mlp_out``, ``l.neurons``, and the per-head points (``l.z``, ``l.heads``,
``l.pattern``, ``l.q``/``k``/``v``, ``l.rot_q``/``rot_k``, ``l.scores`` where the model offers
them) patched one head at a time; TransformerLens aliases
(``blocks.l.hook_attn_out``, ``blocks.l.attn.hook_z``...), or a group word for every layer
(``resid`` or a kind: ``heads``, ``z``, ``attn_out``...). Patterns and scores are patched a query
row at a time and need prompts of the same length (their key axis).

SAE features: with ``saes={"6.mlp": sae}`` (spliced into every forward, as ``model.run`` splices
it) the sub-points ``6.mlp.sae.features``, ``.reconstruction`` and ``.error`` are sites too. The
features are patched one at a time, the feature axis taking the head's place (a ``feature`` column
holds the index, ``head`` is empty); ``features=[12, 40, 7]`` patches some, ``features="top:20"``
the 20 with the largest mean ``|attribution|`` over pairs (:class:`PatchOptions`). Attribution per
feature is AtP: ``(f_clean - f_corrupted) * d metric / d f``, the gradient through the decoder.

Positions: ``"last"`` patches the last token only (clean and corrupted may differ in length: their
last tokens are aligned), ``"all"`` every position at once, ``"each"`` one row per position
(prompts of the same token length), or per named position when the pairs name positions, and a
comma-separated list of names (``"S2,END"``) patches those only.

Tables are long, one row per patch, with the shared site columns (``label`` is the site: for a
hook point below the residual, the site its write lands in, e.g. ``5.heads`` -> site ``5.attn``)
and ``point`` (the hook point), ``kind, head, position, clean_position, position_name, token,
clean_token, metric, clean_metric, corrupted_metric, fraction_recovered, method, direction``
(:mod:`depthscope.analyses.circuits.patching.results`). ``metric`` is the patched value (attribution: the
unpatched value plus the estimate). A patch that copies a value equal to the patched run's gives
exactly that run's metric (fraction 0 denoising, 1 noising); every other patched value is
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

from depthscope.analyses.circuits import memory
from depthscope.analyses.circuits.pairs import PromptPair, as_pairs, is_dataset, mean_over_pairs, read_pairs
from depthscope.analyses.circuits.patching import runs
from depthscope.analyses.circuits.patching.results import (
    FEATURE_COLUMNS,
    PATCH_COLUMNS,
    UNDEFINED,
    add_note,
    expect,
    means,
    run_pairs,
)
from depthscope.analyses.circuits.prompts import (
    Prompt,
    TokenMetric,
    TokenPair,
    last_position,
    logit,
    logit_diff,
    logprob,
    prob,
    tokenize_pairs,
)
from depthscope.common.errors import InputError
from depthscope.hooks.model_checks import require_decoder

__all__ = [
    "activation_patching",
    "attribution_patching",
    "patch_pairs",
    "check_patching",
    "mean_over_pairs",
    "PromptPair",
    "read_pairs",
    "TokenMetric",
    "logit_diff",
    "logit",
    "prob",
    "logprob",
    "last_position",
    "PATCH_COLUMNS",
    "FEATURE_COLUMNS",
    "PatchOptions",
    "POSITIONS",
    "DIRECTIONS",
    "PAIR_KEYS",
]

POSITIONS = runs.POSITIONS
DIRECTIONS = runs.DIRECTIONS
METHODS = ("activation", "attribution")
#: the columns naming one patch across pairs (what :func:`mean_over_pairs` groups by; ``feature``
#: only where the table has it)
PAIR_KEYS = ["point", "head", "feature", "position_name", "method", "direction"]
_TOP = "top:"


@dataclass(frozen=True)
class _Job(runs.Job):
    """What one call patches besides the shared settings: the points, prefix reuse, the SAEs
    spliced in and the features patched (``{point name: indices}``; None: every feature)."""

    points: tuple[runs.PatchPoint, ...] = ()
    reuse: bool = True
    saes: object = None
    features: dict | None = None


@dataclass(frozen=True)
class PatchOptions:
    """The keyword options of the patching functions (``**options``), checked together.

    ``direction``: ``"denoise"`` (the default: clean values into the corrupted run, measuring what
    an activation suffices to restore) or ``"noise"`` (corrupted values into the clean run,
    measuring what the clean behaviour needs). ``batch_tokens`` (exact patching): tokens per
    forward, patched rows x recomputed positions (a position a row holds as a shared prefix
    counts for what its keys and values weigh in memory). ``reuse_prefix`` (exact patching, decoders):
    compute the positions before a patch once, from a shared key/value cache.
    ``saes``: ``{point: SAE}`` spliced into every forward (as ``model.run(saes=...)``), which makes
    ``<point>.sae.features`` (and ``.reconstruction``, ``.error``) patchable ``sites``.
    ``features``: which features of each ``sae.features`` site to patch: None (every one), a list
    of indices, or ``"top:N"``: the N with the largest mean ``|attribution|`` over pairs and
    positions (one forward and backward per pair first), largest first."""

    batch_tokens: int = 2048
    reuse_prefix: bool = True
    direction: str = "denoise"
    saes: object = None
    features: Sequence[int] | str | None = None

    @classmethod
    def of(cls, kw: dict, method: str = "activation") -> PatchOptions:
        """The options of ``kw``; an error names any that ``method`` does not take (attribution
        patching runs no batched forwards: no ``batch_tokens``, no ``reuse_prefix``)."""
        defaults = {k: getattr(cls, k) for k in OPTIONS[method]}
        return cls(**runs.keyword_options(kw, defaults, f"{method} patching"))


#: the keyword options each method takes
OPTIONS = {
    "activation": ("direction", "batch_tokens", "reuse_prefix", "saes", "features"),
    "attribution": ("direction", "saes", "features"),
}


# ----------------------------------------------------------------------------- one pair
# Both functions are written for the denoise direction (clean values into the corrupted run);
# results.measure hands them the flipped pair for noise (see the runs module).
def _activation_pair(model, tp: TokenPair, job: _Job, bar):
    """Exact patching of one pair: chunks of rows, each with an unpatched row 0 it is measured
    against. Returns (patches, patched values, clean value, corrupted value)."""
    fn, k_ids = tp.metric, tp.corrupted_ids
    with torch.no_grad():
        clean_acts, clean_logits, _ = runs.capture(model, tp.clean_ids, job.points, saes=job.saes)
        corrupted_acts, corrupted_logits, _ = runs.capture(model, k_ids, job.points, saes=job.saes)
        clean_value, corrupted_value = float(fn(clean_logits)[0]), float(fn(corrupted_logits)[0])
    del clean_logits, corrupted_logits  # [1, pos, vocab] each: not held through the patched forwards
    cells = runs.pair_cells(tp.clean_ids, k_ids, job.positions, tp.positions)
    patches = runs.make_patches(job.points, cells, clean_acts, job.features)
    expect(bar, len(patches))
    same = runs.to_host([runs.unchanged(p, clean_acts[p.point.name], corrupted_acts[p.point.name]) for p in patches])
    todo = [i for i, s in enumerate(same) if not s]
    values = np.full(len(patches), corrupted_value)
    # a shared prefix hands the metric the recomputed positions' logits only: token metrics (and
    # functions marked last_position) read the last one; any other metric gets every position
    reuse = job.reuse and model.is_decoder and tp.last_only
    first = {i: runs.first_position(patches[i], reuse) for i in todo}
    order = sorted(todo, key=lambda i: -first[i])  # stable: forward order within a position
    n_pos, kept = k_ids.shape[1], {}
    # with reuse, the patched forwards return the last position's logits only (the metric reads only that)
    weight = memory.prefix_weight(memory.Sizes.of(model)) if reuse else 0.0
    bar.update(len(patches) - len(todo))
    for rows, start in runs.plan([first[i] for i in order], n_pos, job.batch_tokens, weight):
        chunk = [patches[order[r]] for r in rows]
        make = functools.partial(runs.hooks_for, chunk, clean_acts, n_pos)
        with torch.no_grad():
            lg = runs.patched_logits(model, k_ids, make, len(chunk) + 1, start, job.saes, last_only=reuse, kept=kept)
            out = fn(lg).float().cpu().numpy()
        values[[order[r] for r in rows]] = corrupted_value + (out[1:] - out[0])
        bar.update(len(rows))
    return patches, values, clean_value, corrupted_value


def _attribution_pair(model, tp: TokenPair, job: _Job, bar):
    """The first-order estimate for one pair: one clean forward, one corrupted forward and backward."""
    with torch.no_grad():
        clean_acts, clean_logits, _ = runs.capture(model, tp.clean_ids, job.points, saes=job.saes)
        clean_value = float(tp.metric(clean_logits)[0])
    acts, logits, run = runs.capture(model, tp.corrupted_ids, job.points, grad=True, saes=job.saes)
    value = tp.metric(logits)[0]
    value.backward()
    cells = runs.pair_cells(tp.clean_ids, tp.corrupted_ids, job.positions, tp.positions)
    patches = runs.make_patches(job.points, cells, clean_acts, job.features)
    expect(bar, len(patches))
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
    return patches, corrupted_value + est, clean_value, corrupted_value


# ----------------------------------------------------------------------------- public API
def patch_pairs(
    model, pairs, sites=None, positions: str = "last", *, method: str = "activation", metric=None, **options
) -> pd.DataFrame:
    """Patching over a dataset of prompt pairs, one row per pair and patch (a ``pair`` column).

    ``pairs``: a list of :class:`PromptPair` / dicts / ``(clean, corrupted)`` tuples or a
    ``.jsonl`` path (:func:`~depthscope.analyses.circuits.pairs.as_pairs`); a pair's own ``target`` and
    ``foil`` make its metric, ``metric`` serves the pairs without a target. ``method``:
    ``activation`` (exact) or ``attribution`` (the estimate); the other arguments as in
    :func:`activation_patching`, ``options`` those of :class:`PatchOptions` (``direction``,
    ``batch_tokens``, ``reuse_prefix``, ``saes``, ``features``). Pairs run one after the other, so
    memory holds one pair's activations and one chunk of rows. :func:`mean_over_pairs`
    (``keys=PAIR_KEYS``) gives the means."""
    job, tps, features = _prepared(model, pairs, sites, positions, method, metric, options)
    job = replace(job, features=_features(model, tps, job, features))
    one = _activation_pair if method == "activation" else _attribution_pair
    return run_pairs(model, tps, job, one, method)


def check_patching(model, pairs, sites=None, positions: str = "last", *, method="activation", metric=None, **options):
    """What :func:`patch_pairs` checks before its first forward, without running it: the method,
    the options, the hook points, the positions of every pair and the memory the largest pair
    needs (:class:`~depthscope.analyses.circuits.memory.WorkTooLarge`). A job that patches
    several times (sites at each position, then heads) checks every call first."""
    _prepared(model, pairs, sites, positions, method, metric, options)


def _prepared(model, pairs, sites, positions, method: str, metric, options: dict):
    """(job, tokenized pairs, the ``features`` option) of a :func:`patch_pairs` call, checked."""
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    require_decoder(model)
    opts = PatchOptions.of(options, method)
    points = tuple(runs.parse_patch_points(model, sites, opts.saes))
    job = _Job(str(positions), opts.batch_tokens, opts.direction, points, bool(opts.reuse_prefix), opts.saes)
    tps = tokenize_pairs(model, as_pairs(pairs), metric)
    _check_positions(tps, job.positions)
    _check_memory(model, tps, job, method)
    return job, tps, opts.features


def _check_positions(tps: list[TokenPair], positions: str) -> None:
    """Before any forward: every pair gives each position named, and ``each`` / ``all`` over pairs
    of different token lengths have names to align them."""
    if positions in ("each", "all") and len({(tp.corrupted_ids.shape[1], bool(tp.positions)) for tp in tps}) > 1:
        if not all(tp.positions for tp in tps) or positions == "all":
            raise InputError(
                f"positions={positions!r} (--positions) over pairs of different token lengths: name the "
                f"positions to patch in every pair (e.g. {{'S2': 9, 'END': -1}}) or patch the last position only"
            )
    if positions in runs.POSITIONS:
        return
    names = [n.strip() for n in positions.split(",") if n.strip()]
    for tp in tps:
        missing = [n for n in names if n not in (tp.positions or {})]
        if missing and names:
            have = f"it names {sorted(tp.positions)}" if tp.positions else "it names no positions"
            raise InputError(
                f"{tp.where} has no position {', '.join(map(repr, missing))} ({have}): positions must be one of "
                f"{', '.join(runs.POSITIONS)} or names of positions every pair gives, got {positions!r}"
            )


def _check_memory(model, tps: list[TokenPair], job: _Job, method: str) -> None:
    """Before any forward: the pair that needs the most memory
    (:func:`~depthscope.analyses.circuits.memory.patch_bytes`) fits in the memory free, else a
    :class:`~depthscope.analyses.circuits.memory.WorkTooLarge` naming it and what helps."""
    kinds = [p.kind for p in job.points]
    best = None
    for tp in tps:
        o = job.oriented(tp)
        n_clean, n_base = o.clean_ids.shape[1], o.corrupted_ids.shape[1]
        last = job.reuse and model.is_decoder and tp.last_only  # as _activation_pair's patched forwards
        kw = dict(method=method, batch_tokens=job.batch_tokens, last_only=last)
        terms = memory.patch_bytes(model, kinds, n_clean, n_base, **kw)
        if best is None or sum(terms.values()) > sum(best[1].values()):
            best = (tp, terms, max(n_clean, n_base))
    tp, terms, n = best
    knobs = ["shorter pairs"]
    if job.positions != "last":
        knobs.insert(0, "--positions last (positions='last')")
    if method == "activation" and job.batch_tokens > 2 * n:
        knobs.insert(0, f"a smaller --batch-tokens (batch_tokens=; now {job.batch_tokens})")
    if len(kinds) > 1:
        knobs.append(f"fewer --sites (sites=; now {len(kinds)} hook points)")
    where = f"{tp.where or f'pair {tp.index}'} ({n:,} tokens)" if len(tps) > 1 else f"the pair ({n:,} tokens)"
    memory.check_room(terms, model.device, f"{method} patching of {where}", knobs)


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
    sub = replace(job, points=tuple(points), features=None)
    scores: dict[str, dict[int, float]] = {p.name: {} for p in points}
    for tp in tps:
        patches, values, _, base = _attribution_pair(model, job.oriented(tp), sub, _Quiet())
        for p, v in zip(patches, values):
            got = scores[p.point.name]
            got[p.head] = got.get(p.head, 0.0) + abs(v - base)
    return {name: sorted(got, key=lambda j: -got[j])[: int(n)] for name, got in scores.items()}


def _single(model, clean, corrupted, metric, **kw) -> pd.DataFrame:
    """One pair through :func:`patch_pairs`, returned without the ``pair`` column."""
    if corrupted is None:
        raise InputError("give a corrupted prompt (or a dataset of pairs as the first argument)")
    if metric is None:
        raise InputError("a metric is needed: a (target, foil) pair, a TokenMetric or a function of the logits")
    df = patch_pairs(model, [PromptPair(clean, corrupted)], metric=metric, **kw).drop(columns="pair")
    if df["fraction_recovered"].isna().all():
        add_note(df, UNDEFINED.format(""))
    return df


def _dispatch(model, clean, corrupted, metric, **kw) -> pd.DataFrame:
    """A dataset's means over pairs, or one pair's table."""
    if isinstance(clean, (list, tuple)) and not clean:
        raise InputError("the pair list is empty: give at least one prompt pair (or a clean and a corrupted prompt)")
    if is_dataset(clean):
        if corrupted is not None:
            raise InputError("with a dataset of pairs as the first argument, give no corrupted prompt")
        return means(patch_pairs(model, clean, metric=metric, **kw), PAIR_KEYS)
    return _single(model, clean, corrupted, metric, **kw)


def activation_patching(
    model,
    clean: Prompt | Sequence | str,
    corrupted: Prompt | None = None,
    metric=None,
    sites=None,
    positions: str = "last",
    **options,
) -> pd.DataFrame:
    """Patch clean activations into the corrupted run (or, ``direction="noise"``, corrupted ones into
    the clean run), one hook point (position, head) at a time.

    One pair: ``activation_patching(model, clean, corrupted, metric, ...)``. A dataset:
    ``activation_patching(model, pairs, ...)`` with pairs as in :func:`patch_pairs` (``metric``
    for pairs without their own target); the table then holds the means over pairs with
    ``fraction_low``, ``fraction_high`` (95% bootstrap interval over pairs; NaN below 10 pairs, the
    table's ``attrs["notes"]`` say why), ``n_pairs`` and the interval's ``ci_n``, ``ci_unit``,
    ``ci_method``.

    Every patch is one batch row of the patched prompt; rows go through the model together,
    ``batch_tokens`` tokens per forward, with one editing hook per hook point that changes only
    its own rows, and row 0 of every forward left unpatched (each patched value is the unpatched
    metric plus its row's difference from that row). ``sites``: hook points (see the module
    docstring; default every residual site).

    ``options`` (:class:`PatchOptions`): ``direction`` (``"denoise"``, the default, or
    ``"noise"``), ``batch_tokens`` (2048), ``reuse_prefix`` (True), ``saes`` and ``features``.

    ``reuse_prefix`` (decoders): a patch at position ``p`` leaves positions before ``p`` as in the
    unpatched run, so those are computed once (a key/value cache shared by the rows) and each row
    recomputes only positions ``p..`` (patches are grouped by position). Only a metric that reads
    the last position gets the logits of those positions alone: the token metrics, and functions
    marked with :func:`~depthscope.analyses.circuits.prompts.last_position`; any other function of
    the logits gets every position (its pairs run without the shared prefix). Returns the tidy
    table described in the module docstring (``method = "activation"``).

    SAE features: ``saes={"6.mlp": sae}`` splices the SAE into every forward and
    ``sites="6.mlp.sae.features"`` patches its features one at a time (a ``feature`` column);
    ``features=[12, 40, 7]`` or ``features="top:20"`` picks which.
    """
    return _dispatch(model, clean, corrupted, metric, sites=sites, positions=positions, **options)


def attribution_patching(
    model,
    clean: Prompt | Sequence | str,
    corrupted: Prompt | None = None,
    metric=None,
    sites=None,
    positions="last",
    **options,
) -> pd.DataFrame:
    """The first-order estimate of :func:`activation_patching`, from gradients.

    One forward of the clean prompt (its activations), one forward and one backward of the
    corrupted prompt (its activations and the metric's gradient ``g`` there); each patch's effect
    is estimated as ``(clean - corrupted) . g`` summed over the patched cells (position, head).
    With ``direction="noise"`` the roles swap: ``(corrupted - clean) . g`` with ``g`` at the clean
    run. Same columns as :func:`activation_patching` with ``method = "attribution"`` and
    ``metric`` = unpatched value + estimate; a dataset of pairs gives the means over pairs in the
    same way. Exact for a metric linear in the activation; a screening tool otherwise: compare
    with exact patching on the sites that matter. ``options``: ``direction``, ``saes``,
    ``features`` (AtP per feature: ``(f_clean - f_corrupted) * d metric / d f``), as in
    :func:`activation_patching`.
    """
    return _dispatch(model, clean, corrupted, metric, sites=sites, positions=positions, method="attribution", **options)
