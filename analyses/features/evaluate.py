"""An SAE (or transcoder) evaluated on held-out text: how well it reconstructs its point, how sparse
it is, and what splicing it into the forward pass costs the model.

=========================  ==================================================================
offers                     what
=========================  ==================================================================
:func:`evaluate_sae`       ``(model, sae, texts)`` -> one row: the point's site columns,
                           ``variance_explained``, ``l0``, ``dead_fraction``, ``loss_clean``,
                           ``loss_spliced``, ``loss_zero``, ``loss_mean``, ``ce_loss_score``,
                           ``ce_loss_score_mean``, ``kl``, ``eval_tokens``
:func:`point_columns`      the shared site columns of a hook point
=========================  ==================================================================

The text is read as every free-text analysis reads it (:func:`~depthscope.analyses.text.text_rows`
under a :class:`~depthscope.analyses.text_settings.TextWindows`, counting predicted tokens), so
``loss_clean`` is the clean loss of the causal test and of ``layers`` on the same text. Every
number is over the same positions: every position of each window but its first (the BOS token,
the attention sink, whose activations are outliers by orders of magnitude), and a window's
tokens that an overlapping earlier window already held. At those positions:

* ``variance_explained`` = ``1 - sum |y - y_hat|^2 / sum |y - mean(y)|^2``, ``y`` the tensor at
  the point the SAE writes (its own point; a transcoder's output), ``y_hat`` its reconstruction;
* ``l0``: active latents per position; ``dead_fraction``: latents that never fire on the text;
* next-token losses (nats, token-weighted means over the predicted tokens): ``loss_clean`` (the
  model as it is), ``loss_spliced`` (the reconstruction in place of the point), ``loss_zero`` (the
  point zeroed), ``loss_mean`` (the point replaced by its mean over these positions);
* ``ce_loss_score = (loss_zero - loss_spliced) / (loss_zero - loss_clean)``, SAELens's "CE loss
  score" (1: splicing costs nothing; 0: as bad as zero ablation); ``ce_loss_score_mean`` the same
  against mean ablation; NaN when ablating costs nothing;
* ``kl``: the mean over the predicted tokens of KL(clean || spliced) of the next-token
  distributions (nats).

The first position of every window is left as the model computes it in every variant. The SAE is
spliced with :meth:`~depthscope.hooks.model.HookedModel.run`'s ``saes=``, so it is checked
against the point as any splice is (:mod:`depthscope.hooks.sae_splice`: a width mismatch is an
error naming the SAE and the point; an SAE recorded for another hook is logged as a warning).
Forward passes: four per batch of windows (clean with the SAE's features and error read,
spliced, zero-ablated, mean-ablated); memory: two batches of logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.next_token import next_token_nll
from depthscope.analyses.text import TextRows, TokenBatch, pad_id, text_rows
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.points import Point
from depthscope.hooks.sae import SAE
from depthscope.hooks.sae_splice import plan_splices
from depthscope.hooks.sites import parse_site, site_from_index

#: the residual-site kinds of hook points (their site columns are a site's)
_RESID_KINDS = ("embed", "attn", "mlp")
LOSSES = ("clean", "spliced", "zero", "mean")


def point_columns(model, point: Point) -> dict:
    """The shared site columns of ``point``: a residual site's, else its name (``label``), layer
    and kind (``sublayer``) with ``site`` and ``depth`` None."""
    if point.kind in _RESID_KINDS:
        s = site_from_index(parse_site(point.name, model.n_layers), model.n_layers)
        return {"site": s.index, "label": s.label, "layer": s.layer, "sublayer": s.sublayer, "depth": s.depth}
    return {"site": None, "label": point.name, "layer": point.layer, "sublayer": point.kind, "depth": None}


class _Sums:
    """Running sums over the evaluated positions: the point's values and squares, the
    reconstruction error, active latents, which latents fired, losses and KL."""

    def __init__(self, d_sae: int):
        self.s1: torch.Tensor | None = None
        self.s2 = self.err = self.l0 = self.kl = 0.0
        self.n = self.n_pred = 0
        self.fired = torch.zeros(d_sae, dtype=torch.bool)
        self.nll = dict.fromkeys(LOSSES, 0.0)

    def add_point(self, y: torch.Tensor, error: torch.Tensor, feats: torch.Tensor, at: torch.Tensor) -> None:
        """``y``, ``error`` ``[batch, pos, ...]`` and ``feats`` ``[batch, pos, d_sae]`` at the positions ``at``."""
        yv = y[at].flatten(1).double().cpu()
        self.s1 = yv.sum(0) if self.s1 is None else self.s1 + yv.sum(0)
        self.s2 += float(yv.pow(2).sum())
        self.err += float(error[at].flatten(1).double().pow(2).sum())
        active = feats[at] > 0
        self.l0 += float(active.sum())
        self.fired |= active.any(0).cpu()
        self.n += int(at.sum())

    def mean(self, like: torch.Tensor) -> torch.Tensor:
        """The point's mean over the positions seen, shaped as one position of ``like``."""
        return (self.s1 / max(self.n, 1)).reshape(like.shape[2:])


def _keep_first(t: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` with every position but the first set to ``value`` (None: zero)."""
    out = torch.zeros_like(t) if value is None else value.to(t.dtype).expand_as(t).clone()
    out[:, :1] = t[:, :1]
    return out


def _nll(sums: _Sums, name: str, logits: torch.Tensor, b: TokenBatch) -> torch.Tensor:
    """Add the summed next-token loss of ``logits`` to ``sums.nll[name]``; returns the scored mask."""
    nll, scored = next_token_nll(logits, b.ids, b.mask, b.first_tensor())
    sums.nll[name] += float(nll.double().sum())
    return scored


def _kl(clean: torch.Tensor, spliced: torch.Tensor, scored: torch.Tensor) -> float:
    """Summed KL(clean || spliced) of the next-token distributions at the ``scored`` positions."""
    p = torch.log_softmax(clean[:, :-1][scored].float(), -1)
    q = torch.log_softmax(spliced[:, :-1][scored].float(), -1)
    return float((p.exp() * (p - q)).sum(-1).double().sum())


@torch.no_grad()
def evaluate_sae(
    model,
    sae: SAE,
    texts: Sequence[str] | str | TextRows,
    *,
    point: str | None = None,
    text: TextWindows | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> pd.DataFrame:
    """``sae`` (any loaded SAE or transcoder, :func:`~depthscope.hooks.sae.load_sae`) at ``point``
    (None: the hook it records) of ``model`` (a decoder HookedModel) on ``texts`` (documents read
    under ``text``, None: the defaults; or rows from :func:`~depthscope.analyses.text.text_rows`
    with ``skip=1``): one row with the metrics of the module docstring."""
    if not model.is_decoder or not model.unembed.decodes_stream:
        raise InputError(f"evaluating an SAE scores next-token predictions: {model.name} is not a decoder LM")
    if not isinstance(sae, SAE):
        raise InputError(f"not an SAE (load one with depthscope.hooks.load_sae): {sae!r}")
    key = "auto" if point is None else point
    splice = plan_splices({key: sae}, model.n_layers)[0]
    rows = texts if isinstance(texts, TextRows) else text_rows(model, texts, text, skip=1)
    batches = list(rows.batches(batch_size, pad_id(model)))
    sums, mean_like = _Sums(sae.d_sae), None
    cache = [f"{splice.prefix}.sae.features", f"{splice.prefix}.sae.error", splice.write.name]
    with progress_bar(len(batches) * len(LOSSES), desc="SAE evaluation", unit="fwd", enabled=progress) as bar:
        for b in batches:
            ids, mask = b.ids.to(model.device), b.mask.to(model.device)
            r = model.run(ids, mask=mask, saes={splice.prefix: sae}, cache=cache)
            at = b.counted.to(r.logits.device)
            sums.add_point(r[splice.write.name], r[cache[1]], r[cache[0]], at)
            mean_like = r[splice.write.name][:1, :1]
            scored = _nll(sums, "clean", r.logits, b)
            keep = {cache[1]: lambda e, ctx: _keep_first(e)}  # the error zeroed: the reconstruction alone
            spliced = model.run(ids, mask=mask, saes={splice.prefix: sae}, hooks=keep).logits
            _nll(sums, "spliced", spliced, b)
            sums.kl += _kl(r.logits, spliced, scored)
            sums.n_pred += int(scored.sum())
            del r, spliced
            zero = {splice.write.name: lambda t, ctx: _keep_first(t)}
            _nll(sums, "zero", model.run(ids, mask=mask, hooks=zero).logits, b)
            bar.update(3)
        mean = sums.mean(mean_like)
        for b in batches:  # the mean is known once every batch has been read
            ids, mask = b.ids.to(model.device), b.mask.to(model.device)
            ablate = {splice.write.name: lambda t, ctx: _keep_first(t, mean.to(t.device))}
            _nll(sums, "mean", model.run(ids, mask=mask, hooks=ablate).logits, b)
            bar.update(1)
    return pd.DataFrame([{**point_columns(model, splice.read), "point": splice.read.name, **_metrics(sums, rows)}])


def _metrics(sums: _Sums, rows: TextRows) -> dict:
    """The table's numbers from the sums (module docstring)."""
    n = max(sums.n, 1)
    total = sums.s2 - float(sums.s1.pow(2).sum()) / n
    loss = {k: v / max(sums.n_pred, 1) for k, v in sums.nll.items()}
    gap, gap_mean = loss["zero"] - loss["clean"], loss["mean"] - loss["clean"]
    return {
        "variance_explained": 1 - sums.err / total if total > 0 else np.nan,
        "l0": sums.l0 / n,
        "dead_fraction": float((~sums.fired).double().mean()),
        **{f"loss_{k}": v for k, v in loss.items()},
        "ce_loss_score": (loss["zero"] - loss["spliced"]) / gap if gap else np.nan,
        "ce_loss_score_mean": (loss["mean"] - loss["spliced"]) / gap_mean if gap_mean else np.nan,
        "kl": sums.kl / max(sums.n_pred, 1),
        "eval_tokens": sums.n_pred,
        "n_docs": int(len(set(rows.doc.tolist()))),
    }
