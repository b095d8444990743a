"""Contribution norms: how much each sublayer writes into the residual stream, relative to it.

The residual stream of a pre-norm decoder is a sum: the embedding plus every sublayer's write.
With ``h_s`` the stream after site ``s`` (see :mod:`depthscope.hooks.sites`), the write of site
``s >= 1`` is the update ``u_s = h_s - h_{s-1}``. This module measures, per site and token,

==================  ==========================================================================
``stream_norm``     ``||h_s||``
``update_norm``     ``||u_s||``
``relative_update`` ``||u_s|| / ||h_{s-1}||``
``cos_update_stream`` ``cos(u_s, h_{s-1})`` (negative: the sublayer erases part of the stream)
``growth``          ``||h_s|| / ||h_{s-1}||``
``block_influence`` ``1 - cos(h_{s-1}, h_s)`` (Men et al. 2024, "ShortGPT")
``attn_share``      ``||u_attn(l)|| / (||u_attn(l)|| + ||u_mlp(l)||)`` of the site's layer ``l``
``effective_write`` ``||g * c(u_s)|| / sigma_N(h_r)``: the update as the norm ``N`` that next reads
                    it sees it (``g`` its gain, ``c`` mean-centring for LayerNorm and the identity
                    for RMSNorm, ``sigma_N`` its RMS/std *of the full stream it reads*, with eps).
``effective_relative`` ``||g * c(u_s)|| / ||g * c(h_r)||``: the same write as a fraction of the
                    normed stream (the scale cancels).
``max_abs``         the largest ``|h_s[d]|`` over tokens and dimensions, with its location
``median_abs``      the (lower) median over dimensions of ``|h_s[d]|``, i.e. the ``(D-1)//2``-th
                    smallest, torch.median's convention
==================  ==========================================================================

and per token ``growth^2 = 1 + relative_update^2 + 2 relative_update cos_update_stream`` holds
exactly (``||h_{s-1} + u||^2`` expanded).

Positions. The first position of every sequence (every window of a long document; each window
starts a fresh context) behaves as an attention sink with outsized norms (on SmolLM2-135M its
stream norm is ~100x the others' after a few blocks), so :func:`contribution_norms` reports it
apart: the result is in long form with one row per ``(site, positions)``, ``positions`` in
``{"rest", "first"}`` ("rest" = real tokens at positions >= 1, "first" = position 0). Padding
is never counted.

Means. Every metric column of :func:`contribution_norms` is a **mean of per-token values**
over the real tokens of its position group (mean of ratios, not ratio of means). Ratios of means
can be formed from the table: e.g. ``update_norm / stream_norm(previous site)`` is the ratio of
mean norms. ``max_abs`` is a maximum, ``max_over_median`` is ``max_abs / median_abs`` (the
largest activation over the *mean* per-token median magnitude, the "massive activation" ratio of
Sun et al. 2024).

Undefined values. A per-token ratio whose denominator is exactly zero (a zero stream, e.g.
ablated by a hook, or a zero update for the cosine) is undefined: it is skipped (never divided)
and counted in ``n_undefined``; a mean with no defined token is NaN. NaN/inf activations are
refused by :meth:`HookedModel.residual_stream` with :class:`NonFiniteActivationError`.

Layouts. Embed rows carry the stream metrics and NaN for update metrics (the embedding has no
previous stream). *Sequential pre-norm* (Llama, SmolLM, GPT-2): ``l.attn``'s write is read next
by ``ln2`` of block ``l`` (on ``h_{l.attn}``), ``l.mlp``'s by ``ln1`` of block ``l+1`` or the
final norm. *Parallel* blocks (GPT-NeoX): attention and MLP both read ``resid_pre``, so no norm
reads ``h_{l.attn}``; the attention write is first read by the next block's ``ln1`` (or the
final norm) on the block output, and ``effective_write`` of ``l.attn`` uses that norm and that
stream. *Post-norm* encoders (BERT): each sublayer ends in a LayerNorm, so ``h_s - h_{s-1}`` is
the change the sublayer *and its norm* make, not a pure write; the update columns then mean
"stream change", ``effective_write`` is NaN, and ``df.attrs["notes"]`` says so.

Direct logit attribution. :func:`direct_logit_attribution` splits a decoder's logit (or logit
difference) into the embedding's and every sublayer's direct contribution through the final
norm with its scale frozen at the final stream, plus a constant (norm bias and unembedding
bias). The parts sum to the model's own logit; the sum is checked on every call.

Per-head writes and norm-weighted attention (Kobayashi et al. 2020) live in
:mod:`depthscope.analyses.heads`; figures in :mod:`depthscope.analyses.plots.norms`.

Precision. Passes over the ``[sites, batch, pos, d_model]`` tensor run in float32 (the model's
own precision); the update is materialised once per batch, and every ratio is formed in float64
from the per-token reductions. Against a float64 recomputation from the same activations
(tests/test_norms.py) norms and ratios agree to ~5e-7 relative, cosines and ``block_influence``
to ~3e-6 absolute; ``block_influence`` uses a cancellation-free form, so at the sink position
(where it is 1e-8..1e-4 in late blocks) it stays within ~3e-5 relative.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from depthscope.hooks.errors import InputError, NonFiniteActivationError, UnsupportedArchitecture
from depthscope.hooks.sites import site_frame

from .text import TokenBatch, token_batches

__all__ = [
    "contribution_norms",
    "norms_by_position",
    "direct_logit_attribution",
    "fit_growth_rate",
    "norms_summary",
    "NORM_METRICS",
]

#: per-token metrics averaged by :func:`contribution_norms` (all but the massive-activation ones).
NORM_METRICS = [
    "stream_norm",
    "update_norm",
    "relative_update",
    "cos_update_stream",
    "growth",
    "block_influence",
    "attn_share",
    "effective_write",
    "effective_relative",
    "median_abs",
]
_UPDATE_METRICS = [
    "update_norm",
    "relative_update",
    "cos_update_stream",
    "growth",
    "block_influence",
    "attn_share",
    "effective_write",
    "effective_relative",
]
POSITION_GROUPS = ("rest", "first")

Inputs = Union[torch.Tensor, Sequence[str], str]


# ---------------------------------------------------------------------------------------- norms
@dataclass
class _Reader:
    """For every site s >= 1: which stream index the norm reading u_s sees, and that norm's params."""

    stream_index: torch.Tensor  # [S-1] long: index into resid of the stream the reading norm reads
    gain: torch.Tensor  # [S-1, D] float64
    centre: torch.Tensor  # [S-1] bool: LayerNorm (mean-centre) vs RMSNorm
    eps: torch.Tensor  # [S-1] float64
    valid: torch.Tensor  # [S-1] bool: False where no norm reads the write (post-norm) -> NaN
    notes: list


def _norm_params(model, norm) -> dict:
    p = model.norm_params(norm)
    d = model.d_model
    w = p.get("weight")
    gain = torch.ones(d, dtype=torch.float64) if w is None else w.detach().to("cpu", torch.float64).reshape(-1)
    b = p.get("bias")
    bias = None if b is None else b.detach().to("cpu", torch.float64).reshape(-1)
    return {"kind": p["kind"], "gain": gain, "bias": bias, "eps": float(p["eps"])}


def _apply_norm(params: dict, h: torch.Tensor) -> torch.Tensor:
    """Our reading of a norm module (used to verify it against the module itself)."""
    h = h.double()
    if params["kind"] == "layer":
        h = h - h.mean(-1, keepdim=True)
    out = params["gain"].to(h.device) * h / torch.sqrt((h * h).mean(-1, keepdim=True) + params["eps"])
    if params["bias"] is not None:
        out = out + params["bias"].to(h.device)
    return out


def _verify_norm(norm, params: dict, h: torch.Tensor, what: str) -> Optional[str]:
    """None when ``params`` reproduce ``norm(h)``, else a sentence saying why not."""
    with torch.no_grad():
        ref = norm(h).double()
    mine = _apply_norm(params, h)
    err = float((ref - mine).abs().max() / ref.abs().max().clamp_min(1e-12))
    if not math.isfinite(err) or err > 1e-3:
        return (
            f"{what} ({type(norm).__name__}) is not gain * centre(h) / sqrt(mean(centre(h)^2) + eps) "
            f"[+ bias] (relative error {err:.1e})"
        )
    return None


def _readers(model, sample: Optional[torch.Tensor]) -> _Reader:
    """The norm that next reads each site's write; verified on ``sample`` ([S, n, D]) when given."""
    S, D = model.n_sites, model.d_model
    idx = torch.arange(1, S)
    gain = torch.ones(S - 1, D, dtype=torch.float64)
    centre = torch.zeros(S - 1, dtype=torch.bool)
    eps = torch.ones(S - 1, dtype=torch.float64)
    valid = torch.zeros(S - 1, dtype=torch.bool)
    notes: list[str] = []
    if model.arch.layout == "post_norm":
        notes.append(
            "post-norm layout: h_s - h_{s-1} is the change made by the sublayer and its LayerNorm "
            "(not a pure write); effective_write is undefined (NaN)"
        )
        return _Reader(idx, gain, centre, eps, valid, notes)
    cache: dict[int, tuple[dict, Optional[str]]] = {}
    for s in range(1, S):
        r = s
        norm = model.norm_reading(s)
        if norm is None and s + 1 < S:  # parallel attention: read next by the block output's reader
            r = s + 1
            norm = model.norm_reading(s + 1)
        if norm is None:
            continue
        key = id(norm)
        if key not in cache:
            params = _norm_params(model, norm)
            problem = None
            if sample is not None:
                problem = _verify_norm(norm, params, sample[r].to(model.dtype), f"the norm reading site {model.labels[s]}")
            cache[key] = (params, problem)
        params, problem = cache[key]
        if problem is not None:
            if problem not in notes:
                notes.append(problem + "; effective_write is NaN there")
            continue
        idx[s - 1] = r
        gain[s - 1] = params["gain"]
        centre[s - 1] = params["kind"] == "layer"
        eps[s - 1] = params["eps"]
        valid[s - 1] = True
    if model.arch.layout == "parallel":
        notes.append(
            "parallel layout: l.attn = resid_pre + attn_out; its effective_write is measured by the "
            "norm that next reads it (next block's ln1 / the final norm, on the block output)"
        )
    return _Reader(idx, gain, centre, eps, valid, notes)


# ----------------------------------------------------------------------------- per-token metrics
def _token_metrics(resid: torch.Tensor, reader: _Reader) -> dict[str, torch.Tensor]:
    """Every per-token metric for every site at once: resid [S, b, P, D] -> dict of [S, b, P].

    Passes over the big tensor run in its own dtype (float32): the update ``u`` is materialised
    once (so small writes onto huge streams keep their precision), norms and dot products are
    reductions of it; everything after the reductions is float64 on [S, b, P] tensors, with
    ``block_influence`` from a cancellation-free form. Undefined ratios (zero denominators) are
    NaN and never divided.
    """
    h = resid if resid.dtype in (torch.float32, torch.float64) else resid.float()
    S, D = h.shape[0], h.shape[-1]
    f64 = torch.float64
    dev = h.device
    hn = torch.linalg.vector_norm(h, dim=-1).to(f64)  # [S, b, P]
    vmax, imax = h.max(-1)
    vmin, imin = h.min(-1)
    neg = -vmin > vmax
    absmax = torch.where(neg, -vmin, vmax).to(f64)
    argdim = torch.where(neg, imin, imax)
    # one scratch buffer of the stream's size, reused: |h| (median), then u, then gain * u, ...
    buf = torch.empty(h.shape, dtype=h.dtype, device=dev)
    torch.abs(h, out=buf)
    median = _lower_median(buf).to(f64)
    u = buf[:-1]
    torch.sub(h[1:], h[:-1], out=u)
    un = torch.linalg.vector_norm(u, dim=-1).to(f64)
    dot = torch.einsum("sbpd,sbpd->sbp", u, h[:-1]).to(f64)  # <u_s, h_{s-1}>
    prev, cur = hn[:-1], hn[1:]
    nan = torch.tensor(float("nan"), dtype=f64, device=dev)

    def ratio(num, den, ok):
        return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), nan)

    prev_ok = prev > 0
    rel = ratio(un, prev, prev_ok)
    growth = ratio(cur, prev, prev_ok)
    cos_u = ratio(dot, un * prev, prev_ok & (un > 0)).clamp(-1, 1)
    # block influence 1 - cos(a, b), a = h_{s-1}, b = a + u. Direct form (a.b)/(|a||b|) loses
    # everything when |u| << |a|; with r = |u|/|a|, c = cos(u, a), g = |b|/|a| it equals
    # r^2 (1 - c^2) / (g (g + 1 + r c)) (exact), used wherever a.b > 0 (then no cancellation).
    hh = prev_ok & (cur > 0)
    cos_u0 = torch.where(torch.isnan(cos_u), torch.zeros_like(cos_u), cos_u)
    rel0 = torch.where(prev_ok, rel, torch.zeros_like(rel))
    g0 = torch.where(prev_ok, growth, torch.ones_like(growth))
    ab = 1 + rel0 * cos_u0  # a.b / |a|^2
    stable = rel0 * rel0 * (1 - cos_u0 * cos_u0) / torch.where(hh & (ab > 0), g0 * (g0 + ab), torch.ones_like(g0))
    direct = 1 - ab / torch.where(hh, g0, torch.ones_like(g0))
    bi = torch.where(hh, torch.where(ab > 0, stable, direct), nan)

    # norm-aware effective write: ||g * c(u)|| / sigma(h_r) with h_r the stream the reader reads
    valid = reader.valid.to(dev)
    eff = eff_rel = torch.full_like(un, float("nan"))
    if bool(valid.any()):
        gain = reader.gain.to(dev, h.dtype)  # [S-1, D]
        centre = reader.centre.to(dev)
        r_idx = reader.stream_index.to(dev)
        shifted = bool((r_idx != torch.arange(1, S, device=dev)).any())
        cmask = centre[:, None, None, None].to(u.dtype)
        if bool(centre.any()):
            u.sub_(u.mean(-1, keepdim=True) * cmask)
        u.mul_(gain[:, None, None, :])
        gu = torch.linalg.vector_norm(u, dim=-1).to(f64)

        def gain_norms(x, g, c, xn, out):  # ||g * centre(x)|| and mean(centre(x)^2), per token
            if bool(c.any()):
                torch.sub(x, x.mean(-1, keepdim=True) * c[:, None, None, None].to(x.dtype), out=out)
                xn = torch.linalg.vector_norm(out, dim=-1).to(f64)
                out.mul_(g[:, None, None, :])
            else:
                torch.mul(x, g[:, None, None, :], out=out)
            return torch.linalg.vector_norm(out, dim=-1).to(f64), xn * xn / D

        gh, ms = gain_norms(h[1:], gain, centre, hn[1:], u)  # reader reads h_s (sequential layouts)
        if shifted:  # reader reads h_{s+1} (parallel attention): recompute those sites
            gh2, ms2 = gain_norms(h[2:], gain[:-1], centre[:-1], hn[2:], u[:-1])
            sh = (r_idx[:-1] == torch.arange(2, S, device=dev))[:, None, None]
            gh = torch.cat([torch.where(sh, gh2, gh[:-1]), gh[-1:]], 0)
            ms = torch.cat([torch.where(sh, ms2, ms[:-1]), ms[-1:]], 0)
        sigma = torch.sqrt(ms + reader.eps.to(dev)[:, None, None])
        v = valid[:, None, None]
        eff = torch.where(v, gu / sigma, nan)
        eff_rel = ratio(gu, gh, v & (gh > 0))

    # attention share per layer, on both sites of the layer
    ua, um = un[0::2], un[1::2]  # attn sites 1, 3, ..; mlp sites 2, 4, ..  -> [L, b, P]
    tot = ua + um
    share = ratio(ua, tot, tot > 0).repeat_interleave(2, dim=0)

    def pad(x):  # the embed row: NaN
        return torch.cat([torch.full_like(x[:1], float("nan")), x], 0)

    return {
        "stream_norm": hn,
        "update_norm": pad(un),
        "relative_update": pad(rel),
        "cos_update_stream": pad(cos_u),
        "growth": pad(growth),
        "block_influence": pad(bi),
        "attn_share": pad(share),
        "effective_write": pad(eff),
        "effective_relative": pad(eff_rel),
        "median_abs": median,
        "max_abs": absmax,
        "max_abs_dim": argdim,
    }


def _lower_median(a: torch.Tensor) -> torch.Tensor:
    """The lower median (the ``(D-1)//2``-th smallest) over the last axis; ``a`` is scratch.

    On CPU an in-place ``numpy.partition`` (linear time) instead of torch's sort-based median;
    the result equals ``torch.median`` (which also returns the lower median)."""
    k = (a.shape[-1] - 1) // 2
    if a.device.type == "cpu" and a.is_contiguous():
        x = a.numpy()
        x.partition(k, axis=-1)
        return a[..., k].clone()
    return a.median(-1).values


def _chunked_metrics(resid: torch.Tensor, reader: _Reader, max_elems: int = 48_000_000):
    """:func:`_token_metrics` over chunks of batch rows, so the scratch buffer stays bounded."""
    S, B, P, D = resid.shape
    rows = max(1, max_elems // max(1, S * P * D))
    if rows >= B:
        return _token_metrics(resid, reader)
    parts = [_token_metrics(resid[:, i : i + rows], reader) for i in range(0, B, rows)]
    return {k: torch.cat([p[k] for p in parts], 1) for k in parts[0]}


def _stream(model, batch: TokenBatch, hooks):
    """All sites for one batch. The finiteness check is ours (on the per-token norms of real
    tokens, see :func:`_check_finite`), which saves residual_stream a full pass."""
    return model.residual_stream(batch.ids, mask=batch.mask, return_logits=False, hooks=hooks, check_finite=False)


def _check_finite(model, stream_norm: torch.Tensor, mask: torch.Tensor) -> None:
    """NaN/inf anywhere in a real token's stream makes its norm non-finite: refuse, naming the site."""
    bad = ~torch.isfinite(stream_norm) & mask.to(stream_norm.device)[None]
    if bool(bad.any()):
        per_site = bad.flatten(1).any(1)
        s = int(per_site.nonzero()[0, 0])
        rows = bad[s].any(-1).nonzero().flatten().tolist()
        raise NonFiniteActivationError(
            f"NaN/inf in the residual stream first at site {model.labels[s]} (batch rows {rows}); "
            f"contribution norms are undefined there"
        )


def _undefined(metrics: dict[str, torch.Tensor], reader: _Reader) -> torch.Tensor:
    """[S, b, P] True where some defined-by-design update metric is NaN (zero denominators)."""
    und = torch.zeros_like(metrics["stream_norm"], dtype=torch.bool)
    for k in ("relative_update", "cos_update_stream", "growth", "block_influence", "attn_share"):
        und[1:] |= torch.isnan(metrics[k][1:])
    if bool(reader.valid.any()):
        und[1:] |= torch.isnan(metrics["effective_relative"][1:]) & reader.valid.to(und.device)[:, None, None]
    return und


# ----------------------------------------------------------------------------- streaming
def _limited(batches: Iterable[TokenBatch], max_tokens: Optional[int]) -> Iterable[TokenBatch]:
    """Stop after ``max_tokens`` real tokens (the last sequence is cut to a prefix)."""
    if max_tokens is None:
        yield from batches
        return
    if max_tokens <= 0:
        raise InputError(f"max_tokens must be positive, got {max_tokens}")
    left = max_tokens
    for b in batches:
        if left <= 0:
            return
        n = b.mask.sum(1)
        if int(n.sum()) <= left:
            left -= int(n.sum())
            yield b
            continue
        mask = b.mask.clone()
        keep_rows = 0
        for i in range(mask.shape[0]):
            k = min(int(n[i]), left)
            mask[i, k:] = False
            left -= k
            if k > 0:
                keep_rows = i + 1
        width = int(mask[:keep_rows].sum(1).max())
        yield TokenBatch(b.ids[:keep_rows, :width], mask[:keep_rows, :width], b.doc_index[:keep_rows], b.window_index[:keep_rows])
        return


def _batches(model, inputs, batch_size, window, max_tokens, mask=None):
    if batch_size <= 0:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    return _limited(token_batches(model, inputs, batch_size=batch_size, window=window, mask=mask), max_tokens)


def _sample(resid: torch.Tensor, mask: torch.Tensor, n: int = 64) -> torch.Tensor:
    """Up to ``n`` real tokens' streams at every site, [S, n, D], to verify the norms against."""
    b, p = mask.nonzero(as_tuple=True)
    return resid[:, b[:n], p[:n]]


def _check_model(model) -> None:
    if model.n_layers < 1:
        raise UnsupportedArchitecture("a model without blocks has no sublayer writes")


# ----------------------------------------------------------------------------- public API
def contribution_norms(
    model,
    inputs: Inputs,
    *,
    batch_size: int = 4,
    window: Optional[int] = None,
    max_tokens: Optional[int] = None,
    hooks=None,
    progress: bool = False,
    mask: Optional[torch.Tensor] = None,
) -> pd.DataFrame:
    """Per-site contribution norms over a dataset, streamed in bounded memory.

    ``inputs``: texts (one document each), one text, or a LongTensor of token ids; documents
    longer than ``window`` (default min(context, 512)) are split into windows, each a fresh
    context. ``max_tokens`` stops after that many real tokens. ``hooks`` (site -> fn) are
    passed to :meth:`HookedModel.residual_stream` (e.g. to ablate a site). ``mask`` (with token
    ids) marks the real tokens of padded rows.

    Returns a long DataFrame with one row per ``(site, positions)``, ``positions`` in
    ``("rest", "first")``, columns: ``site, label, layer, sublayer, depth, positions,
    n_tokens`` (real tokens averaged), the mean per-token metrics :data:`NORM_METRICS`
    (``stream_norm, update_norm, relative_update, cos_update_stream, growth, block_influence,
    attn_share, effective_write, effective_relative, median_abs``), the massive-activation
    columns ``max_abs, max_abs_doc, max_abs_window, max_abs_position, max_abs_dim,
    max_abs_token_id, max_over_median`` (the location of the largest ``|h|``: document, window,
    position in the window, dimension and token there) and ``n_undefined`` (tokens with a zero
    denominator, see the module doc). ``attn_share`` of layer ``l`` is on both its rows.
    ``df.attrs`` holds ``model``, ``layout`` and ``notes``.
    """
    _check_model(model)
    S = model.n_sites
    G = len(POSITION_GROUPS)
    sums = {k: torch.zeros(S, G, dtype=torch.float64) for k in NORM_METRICS}
    counts = {k: torch.zeros(S, G, dtype=torch.float64) for k in NORM_METRICS}
    n_tok = torch.zeros(S, G, dtype=torch.float64)
    n_und = torch.zeros(S, G, dtype=torch.float64)
    best = torch.full((S, G), -1.0, dtype=torch.float64)
    loc = torch.full((S, G, 5), -1, dtype=torch.long)  # doc, window, position, dim, token id
    reader = None
    seen = 0
    it = _batches(model, inputs, batch_size, window, max_tokens, mask)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="norms", unit="batch")
    for batch in it:
        rs = _stream(model, batch, hooks)
        resid, real = rs.resid, rs.mask.to(rs.resid.device)
        if reader is None:
            reader = _readers(model, _sample(resid, real))
        m = _chunked_metrics(resid, reader)
        _check_finite(model, m["stream_norm"], real)
        rs.resid = None  # free the big tensor before the next forward
        del resid
        B, P = real.shape
        pos = torch.arange(P, device=real.device)
        groups = torch.stack([real & (pos >= 1), real & (pos == 0)], 0)  # [G, B, P]
        seen += int(real.sum())
        for k in NORM_METRICS:
            v = m[k]  # [S, B, P]
            ok = ~torch.isnan(v)
            for g in range(G):
                sel = ok & groups[g]
                sums[k][:, g] += torch.where(sel, v, torch.zeros_like(v)).sum((1, 2)).cpu()
                counts[k][:, g] += sel.sum((1, 2)).double().cpu()
        und = _undefined(m, reader)
        for g in range(G):
            n_tok[:, g] += float(groups[g].sum())
            n_und[:, g] += (und & groups[g]).sum((1, 2)).double().cpu()
            vals = torch.where(groups[g], m["max_abs"], torch.full_like(m["max_abs"], -1.0)).flatten(1)
            v, flat = vals.max(1)  # [S]
            better = v.cpu() > best[:, g]
            if bool(better.any()):
                b_i, p_i = flat // P, flat % P
                dims = m["max_abs_dim"].flatten(1).gather(1, flat[:, None])[:, 0]
                doc = torch.tensor(batch.doc_index, device=b_i.device)[b_i]
                win = torch.tensor(batch.window_index, device=b_i.device)[b_i]
                tok = rs.input_ids[b_i, p_i]
                new = torch.stack([doc, win, p_i, dims, tok.to(b_i.device)], 1).cpu()
                best[:, g] = torch.where(better, v.cpu(), best[:, g])
                loc[:, g] = torch.where(better[:, None], new, loc[:, g])
    if seen == 0:
        raise InputError("empty input: no real tokens to measure")

    frames = []
    sf = site_frame(range(S), model.n_layers)
    for g, name in enumerate(POSITION_GROUPS):
        f = sf.copy()
        f["positions"] = name
        f["n_tokens"] = n_tok[:, g].numpy().astype(np.int64)
        for k in NORM_METRICS:
            c = counts[k][:, g]
            f[k] = torch.where(c > 0, sums[k][:, g] / c.clamp_min(1), torch.tensor(float("nan"), dtype=torch.float64)).numpy()
        has = best[:, g] >= 0
        f["max_abs"] = torch.where(has, best[:, g], torch.tensor(float("nan"), dtype=torch.float64)).numpy()
        for j, col in enumerate(["max_abs_doc", "max_abs_window", "max_abs_position", "max_abs_dim", "max_abs_token_id"]):
            f[col] = loc[:, g, j].numpy()
        med, mx = f["median_abs"].to_numpy(float), f["max_abs"].to_numpy(float)
        f["max_over_median"] = np.where(med > 0, mx / np.where(med > 0, med, 1.0), np.nan)
        f["n_undefined"] = n_und[:, g].numpy().astype(np.int64)
        frames.append(f)
    df = pd.concat(frames, ignore_index=True)
    df.attrs.update(_attrs(model, reader))
    return df


def _attrs(model, reader) -> dict:
    return {
        "model": str(model.name),
        "layout": model.arch.layout,
        "notes": "; ".join(reader.notes) if reader is not None else "",
    }


def norms_by_position(
    model,
    inputs: Inputs,
    *,
    batch_size: int = 4,
    window: Optional[int] = None,
    max_tokens: Optional[int] = 4096,
    hooks=None,
    mask: Optional[torch.Tensor] = None,
) -> pd.DataFrame:
    """Per-token contribution metrics: one row per ``(sequence, position, site)``.

    Meant for prompts and short texts (heatmaps, the per-token identity); its size is
    ``tokens x sites`` rows, so ``max_tokens`` (default 4096; None for no limit) caps it.
    Columns: ``sequence`` (row in input order), ``doc, window, position, token_id, token``,
    the shared site columns, the per-token metrics (:data:`NORM_METRICS`), ``max_abs`` and
    ``max_abs_dim``. Undefined ratios are NaN (module doc).
    """
    _check_model(model)
    S = model.n_sites
    frames = []
    seq = 0
    reader = None
    sf = site_frame(range(S), model.n_layers)
    tok = model.tokenizer
    for batch in _batches(model, inputs, batch_size, window, max_tokens, mask):
        rs = _stream(model, batch, hooks)
        resid, real = rs.resid, rs.mask
        if reader is None:
            reader = _readers(model, _sample(resid, real.to(resid.device)))
        m = _chunked_metrics(resid, reader)
        _check_finite(model, m["stream_norm"], real)
        real = real.cpu()
        for b in range(real.shape[0]):
            n = int(real[b].sum())
            ids = rs.input_ids[b, :n].cpu()
            f = pd.DataFrame(
                {
                    "sequence": seq,
                    "doc": batch.doc_index[b],
                    "window": batch.window_index[b],
                    "position": np.tile(np.arange(n), S),
                    "token_id": np.tile(ids.numpy(), S),
                }
            )
            if tok is not None:
                strs = [tok.decode([int(t)]) for t in ids]
                f["token"] = np.tile(np.array(strs, dtype=object), S)
            for c in sf.columns:
                f[c] = np.repeat(sf[c].to_numpy(), n)
            for k in NORM_METRICS + ["max_abs", "max_abs_dim"]:
                f[k] = m[k][:, b, :n].cpu().numpy().reshape(-1)
            frames.append(f)
            seq += 1
    if not frames:
        raise InputError("empty input: no real tokens to measure")
    df = pd.concat(frames, ignore_index=True)
    first = ["sequence", "doc", "window", "position", "token_id"] + (["token"] if "token" in df else [])
    df = df[first + list(sf.columns) + [c for c in df.columns if c not in first and c not in sf.columns]]
    df.attrs.update(_attrs(model, reader))
    return df


# ----------------------------------------------------------------------------- summaries
def fit_growth_rate(df: pd.DataFrame, *, positions: str = "rest", column: str = "stream_norm") -> dict:
    """Fit ``log(stream_norm) = a + b * depth`` over the block outputs (``l.mlp`` sites).

    Returns ``{"rate": exp(b)`` (multiplicative growth per block), ``"intercept": exp(a)``,
    ``"r2"``, ``"n"}``. The embedding is left out (its scale is set by the embedding matrix,
    not by the blocks' writes). Works on :func:`contribution_norms` tables (and on any table
    with ``sublayer``, ``depth`` and ``column``).
    """
    d = df
    if "positions" in d.columns:
        d = d[d["positions"] == positions]
    d = d[(d["sublayer"] == "mlp") & (d[column] > 0)]
    if len(d) < 2:
        return {"rate": float("nan"), "intercept": float("nan"), "r2": float("nan"), "n": int(len(d))}
    x = d["depth"].to_numpy(float)
    y = np.log(d[column].to_numpy(float))
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else float("nan")
    return {"rate": float(np.exp(b)), "intercept": float(np.exp(a)), "r2": r2, "n": int(len(d))}


def norms_summary(df: pd.DataFrame) -> dict:
    """Headline numbers of a :func:`contribution_norms` table (for reports and the CLI).

    ``growth_rate`` (fitted per block, "rest" positions), ``growth_r2``, ``attn_share``
    (mean over layers of the per-layer mean attention share, "rest"), ``sink_ratio`` (median
    over block outputs of first-position stream norm / rest stream norm), ``final_stream_norm``
    (rest and first), and the largest massive activation (``massive_site``, ``massive_value``,
    ``massive_dim``, ``massive_position``, ``massive_positions`` group, ``massive_over_median``).
    """
    rest = df[df["positions"] == "rest"].set_index("site")
    first = df[df["positions"] == "first"].set_index("site")
    fit = fit_growth_rate(df)
    mlp = rest[rest["sublayer"] == "mlp"]
    out = {
        "growth_rate": fit["rate"],
        "growth_r2": fit["r2"],
        "attn_share": float(mlp["attn_share"].mean()),
        "final_stream_norm_rest": float(rest["stream_norm"].iloc[-1]),
        "final_stream_norm_first": float(first["stream_norm"].iloc[-1]) if len(first) else float("nan"),
    }
    if len(first) and first["n_tokens"].max() > 0:
        blocks = mlp.index
        ratio = first.loc[blocks, "stream_norm"] / rest.loc[blocks, "stream_norm"]
        out["sink_ratio"] = float(ratio.median())
        out["sink_ratio_max"] = float(ratio.max())
    else:
        out["sink_ratio"] = out["sink_ratio_max"] = float("nan")
    d = df.dropna(subset=["max_abs"])
    if len(d):
        top = d.loc[d["max_abs"].idxmax()]
        out.update(
            massive_site=str(top["label"]),
            massive_value=float(top["max_abs"]),
            massive_dim=int(top["max_abs_dim"]),
            massive_position=int(top["max_abs_position"]),
            massive_positions=str(top["positions"]),
            massive_over_median=float(top["max_over_median"]),
        )
        r = d[d["positions"] == "rest"]
        if len(r):
            top_r = r.loc[r["max_abs"].idxmax()]
            out.update(
                massive_rest_site=str(top_r["label"]),
                massive_rest_value=float(top_r["max_abs"]),
                massive_rest_dim=int(top_r["max_abs_dim"]),
                massive_rest_over_median=float(top_r["max_over_median"]),
            )
    return out


# ----------------------------------------------------------------------------- DLA
def _token_id(model, t, what: str) -> int:
    if isinstance(t, (int, np.integer)) or (isinstance(t, torch.Tensor) and t.numel() == 1):
        i = int(t)
        if not 0 <= i < model.vocab_size:
            raise InputError(f"{what} token id {i} out of range 0..{model.vocab_size - 1}")
        return i
    if not isinstance(t, str) or t == "":
        raise InputError(f"{what} must be a token id or a non-empty string, got {t!r}")
    if model.tokenizer is None:
        raise InputError(f"this model has no tokenizer: pass the {what} as a token id")
    ids = model.tokenizer(t, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [model.tokenizer.decode([i]) for i in ids]
        raise InputError(
            f"{what} {t!r} is {len(ids)} tokens {pieces}, not one; pass a single-token string "
            f"(mind the leading space, e.g. ' Paris') or a token id"
        )
    return int(ids[0])


def _per_example(model, tokens, n: int, what: str) -> Optional[list[int]]:
    if tokens is None:
        return None
    if isinstance(tokens, (str, int, np.integer)) or (isinstance(tokens, torch.Tensor) and tokens.numel() == 1):
        return [_token_id(model, tokens, what)] * n
    tokens = list(tokens)
    if len(tokens) != n:
        raise InputError(f"{len(tokens)} {what} tokens for {n} examples; give one, or one per example")
    return [_token_id(model, t, what) for t in tokens]


def direct_logit_attribution(
    model,
    inputs: Inputs,
    target_tokens=None,
    contrast_tokens=None,
    *,
    position: int = -1,
    batch_size: int = 8,
    check: bool = True,
    mask: Optional[torch.Tensor] = None,
) -> pd.DataFrame:
    """Direct logit attribution of every sublayer (and the embedding) to a target logit.

    ``inputs``: prompts (strings; each one example, not split into windows) or a LongTensor
    ``[n, pos]`` of token ids. ``target_tokens`` (and optional ``contrast_tokens``): one token
    (single-token string such as ``" Paris"`` or an id) for all examples or one per example;
    with a contrast the attributed quantity is ``logit[target] - logit[contrast]``.
    ``position``: the token whose next-token logit is explained, counted among real tokens
    (default -1, the last); ``mask`` marks the real tokens of padded (right-padded) id rows.

    The final stream is ``h = embed + sum_s u_s``; the final norm with its scale frozen at
    ``h`` is linear, so ``logit = sum_c w . centre(c) / sigma(h) + const`` with
    ``w = gain * W_U[:, target]`` (minus the contrast column), ``centre`` the identity for
    RMSNorm and mean-centring for LayerNorm, and ``const = W_U[:, t] . bias_norm + b_U[t]``.
    A ``logit_scale`` multiplies everything; soft-capped logits are refused (not linear).

    Returns one row per ``(example, site)`` plus one ``const`` row per example (``site=-1``,
    ``label="const"``, ``layer=-1``, ``sublayer="const"``, ``depth`` NaN), columns ``example,
    text, position, token, target, target_id, contrast, contrast_id`` + site columns +
    ``contribution`` (this part), ``logit`` (the model's own logit or logit difference). With
    ``check`` the sum of the parts must equal ``logit`` (relative 1e-4 of the scale of the
    parts), else a RuntimeError names the example.
    """
    _check_model(model)
    arch = model.arch
    if not model.is_decoder or arch.final_norm is None or arch.unembed is None:
        raise UnsupportedArchitecture(
            f"{model.name}: direct logit attribution needs a decoder whose logits are "
            f"unembed(final_norm(stream)); {arch.family} ({arch.layout}) is not"
        )
    if arch.softcap:
        raise UnsupportedArchitecture(
            f"{model.name} soft-caps its logits (tanh(x/{arch.softcap})*{arch.softcap}): logits are "
            f"not linear in the stream, so direct logit attribution does not decompose them"
        )
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, torch.Tensor):
        ids_all = inputs if inputs.dim() == 2 else inputs[None]
        if ids_all.numel() == 0:
            raise InputError("empty input: no tokens")
        texts = None
        n = ids_all.shape[0]
    else:
        texts = list(inputs)
        if not texts or any((not isinstance(t, str)) or t == "" for t in texts):
            raise InputError("empty input: give non-empty prompts")
        n = len(texts)
    targets = _per_example(model, target_tokens, n, "target")
    contrasts = _per_example(model, contrast_tokens, n, "contrast")
    params = _norm_params(model, arch.final_norm)
    W_U = model.W_U.detach()
    b_U = model.b_U
    scale = float(arch.logit_scale) if arch.logit_scale is not None else 1.0
    S = model.n_sites
    sf = site_frame(range(S), model.n_layers)
    rows = []
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        if texts is None:
            m = None if mask is None else mask.reshape(ids_all.shape)[start:stop]
            rs = model.residual_stream(ids_all[start:stop], mask=m)
        else:
            rs = model.residual_stream(texts[start:stop])
        lengths = rs.mask.sum(1)
        for j in range(stop - start):
            ex = start + j
            L = int(lengths[j])
            p = position if position >= 0 else L + position
            if not 0 <= p < L:
                raise InputError(f"position {position} outside example {ex}'s {L} tokens")
            h = rs.resid[:, j, p].double()  # [S, D] the stream after every site at this token
            comps = torch.cat([h[:1], h[1:] - h[:-1]], 0)  # embed, then every write
            final = h[-1]
            t = targets[ex] if targets is not None else int(rs.logits[j, p].argmax())
            c = contrasts[ex] if contrasts is not None else None
            wcol = W_U[:, t].double()
            if c is not None:
                wcol = wcol - W_U[:, c].double()
            w = params["gain"].to(wcol.device) * wcol
            if params["kind"] == "layer":
                fc = final - final.mean()
                comps = comps - comps.mean(-1, keepdim=True)
            else:
                fc = final
            sigma = torch.sqrt((fc * fc).mean() + params["eps"])
            contrib = (comps @ w) / sigma * scale
            const = 0.0
            if params["bias"] is not None:
                const += float(params["bias"].to(wcol.device) @ wcol)
            if b_U is not None:
                const += float(b_U[t]) - (float(b_U[c]) if c is not None else 0.0)
            const *= scale
            lg = rs.logits[j, p].double()
            logit = float(lg[t] - (lg[c] if c is not None else 0.0))
            if check:
                total = float(contrib.sum()) + const
                size = max(float(contrib.abs().sum()) + abs(const), abs(logit), 1e-6)
                if abs(total - logit) > 1e-4 * size:
                    raise RuntimeError(
                        f"direct logit attribution does not reproduce the model's logit for example {ex} "
                        f"(parts sum to {total:.6g}, model says {logit:.6g}): the final norm or the "
                        f"unembedding of {model.name} is not the plain RMSNorm/LayerNorm -> linear form"
                    )
            info = {
                "example": ex,
                "text": texts[ex] if texts is not None else None,
                "position": p,
                "token": model.tokenizer.decode([int(rs.input_ids[j, p])]) if model.tokenizer is not None else None,
                "target": model.tokenizer.decode([t]) if model.tokenizer is not None else str(t),
                "target_id": t,
                "contrast": (model.tokenizer.decode([c]) if model.tokenizer is not None else str(c)) if c is not None else None,
                "contrast_id": c if c is not None else -1,
                "logit": logit,
            }
            f = sf.copy()
            f["contribution"] = contrib.cpu().numpy()
            const_row = pd.DataFrame(
                {"site": [-1], "label": ["const"], "layer": [-1], "sublayer": ["const"], "depth": [float("nan")], "contribution": [const]}
            )
            f = pd.concat([f, const_row], ignore_index=True)
            for k, v in info.items():
                f[k] = v
            rows.append(f)
    df = pd.concat(rows, ignore_index=True)
    first = ["example", "text", "position", "token", "target", "target_id", "contrast", "contrast_id"]
    df = df[first + list(sf.columns) + ["contribution", "logit"]]
    df.attrs.update({"model": str(model.name), "what": "logit difference" if contrasts else "logit"})
    return df
