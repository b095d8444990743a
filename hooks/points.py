"""Hook points: the one registry of every tensor the hook engine can read and replace.

Beside the ``2L + 1`` residual sites (:mod:`depthscope.hooks.sites`), each block ``l`` offers
thirteen points below the stream. ``REGISTRY`` lists them all, in forward order within block ``l``:

==============  ======================================  ===============================  ==========  ============
name            tensor                                  TransformerLens alias            module      capture
==============  ======================================  ===============================  ==========  ============
``embed``       input of block 0 (l = 0)                blocks.0.hook_resid_pre          blocks[0]   block_input
                [batch, pos, d_model]
``l.q``         query projection's output per head,     blocks.l.attn.hook_q             q_proj      qkv
                before rotary embedding (and before a
                query norm: Qwen3, OLMo-2)
                [batch, pos, heads, d_head]
``l.k``         key projection's output per key/value   blocks.l.attn.hook_k             k_proj      qkv
                head, before rotary embedding (and a
                key norm)
                [batch, pos, kv_heads, d_head]
``l.v``         value projection's output per           blocks.l.attn.hook_v             v_proj      qkv
                key/value head
                [batch, pos, kv_heads, d_head]
``l.rot_q``     queries as the attention function gets  blocks.l.attn.hook_rot_q         attn_fn     attention
                them (after rotary embedding and any
                norm; = ``l.q`` without rotary)
                [batch, pos, heads, d_head]
``l.rot_k``     keys likewise, every key position the   blocks.l.attn.hook_rot_k         attn_fn     attention
                attention sees (cached ones included)
                [batch, keys, kv_heads, d_head]
``l.scores``    pre-softmax attention scores, scaled,   blocks.l.attn.hook_attn_scores   attn_fn     attention
                soft-capped, mask added
                [batch, heads, q, k]
``l.pattern``   attention probabilities                 blocks.l.attn.hook_pattern       attn_fn     attention
                [batch, heads, q, k]
``l.z``         per-head output before the output       blocks.l.attn.hook_z             o_proj      heads_input
                projection [batch, pos, heads, d_head]
``l.heads``     per-head term of the output projection  blocks.l.attn.hook_result        o_proj      heads_output
                [batch, pos, heads, d_model] (sums,
                with its bias, to ``l.proj_out``: to
                ``l.attn_out`` except in sandwich
                families, where the post-attention
                norm comes after)
``l.attn_out``  attention write into the stream         blocks.l.hook_attn_out           attn_write  output
                [batch, pos, d_model]
``l.attn``      stream after the attention write        blocks.l.hook_resid_mid          attn_site   resid_mid
                (resid_mid)
``l.mlp_in``    the MLP's input (after the pre-MLP      blocks.l.ln2.hook_normalized     mlp         block_input
                norm in pre-norm models; what a
                transcoder reads) [batch, pos, d_model]
``l.neurons``   MLP hidden activation feeding its       blocks.l.mlp.hook_post           down_proj   input
                output projection [batch, pos, d_mlp]
``l.mlp_out``   MLP write into the stream               blocks.l.hook_mlp_out            mlp_write   output
                [batch, pos, d_model]
``l.mlp``       block output (resid_post)               blocks.l.hook_resid_post         blocks      output
==============  ======================================  ===============================  ==========  ============

Three more points serve depthscope's own analyses and are not named by users (not in
``POINT_KINDS``; pass them as :class:`Point` objects to :mod:`depthscope.hooks.engine`):
``l.values`` (value vectors per query head [batch, pos, heads, d_head], read only; module
``v_proj``, capture ``values``), ``l.proj_out`` (the attention output projection's own output,
before any post-sublayer norm; ``o_proj``, ``output``) and ``final`` (the final norm's output;
``final_norm``, ``output``).

``module`` is the field of :class:`~depthscope.hooks.arch.ResolvedArch` holding the hooked module
(one per block, or one for the model), ``capture`` the function of :mod:`depthscope.hooks.engine`
that reads and replaces the tensor there. Adding a hook point is one :class:`PointSpec` in
``REGISTRY`` (plus, for a tensor no capture reads yet, one capture function in the engine).

``blocks.l.hook_resid_pre`` is the previous residual site, as in :func:`~depthscope.hooks.sites.parse_site`.
The stream's TransformerLens words are names too: ``l.resid_pre`` (the stream entering block l:
``embed`` for l = 0, else ``(l-1).mlp``), ``l.resid_mid`` (= ``l.attn``) and ``l.resid_post``
(= ``l.mlp``); each parses to the residual site it names. ``hook_embed`` is refused: in
TransformerLens it is the token embedding alone (``W_E[tokens]``, with ``hook_pos_embed`` apart),
which differs from ``embed`` (the input of block 0: token plus position embeddings in GPT-2, their
LayerNorm in BERT), so accepting it as ``embed`` would read a different tensor than its name says.
Heads are the query heads (grouped-query models: K/V shared by a group are expanded in ``l.pattern``,
``l.scores``, ``l.z``, ``l.heads``), except in ``l.k``, ``l.v`` and ``l.rot_k``, which hold the key/value
heads as the model has them. Fused projections (GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``)
are read per part and a replacement goes back into that part of the fused output. In
"sandwich" families (OLMo-2, Gemma-2/3) the writes are taken after the post-sublayer norm, so
``resid_post = resid_pre + attn_out + mlp_out`` holds; in post-norm encoders (BERT) the writes are
what enters the sublayer's LayerNorm together with the stream.

``l.rot_q``, ``l.rot_k``, ``l.scores`` and ``l.pattern`` are exact for every attention kernel: a call
that reads or replaces one runs every attention layer through the family's own eager attention
function (switched on for that call only, see :mod:`depthscope.hooks.attention`), like
``output_attentions=True`` under eager; the scores are checked on every call against that
function's pattern (a family they do not fit is refused). A replaced ``l.scores`` is softmaxed
and multiplied with V; a replaced ``l.rot_k`` changes that step's attention only (a key/value
cache keeps the keys it stored).

A point is a :class:`Point` ``(kind, layer)``: residual sites have kind ``embed`` / ``attn`` /
``mlp`` (their sublayer, as in :class:`~depthscope.hooks.sites.Site`), the others the kinds above.
Pure functions: :func:`parse_point`, :func:`parse_points`, :func:`point_names`, :func:`tl_name`,
:func:`spec_of`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from depthscope.common.errors import InputError


class PointSpec(NamedTuple):
    """One row of the registry: where a kind of hook point lives and how the engine reads it."""

    kind: str
    module: str  # the ResolvedArch field holding the hooked module (a list per block, or one module)
    capture: str  # the engine's capture function (a key of depthscope.hooks.engine.CAPTURES)
    tl: str | None = None  # TransformerLens name after "blocks.<l>."; None: no alias
    per_head: bool = False  # needs the head count and head size of the architecture
    public: bool = True  # False: used by depthscope's analyses only, never parsed from a name


#: every hook point, in forward order (``embed`` first, ``final`` last, block points in between)
REGISTRY: tuple[PointSpec, ...] = (
    PointSpec("embed", "blocks", "block_input"),
    PointSpec("q", "q_proj", "qkv", "attn.hook_q", per_head=True),
    PointSpec("k", "k_proj", "qkv", "attn.hook_k", per_head=True),
    PointSpec("v", "v_proj", "qkv", "attn.hook_v", per_head=True),
    PointSpec("values", "v_proj", "values", per_head=True, public=False),
    PointSpec("rot_q", "attn_fn", "attention", "attn.hook_rot_q"),
    PointSpec("rot_k", "attn_fn", "attention", "attn.hook_rot_k"),
    PointSpec("scores", "attn_fn", "attention", "attn.hook_attn_scores"),
    PointSpec("pattern", "attn_fn", "attention", "attn.hook_pattern"),
    PointSpec("z", "o_proj", "heads_input", "attn.hook_z", per_head=True),
    PointSpec("heads", "o_proj", "heads_output", "attn.hook_result", per_head=True),
    PointSpec("proj_out", "o_proj", "output", public=False),
    PointSpec("attn_out", "attn_write", "output", "hook_attn_out"),
    PointSpec("attn", "attn_site", "resid_mid", "hook_resid_mid"),
    PointSpec("mlp_in", "mlp", "block_input", "ln2.hook_normalized"),
    PointSpec("neurons", "down_proj", "input", "mlp.hook_post"),
    PointSpec("mlp_out", "mlp_write", "output", "hook_mlp_out"),
    PointSpec("mlp", "blocks", "output", "hook_resid_post"),
    PointSpec("final", "final_norm", "output", public=False),
)
_SPECS = {s.kind: s for s in REGISTRY}
_RANK = {s.kind: i for i, s in enumerate(REGISTRY)}
MODEL_KINDS = ("embed", "final")  # one per model (layer -1), not one per block

RESID_KINDS = ("embed", "attn", "mlp")
SUB_KINDS = tuple(s.kind for s in REGISTRY if s.public and s.kind not in RESID_KINDS)
# forward order of the kinds inside one block (embed only before block 0)
BLOCK_ORDER = tuple(s.kind for s in REGISTRY if s.public and s.kind not in MODEL_KINDS)
POINT_KINDS = RESID_KINDS + SUB_KINDS

_TL_SUB = {k: _SPECS[k].tl for k in (*SUB_KINDS, "attn", "mlp")}  # the order the error message lists them in
_FROM_TL = {v: k for k, v in _TL_SUB.items()}
_NAME = re.compile(r"^(\d+)\.(" + "|".join(BLOCK_ORDER) + r")$")
#: the stream's TransformerLens words as ``l.<word>``: the residual site each names (``resid_pre``:
#: the site before block l, so ``0.resid_pre`` is ``embed``)
RESID_WORDS = {"resid_pre": 0, "resid_mid": 1, "resid_post": 2}
_WORD = re.compile(r"^(\d+)\.(" + "|".join(RESID_WORDS) + r")$")
#: why ``hook_embed`` is not a name of ``embed`` (TransformerLens's token embedding alone)
HOOK_EMBED = (
    "'hook_embed' is TransformerLens's token embedding alone (W_E[tokens], the position embedding apart in "
    "hook_pos_embed), which depthscope does not hook; 'embed' (blocks.0.hook_resid_pre, 0.resid_pre) is the "
    "input of block 0: the token embedding in rotary models, token plus position embeddings in GPT-2, their "
    "LayerNorm in BERT"
)
_TL = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(v) for v in _TL_SUB.values()) + r"|hook_resid_pre)$")


def spec_of(kind: str) -> PointSpec:
    """The registry row of a kind (public or engine-internal)."""
    try:
        return _SPECS[kind]
    except KeyError:
        raise InputError(f"unknown hook point kind {kind!r}; kinds: {list(_SPECS)}") from None


class Point(NamedTuple):
    """One hook point: ``kind`` (see ``POINT_KINDS``) and block ``layer`` (-1 for ``embed``)."""

    kind: str
    layer: int

    @property
    def name(self) -> str:
        """The canonical name (``"embed"``, ``"3.attn"``, ``"3.pattern"``...)."""
        return self.kind if self.kind in MODEL_KINDS else f"{self.layer}.{self.kind}"

    @property
    def is_resid(self) -> bool:
        return self.kind in RESID_KINDS

    @property
    def site(self) -> int | None:
        """The residual site index (``embed`` 0, ``l.attn`` 2l+1, ``l.mlp`` 2l+2), None below the stream."""
        if self.kind == "embed":
            return 0
        if self.kind in ("attn", "mlp"):
            return 2 * self.layer + (1 if self.kind == "attn" else 2)
        return None

    @property
    def order(self) -> tuple[int, int]:
        """Sort key in forward order."""
        if self.kind in MODEL_KINDS:
            return (-1, 0) if self.kind == "embed" else (1 << 30, 0)
        return (self.layer, _RANK[self.kind])


def tl_name(point: Point) -> str:
    """The TransformerLens name of a point (``blocks.0.hook_resid_pre`` for ``embed``)."""
    if point.kind == "embed":
        return "blocks.0.hook_resid_pre"
    return f"blocks.{point.layer}.{_TL_SUB[point.kind]}"


def point_names(n_layers: int, kinds: Iterable[str] | None = None) -> list[str]:
    """Canonical names of all points (or of some ``kinds``) in forward order."""
    kinds = set(POINT_KINDS if kinds is None else kinds)
    bad = kinds - set(POINT_KINDS)
    if bad:
        raise InputError(f"unknown hook point kinds {sorted(bad)}; kinds: {list(POINT_KINDS)}")
    names = ["embed"] if "embed" in kinds else []
    for layer in range(n_layers):
        names += [f"{layer}.{k}" for k in BLOCK_ORDER if k in kinds]
    return names


def _unknown(name, n_layers: int, why: str = "") -> InputError:
    """The error for a name that is no point of this model; ``why`` (e.g. a layer out of range)
    is also kept as the error's ``why`` attribute for callers with their own message."""
    last = n_layers - 1
    err = InputError(
        f"unknown hook point {name!r}{why}. Valid names: 'embed', '<l>.<kind>' with l in 0..{last} and kind in "
        f"{list(BLOCK_ORDER)} (e.g. '{last}.pattern'), '<l>.resid_pre', '<l>.resid_mid', '<l>.resid_post', a "
        f"residual site index 0..{2 * n_layers}; TransformerLens "
        f"aliases: " + ", ".join(f"blocks.<l>.{v}" for v in ["hook_resid_pre", *_TL_SUB.values()])
    )
    err.why = why
    return err


def parse_point(name: str | int | Point, n_layers: int) -> Point:
    """The :class:`Point` named by a canonical name, a TransformerLens alias or a residual site index."""
    if isinstance(name, Point):
        if name.kind not in POINT_KINDS or not (name.kind == "embed" or 0 <= name.layer < n_layers):
            raise _unknown(name, n_layers)
        return name
    if isinstance(name, int) or (isinstance(name, str) and name.strip().isdigit()):
        i = int(name)
        if not 0 <= i <= 2 * n_layers:
            raise _unknown(name, n_layers, f": site index out of range 0..{2 * n_layers}")
        return _from_site(i)
    if not isinstance(name, str):
        raise _unknown(name, n_layers)
    s = name.strip()
    if s in ("embed", "resid_pre0"):
        return Point("embed", -1)
    if s == "hook_embed":
        raise InputError(HOOK_EMBED)
    m = _WORD.match(s)
    if m:  # l.resid_pre / l.resid_mid / l.resid_post: the residual site it names
        layer = _in_range(name, int(m.group(1)), n_layers)
        return _from_site(2 * layer + RESID_WORDS[m.group(2)])
    m = _NAME.match(s)
    if m:
        return Point(m.group(2), _in_range(name, int(m.group(1)), n_layers))
    m = _TL.match(s)
    if not m:
        raise _unknown(name, n_layers)
    layer = _in_range(name, int(m.group(1)), n_layers)
    if m.group(2) == "hook_resid_pre":
        return _from_site(2 * layer)
    return Point(_FROM_TL[m.group(2)], layer)


def _in_range(name, layer: int, n_layers: int) -> int:
    """``layer``, or the unknown-point error when the model has no such block."""
    if not 0 <= layer < n_layers:
        raise _unknown(name, n_layers, f": layer {layer} out of range 0..{n_layers - 1}")
    return layer


def _from_site(index: int) -> Point:
    if index == 0:
        return Point("embed", -1)
    layer, rem = divmod(index - 1, 2)
    return Point("attn" if rem == 0 else "mlp", layer)


def parse_points(names, n_layers: int) -> list[Point]:
    """Points in forward order, de-duplicated. ``names``: one name, a list of names, ``"all"``
    (every point), ``"resid"`` (the 2L+1 residual sites) or None / empty (no point)."""
    if names is None:
        return []
    if isinstance(names, str) and names in ("all", "resid"):
        kinds = None if names == "all" else RESID_KINDS
        return [parse_point(n, n_layers) for n in point_names(n_layers, kinds)]
    if isinstance(names, (str, int, Point)):
        names = [names]
    return sorted({parse_point(n, n_layers) for n in names}, key=lambda p: p.order)
