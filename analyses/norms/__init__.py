"""The norms room. Contribution norms: how much each sublayer writes into the residual stream,
relative to it. One file per analysis:

=====================  ========================================================================
``contribution.py``    :func:`contribution_norms`: per-site means over a dataset
``by_position.py``     :func:`norms_by_position`: per token, for prompts and short texts
``growth.py``          :func:`fit_growth_rate`, :func:`norms_summary`: headline numbers
``dla.py``             :func:`direct_logit_attribution`: the logit split into sublayer parts
``metrics.py``         the per-token metrics they share (:data:`NORM_METRICS`)
``streaming.py``       batching, capture and the finiteness check they share
``heads.py``           :func:`head_write_norms`, :func:`norm_weighted_attention`: per head
``config.py``          :class:`NormsConfig` (``depthscope norms``)
``plots.py``           the norms figures, drawn from the tables
=====================  ========================================================================

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

Intervals. Beside each mean, ``<metric>_se``, ``<metric>_lo`` and ``<metric>_hi`` give its
standard error and 95% interval with the documents as clusters (the tokens of one text are
correlated; a single document's windows are the clusters instead), from per-window sums
gathered in the same pass (:mod:`depthscope.analyses.intervals`).

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
:mod:`depthscope.analyses.norms.heads`; figures in :mod:`depthscope.analyses.norms.plots`.

Precision. Passes over the ``[sites, batch, pos, d_model]`` tensor run in float32 (the model's
own precision); the update is materialised once per batch, and every ratio is formed in float64
from the per-token reductions. Against a float64 recomputation from the same activations
(tests/test_norms.py) norms and ratios agree to ~5e-7 relative, cosines and ``block_influence``
to ~3e-6 absolute; ``block_influence`` uses a cancellation-free form, so at the sink position
(where it is 1e-8..1e-4 in late blocks) it stays within ~3e-5 relative.
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "contribution_norms": "contribution",
    "norms_by_position": "by_position",
    "direct_logit_attribution": "dla",
    "fit_growth_rate": "growth",
    "norms_summary": "growth",
    "NORM_METRICS": "metrics",
    "POSITION_GROUPS": "metrics",
    "head_write_norms": "heads",
    "norm_weighted_attention": "heads",
    "NormsConfig": "config",
    "plot_stream_growth": "plots",
    "plot_update_norms": "plots",
    "plot_relative_update": "plots",
    "plot_position_heatmap": "plots",
    "plot_dla": "plots",
    "plot_head_writes": "plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
