"""Hook points: the names of every tensor ``model.run`` can read and replace.

Beside the ``2L + 1`` residual sites (:mod:`depthscope.hooks.sites`), each block ``l`` offers
six points below the stream. In forward order within block ``l``:

===============  ==============================================  =================================
name             tensor                                          TransformerLens alias
===============  ==============================================  =================================
``embed``        input of block 0 [batch, pos, d_model] (l = 0)  ``blocks.0.hook_resid_pre``
``l.pattern``    attention probabilities [batch, heads, q, k]    ``blocks.l.attn.hook_pattern``
``l.z``          per-head output before the output projection    ``blocks.l.attn.hook_z``
                 [batch, pos, heads, d_head]
``l.heads``      per-head write [batch, pos, heads, d_model]     ``blocks.l.attn.hook_result``
                 (sums to ``l.attn_out`` less any bias)
``l.attn_out``   attention write into the stream                 ``blocks.l.hook_attn_out``
                 [batch, pos, d_model]
``l.attn``       stream after the attention write (resid_mid)    ``blocks.l.hook_resid_mid``
``l.neurons``    MLP hidden activation feeding its output        ``blocks.l.mlp.hook_post``
                 projection [batch, pos, d_mlp]
``l.mlp_out``    MLP write into the stream [batch, pos, d_model] ``blocks.l.hook_mlp_out``
``l.mlp``        block output (resid_post)                       ``blocks.l.hook_resid_post``
===============  ==============================================  =================================

``blocks.l.hook_resid_pre`` is the previous residual site, as in :func:`~depthscope.hooks.sites.parse_site`.
Heads are the query heads (grouped-query models: K/V shared by a group are expanded). In
"sandwich" families (OLMo-2, Gemma-2/3) the writes are taken after the post-sublayer norm, so
``resid_post = resid_pre + attn_out + mlp_out`` holds; in post-norm encoders (BERT) the writes are
what enters the sublayer's LayerNorm together with the stream.

``l.pattern`` is exact for every attention kernel: a call that reads or replaces a pattern runs
every attention layer through the family's own eager attention function (switched on for that
call only, see :mod:`depthscope.hooks.attention`), like ``output_attentions=True`` under eager.

A point is a :class:`Point` ``(kind, layer)``: residual sites have kind ``embed`` / ``attn`` /
``mlp`` (their sublayer, as in :class:`~depthscope.hooks.sites.Site`), the others the kinds above.
Pure functions: :func:`parse_point`, :func:`parse_points`, :func:`point_names`, :func:`tl_name`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from depthscope.common.errors import InputError

RESID_KINDS = ("embed", "attn", "mlp")
SUB_KINDS = ("pattern", "z", "heads", "attn_out", "neurons", "mlp_out")
# forward order of the kinds inside one block (embed only before block 0)
BLOCK_ORDER = ("pattern", "z", "heads", "attn_out", "attn", "neurons", "mlp_out", "mlp")
POINT_KINDS = RESID_KINDS + SUB_KINDS

_TL_SUB = {
    "pattern": "attn.hook_pattern",
    "z": "attn.hook_z",
    "heads": "attn.hook_result",
    "attn_out": "hook_attn_out",
    "neurons": "mlp.hook_post",
    "mlp_out": "hook_mlp_out",
    "attn": "hook_resid_mid",
    "mlp": "hook_resid_post",
}
_FROM_TL = {v: k for k, v in _TL_SUB.items()}
_NAME = re.compile(r"^(\d+)\.(" + "|".join(BLOCK_ORDER) + r")$")
_TL = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(v) for v in _TL_SUB.values()) + r"|hook_resid_pre)$")


class Point(NamedTuple):
    """One hook point: ``kind`` (see ``POINT_KINDS``) and block ``layer`` (-1 for ``embed``)."""

    kind: str
    layer: int

    @property
    def name(self) -> str:
        """The canonical name (``"embed"``, ``"3.attn"``, ``"3.pattern"``...)."""
        return "embed" if self.kind == "embed" else f"{self.layer}.{self.kind}"

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
        return (-1, 0) if self.kind == "embed" else (self.layer, BLOCK_ORDER.index(self.kind))


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
    last = n_layers - 1
    return InputError(
        f"unknown hook point {name!r}{why}. Valid names: 'embed', '<l>.<kind>' with l in 0..{last} and kind in "
        f"{list(BLOCK_ORDER)} (e.g. '{last}.pattern'), a residual site index 0..{2 * n_layers}; TransformerLens "
        f"aliases: " + ", ".join(f"blocks.<l>.{v}" for v in ["hook_resid_pre", *_TL_SUB.values()])
    )


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
    if s in ("embed", "hook_embed", "resid_pre0"):
        return Point("embed", -1)
    m = _NAME.match(s)
    if m:
        layer, kind = int(m.group(1)), m.group(2)
    else:
        m = _TL.match(s)
        if not m:
            raise _unknown(name, n_layers)
        layer = int(m.group(1))
        if m.group(2) == "hook_resid_pre":
            if not 0 <= layer < n_layers:
                raise _unknown(name, n_layers, f": layer {layer} out of range 0..{n_layers - 1}")
            return _from_site(2 * layer)
        kind = _FROM_TL[m.group(2)]
    if not 0 <= layer < n_layers:
        raise _unknown(name, n_layers, f": layer {layer} out of range 0..{n_layers - 1}")
    return Point(kind, layer)


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
