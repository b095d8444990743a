"""Residual-stream sites: names, depths and the shared tidy columns.

A pre-norm block ``l`` computes ``h' = h + Attn(Norm(h))`` then ``h'' = h' + MLP(Norm(h'))``.
depthscope names the stream at ``2L + 1`` sites, in forward order:

=========  =========================================  =====  =========  ==========
label      stream                                     layer  sublayer   depth
=========  =========================================  =====  =========  ==========
embed      input of block 0                           -1     embed      0
l.attn     resid_pre(l) + attn_out(l)  (resid_mid)     l      attn       l + 0.5
l.mlp      resid_mid(l) + mlp_out(l)   (resid_post)    l      mlp        l + 1
=========  =========================================  =====  =========  ==========

The integer ``site`` index is the position in that order (embed 0, ``l.attn`` = 2l+1,
``l.mlp`` = 2l+2). Depth is in block units, so the numbers compare with layer numbers of
papers such as Tenney et al. (2019). TransformerLens names are accepted as aliases:
``blocks.{l}.hook_resid_pre`` (= the previous site), ``hook_resid_mid`` (= ``l.attn``),
``hook_resid_post`` (= ``l.mlp``), and so are their short forms ``l.resid_pre``, ``l.resid_mid``,
``l.resid_post``. ``hook_embed`` is refused: TransformerLens's token embedding alone is not the
input of block 0 in GPT-2 or BERT (:data:`~depthscope.hooks.points.HOOK_EMBED`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from depthscope.common.errors import SiteError
from depthscope.hooks.points import HOOK_EMBED

SITE_COLUMNS = ["site", "label", "layer", "sublayer", "depth"]


@dataclass(frozen=True)
class Site:
    index: int
    label: str
    layer: int
    sublayer: str
    depth: float


def site_labels(n_layers: int) -> list[str]:
    labels = ["embed"]
    for layer in range(n_layers):
        labels += [f"{layer}.attn", f"{layer}.mlp"]
    return labels


def all_sites(n_layers: int) -> list[Site]:
    return [site_from_index(i, n_layers) for i in range(2 * n_layers + 1)]


def site_from_index(index: int, n_layers: int) -> Site:
    n_sites = 2 * n_layers + 1
    if not 0 <= index < n_sites:
        raise SiteError(f"site index {index} out of range 0..{n_sites - 1} (the model has {n_layers} layers)")
    if index == 0:
        return Site(0, "embed", -1, "embed", 0.0)
    layer, rem = divmod(index - 1, 2)
    if rem == 0:
        return Site(index, f"{layer}.attn", layer, "attn", layer + 0.5)
    return Site(index, f"{layer}.mlp", layer, "mlp", layer + 1.0)


_LABEL = re.compile(r"^(\d+)\.(attn|mlp)$")
_TL = re.compile(r"^(?:blocks\.(\d+)\.hook_|(\d+)\.)resid_(pre|mid|post)$")
_EMBED = ("embed", "resid_pre0")
#: a point inside block l (``l.q``, ``l.attn_out``, ``blocks.l.attn.hook_z``...): not a residual site
_INSIDE = re.compile(r"^(\d+\.\w+|blocks\.\d+\..+)$")
ALLOWED = (
    "the residual sites are 'embed', '<layer>.attn', '<layer>.mlp', their indices 0..2L, "
    "'<layer>.resid_pre|mid|post' and blocks.<layer>.hook_resid_pre|mid|post"
)


def _not_a_site(name, n_layers: int | None) -> SiteError:
    """The error for a name that is no residual site, saying what is allowed (for ``n_layers``)."""
    allowed = ALLOWED if n_layers is None else ALLOWED.replace("2L", str(2 * n_layers)) + f" (layers 0..{n_layers - 1})"
    if _INSIDE.match(str(name)):
        return SiteError(f"site {name!r} is a hook point inside a block, not a residual site: {allowed}")
    return SiteError(f"unknown site {name!r}: {allowed}")


def _layer_of(name: str) -> tuple[int, int] | None:
    """``(layer, site index)`` of a label or TransformerLens name, None when ``name`` is neither."""
    m = _LABEL.match(name)
    if m:
        layer = int(m.group(1))
        return layer, 2 * layer + (1 if m.group(2) == "attn" else 2)
    m = _TL.match(name)
    if m:
        layer = int(m.group(1) or m.group(2))
        return layer, {"pre": 2 * layer, "mid": 2 * layer + 1, "post": 2 * layer + 2}[m.group(3)]
    return None


def check_site_names(names) -> None:
    """Raise :class:`~depthscope.common.errors.SiteError` for a name in ``names`` that no model
    has as a residual site (checked before any model loads; the layer range needs the model and
    is :func:`parse_site`'s)."""
    for name in [names] if isinstance(names, (str, int)) else (names or []):
        if isinstance(name, bool) or not isinstance(name, (str, int)):
            raise _not_a_site(name, None)
        text = str(name).strip()
        if text == "hook_embed":
            raise SiteError(HOOK_EMBED)
        if text in _EMBED or _layer_of(text) is not None:
            continue
        if text.lstrip("-").isdigit():
            if int(text) < 0:
                raise SiteError(f"site index {text} is negative: {ALLOWED}")
            continue
        raise _not_a_site(name, None)


def parse_site(name: str | int, n_layers: int) -> int:
    """Index of a site given by index, label (``"3.attn"``) or TransformerLens hook name; a
    :class:`~depthscope.common.errors.SiteError` naming it and what is allowed otherwise."""
    if isinstance(name, int) and not isinstance(name, bool):
        return site_from_index(name, n_layers).index
    if not isinstance(name, str):
        raise _not_a_site(name, n_layers)
    name = name.strip()
    if name in _EMBED:
        return 0
    if name == "hook_embed":
        raise SiteError(HOOK_EMBED)
    found = _layer_of(name)
    if found is None:
        if name.lstrip("-").isdigit():
            return parse_site(int(name), n_layers)
        raise _not_a_site(name, n_layers)
    layer, idx = found
    if not 0 <= layer < n_layers:
        raise SiteError(f"site {name!r}: layer {layer} out of range 0..{n_layers - 1} ({n_layers} layers)")
    return idx


def parse_sites(names: Iterable[str | int] | None, n_layers: int) -> list[int]:
    """Sorted, de-duplicated site indices (all sites when ``names`` is None)."""
    if names is None:
        return list(range(2 * n_layers + 1))
    if isinstance(names, (str, int)):
        names = [names]
    return sorted({parse_site(n, n_layers) for n in names})


def site_frame(indices: Sequence[int], n_layers: int) -> pd.DataFrame:
    """The shared site columns (``site, label, layer, sublayer, depth``) for some sites."""
    rows = [site_from_index(int(i), n_layers) for i in indices]
    return pd.DataFrame(
        {
            "site": [s.index for s in rows],
            "label": [s.label for s in rows],
            "layer": [s.layer for s in rows],
            "sublayer": [s.sublayer for s in rows],
            "depth": [s.depth for s in rows],
        }
    )
