"""How patches run: hook points as patched, positions per pair, editing hooks, batched forwards.

The machinery under :mod:`depthscope.analyses.circuits.patching.activation` and
:mod:`~depthscope.analyses.circuits.patching.paths` (and any method that patches one pair's activations,
such as edge attribution): a patch copies the *source* run's activation at one hook point,
position (and head) into one batch row of the *base* run; many rows go through the model in one
forward, each changed only by its own editing hook cells.

Directions. ``denoise`` (the default) patches clean values into the corrupted run: the source is
the clean prompt, the base the corrupted one. ``noise`` patches corrupted values into the clean
run (Wang et al.'s path patching). Every primitive here is written for ``denoise``, with the
TokenPair's ``clean_ids`` as the source and ``corrupted_ids`` as the base; :meth:`Job.oriented`
turns a pair round for ``noise`` (:meth:`~depthscope.analyses.circuits.prompts.TokenPair.flipped`)
and :meth:`Cell.flipped` turns its cells back for the table. So a :class:`Cell`'s ``pos`` is the
base run's position and ``cpos`` the source run's.

======================  ==========================================================================
offers                  what
======================  ==========================================================================
Job, DIRECTIONS         what one call computes, shared by every method: the positions mode, the
                        token budget per forward and the direction (methods add their fields)
keyword_options         a method's keyword options (``**options``) with their defaults, checked
PatchPoint              a hook point as patched: its name, kind, the residual site its write lands
                        in, and which axes are the position and the head (``LAYOUT``)
patch_point             the PatchPoint of a registry point
parse_patch_points      the points a ``sites`` argument names (names, aliases, group words, the
                        sub-points of SAEs spliced in: ``6.mlp.sae.features``)
Cell, pair_cells        the positions patched in one pair: ``last``, ``all``, ``each`` or names
Patch, make_patches     one patch (point, cell, head) and all of them for a pair (``features``: the
                        SAE features patched, by point)
unchanged               whether a patch copies a value equal to the base run's (so it changes
                        nothing and is not run)
capture                 activations ``[...]`` (batch dropped) and logits of one prompt (SAEs spliced)
landing_site            the residual site a hook point's write lands in
to_host                 per-patch 0-d tensors (flags, estimates) read back in one transfer
axes_first              a view with a point's position (then head) axis first
hooks_for               the editing hooks of a chunk of patches (one hook per point)
plan                    chunks of patches within a token budget, each with the first position its
                        forward recomputes
patched_logits          logits of the rows of one chunk (a shared key/value prefix when it helps)
======================  ==========================================================================

Layouts. Most points are ``[batch, pos, ...]``; per-head points are ``[batch, pos, heads, ...]``
(``z``, ``heads``, ``q``, ``k``, ``v``, ``rot_q``, ``rot_k``: key/value heads as the model has
them) or ``[batch, heads, query, key]`` (``pattern``, ``scores``: the query is the patched
position, the key axis is copied whole, so clean and corrupted need the same length there).
``rot_k`` holds every key position the attention sees, cached ones included, so its patches
run without a shared prefix.

SAE sub-points (``<p>.sae.features``, ``.reconstruction``, ``.error``; kinds ``sae.features``...)
exist when ``saes`` are spliced in (:mod:`depthscope.hooks.sae_splice`) and land in the site the SAE
writes. ``sae.features`` ``[batch, pos, d_sae]`` is patched one feature at a time, the feature axis
taking the place of the head axis (a patch's ``head`` is the feature index). Their patches run
without a shared prefix: the prefix path drives the transformers model without the splice.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from depthscope.analyses.circuits.prompts import TokenPair
from depthscope.common.errors import InputError
from depthscope.common.settings import TOKENS, check_number
from depthscope.hooks.interventions import FeatureSwap, VectorSwap
from depthscope.hooks.late_start import KVPrefix, tail_logits
from depthscope.hooks.points import REGISTRY, SUB_KINDS, Point, parse_point, parse_points
from depthscope.hooks.sae_splice import SUB_POINTS, plan_splices, sub_name

POSITIONS = ("last", "all", "each")
#: the patching directions: clean values into the corrupted run, or corrupted values into the clean run
DIRECTIONS = ("denoise", "noise")
#: group words: every residual site, or one kind below the stream at every layer
KINDS = ("resid", *SUB_KINDS)
#: (position axis, head axis) of the kinds that are not ``[batch, pos, ...]``
LAYOUT = {
    "pattern": (2, 1),
    "scores": (2, 1),
    **{k: (1, 2) for k in ("z", "heads", "q", "k", "v", "rot_q", "rot_k")},
    "sae.features": (1, 2),  # one feature at a time, like a head
}
#: the kind of an SAE's features: the points whose patches ``features`` selects
FEATURES = "sae.features"
#: kinds whose tensor spans every key position, cached ones included (no shared prefix)
FULL_KEYS = ("rot_k",)
_RANK = {s.kind: i for i, s in enumerate(REGISTRY)}


@dataclass(frozen=True)
class Job:
    """What one patching call computes, the part every method shares: the ``positions`` mode, the
    tokens per forward (``batch_tokens``) and the ``direction`` (:data:`DIRECTIONS`). Each method
    subclasses it with its own fields (the points patched, the senders and receivers...)."""

    positions: str
    batch_tokens: int = 2048
    direction: str = "denoise"

    def __post_init__(self) -> None:
        check_number("batch_tokens", self.batch_tokens, maximum=TOKENS)
        if self.direction not in DIRECTIONS:
            raise InputError(
                f"direction must be one of {', '.join(DIRECTIONS)} (denoise: clean values into the corrupted run; "
                f"noise: corrupted values into the clean run), got {self.direction!r}"
            )

    def oriented(self, tp: TokenPair) -> TokenPair:
        """The pair as the primitives see it: as given for ``denoise`` (clean is the source), its
        prompts exchanged for ``noise`` (the corrupted prompt is the source)."""
        return tp.flipped() if self.direction == "noise" else tp


@dataclass(frozen=True)
class PatchPoint:
    """A hook point as patched: ``name`` (canonical), ``kind`` (``resid`` for residual sites),
    ``site`` (the residual site its write lands in) and the layout of its tensor."""

    name: str
    kind: str
    site: int
    order: tuple[int, ...]
    pos_axis: int = 1
    head_axis: int | None = None

    @property
    def per_head(self) -> bool:
        return self.head_axis is not None


def to_host(values: list) -> list:
    """0-d tensors, one per patch (flags, estimates) on the model's device, as Python values
    read back in one transfer: a read per patch would wait for the device once per site or head."""
    if not values:
        return []
    return torch.stack([v.to(values[0].device) for v in values]).cpu().tolist()


def landing_site(point: Point) -> int:
    """The residual site a point's write lands in: its own for a residual site, ``l.attn`` for the
    points up to the attention write, ``l.mlp`` for the MLP's."""
    if point.is_resid:
        return point.site
    return 2 * point.layer + (1 if _RANK[point.kind] <= _RANK["attn"] else 2)


def keyword_options(kw: dict, defaults: dict, what: str) -> dict:
    """``defaults`` updated by the keyword options ``kw``; an error names any that ``what`` does
    not take (so a misspelt option is never ignored)."""
    extra = sorted(set(kw) - set(defaults))
    if extra:
        raise InputError(f"unexpected keyword argument(s) {extra}: {what} takes {', '.join(defaults)} as keywords")
    return {**defaults, **kw}


def patch_point(point: Point) -> PatchPoint:
    """The PatchPoint of a registry point (``kind`` ``resid`` for a residual site)."""
    kind = "resid" if point.is_resid else point.kind
    pos, head = LAYOUT.get(point.kind, (1, None))
    return PatchPoint(point.name, kind, landing_site(point), point.order, pos, head)


def _sae_point(key: str, n_layers: int, saes) -> PatchPoint | None:
    """The patch point of an SAE sub-point name (None for any other name): it lands where the SAE
    writes, after that point's own tensor in forward order."""
    got = sub_name(key, n_layers)
    if got is None:
        return None
    prefix, sub = got
    splices = {s.prefix: s for s in plan_splices(saes, n_layers)}
    if prefix not in splices:
        raise InputError(
            f"hook point {key!r}: no SAE is attached at {prefix}; pass saes={{{prefix!r}: sae}} "
            f"(attached: {sorted(splices) or 'none'})"
        )
    splice = splices[prefix]
    kind = f"sae.{sub}"
    pos, head = LAYOUT.get(kind, (1, None))
    order = (*splice.write.order, 1 + SUB_POINTS.index(sub))
    return PatchPoint(f"{prefix}.sae.{sub}", kind, landing_site(splice.write), order, pos, head)


def _parse_one(name, n_layers: int, saes=None) -> list[PatchPoint]:
    """The points one name stands for: a group word (every layer), one registry point name or an
    SAE sub-point of ``saes``."""
    key = name.strip() if isinstance(name, str) else name
    sae = _sae_point(key, n_layers, saes)
    if sae is not None:
        return [sae]
    if key == "resid":
        return [patch_point(p) for p in parse_points("resid", n_layers)]
    if key in KINDS:
        return [patch_point(Point(key, layer)) for layer in range(n_layers)]
    bad_layer = _out_of_range(key, n_layers)
    if bad_layer:
        raise InputError(bad_layer)
    try:
        return [patch_point(parse_point(key, n_layers))]
    except InputError as e:
        raise InputError(f"{e}; group words (every layer): {', '.join(KINDS)}") from None


def _out_of_range(key, n_layers: int) -> str | None:
    """The message for ``<layer>.<kind>`` with a layer the model does not have, else None."""
    layer, dot, kind = key.partition(".") if isinstance(key, str) else ("", "", "")
    if not dot or kind not in _RANK or not layer.lstrip("-").isdigit() or 0 <= int(layer) < n_layers:
        return None
    every = f", or '{kind}' for every layer" if kind in KINDS else ""
    return (
        f"hook point {key!r}: layer {layer} out of range: this model has {n_layers} layers, "
        f"numbered 0..{n_layers - 1} (e.g. '{n_layers - 1}.{kind}'{every})"
    )


def parse_patch_points(model, sites, saes=None) -> list[PatchPoint]:
    """Hook points in forward order, de-duplicated (default: every residual site); ``saes`` (as
    ``model.run`` takes them) make their sub-points patchable."""
    if sites is None:
        sites = ["resid"]
    elif isinstance(sites, (str, int)):
        sites = [s.strip() for s in sites.split(",")] if isinstance(sites, str) else [sites]
    points: dict[str, PatchPoint] = {}
    for s in sites:
        for p in _parse_one(s, model.n_layers, saes):
            points[p.name] = p
    if not points:
        raise InputError("no hook points given")
    return sorted(points.values(), key=lambda p: p.order)


# ----------------------------------------------------------------------------- positions
@dataclass(frozen=True)
class Cell:
    """A patched position of one pair: its ``name`` (``last``, ``all``, an index or a named
    position), the base run's position ``pos`` and the source run's ``cpos`` (None, None: every
    position). In the ``denoise`` direction, and in the tables, those are the corrupted and the
    clean position."""

    name: str
    pos: int | None
    cpos: int | None

    def flipped(self) -> Cell:
        """The cell with its two positions exchanged (a ``noise`` cell as the table reads it)."""
        return Cell(self.name, self.cpos, self.pos)


def pair_cells(clean: torch.Tensor, corrupted: torch.Tensor, positions: str, named=None) -> list[Cell]:
    """The cells of one pair for a ``positions`` mode (see :data:`POSITIONS`) or a
    comma-separated list of position names (each a key of the pair's ``named`` positions)."""
    tc, tk = clean.shape[1], corrupted.shape[1]
    if positions == "last":
        return [Cell("last", tk - 1, tc - 1)]
    if positions == "each" and named:
        return [Cell(n, k, c) for n, (c, k) in named.items()]
    if positions in ("all", "each"):
        if tc != tk:
            raise InputError(
                f"positions={positions!r} needs clean and corrupted prompts of the same token length, got {tc} and "
                f"{tk} tokens; make the corrupted prompt differ by same-length tokens (e.g. swap one name for "
                f"another), name the positions to patch in each pair ({{'S2': 9, 'END': -1}}), or patch the last "
                f"position only (--positions last; positions='last'), which aligns the last tokens"
            )
        return [Cell("all", None, None)] if positions == "all" else [Cell(str(p), p, p) for p in range(tk)]
    names = [n.strip() for n in str(positions).split(",") if n.strip()]
    missing = [n for n in names if not named or n not in named]
    if not names or missing:
        have = f"; this pair names {sorted(named)}" if named else "; this pair names no positions"
        raise InputError(
            f"positions must be one of {', '.join(POSITIONS)} or names of positions every pair gives, got "
            f"{positions!r}{have}"
        )
    return [Cell(n, named[n][1], named[n][0]) for n in names]


# ----------------------------------------------------------------------------- patches
@dataclass(frozen=True)
class Patch:
    point: PatchPoint
    cell: Cell
    head: int | None


def make_patches(
    points: list[PatchPoint], cells: list[Cell], acts: dict[str, torch.Tensor], features=None
) -> list[Patch]:
    """Every (point, cell, head) of one pair; heads counted on the activations ``acts`` (batch
    dropped). ``features``: ``{point name: feature indices}`` for SAE feature points (default every
    feature), checked against the SAE's width."""
    out = []
    for pt in points:
        heads = range(acts[pt.name].shape[pt.head_axis - 1]) if pt.per_head else [None]
        if pt.kind == FEATURES and features and features.get(pt.name) is not None:
            heads = _checked_features(pt.name, features[pt.name], len(heads))
        out += [Patch(pt, c, h) for c in cells for h in heads]
    return out


def unchanged(patch: Patch, source: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Whether a patch copies a value equal to the base run's at its cells (so it changes nothing:
    its value is exactly the base run's, with no forward), as a 0-d bool tensor on the activations'
    device (read back with the others by :func:`to_host`). ``source``, ``base``: the point's
    activations of the two runs, batch dropped."""
    pt, c = patch.point, patch.cell
    a, b = axes_first(source, pt, batch=False), axes_first(base, pt, batch=False)
    if c.pos is not None:
        a, b = a[c.cpos], b[c.pos]
    if patch.head is not None:
        a, b = (a[patch.head], b[patch.head]) if c.pos is not None else (a[:, patch.head], b[:, patch.head])
    if a.shape != b.shape:
        return torch.zeros((), dtype=torch.bool, device=a.device)
    return (a == b).all()


def _checked_features(name: str, wanted, n: int) -> list[int]:
    """Feature indices (Python or NumPy integers) within the SAE's width, de-duplicated in order."""
    try:
        got = [operator.index(j) for j in wanted if not isinstance(j, bool)]
    except TypeError:
        got = []
    if not got or len(got) != len(wanted) or not all(0 <= j < n for j in got):
        raise InputError(f"{name}: features must be indices 0..{n - 1} of the SAE's {n} features, got {list(wanted)!r}")
    return list(dict.fromkeys(got))


def capture(model, ids: torch.Tensor, points: list[PatchPoint], *, grad: bool = False, saes=None):
    """(activations by point name with the batch dropped; logits ``[1, pos, vocab]``; the Run).
    With ``grad=True`` the activations are in the graph of the logits (for a backward); ``saes``
    are spliced in as ``model.run`` splices them."""
    run = model.run(ids, cache=[p.name for p in points], grad=grad, saes=saes)
    return {p.name: run[p.name][0] for p in points}, run.logits, run


def axes_first(t: torch.Tensor, point: PatchPoint, batch: bool) -> torch.Tensor:
    """A view of ``t`` with its position (then head) axis first after the batch (when ``batch``)."""
    off = 0 if batch else 1
    src = [point.pos_axis - off] + ([point.head_axis - off] if point.per_head else [])
    return t.movedim(src, list(range(1 - off, 1 - off + len(src))))


def _editor(point: PatchPoint, clean: torch.Tensor, cells: tuple[list, list, list, list]) -> Callable:
    """A hook writing clean activations into some (row, position[, head]) cells of its batch
    (:class:`~depthscope.hooks.interventions.VectorSwap`; an SAE feature point:
    :class:`~depthscope.hooks.interventions.FeatureSwap`)."""
    rows, pos, cpos, heads = (torch.as_tensor(v, dtype=torch.long, device=clean.device) for v in cells)
    src = axes_first(clean, point, batch=False)
    swap = VectorSwap()

    def edit(t: torch.Tensor, *_):
        new = t.clone()
        view, s = axes_first(new, point, batch=True), src.to(device=t.device, dtype=t.dtype)
        if view.shape[2 + point.per_head :] != s.shape[1 + point.per_head :]:
            raise InputError(
                f"{point.name}: the clean activation {tuple(s.shape)} does not fit the corrupted run's "
                f"{tuple(view.shape[1:])} (its key axis follows the prompt's length: patch it between prompts "
                f"of the same token length)"
            )
        if point.kind == FEATURES:  # one SAE feature per row: the feature axis stands in the head's place
            view[rows, pos] = FeatureSwap(heads)(view[rows, pos], s[cpos])
        elif point.per_head:
            view[rows, pos, heads] = swap(view[rows, pos, heads], s[cpos, heads])
        else:
            view[rows, pos] = swap(view[rows, pos], s[cpos])
        return new

    return edit


def hooks_for(chunk: list[Patch], clean_acts: dict, n_pos: int, start: int) -> dict:
    """One editing hook per hook point for a chunk whose row 0 is left unpatched (patch ``k`` is
    row ``k + 1``); the forward computes positions ``start..n_pos-1`` only, so positions are
    shifted by ``start`` (except for kinds in ``FULL_KEYS``, run with ``start`` 0)."""
    cells: dict[str, tuple[PatchPoint, tuple[list, list, list, list]]] = {}
    for k, patch in enumerate(chunk):
        pt, c = patch.point, patch.cell
        rows, pos, cpos, heads = cells.setdefault(pt.name, (pt, ([], [], [], [])))[1]
        span = [(c.pos, c.cpos)] if c.pos is not None else [(q, q) for q in range(n_pos)]
        for q, cq in span:
            rows.append(k + 1)
            pos.append(q - start)
            cpos.append(cq)
            heads.append(patch.head if patch.head is not None else 0)
    return {name: _editor(pt, clean_acts[name], c) for name, (pt, c) in cells.items()}


def first_position(patch: Patch, reuse: bool) -> int:
    """The first position a patch changes (0 without prefix reuse): positions before it equal the
    corrupted run, so a forward may start there. SAE sub-points start at 0 (the shared prefix
    path runs the transformers model without the splice)."""
    if not reuse or patch.cell.pos is None or patch.point.kind in FULL_KEYS or patch.point.kind.startswith("sae."):
        return 0
    return patch.cell.pos


def plan(starts: list[int], n_pos: int, batch_tokens: int, weight: float = 0.0) -> list[tuple[range, int]]:
    """Chunks of consecutive patches (``starts`` descending: the first position each patch
    changes) within the token budget, each with the first position its forward recomputes.
    Every chunk holds one more row (the unpatched baseline). A row counts the positions it
    recomputes plus ``weight`` for each position it holds as a cached key/value prefix (what such
    a position costs in memory: :func:`~depthscope.analyses.circuits.memory.prefix_weight`), so
    the budget bounds memory however late the rows start."""
    chunks, i = [], 0
    while i < len(starts):
        j = i + 1
        while j < len(starts) and (j - i + 2) * (n_pos - starts[j] + weight * starts[j]) <= batch_tokens:
            j += 1
        chunks.append((range(i, j), starts[j - 1]))
        i = j
    return chunks


def _prefix_cache(model, ids: torch.Tensor, start: int, n_rows: int, kept: dict | None = None) -> KVPrefix | None:
    """The corrupted prompt's key/value prefix for positions ``0..start-1``, repeated for ``n_rows``
    rows (None when there is nothing to reuse or the model keeps no such cache). ``kept``: the
    one-row prefix of the last start asked, reused (copied) by the next chunk with that start."""
    if kept is None:
        prefix = KVPrefix.build(model, ids, start)
        return prefix.repeat(n_rows) if prefix is not None else None
    if start not in kept:
        kept.clear()  # chunks come in order of start: one prefix kept at a time
        kept[start] = KVPrefix.build(model, ids, start)
    base = kept[start]
    return KVPrefix(model, copy.deepcopy(base.cache), start).repeat(n_rows) if base is not None else None


def patched_logits(
    model,
    ids: torch.Tensor,
    make_hooks: Callable[[int], dict],
    n_rows: int,
    start: int,
    saes=None,
    *,
    last_only: bool = False,
    kept: dict | None = None,
) -> torch.Tensor:
    """Logits of ``n_rows`` copies of ``ids`` with the hooks ``make_hooks(start)``. Positions before
    ``start`` (where no row is patched, so every row equals the corrupted run) come from one shared
    key/value prefix (:class:`~depthscope.hooks.late_start.KVPrefix`) and the logits cover positions
    ``start..`` only; without such a prefix (or with ``start`` 0) one plain ``model.run`` of every
    position, with ``saes`` spliced in. (A chunk with an SAE patch starts at 0; the others may skip
    the splice: unedited, it changes no number.) Keywords: ``last_only`` (the last position's
    logits only, where the model can skip the others: a metric that reads only that one) and
    ``kept`` (a dict in which the prefix of one start is kept for the next chunk)."""
    prefix = _prefix_cache(model, ids, start, n_rows, kept)
    if prefix is None:
        if last_only and saes is None:
            return tail_logits(model, ids.expand(n_rows, -1), make_hooks(0), last_only=True)
        return model.run(ids.expand(n_rows, -1), hooks=make_hooks(0), saes=saes).logits
    return prefix.forward(ids.expand(n_rows, -1), make_hooks(start), keep=False, last_only=last_only)
