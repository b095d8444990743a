"""Path patching (Wang et al. 2022): how much of a clean run a sender restores along its direct path to receivers.

Activation patching copies a clean activation into the corrupted run and lets its effect flow
through everything downstream. Path patching restricts the flow: the sender's clean output may
reach the *receivers* only directly, not through other attention heads. Per pair:

1. clean and corrupted runs cache every head's write ``l.heads`` (and, with ``freeze_mlps``,
   every ``l.mlp_out``, and the senders' own points);
2. the corrupted prompt runs with every head's write frozen at its corrupted value (and every
   MLP write too with ``freeze_mlps``; otherwise MLPs are recomputed, as in Wang et al.), except
   the sender, set to its clean value; the receivers' inputs are read there;
3. the corrupted prompt runs with only the receivers' values replaced by those of step 2
   (everything else computed freely) and each pair's metric is measured. With
   ``receivers="logits"`` step 2's logits are the answer (with ``freeze_mlps``: the sender's
   direct effect on the logits).

=========================  =====================================================================
offers                     what
=========================  =====================================================================
path_patching              the means over pairs: one row per sender, the table of
                           :func:`~depthscope.analyses.circuits.patching.activation.activation_patching` on a
                           dataset plus ``receiver`` (``method = "path"``; the columns of
                           :mod:`~depthscope.analyses.circuits.patching.results`)
path_patch_pairs           the per-pair rows those means come from (a ``pair`` column)
parse_senders              the senders a ``senders`` argument names (:class:`Sender`)
parse_receivers            the receivers a ``receivers`` argument names (:class:`Receiver`) and
                           their normalised spec (the ``receiver`` column)
PATH_COLUMNS, PATH_KEYS    the per-pair table's columns (without ``pair``); the columns naming
                           one row across pairs (what the means group by)
=========================  =====================================================================

Directions. ``direction="denoise"`` (the default) is the above: clean senders into the corrupted
run, every other head frozen at its corrupted value, measuring what a path suffices to restore.
``direction="noise"`` is Wang et al.'s own: the same three steps on the clean prompt, every head
frozen at its clean value except the sender, set to its *corrupted* value, measuring what the
clean behaviour needs from that path. ``fraction_recovered`` is ``(patched - corrupted) / (clean
- corrupted)`` either way: noising, 1 means the path carries nothing the behaviour needs.

Senders: ``heads`` (every head of every layer), ``<l>.heads`` (every head of layer l, one row
each), ``<l>.heads.<h>`` (one head), ``<l>.attn_out`` / ``<l>.mlp_out`` (a whole sublayer write;
an MLP sender is set to its clean value, not frozen), and the stream at residual sites ``embed``,
``<l>.attn``, ``<l>.mlp`` (or ``<l>.resid_pre``, ``<l>.resid_mid``, ``<l>.resid_post``: the stream
there set to clean; later heads, and MLPs with ``freeze_mlps``, frozen); a list or a
comma-separated string. Receivers: ``logits``, or ``<l>.q``, ``<l>.k``, ``<l>.v`` (every head of
layer l: the per-head projection outputs before rotary embedding; ``k`` and ``v`` count key/value
heads), ``<l>.q.<h>`` (one head) and ``<l>.mlp_in`` (the input of the MLP of layer l, replaced
as the MLP's write: a function of its input only, so replacing the write equals replacing the
input), all patched together in step 3. ``<l>.mlp`` is the stream after block l, a sender; as a
receiver it is refused with the word to use (it once meant the MLP's input there).

Order. A sender reaches a receiver only when the receiver comes after it in the forward (a head
of layer l reaches the queries of layers > l and the MLPs of layers >= l). A sender named on its
own (``2.heads``, ``1.mlp_out``...) that reaches no receiver is refused (:class:`InputError`), as
is a call in which no sender reaches one; the group word ``heads`` keeps its heads at or after
the receivers as rows that are not measured (``metric`` and ``fraction_recovered`` NaN, with a
note), so its heatmap keeps its shape. A sender whose source value equals the patched run's
gives exactly the patched run's value (fraction 0 denoising, 1 noising).

Positions (of the sender): ``"all"`` (default) every position, which needs clean and corrupted
prompts of the same token length within each pair (pairs may differ from each other);
``"last"`` the last position only (clean and corrupted last tokens aligned). Receivers are
replaced at every position.

Values. Every forward holds one row per sender plus a row 0 without any sender (all heads
frozen, the receivers patched with that row's own step-2 values): a row's patched value is the
unpatched metric plus its difference from row 0, so freezing's float rounding cancels. Rows go
through the model in chunks of ``batch_tokens`` tokens; memory holds one pair's cached writes
and one chunk. ``fraction_recovered`` over pairs is ``(mean patched - mean corrupted) / (mean
clean - mean corrupted)`` with a bootstrap interval over pairs, NaN below 10 pairs
(:func:`~depthscope.analyses.circuits.pairs.mean_over_pairs`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.circuits import memory
from depthscope.analyses.circuits.pairs import as_pairs
from depthscope.analyses.circuits.patching import runs
from depthscope.analyses.circuits.patching.results import PATCH_COLUMNS, add_note, means, run_pairs
from depthscope.analyses.circuits.prompts import TokenPair, tokenize_pairs
from depthscope.common.errors import InputError
from depthscope.hooks.model_checks import require_decoder
from depthscope.hooks.points import Point, parse_point

__all__ = [
    "path_patching",
    "path_patch_pairs",
    "parse_senders",
    "parse_receivers",
    "Sender",
    "Receiver",
    "PATH_COLUMNS",
    "PATH_KEYS",
    "POSITIONS",
]

POSITIONS = ("all", "last")
PATH_COLUMNS = [*PATCH_COLUMNS, "receiver"]
#: the columns naming one path patch across pairs (what :func:`mean_over_pairs` groups by)
PATH_KEYS = ["point", "head", "position_name", "method", "direction", "receiver"]
#: the keyword options of path patching and their defaults
OPTIONS = {"direction": "denoise", "batch_tokens": 2048}
#: the note of a table with senders at or after every receiver
LATE = (
    "senders at or after every receiver are not measured (metric and fraction_recovered NaN): no path "
    "leads from them to the receivers"
)
SENDER_KINDS = ("embed", "heads", "attn_out", "attn", "mlp_out", "mlp")
_HEAD = re.compile(r"^(.+)\.(\d+)$")
_SENDERS = (
    "'heads', '<l>.heads', '<l>.heads.<h>', '<l>.attn_out', '<l>.mlp_out', or the stream at a residual site: "
    "'embed', '<l>.attn', '<l>.mlp' (also '<l>.resid_pre', '<l>.resid_mid', '<l>.resid_post')"
)
_RECEIVERS = "'logits', or '<l>.q', '<l>.k', '<l>.v', '<l>.q.<h>', '<l>.k.<h>', '<l>.v.<h>' and '<l>.mlp_in'"


@dataclass(frozen=True)
class Sender:
    """One sender: the hook point its clean value is written to, the head (None: the whole
    tensor) and whether it was named on its own (not through the group word ``heads``)."""

    point: Point
    head: int | None = None
    named: bool = True


@dataclass(frozen=True)
class Receiver:
    """One receiver: the hook point replaced in step 3 (``l.q``/``l.k``/``l.v``; for the MLP of
    layer l, named ``l.mlp_in``, its write ``l.mlp_out``: a function of the MLP's input alone, so
    replacing it equals replacing the input) and the head (None: every head of that point)."""

    point: Point
    head: int | None = None

    @property
    def name(self) -> str:
        base = f"{self.point.layer}.mlp_in" if self.point.kind == "mlp_out" else self.point.name
        return base if self.head is None else f"{base}.{self.head}"


@dataclass(frozen=True)
class _Job(runs.Job):
    """What one call computes besides the shared settings: the senders, the receivers (empty: the
    logits) and their normalised spec, and whether MLPs are frozen."""

    senders: tuple[Sender, ...] = ()
    receivers: tuple[Receiver, ...] = ()
    label: str = "logits"
    freeze_mlps: bool = False


@dataclass(frozen=True)
class _Acts:
    """One pair's cached values (batch dropped), its patched cell and its metric values (written
    for denoise: ``clean`` is the source run, ``corrupted`` the run patched)."""

    clean: dict[str, torch.Tensor]
    corrupted: dict[str, torch.Tensor]
    cell: runs.Cell
    clean_value: float
    corrupted_value: float


# ----------------------------------------------------------------------------- specs
def _specs(value, what: str) -> list[str]:
    """The names of a list or a comma-separated string, stripped; an error when empty."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise InputError(f"{what} must be a name, a comma-separated string or a list of names, got {value!r}")
    items = [str(x).strip() for x in items]
    if not items or not all(items):
        raise InputError(f"{what}: an empty name in {value!r}")
    return items


def _point_and_head(spec: str, n_layers: int, head_kinds: tuple[str, ...]) -> tuple[Point, int | None]:
    """The point a name stands for and a trailing head index (only after a kind in ``head_kinds``)."""
    m = _HEAD.match(spec)
    if m:
        try:
            point = parse_point(m.group(1), n_layers)
        except InputError:
            point = None
        if point is not None and point.kind in head_kinds:
            return point, int(m.group(2))
    return parse_point(spec, n_layers), None


def _check_head(head: int | None, n: int, spec: str, what: str) -> None:
    if head is not None and not 0 <= head < n:
        raise InputError(f"{what} {spec!r}: head {head} out of range 0..{n - 1}")


def parse_senders(model, senders) -> list[Sender]:
    """The senders named (see the module docstring), de-duplicated, in forward order (then head)."""
    n_layers, n_heads = model.n_layers, model.arch.n_heads
    out: dict[tuple[Point, int | None], Sender] = {}
    for spec in _specs(senders, "senders"):
        if spec == "heads":
            for layer in range(n_layers):
                for h in range(n_heads):
                    out.setdefault((Point("heads", layer), h), Sender(Point("heads", layer), h, named=False))
            continue
        try:
            point, head = _point_and_head(spec, n_layers, ("heads",))
        except InputError as e:
            why = getattr(e, "why", "")
            raise InputError(f"unknown sender {spec!r}{why}: senders are {_SENDERS}, l in 0..{n_layers - 1}") from None
        if point.kind not in SENDER_KINDS:
            raise InputError(f"{spec!r} ({point.kind}) cannot be a sender: senders are {_SENDERS}")
        _check_head(head, n_heads, spec, "sender")
        heads = range(n_heads) if point.kind == "heads" and head is None else [head]
        for h in heads:
            out[(point, h)] = Sender(point, h)
    return sorted(out.values(), key=lambda s: (s.point.order, -1 if s.head is None else s.head))


def parse_receivers(model, receivers) -> tuple[list[Receiver], str]:
    """The receivers named (none for ``logits``) in forward order and their normalised spec."""
    specs = _specs(receivers, "receivers")
    if specs == ["logits"]:
        return [], "logits"
    if "logits" in specs:
        raise InputError(f"receivers: 'logits' stands alone (step 2's logits); got {receivers!r}")
    arch, n_layers = model.arch, model.n_layers
    out: dict[tuple[Point, int | None], Receiver] = {}
    for spec in specs:
        try:
            point, head = _point_and_head(spec, n_layers, ("q", "k", "v"))
        except InputError as e:
            why = getattr(e, "why", "")
            raise InputError(f"unknown receiver {spec!r}{why}: receivers are {_RECEIVERS}") from None
        if point.kind == "mlp":  # the word of the stream after block l, once also the MLP's input here
            raise InputError(
                f"receiver {spec!r} is the residual stream after block {point.layer}, not a receiver; the input of "
                f"the MLP of layer {point.layer} is '{point.layer}.mlp_in' (the MLP receiver was once spelled "
                f"'{point.layer}.mlp', which names the stream everywhere else)"
            )
        if point.kind not in ("q", "k", "v", "mlp_in") or point.layer < 0:
            raise InputError(f"{spec!r} ({point.kind}) cannot be a receiver: receivers are {_RECEIVERS}")
        _check_head(head, arch.n_heads if point.kind == "q" else arch.n_kv_heads or arch.n_heads, spec, "receiver")
        point = Point("mlp_out", point.layer) if point.kind == "mlp_in" else point
        out[(point, head)] = Receiver(point, head)
    whole = {p for p, h in out if h is None}  # a whole layer's receiver covers its single heads
    kept = sorted((r for (p, h), r in out.items() if h is None or p not in whole), key=_receiver_order)
    return kept, ",".join(r.name for r in kept)


def _receiver_order(r: Receiver):
    return r.point.order, -1 if r.head is None else r.head


def _reaches(sender: Sender, receivers: list[Receiver]) -> bool:
    """Whether some receiver comes after the sender in the forward (the logits always do)."""
    return not receivers or any(r.point.order > sender.point.order for r in receivers)


def _sender_name(s: Sender) -> str:
    return s.point.name if s.head is None else f"{s.point.name}.{s.head}"


def _check_order(senders: list[Sender], receivers: list[Receiver], label: str) -> None:
    late = [_sender_name(s) for s in senders if s.named and not _reaches(s, receivers)]
    if late:
        shown = ", ".join(late[:6]) + (f" (and {len(late) - 6} more)" if len(late) > 6 else "")
        raise InputError(
            f"sender(s) {shown} come at or after every receiver ({label}): no path leads from them to the "
            f"receivers; name receivers in later layers (or senders in earlier ones)"
        )
    if not any(_reaches(s, receivers) for s in senders):
        raise InputError(f"no sender comes before the receivers ({label}): every value would be the corrupted one")


def _job(model, senders, receivers, freeze_mlps, positions, batch_tokens, direction) -> _Job:
    if positions not in POSITIONS:
        raise InputError(f"positions must be one of {', '.join(POSITIONS)} for path patching, got {positions!r}")
    runs.Job(positions, batch_tokens, direction)  # the shared settings, checked before the specs
    ss = parse_senders(model, senders)
    rs, label = parse_receivers(model, receivers)
    _check_order(ss, rs, label)
    return _Job(positions, int(batch_tokens), direction, tuple(ss), tuple(rs), label, bool(freeze_mlps))


# ----------------------------------------------------------------------------- one pair
# Written for the denoise direction (clean values into the corrupted run); results.measure hands
# these functions the flipped pair for noise (see the runs module).
def _capture(model, tp: TokenPair, job: _Job, cell: runs.Cell) -> _Acts:
    """Step 1: the heads' writes (MLP writes, the senders' points) of the clean and corrupted runs."""
    names = {f"{layer}.heads" for layer in range(model.n_layers)} | {s.point.name for s in job.senders}
    if job.freeze_mlps:
        names |= {f"{layer}.mlp_out" for layer in range(model.n_layers)}
    names = sorted(names)
    with torch.no_grad():
        c, k = model.run(tp.clean_ids, cache=names), model.run(tp.corrupted_ids, cache=names)
        values = float(tp.metric(c.logits)[0]), float(tp.metric(k.logits)[0])
    return _Acts({n: c[n][0] for n in names}, {n: k[n][0] for n in names}, cell, *values)


def _cell_of(t: torch.Tensor, head: int | None, pos: int | None) -> torch.Tensor:
    """A view of ``t`` ``[pos, (heads,) ...]`` at one head and position (None: all of them)."""
    t = t if head is None else t[:, head]
    return t if pos is None else t[pos]


def _patch(s: Sender, cell: runs.Cell) -> runs.Patch:
    """A sender as a patch of its point at the pair's cell (what the table and the unchanged check read)."""
    return runs.Patch(runs.patch_point(s.point), cell, s.head)


def _step2_hook(name: str, acts: _Acts, edits: list[tuple[int, int | None]], freeze: bool, stash: dict | None):
    """The step-2 hook at one point: stash what the model computed there (a receiver), freeze it
    at its corrupted value, then write the clean value into the senders' rows (``edits``)."""

    def fn(t: torch.Tensor, ctx):
        if stash is not None:
            stash[name] = t.detach().clone()
        if not (freeze or edits):
            return None
        new = acts.corrupted[name].to(t.dtype).expand_as(t).clone() if freeze else t.clone()
        clean = acts.clean[name].to(t.dtype)
        for row, head in edits:
            _cell_of(new[row], head, acts.cell.pos).copy_(_cell_of(clean, head, acts.cell.cpos))
        return new

    return fn


def _step2_hooks(model, job: _Job, acts: _Acts, chunk: list[Sender], stash: dict) -> dict:
    """Every head frozen (and every MLP with ``freeze_mlps``), sender ``k`` clean in row ``k + 1``,
    the receivers' values stashed."""
    edits: dict[str, list[tuple[int, int | None]]] = {}
    for k, s in enumerate(chunk, 1):
        edits.setdefault(s.point.name, []).append((k, s.head))
    frozen = {f"{layer}.heads" for layer in range(model.n_layers)}
    if job.freeze_mlps:
        frozen |= {f"{layer}.mlp_out" for layer in range(model.n_layers)}
    read = {r.point.name for r in job.receivers}
    return {
        n: _step2_hook(n, acts, edits.get(n, []), n in frozen, stash if n in read else None)
        for n in sorted(frozen | set(edits) | read)
    }


def _step3_hook(value: torch.Tensor, heads: list[int | None]):
    """Step 3 at one receiver point: its step-2 value, whole or at some heads."""

    def fn(t: torch.Tensor, ctx):
        if None in heads:
            return value.to(t.dtype)
        new = t.clone()
        new[:, :, heads] = value[:, :, heads].to(t.dtype)
        return new

    return fn


def _chunk_values(model, tp: TokenPair, job: _Job, acts: _Acts, chunk: list[Sender]) -> np.ndarray:
    """Patched values of a chunk of senders: steps 2 and 3 on ``len(chunk) + 1`` rows."""
    ids, stash = tp.corrupted_ids.expand(len(chunk) + 1, -1), {}
    with torch.no_grad():
        logits = model.run(ids, hooks=_step2_hooks(model, job, acts, chunk, stash)).logits
        if job.receivers:
            heads: dict[str, list[int | None]] = {}
            for r in job.receivers:
                heads.setdefault(r.point.name, []).append(r.head)
            hooks = {n: _step3_hook(stash[n], h) for n, h in heads.items()}
            logits = model.run(ids, hooks=hooks).logits
        out = tp.metric(logits).float().cpu().numpy()
    return acts.corrupted_value + (out[1:] - out[0])


def _pair_values(model, tp: TokenPair, job: _Job, bar):
    """One pair: every sender's patched value (chunks of rows); senders that reach no receiver
    are not measured (NaN). Returns (patches, values, clean value, corrupted value)."""
    cell = runs.pair_cells(tp.clean_ids, tp.corrupted_ids, job.positions)[0]
    acts = _capture(model, tp, job, cell)
    patches = [_patch(s, cell) for s in job.senders]
    values = np.full(len(job.senders), acts.corrupted_value)
    same = runs.to_host([runs.unchanged(p, acts.clean[p.point.name], acts.corrupted[p.point.name]) for p in patches])
    reach = [_reaches(s, job.receivers) for s in job.senders]
    values[~np.asarray(reach, dtype=bool)] = np.nan
    todo = [i for i in range(len(job.senders)) if reach[i] and not same[i]]
    bar.update(len(job.senders) - len(todo))
    for rows, _ in runs.plan([0] * len(todo), tp.corrupted_ids.shape[1], job.batch_tokens):
        idx = [todo[r] for r in rows]
        values[idx] = _chunk_values(model, tp, job, acts, [job.senders[i] for i in idx])
        bar.update(len(idx))
    return patches, values, acts.clean_value, acts.corrupted_value


def _cells(tps: list[TokenPair], job: _Job) -> None:
    """Each pair's patched cell checked before any forward (``all``: same lengths within a pair)."""
    for tp in tps:
        try:
            runs.pair_cells(tp.clean_ids, tp.corrupted_ids, job.positions)
        except InputError as e:
            raise InputError(f"{tp.where}: {e}") from None


def _check_memory(model, tps: list[TokenPair], job: _Job) -> None:
    """Before any forward: the longest pair's senders and receivers cached in both runs and a
    chunk of rows through two forwards of every position fit in the memory free
    (:func:`~depthscope.analyses.circuits.memory.patch_bytes`), else
    :class:`~depthscope.analyses.circuits.memory.WorkTooLarge`."""
    kinds = [k for _, k in dict.fromkeys((x.point.name, x.point.kind) for x in (*job.senders, *job.receivers))]
    kinds += ["resid"] * (2 * model.n_layers if job.freeze_mlps else 0)  # the frozen MLPs' writes, roughly
    tp = max(tps, key=lambda t: max(t.clean_ids.shape[1], t.corrupted_ids.shape[1]))
    n_clean, n = tp.clean_ids.shape[1], tp.corrupted_ids.shape[1]
    kw = dict(method="activation", batch_tokens=job.batch_tokens, last_only=False)
    terms = memory.patch_bytes(model, kinds, n_clean, n, **kw)
    knobs = ["shorter pairs"]
    if job.batch_tokens > 2 * max(n, n_clean):
        knobs.insert(0, f"a smaller --batch-tokens (batch_tokens=; now {job.batch_tokens})")
    what = f"path patching of {tp.where or f'pair {tp.index}'} ({max(n, n_clean):,} tokens)"
    memory.check_room(terms, model.device, what, knobs)


# ----------------------------------------------------------------------------- public API
def path_patch_pairs(
    model,
    pairs,
    senders="heads",
    receivers="logits",
    freeze_mlps: bool = False,
    positions: str = "all",
    *,
    metric=None,
    **options,
) -> pd.DataFrame:
    """Path patching over a dataset of prompt pairs, one row per pair and sender (a ``pair`` column).

    ``pairs``: what :func:`~depthscope.analyses.circuits.pairs.as_pairs` accepts (PromptPairs, dicts,
    ``(clean, corrupted)`` tuples, a ``.jsonl`` path); each pair's ``target`` and ``foil`` make
    its metric, ``metric`` serves pairs without a target. ``senders``, ``receivers``,
    ``freeze_mlps`` and ``positions`` as in the module docstring. ``options``: ``direction``
    (``"denoise"``, the default, or ``"noise"``: see the module docstring) and ``batch_tokens``
    (2048: the tokens of one forward). Columns :data:`PATH_COLUMNS` after ``pair``; ``metric`` is
    the patched value (NaN for a sender at or after every receiver: not measured).
    :func:`path_patching` gives the means over pairs."""
    require_decoder(model, "path patching")
    if isinstance(pairs, (list, tuple)) and not pairs:
        raise InputError("the pair list is empty: give at least one prompt pair")
    opts = runs.keyword_options(options, OPTIONS, "path patching")
    job = _job(model, senders, receivers, freeze_mlps, str(positions), opts["batch_tokens"], opts["direction"])
    tps = tokenize_pairs(model, as_pairs(pairs), metric)
    _cells([job.oriented(tp) for tp in tps], job)
    _check_memory(model, tps, job)
    out = run_pairs(model, tps, job, _pair_values, "path", total=len(job.senders), extra={"receiver": job.label})
    out.attrs.update(receivers=job.label, freeze_mlps=job.freeze_mlps)
    if not all(_reaches(s, job.receivers) for s in job.senders):
        add_note(out, LATE)
    return out


def path_patching(
    model,
    pairs,
    senders="heads",
    receivers="logits",
    freeze_mlps: bool = False,
    positions: str = "all",
    *,
    metric=None,
    **options,
) -> pd.DataFrame:
    """The means over pairs of :func:`path_patch_pairs`: one row per sender with ``metric``,
    ``clean_metric``, ``corrupted_metric`` means, ``fraction_recovered`` = ``(mean patched - mean
    corrupted) / (mean clean - mean corrupted)``, its 95% bootstrap interval over pairs
    (``fraction_low``, ``fraction_high``; NaN below 10 pairs, the notes say why), ``n_pairs`` and
    the interval's ``ci_n``, ``ci_unit``, ``ci_method``; ``receiver`` holds the receivers'
    normalised spec, ``method`` is ``"path"`` and ``direction`` the direction. Arguments and
    ``options`` (``direction``, ``batch_tokens``) as in :func:`path_patch_pairs`."""
    per_pair = path_patch_pairs(model, pairs, senders, receivers, freeze_mlps, positions, metric=metric, **options)
    return means(per_pair, PATH_KEYS)
