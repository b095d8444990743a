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
                           per forward (chunked by a token budget), not one forward per site
attribution_patching       first-order estimate ``(clean - corrupted) . d metric / d activation``
                           at the corrupted run: one forward and one backward per prompt pair
logit_diff, logit,         metric helpers (:class:`TokenMetric`); a ``(target, foil)`` pair means
prob, logprob              ``logit_diff(target, foil)``; any ``fn(logits) -> [batch]`` works too
PATCH_COLUMNS              the column order of both tables
=========================  =====================================================================

Hook points (:mod:`depthscope.hooks.points`, read and replaced through ``model.run``): the 2L+1
residual sites (``embed``, ``l.attn``, ``l.mlp``; the default is all of them), ``l.attn_out``,
``l.mlp_out``, and ``l.heads`` and ``l.z`` patched one head at a time; TransformerLens aliases
(``blocks.l.hook_attn_out``, ``blocks.l.attn.hook_z``...), or the group words ``resid``,
``attn_out``, ``mlp_out``, ``heads``, ``z`` for every layer.

Positions: ``"last"`` patches the last token only (clean and corrupted may differ in length: their
last tokens are aligned), ``"all"`` every position at once, ``"each"`` one row per position
(``"all"`` and ``"each"`` need prompts of the same token length and raise
:class:`~depthscope.common.errors.InputError` otherwise).

Tables are long, one row per patch, with the shared site columns (for a hook point below the
residual: the site its write lands in, e.g. ``5.heads`` -> site ``5.attn``) and
``point, kind, head, position, clean_position, token, clean_token, metric, clean_metric,
corrupted_metric, fraction_recovered, method``. ``metric`` is the patched value (attribution:
the corrupted value plus the estimate). Metric functions receive logits ``[batch, pos, vocab]``
of unpadded runs of one prompt, so position -1 is the last real token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.arch import cache_keyword, returned_cache
from depthscope.hooks.engine import Engine, normalise_hooks
from depthscope.hooks.points import Point, parse_point, parse_points
from depthscope.hooks.sites import SITE_COLUMNS, site_frame

__all__ = [
    "activation_patching",
    "attribution_patching",
    "TokenMetric",
    "logit_diff",
    "logit",
    "prob",
    "logprob",
    "PATCH_COLUMNS",
    "POSITIONS",
]

POSITIONS = ("last", "all", "each")
KINDS = ("resid", "attn_out", "mlp_out", "heads", "z")
PATCH_COLUMNS = [
    *SITE_COLUMNS,
    "point",
    "kind",
    "head",
    "position",
    "clean_position",
    "token",
    "clean_token",
    "metric",
    "clean_metric",
    "corrupted_metric",
    "fraction_recovered",
    "method",
]
Prompt = str | torch.Tensor | Sequence[int]


# ----------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class TokenMetric:
    """A metric of the logits at the last position: ``kind`` is ``logit_diff`` (target minus
    foil), ``logit``, ``prob`` or ``logprob`` of ``target``. Tokens are single-token strings
    (mind the leading space: ``" Mary"``) or token ids; :meth:`bind` resolves them for a model."""

    kind: str
    target: str | int
    foil: str | int | None = None

    def bind(self, model) -> Callable[[torch.Tensor], torch.Tensor]:
        t = _single_token(model, self.target, "target")
        f = _single_token(model, self.foil, "foil") if self.kind == "logit_diff" else None
        kind = self.kind

        def metric(logits: torch.Tensor) -> torch.Tensor:
            last = logits[:, -1].float()
            if kind == "logit_diff":
                return last[:, t] - last[:, f]
            if kind == "logit":
                return last[:, t]
            lp = torch.log_softmax(last, dim=-1)[:, t]
            return lp if kind == "logprob" else lp.exp()

        return metric

    def describe(self) -> str:
        if self.kind == "logit_diff":
            return f"logit[{self.target!r}] - logit[{self.foil!r}]"
        return f"{self.kind}[{self.target!r}]"


def logit_diff(target, foil) -> TokenMetric:
    """``logit[target] - logit[foil]`` at the last position."""
    return TokenMetric("logit_diff", target, foil)


def logit(target) -> TokenMetric:
    """``logit[target]`` at the last position."""
    return TokenMetric("logit", target)


def prob(target) -> TokenMetric:
    """Probability of ``target`` at the last position."""
    return TokenMetric("prob", target)


def logprob(target) -> TokenMetric:
    """Log-probability of ``target`` at the last position."""
    return TokenMetric("logprob", target)


def _single_token(model, token, what: str) -> int:
    if token is None:
        raise InputError(f"a logit difference needs a {what} token")
    return model.token_id(token, what)


def _bind_metric(model, metric) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """(fn(logits [batch, pos, vocab]) -> [batch], description) from any accepted metric."""
    if isinstance(metric, tuple) and len(metric) == 2:
        metric = logit_diff(*metric)
    if isinstance(metric, TokenMetric):
        if metric.kind not in ("logit_diff", "logit", "prob", "logprob"):
            raise InputError(f"unknown metric kind {metric.kind!r}: use logit_diff, logit, prob or logprob")
        return metric.bind(model), metric.describe()
    if callable(metric):
        name = getattr(metric, "__name__", type(metric).__name__)

        def checked(logits: torch.Tensor) -> torch.Tensor:
            out = torch.as_tensor(metric(logits))
            if out.dim() == 0 and logits.shape[0] == 1:
                out = out.reshape(1)
            if out.shape != (logits.shape[0],):
                raise InputError(
                    f"metric {name} returned shape {tuple(out.shape)}; it must return one "
                    f"number per batch row, shape ({logits.shape[0]},)"
                )
            return out.float()

        return checked, name
    raise InputError(
        f"metric must be a (target, foil) pair, a TokenMetric (logit_diff, prob, ...) or a "
        f"function of the logits, got {type(metric).__name__}"
    )


# ----------------------------------------------------------------------------- hook points
@dataclass(frozen=True)
class _Point:
    name: str  # the hook name the model understands: "embed", "5.attn", "5.attn_out", "5.heads", ...
    kind: str  # resid | attn_out | mlp_out | heads | z
    site: int  # the residual site its write lands in

    @property
    def per_head(self) -> bool:
        return self.kind in ("heads", "z")


#: the kinds of hook point that are patched (the residual sites and the writes below them)
PATCH_KINDS = ("embed", "attn", "mlp", "attn_out", "mlp_out", "heads", "z")


def _patch_point(point: Point) -> _Point:
    """A registry point as a patching point (residual sites have kind ``resid``)."""
    if point.is_resid:
        return _Point(point.name, "resid", point.site)
    return _Point(point.name, point.kind, 2 * point.layer + (2 if point.kind == "mlp_out" else 1))


def _parse_one(name, n_layers: int) -> list[_Point]:
    """The points one name stands for: a group word (every layer) or one hook point name of the
    registry (:func:`~depthscope.hooks.points.parse_point`, aliases included) of a patched kind."""
    key = name.strip() if isinstance(name, str) else name
    if key == "resid":
        return [_patch_point(p) for p in parse_points("resid", n_layers)]
    if key in KINDS:
        return [_patch_point(Point(key, layer)) for layer in range(n_layers)]
    try:
        point = parse_point(key, n_layers)
        why = "" if point.kind in PATCH_KINDS else f": {point.kind} points are not patched"
    except InputError as e:
        point, why = None, getattr(e, "why", "")
    if point is None or why:
        raise InputError(
            f"unknown hook point {name!r}{why}: use a residual site ('embed', '<layer>.attn', '<layer>.mlp', an "
            f"index 0..{2 * n_layers}, blocks.<layer>.hook_resid_pre|mid|post), '<layer>.attn_out', "
            f"'<layer>.mlp_out', '<layer>.heads', '<layer>.z' (or blocks.<layer>.hook_attn_out, hook_mlp_out, "
            f"attn.hook_result, attn.hook_z), or a group word: {', '.join(KINDS)}"
        )
    return [_patch_point(point)]


def _parse_points(model, sites) -> list[_Point]:
    """Hook points in forward order (by site, residual stream after the writes that land in it)."""
    if sites is None:
        sites = ["resid"]
    elif isinstance(sites, (str, int)):
        sites = [s.strip() for s in sites.split(",")] if isinstance(sites, str) else [sites]
    points: dict[str, _Point] = {}
    for s in sites:
        for p in _parse_one(s, model.n_layers):
            points[p.name] = p
    if not points:
        raise InputError("no hook points given")
    order = {k: i for i, k in enumerate(("z", "heads", "attn_out", "mlp_out", "resid"))}  # forward order
    return sorted(points.values(), key=lambda p: (p.site, order[p.kind]))


# ----------------------------------------------------------------------------- prompts
def _ids(model, prompt: Prompt, what: str) -> torch.Tensor:
    """Token ids ``[1, pos]`` of one prompt (a string, or token ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"the {what} prompt is empty")
        ids, _ = model.tokenize([prompt])
    else:
        t = torch.as_tensor(prompt)
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1 or t.numel() == 0 or t.dtype in (torch.float16, torch.float32, torch.float64, torch.bool):
            raise InputError(
                f"the {what} prompt must be a string or one sequence of token ids, got shape {tuple(t.shape)} {t.dtype}"
            )
        ids = t.long()[None]
        if int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size:
            raise InputError(f"the {what} prompt has token ids out of range 0..{model.vocab_size - 1}")
    ctx = model.max_context
    if ctx is not None and ids.shape[1] > ctx:
        raise InputError(f"the {what} prompt has {ids.shape[1]} tokens, more than the context of {ctx}")
    return ids.to(model.device)


def _pairs(clean: torch.Tensor, corrupted: torch.Tensor, positions: str) -> list[tuple[int | None, int | None]]:
    """(corrupted position, clean position) per patch; (None, None) = every position at once."""
    if positions not in POSITIONS:
        raise InputError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    tc, tk = clean.shape[1], corrupted.shape[1]
    if positions == "last":
        return [(tk - 1, tc - 1)]
    if tc != tk:
        raise InputError(
            f"positions={positions!r} needs clean and corrupted prompts of the same token length, got {tc} and {tk} "
            f"tokens; make the corrupted prompt differ by same-length tokens (e.g. swap one name for another) "
            f"or patch the last position only (--positions last; positions='last'), which aligns the last tokens"
        )
    return [(None, None)] if positions == "all" else [(p, p) for p in range(tk)]


def _decode(model, ids: torch.Tensor, p: int | None) -> str:
    if p is None:
        return ""
    i = int(ids[0, p])
    return model.tokenizer.decode([i]) if model.tokenizer is not None else str(i)


# ----------------------------------------------------------------------------- running the model
def _capture(model, ids: torch.Tensor, points: list[_Point], *, grad: bool = False):
    """(activations by point name, each ``[pos, ...]``; logits ``[1, pos, vocab]``; the Run).
    With ``grad=True`` the activations are in the graph of the logits (for a backward)."""
    run = model.run(ids, cache=[p.name for p in points], grad=grad)
    return {p.name: run[p.name][0] for p in points}, run.logits, run


def _editor(clean: torch.Tensor, rows, pos, cpos, heads) -> Callable:
    """A hook that writes clean activations into some (row, position[, head]) cells of its batch."""
    r = torch.as_tensor(rows, dtype=torch.long, device=clean.device)
    p = torch.as_tensor(pos, dtype=torch.long, device=clean.device)
    c = torch.as_tensor(cpos, dtype=torch.long, device=clean.device)
    h = torch.as_tensor(heads, dtype=torch.long, device=clean.device) if heads is not None else None

    def edit(t: torch.Tensor, *_):
        new = t.clone()
        src = clean.to(device=t.device, dtype=t.dtype)
        if h is None:
            new[r, p] = src[c]
        else:
            new[r, p, h] = src[c, h]
        return new

    return edit


# ----------------------------------------------------------------------------- the patches
@dataclass(frozen=True)
class _Patch:
    point: _Point
    pos: int | None  # corrupted position; None = every position
    cpos: int | None
    head: int | None


def _patches(points: list[_Point], pairs, n_heads: dict[str, int]) -> list[_Patch]:
    out = []
    for pt in points:
        for pos, cpos in pairs:
            heads = range(n_heads[pt.name]) if pt.per_head else [None]
            out += [_Patch(pt, pos, cpos, h) for h in heads]
    return out


def _hooks_for(chunk: list[_Patch], first_row: int, clean_acts: dict, n_pos: int, start: int) -> dict:
    """One editing hook per hook point, covering the rows of this chunk patched there; the
    forward computes positions ``start..n_pos-1`` only (row positions are shifted by ``start``)."""
    cells: dict[str, tuple[list, list, list, list]] = {}
    for k, patch in enumerate(chunk):
        rows, pos, cpos, heads = cells.setdefault(patch.point.name, ([], [], [], []))
        span = [(patch.pos, patch.cpos)] if patch.pos is not None else [(q, q) for q in range(n_pos)]
        for q, cq in span:
            rows.append(first_row + k)
            pos.append(q - start)
            cpos.append(cq)
            heads.append(patch.head)
    hooks = {}
    for name, (rows, pos, cpos, heads) in cells.items():
        hs = None if heads[0] is None else heads
        hooks[name] = _editor(clean_acts[name], rows, pos, cpos, hs)
    return hooks


def _plan(starts: list[int], n_pos: int, batch_tokens: int) -> list[tuple[range, int]]:
    """Chunks of consecutive patches (``starts`` descending: the first position each patch
    changes) within the token budget, each with the first position its forward recomputes. The
    first chunk holds one more row (the unpatched baseline)."""
    chunks, i = [], 0
    while i < len(starts) or not chunks:
        extra = 0 if chunks else 1
        j = i + 1
        while j < len(starts) and (j - i + 1 + extra) * (n_pos - starts[j]) <= batch_tokens:
            j += 1
        j = min(j, len(starts))
        chunks.append((range(i, j), starts[j - 1] if j > i else n_pos - 1))
        i = j
    return chunks


def _prefix_cache(model, ids: torch.Tensor, start: int, n_rows: int):
    """The corrupted prompt's key/value cache for positions ``0..start-1``, repeated for ``n_rows``
    rows (None when there is nothing to reuse or the model keeps no such cache)."""
    if start <= 0 or not model.is_decoder:
        return None
    out = model.hf_model(input_ids=ids[:, :start], use_cache=True)
    past = returned_cache(out)
    if past is None or not hasattr(past, "batch_repeat_interleave"):
        return None
    past.batch_repeat_interleave(n_rows)
    return past


def _patched_logits(model, ids: torch.Tensor, make_hooks: Callable[[int], dict], n_rows: int, start: int):
    """Logits of ``n_rows`` copies of ``ids`` with the hooks ``make_hooks(start)``. Positions before
    ``start`` (where no row is patched, so every row equals the corrupted run) come from one shared
    key/value cache and the logits cover positions ``start..`` only; without such a cache (or with
    ``start`` 0) one plain ``model.run`` of every position."""
    past = _prefix_cache(model, ids, start, n_rows)
    if past is None:
        return model.run(ids.expand(n_rows, -1), hooks=make_hooks(0)).logits
    mask = torch.ones(n_rows, ids.shape[1], dtype=torch.long, device=ids.device)
    with Engine(model, (), normalise_hooks(make_hooks(start), model.n_layers)):
        out = model.hf_model(
            input_ids=ids[:, start:].expand(n_rows, -1),
            attention_mask=mask,
            use_cache=True,
            **{cache_keyword(model.hf_model): past},
        )
    return out.logits


def activation_patching(
    model,
    clean: Prompt,
    corrupted: Prompt,
    metric,
    sites=None,
    positions: str = "last",
    *,
    batch_tokens: int = 2048,
    reuse_prefix: bool = True,
) -> pd.DataFrame:
    """Patch clean activations into the corrupted run, one hook point (position, head) at a time.

    Every patch is one batch row of the corrupted prompt; rows go through the model together,
    ``batch_tokens`` tokens per forward, with one editing hook per hook point that changes only
    its own rows. The first row of the first forward is left unpatched: it gives
    ``corrupted_metric``, so patches that change nothing give a fraction of exactly 0.
    ``sites``: hook points (see the module docstring; default every residual site).

    ``reuse_prefix`` (decoders): a patch at position ``p`` leaves positions before ``p`` as in the
    corrupted run, so those are computed once (a key/value cache shared by the rows) and each row
    recomputes only positions ``p..`` (patches are grouped by position); the metric then receives
    logits for those positions only, so it must read the last position (as the token metrics do).
    Pass ``reuse_prefix=False`` for a metric that reads earlier positions. Returns the tidy table
    described in the module docstring (``method = "activation"``).
    """
    if int(batch_tokens) < 1:
        raise InputError(f"batch_tokens must be >= 1, got {batch_tokens}")
    fn, what = _bind_metric(model, metric)
    c_ids, k_ids = _ids(model, clean, "clean"), _ids(model, corrupted, "corrupted")
    pairs = _pairs(c_ids, k_ids, positions)
    points = _parse_points(model, sites)
    with torch.no_grad():
        clean_acts, clean_logits, _ = _capture(model, c_ids, points)
        clean_value = float(fn(clean_logits)[0])
    n_heads = {p.name: int(clean_acts[p.name].shape[1]) for p in points if p.per_head}
    patches = _patches(points, pairs, n_heads)
    n_pos = k_ids.shape[1]
    reuse = reuse_prefix and model.is_decoder
    first = [p.pos if (reuse and p.pos is not None) else 0 for p in patches]
    order = sorted(range(len(patches)), key=lambda i: -first[i])  # stable: forward order within a position
    values, corrupted_value = np.empty(len(patches)), None
    bar = progress_bar(len(patches), desc="patching", unit="patch")
    for rows, start in _plan([first[i] for i in order], n_pos, int(batch_tokens)):
        chunk = [patches[order[r]] for r in rows]
        base = int(corrupted_value is None)
        make = functools.partial(_hooks_for, chunk, base, clean_acts, n_pos)
        with torch.no_grad():
            out = fn(_patched_logits(model, k_ids, make, len(chunk) + base, start)).float().cpu().numpy()
        if base:
            corrupted_value = float(out[0])
        values[[order[r] for r in rows]] = out[base:]
        bar.update(len(rows))
    bar.close()
    pair = _Pair(c_ids, k_ids, clean_value, corrupted_value)
    return _table(model, patches, values, pair, "activation", what, positions)


def attribution_patching(
    model, clean: Prompt, corrupted: Prompt, metric, sites=None, positions: str = "last"
) -> pd.DataFrame:
    """The first-order estimate of :func:`activation_patching`, from gradients.

    One forward of the clean prompt (its activations), one forward and one backward of the
    corrupted prompt (its activations and the metric's gradient ``g`` there); each patch's effect
    is estimated as ``(clean - corrupted) . g`` summed over the patched cells (position, head).
    Same columns as :func:`activation_patching` with ``method = "attribution"`` and ``metric`` =
    corrupted value + estimate. Exact for a metric linear in the activation; a screening tool
    otherwise: compare with exact patching on the sites that matter.
    """
    fn, what = _bind_metric(model, metric)
    c_ids, k_ids = _ids(model, clean, "clean"), _ids(model, corrupted, "corrupted")
    pairs = _pairs(c_ids, k_ids, positions)
    points = _parse_points(model, sites)
    with torch.no_grad():
        clean_acts, clean_logits, _ = _capture(model, c_ids, points)
        clean_value = float(fn(clean_logits)[0])
    acts, logits, run = _capture(model, k_ids, points, grad=True)
    value = fn(logits)[0]
    value.backward()
    grads = {p.name: run.grad(p.name)[0] for p in points}
    n_heads = {p.name: int(clean_acts[p.name].shape[1]) for p in points if p.per_head}
    patches = _patches(points, pairs, n_heads)
    est = np.empty(len(patches))
    for i, pt in enumerate(patches):
        a, g, c = acts[pt.point.name].detach().float(), grads[pt.point.name].float(), clean_acts[pt.point.name].float()
        if pt.pos is None:
            delta, grad = c - a, g
        else:
            delta, grad = c[pt.cpos] - a[pt.pos], g[pt.pos]
        if pt.head is not None:
            delta, grad = delta[..., pt.head, :], grad[..., pt.head, :]
        est[i] = float((delta * grad).sum())
    pair = _Pair(c_ids, k_ids, clean_value, float(value.detach()))
    return _table(model, patches, pair.corrupted_value + est, pair, "attribution", what, positions)


@dataclass(frozen=True)
class _Pair:
    """The clean and corrupted prompts of one call: their token ids and metric values."""

    clean_ids: torch.Tensor
    corrupted_ids: torch.Tensor
    clean_value: float
    corrupted_value: float


def _table(model, patches, values, pair: _Pair, method: str, what: str, positions: str) -> pd.DataFrame:
    """The tidy table: one row per patch, shared site columns first."""
    c_ids, k_ids = pair.clean_ids, pair.corrupted_ids
    clean_value, corrupted_value = pair.clean_value, pair.corrupted_value
    df = site_frame([p.point.site for p in patches], model.n_layers)
    df["label"] = [p.point.name for p in patches]
    df["point"] = [p.point.name for p in patches]
    df["kind"] = [p.point.kind for p in patches]
    df["head"] = pd.array([p.head for p in patches], dtype="Int64")
    df["position"] = pd.array([p.pos for p in patches], dtype="Int64")
    df["clean_position"] = pd.array([p.cpos for p in patches], dtype="Int64")
    df["token"] = [_decode(model, k_ids, p.pos) for p in patches]
    df["clean_token"] = [_decode(model, c_ids, p.cpos) for p in patches]
    df["metric"] = np.asarray(values, dtype=float)
    df["clean_metric"] = clean_value
    df["corrupted_metric"] = corrupted_value
    denom = clean_value - corrupted_value
    # equal prompts, or a gap at the level of float rounding (the clean and the patched runs are
    # different forwards): the fraction would be noise
    if torch.equal(c_ids.cpu(), k_ids.cpu()) or abs(denom) <= 1e-6 * max(1.0, abs(clean_value), abs(corrupted_value)):
        denom = 0.0
    df["fraction_recovered"] = (df["metric"] - corrupted_value) / denom if denom != 0 else np.nan
    df["method"] = method
    df.attrs.update(model=str(model.name), metric=what, positions=positions, method=method)
    if denom == 0:
        df.attrs["notes"] = "clean and corrupted metrics are equal: fraction_recovered is undefined (NaN)"
    return df[PATCH_COLUMNS]
