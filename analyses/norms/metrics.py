"""Per-token contribution metrics of a batch of residual streams (the core the norms analyses share).

:func:`token_metrics` turns ``resid [sites, batch, pos, d]`` into every per-token metric of
:data:`NORM_METRICS` (plus ``max_abs``/``max_abs_dim``) at once; :func:`readers` says which norm
next reads each site's write (for ``effective_write``), verified against the module. Definitions,
layouts and precision: :mod:`depthscope.analyses.norms`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthscope.hooks.unembed import NormParams

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
#: the range of each metric (its mean's 95% interval is cut to it)
METRIC_BOUNDS = {
    "stream_norm": (0.0, None),
    "update_norm": (0.0, None),
    "relative_update": (0.0, None),
    "cos_update_stream": (-1.0, 1.0),
    "growth": (0.0, None),
    "block_influence": (0.0, 2.0),
    "attn_share": (0.0, 1.0),
    "effective_write": (0.0, None),
    "effective_relative": (0.0, None),
    "median_abs": (0.0, None),
}


@dataclass
class Reader:
    """For every site s >= 1: which stream index the norm reading u_s sees, and that norm's params."""

    stream_index: torch.Tensor  # [S-1] long: index into resid of the stream the reading norm reads
    gain: torch.Tensor  # [S-1, D] float64
    centre: torch.Tensor  # [S-1] bool: LayerNorm (mean-centre) vs RMSNorm
    eps: torch.Tensor  # [S-1] float64
    valid: torch.Tensor  # [S-1] bool: False where no norm reads the write (post-norm) -> NaN
    notes: list


def readers(model, sample: torch.Tensor | None) -> Reader:
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
        return Reader(idx, gain, centre, eps, valid, notes)
    cache: dict[int, tuple[dict, str | None]] = {}
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
            params = NormParams.of(norm, model.d_model)
            problem = None
            if sample is not None:
                problem = params.mismatch(norm, sample[r].to(model.dtype), f"the norm reading site {model.labels[s]}")
            cache[key] = (params, problem)
        params, problem = cache[key]
        if problem is not None:
            if problem not in notes:
                notes.append(problem + "; effective_write is NaN there")
            continue
        idx[s - 1] = r
        gain[s - 1] = params.gain
        centre[s - 1] = params.kind == "layer"
        eps[s - 1] = params.eps
        valid[s - 1] = True
    if model.arch.layout == "parallel":
        notes.append(
            "parallel layout: l.attn = resid_pre + attn_out; its effective_write is measured by the "
            "norm that next reads it (next block's ln1 / the final norm, on the block output)"
        )
    return Reader(idx, gain, centre, eps, valid, notes)


def token_metrics(resid: torch.Tensor, reader: Reader) -> dict[str, torch.Tensor]:
    """Every per-token metric for every site at once: resid [S, b, P, D] -> dict of [S, b, P].

    Passes over the big tensor run in its own dtype (float32): the update ``u`` is materialised
    once (so small writes onto huge streams keep their precision), norms and dot products are
    reductions of it; everything after the reductions is float64 on [S, b, P] tensors, with
    ``block_influence`` from a cancellation-free form. Undefined ratios (zero denominators) are
    NaN and never divided.
    """
    h = resid if resid.dtype in (torch.float32, torch.float64) else resid.float()
    f64 = torch.float64
    hn = torch.linalg.vector_norm(h, dim=-1).to(f64)  # [S, b, P]
    absmax, argdim = _abs_max(h)
    # one scratch buffer of the stream's size, reused: |h| (median), then u, then gain * u, ...
    buf = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    torch.abs(h, out=buf)
    median = _lower_median(buf).to(f64)
    u = buf[:-1]
    torch.sub(h[1:], h[:-1], out=u)
    un = torch.linalg.vector_norm(u, dim=-1).to(f64)
    dot = torch.einsum("sbpd,sbpd->sbp", u, h[:-1]).to(f64)  # <u_s, h_{s-1}>
    prev, cur = hn[:-1], hn[1:]
    prev_ok = prev > 0
    rel = _ratio(un, prev, prev_ok)
    growth = _ratio(cur, prev, prev_ok)
    cos_u = _ratio(dot, un * prev, prev_ok & (un > 0)).clamp(-1, 1)
    bi = _block_influence(rel, growth, cos_u, prev_ok, cur > 0)
    # norm-aware effective write: ||g * c(u)|| / sigma(h_r) with h_r the stream the reader reads
    eff, eff_rel = _effective_write(h, u, hn, un, reader)
    return {
        "stream_norm": hn,
        "update_norm": _pad_embed(un),
        "relative_update": _pad_embed(rel),
        "cos_update_stream": _pad_embed(cos_u),
        "growth": _pad_embed(growth),
        "block_influence": _pad_embed(bi),
        "attn_share": _pad_embed(_attn_share(un)),
        "effective_write": _pad_embed(eff),
        "effective_relative": _pad_embed(eff_rel),
        "median_abs": median,
        "max_abs": absmax,
        "max_abs_dim": argdim,
    }


def _ratio(num: torch.Tensor, den: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``ok``, NaN elsewhere (a zero denominator is never divided by)."""
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=num.device)
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), nan)


def _pad_embed(x: torch.Tensor) -> torch.Tensor:
    """An update metric of sites 1.. with the embedding's row (NaN: it has no update) in front."""
    return torch.cat([torch.full_like(x[:1], float("nan")), x], 0)


def _abs_max(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest absolute coordinate of every stream (float64) and its dimension, from one max
    and one min pass (no ``|h|`` copy)."""
    vmax, imax = h.max(-1)
    vmin, imin = h.min(-1)
    neg = -vmin > vmax
    return torch.where(neg, -vmin, vmax).to(torch.float64), torch.where(neg, imin, imax)


def _block_influence(rel, growth, cos_u, prev_ok, cur_ok) -> torch.Tensor:
    """``1 - cos(a, b)`` with ``a = h_{s-1}``, ``b = a + u``, from the per-token ratios ``rel``
    (r = |u|/|a|), ``growth`` (g = |b|/|a|) and ``cos_u`` (c = cos(u, a)).

    The direct form (a.b)/(|a||b|) loses everything when |u| << |a|; ``r^2 (1 - c^2) / (g (g + 1
    + r c))`` equals it exactly and is used wherever a.b > 0 (then no cancellation); NaN where
    ``a`` or ``b`` is zero."""
    hh = prev_ok & cur_ok
    cos_u0 = torch.where(torch.isnan(cos_u), torch.zeros_like(cos_u), cos_u)
    rel0 = torch.where(prev_ok, rel, torch.zeros_like(rel))
    g0 = torch.where(prev_ok, growth, torch.ones_like(growth))
    ab = 1 + rel0 * cos_u0  # a.b / |a|^2
    stable = rel0 * rel0 * (1 - cos_u0 * cos_u0) / torch.where(hh & (ab > 0), g0 * (g0 + ab), torch.ones_like(g0))
    direct = 1 - ab / torch.where(hh, g0, torch.ones_like(g0))
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=rel.device)
    return torch.where(hh, torch.where(ab > 0, stable, direct), nan)


def _attn_share(un: torch.Tensor) -> torch.Tensor:
    """Per layer the attention write's share of the two writes' norms, on both its sites."""
    ua, um = un[0::2], un[1::2]  # attn sites 1, 3, ..; mlp sites 2, 4, ..  -> [L, b, P]
    tot = ua + um
    return _ratio(ua, tot, tot > 0).repeat_interleave(2, dim=0)


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


def chunked_metrics(resid: torch.Tensor, reader: Reader, max_elems: int = 48_000_000):
    """:func:`token_metrics` over chunks of batch rows, so the scratch buffer stays bounded."""
    S, B, P, D = resid.shape
    rows = max(1, max_elems // max(1, S * P * D))
    if rows >= B:
        return token_metrics(resid, reader)
    parts = [token_metrics(resid[:, i : i + rows], reader) for i in range(0, B, rows)]
    return {k: torch.cat([p[k] for p in parts], 1) for k in parts[0]}


def undefined_tokens(metrics: dict[str, torch.Tensor], reader: Reader) -> torch.Tensor:
    """[S, b, P] True where some defined-by-design update metric is NaN (zero denominators)."""
    und = torch.zeros_like(metrics["stream_norm"], dtype=torch.bool)
    for k in ("relative_update", "cos_update_stream", "growth", "block_influence", "attn_share"):
        und[1:] |= torch.isnan(metrics[k][1:])
    if bool(reader.valid.any()):
        und[1:] |= torch.isnan(metrics["effective_relative"][1:]) & reader.valid.to(und.device)[:, None, None]
    return und


def _effective_write(h: torch.Tensor, u: torch.Tensor, hn: torch.Tensor, un: torch.Tensor, reader: Reader):
    """``effective_write`` and ``effective_relative`` [S-1, b, P]: the update ``u`` (overwritten:
    scratch) as the norm that next reads it sees it, against the stream that norm reads."""
    S, D, dev, f64 = h.shape[0], h.shape[-1], h.device, torch.float64
    nan = torch.tensor(float("nan"), dtype=f64, device=dev)
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
        eff_rel = _ratio(gu, gh, v & (gh > 0))
    return eff, eff_rel
