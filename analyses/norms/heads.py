"""Per-head attention writes and norm-weighted attention (Kobayashi et al. 2020).

An attention sublayer's write is a sum over heads: ``u_attn = sum_h W_O^h z_h + b_O`` with
``z_h(i) = sum_j a^h_ij v^h_j`` the head's output before the output projection. So

* :func:`head_write_norms` measures ``||W_O^h z_h(i)|| = ||sum_j a^h_ij f_h(x_j)||`` per head over
  a dataset (``f_h(x_j) = W_O^h v^h_j``), streamed like
  :func:`~depthscope.analyses.norms.contribution_norms` (one row per ``(layer, head,
  positions)``, the first position apart);
* :func:`norm_weighted_attention` gives, for one text, every head's attention weight
  ``a^h_ij`` next to the norm of what it moves, ``||f_h(x_j)||``, and their product
  ``||a^h_ij f_h(x_j)||`` (Kobayashi, Kuribayashi, Yokoi and Inui 2020, "Attention is not only a
  weight"), which discounts attention paid to tokens that carry little (e.g. a sink with a tiny
  value vector).

Both read the input of the attention's output projection (``l.z``) and its own output (the
engine-internal point ``l.proj_out``; value vectors: ``l.values``) through the hook engine
(:func:`depthscope.hooks.engine.cache_points`; modules, head counts and value layouts located by
:mod:`depthscope.hooks.arch`), and use
``||W_h^T x||^2 = x^T (W_h^T W_h) x`` with the per-head Gram matrices, so the per-head writes never
materialise ``[tokens, heads, d_model]``. Every call checks
that the heads sum (with the output bias) to the attention module's own output. Value vectors
(needed only by :func:`norm_weighted_attention`) are read for Llama-style (``v_proj``), GPT-2
(``c_attn``) and GPT-NeoX (``query_key_value``) attention; other layouts are refused. Post-norm
encoders (BERT) are refused: their heads' writes pass through a LayerNorm before the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.norms.metrics import POSITION_GROUPS
from depthscope.analyses.norms.streaming import norm_batches, text_settings
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError, UnsupportedArchitecture
from depthscope.hooks.arch import linear_weight
from depthscope.hooks.engine import cache_points
from depthscope.hooks.model import refuse_non_finite
from depthscope.hooks.points import Point
from depthscope.hooks.sites import SITE_COLUMNS, site_frame

__all__ = ["head_write_norms", "norm_weighted_attention"]

WRITE_METRICS = ("write_norm", "write_share", "attn_write_norm", "heads_coherence")
NWA_COLUMNS = [
    *SITE_COLUMNS,
    "head",
    "query",
    "query_token",
    "key",
    "key_token",
    "weight",
    "value_norm",
    "norm_weighted",
]


@dataclass
class _HeadWeights:
    """Per layer, the output projection's matrix split by head (what the per-head norms need)."""

    out_proj: list  # per layer: the output projection module
    W: list  # per layer: [D, H*dh] float32 (x -> x @ W.T is the projection without bias)
    bias: list  # per layer: [D] or None
    gram: list  # per layer: [H, dh, dh]
    n_heads: int
    head_dim: int


def _head_weights(model) -> _HeadWeights:
    """Read every layer's output projection (located by :mod:`depthscope.hooks.arch`)."""
    arch = model.arch
    if arch.layout == "post_norm":
        raise UnsupportedArchitecture(
            f"{model.name} is a post-norm encoder: each attention output passes a LayerNorm before it "
            f"joins the stream, so per-head writes into the stream are not defined"
        )
    H = arch.n_heads
    if not H:
        raise UnsupportedArchitecture(f"{model.name}: cannot find the number of attention heads in its config")
    projs, Ws, biases, grams = [], [], [], []
    for layer, proj in enumerate(arch.o_proj):
        if proj is None:
            raise UnsupportedArchitecture(
                f"{model.name}: attention of layer {layer} ({type(arch.attn[layer]).__name__}) has no output "
                f"projection known to depthscope.hooks.arch; per-head writes need it"
            )
        W = linear_weight(proj).float()
        if W.shape[0] != model.d_model or W.shape[1] % H:
            raise UnsupportedArchitecture(
                f"{model.name}: output projection of layer {layer} has shape {tuple(W.shape)}"
            )
        dh = W.shape[1] // H
        Wh = W.reshape(model.d_model, H, dh)  # columns of head h: h*dh..(h+1)*dh
        grams.append(torch.einsum("dhk,dhl->hkl", Wh, Wh))
        projs.append(proj)
        Ws.append(W)
        b = getattr(proj, "bias", None)
        biases.append(None if b is None else b.detach().float())
    return _HeadWeights(projs, Ws, biases, grams, H, Ws[0].shape[1] // H)


def _head_norms(z: torch.Tensor, gram: torch.Tensor, H: int) -> torch.Tensor:
    """||W_O^h z_h|| per head: z [B, P, H*dh] -> [B, P, H] (via the Gram matrices)."""
    zh = z.float().reshape(*z.shape[:-1], H, -1)
    sq = torch.einsum("bphk,hkl,bphl->bph", zh, gram.to(zh.device), zh)
    return sq.clamp_min(0).sqrt()


def _capture(model, ids: torch.Tensor, mask: torch.Tensor, points: list[Point], check_last: bool = False) -> dict:
    """``points`` for one batch, name -> tensor (``l.z`` flattened back to the projection's input
    ``[B, P, H*dh]``), in one forward that stops after the last of them. ``check_last`` also caches
    the last residual site and refuses NaN/inf there, as a full forward's check would."""
    last = Point("mlp", model.n_layers - 1)
    store = cache_points(model, ids, mask, [*points, last] if check_last else points)
    if check_last:
        refuse_non_finite(store.pop(last.name)[None], [last.name])
    return {k: v.flatten(-2) if k.endswith(".z") else v for k, v in store.items()}


def _check_heads_sum(spec: _HeadWeights, layer: int, z: torch.Tensor, out: torch.Tensor) -> None:
    recon = z.float() @ spec.W[layer].to(z.device).T
    if spec.bias[layer] is not None:
        recon = recon + spec.bias[layer].to(z.device)
    err = float((recon - out.float()).abs().max() / out.float().abs().max().clamp_min(1e-12))
    if not err <= 1e-4:
        raise UnsupportedArchitecture(
            f"the heads of layer {layer} do not sum to the attention output (relative error {err:.1e}): "
            f"the output projection is not a plain linear map of the concatenated heads"
        )


def head_write_norms(
    model,
    inputs,
    *,
    batch_size: int = 4,
    window: int | None = None,
    max_tokens: int | None = None,
    mask: torch.Tensor | None = None,
    text: TextWindows | None = None,
) -> pd.DataFrame:
    """Per-head attention write norms over a dataset, streamed in bounded memory; the inputs are
    read as :func:`~depthscope.analyses.norms.contribution_norms` reads them (``text``).

    Returns one row per ``(layer, head, positions)`` (``positions`` in ``("rest", "first")`` as
    in :func:`~depthscope.analyses.norms.contribution_norms`) with the shared site columns of the
    layer's ``l.attn`` site, ``head``, ``n_tokens`` and the per-token means of

    * ``write_norm``: ``||W_O^h z_h||``, the head's write (= ``||sum_j a_ij f_h(x_j)||``);
    * ``write_share``: ``write_norm / sum_h' write_norm_h'`` (per token, then averaged);
    * ``attn_write_norm``: ``||u_attn||`` of the whole sublayer (same on all heads of a layer);
    * ``heads_coherence``: ``||sum_h W_O^h z_h|| / sum_h ||W_O^h z_h||`` (1: heads write in one
      direction; small: they cancel), same on all heads of a layer.
    """
    spec = _head_weights(model)
    L, H = model.n_layers, spec.n_heads
    sums = {k: torch.zeros(L, H, len(POSITION_GROUPS), dtype=torch.float64) for k in WRITE_METRICS}
    n_tok = torch.zeros(len(POSITION_GROUPS), dtype=torch.float64)
    checked = False
    for batch in norm_batches(model, inputs, batch_size, window, max_tokens, mask, text=text_settings(inputs, text)):
        points = [Point(k, l) for l in range(L) for k in ("z", "proj_out")]
        store = _capture(model, batch.ids, batch.mask, points, check_last=True)
        real = batch.counted.to(model.device)
        pos = torch.arange(real.shape[1], device=real.device)
        groups = torch.stack([real & (pos >= 1), real & (pos == 0)], 0).double()  # [G, B, P]
        n_tok += groups.sum((1, 2)).cpu()
        for layer in range(L):
            z, out = store[f"{layer}.z"], store[f"{layer}.proj_out"]
            if not checked:
                _check_heads_sum(spec, layer, z[real], out[real])
            _add_write_sums(sums, layer, _write_metrics(spec, layer, z, out), groups)
        checked = True
    if float(n_tok.sum()) == 0:
        raise InputError("empty input: no real tokens to measure")
    df = _write_frame(sums, n_tok, L, H)
    df.attrs.update({"model": str(model.name), "n_heads": H, "head_dim": spec.head_dim})
    return df


def _write_metrics(spec: _HeadWeights, layer: int, z: torch.Tensor, out: torch.Tensor) -> dict:
    """Per token of one layer: ``write_norm`` and ``write_share`` ``[B, P, H]``, ``attn_write_norm``
    and ``heads_coherence`` ``[B, P]`` (float64; shares and coherence 0 where the heads write nothing)."""
    hn = _head_norms(z, spec.gram[layer], spec.n_heads).double()  # [B, P, H]
    tot = hn.sum(-1, keepdim=True)
    share = torch.where(tot > 0, hn / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.zeros_like(hn))
    heads_only = z.float() @ spec.W[layer].to(z.device).T  # the sum of the heads (no bias)
    an = torch.linalg.vector_norm(out.float(), dim=-1).double()  # [B, P]
    coh = torch.where(
        tot[..., 0] > 0,
        torch.linalg.vector_norm(heads_only, dim=-1).double()
        / torch.where(tot[..., 0] > 0, tot[..., 0], torch.ones_like(an)),
        torch.zeros_like(an),
    )
    return {"write_norm": hn, "write_share": share, "attn_write_norm": an, "heads_coherence": coh}


def _add_write_sums(sums: dict, layer: int, metrics: dict, groups: torch.Tensor) -> None:
    """Add one batch's per-token metrics of one layer to the running sums ``[L, H, G]`` per group."""
    H = sums["write_norm"].shape[1]
    for k, v in metrics.items():
        if v.dim() == 3:  # per head
            sums[k][layer] += torch.einsum("gbp,bph->hg", groups, v).cpu()
        else:  # per layer: the same on every head
            sums[k][layer] += torch.einsum("gbp,bp->g", groups, v).cpu()[None].expand(H, -1)


def _write_frame(sums: dict, n_tok: torch.Tensor, L: int, H: int) -> pd.DataFrame:
    """The table of :func:`head_write_norms`: per-token means, one row per (layer, head, positions)."""
    frames = []
    sf = site_frame([2 * l + 1 for l in range(L)], L)
    for g, name in enumerate(POSITION_GROUPS):
        f = sf.loc[sf.index.repeat(H)].reset_index(drop=True)
        f["head"] = np.tile(np.arange(H), L)
        f["positions"] = name
        f["n_tokens"] = int(n_tok[g])
        for k, v in sums.items():
            f[k] = (v[:, :, g] / n_tok[g]).reshape(-1).numpy() if n_tok[g] > 0 else np.nan
        frames.append(f)
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------- Kobayashi
def norm_weighted_attention(model, text: str, *, layers: Sequence[int] | None = None) -> pd.DataFrame:
    """Attention weights and norm-weighted attention of every head for one text.

    One row per ``(layer, head, query i, key j <= i)`` with ``query_token, key_token``,
    ``weight`` (``a^h_ij``), ``value_norm`` (``||f_h(x_j)|| = ||W_O^h v^h_j||``) and
    ``norm_weighted`` (``a^h_ij ||f_h(x_j)||``), plus the shared site columns of ``l.attn``.
    The heads' outputs rebuilt from these weights and values are checked against the output
    projection's input (and the heads' sum against the projection's output) on every call.
    """
    if not isinstance(text, str) or not text:
        raise InputError("norm_weighted_attention takes one non-empty text")
    spec = _head_weights(model)
    H, L = spec.n_heads, model.n_layers
    layers = list(range(L)) if layers is None else [int(l) for l in layers]
    if any(not 0 <= l < L for l in layers):
        raise InputError(f"layers must be in 0..{L - 1}")
    ids, mask = model.tokenize([text])
    # patterns, head outputs and projections as the model computes them (exact, any attention kernel)
    store = _capture(model, ids, mask, [Point(k, l) for l in layers for k in ("values", "pattern", "z", "proj_out")])
    P = ids.shape[1]
    toks = (
        [model.tokenizer.decode([int(t)]) for t in ids[0]]
        if model.tokenizer is not None
        else [str(int(t)) for t in ids[0]]
    )
    sf = site_frame([2 * l + 1 for l in layers], L).set_index("layer", drop=False)
    frames = []
    for l in layers:
        a, v, zt = _checked_heads(spec, l, store)
        f = _pair_frame(a, _head_norms(v.reshape(1, P, -1), spec.gram[l], H)[0], np.array(toks, dtype=object))
        for c in SITE_COLUMNS:
            f[c] = sf.loc[l, c]
        frames.append(f)
    df = pd.concat(frames, ignore_index=True)[NWA_COLUMNS]
    df.attrs.update({"model": str(model.name), "text": text})
    return df


def _checked_heads(spec: _HeadWeights, l: int, store: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``l``'s pattern ``[H, P, P]``, values ``[P, H, dh]`` and projection input ``[P, H*dh]``
    of the first text, checked: pattern x values rebuild the heads' outputs, and the heads sum to
    the projection's own output (not to ``l.attn_out``, which sandwich-norm families such as OLMo-2
    and Gemma-2 take after the post-attention norm, not a sum over heads)."""
    a = store[f"{l}.pattern"][0].float()  # [H, P, P]
    v = store[f"{l}.values"][0].float()  # [P, H, dh]
    P = a.shape[-1]
    z = torch.einsum("hij,jhk->ihk", a, v).reshape(P, -1)  # rebuilt head outputs
    zt = store[f"{l}.z"][0].float()  # the output projection's input
    err = float((z - zt).abs().max() / zt.abs().max().clamp_min(1e-12))
    if not err <= 1e-3:
        raise UnsupportedArchitecture(
            f"layer {l}: attention weights x values do not rebuild the heads' outputs (relative error {err:.1e})"
        )
    _check_heads_sum(spec, l, zt, store[f"{l}.proj_out"][0])
    return a, v, zt


def _pair_frame(a: torch.Tensor, value_norms: torch.Tensor, toks: np.ndarray) -> pd.DataFrame:
    """One row per ``(head, query i, key j <= i)`` of one layer: ``weight`` ``a[h, i, j]``,
    ``value_norm`` ``||f_h(x_j)||`` (``value_norms`` ``[P, H]``), their product and the tokens."""
    H, P = a.shape[0], a.shape[-1]
    qi, kj = np.tril_indices(P)
    f = pd.DataFrame(
        {
            "head": np.tile(np.arange(H), len(qi)),
            "query": np.repeat(qi, H),
            "key": np.repeat(kj, H),
            "weight": a[:, qi, kj].T.numpy().reshape(-1),
            "value_norm": value_norms[kj].numpy().reshape(-1),
        }
    )
    f["norm_weighted"] = f["weight"] * f["value_norm"]
    f["query_token"] = toks[f["query"].to_numpy()]
    f["key_token"] = toks[f["key"].to_numpy()]
    return f
