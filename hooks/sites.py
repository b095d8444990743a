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
        raise IndexError(f"site index {index} out of range 0..{n_sites - 1}")
    if index == 0:
        return Site(0, "embed", -1, "embed", 0.0)
    layer, rem = divmod(index - 1, 2)
    if rem == 0:
        return Site(index, f"{layer}.attn", layer, "attn", layer + 0.5)
    return Site(index, f"{layer}.mlp", layer, "mlp", layer + 1.0)


_LABEL = re.compile(r"^(\d+)\.(attn|mlp)$")
_TL = re.compile(r"^(?:blocks\.(\d+)\.hook_|(\d+)\.)resid_(pre|mid|post)$")


def parse_site(name: str | int, n_layers: int) -> int:
    """Index of a site given by index, label (``"3.attn"``) or TransformerLens hook name."""
    if isinstance(name, int):
        return site_from_index(name, n_layers).index
    name = str(name).strip()
    if name in ("embed", "resid_pre0"):
        return 0
    if name == "hook_embed":
        raise KeyError(HOOK_EMBED)
    m = _LABEL.match(name)
    if m:
        layer, sub = int(m.group(1)), m.group(2)
        idx = 2 * layer + (1 if sub == "attn" else 2)
    else:
        m = _TL.match(name)
        if not m:
            if name.lstrip("-").isdigit():
                return parse_site(int(name), n_layers)
            raise KeyError(
                f"unknown site {name!r}: use 'embed', '<layer>.attn', '<layer>.mlp', an index "
                f"0..{2 * n_layers}, '<layer>.resid_pre|mid|post' or blocks.<layer>.hook_resid_pre|mid|post"
            )
        layer, kind = int(m.group(1) or m.group(2)), m.group(3)
        idx = {"pre": 2 * layer, "mid": 2 * layer + 1, "post": 2 * layer + 2}[kind]
    if not 0 <= layer < n_layers:
        raise KeyError(f"site {name!r}: layer {layer} out of range 0..{n_layers - 1}")
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
