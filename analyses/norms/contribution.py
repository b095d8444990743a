"""Contribution norms over a dataset: per site, the mean per-token metrics in bounded memory."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.intervals import ClusterSums, add_notes, cluster_provenance, interval_columns, pick_clusters
from depthscope.analyses.norms.metrics import (
    METRIC_BOUNDS,
    NORM_METRICS,
    POSITION_GROUPS,
    chunked_metrics,
    readers,
    undefined_tokens,
)
from depthscope.analyses.norms.streaming import (
    Inputs,
    check_has_blocks,
    check_norms_finite,
    norm_batches,
    norm_sample,
    stream_batches,
    table_attrs,
    text_settings,
    window_keywords,
)
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.sites import site_frame


def contribution_norms(
    model,
    inputs: Inputs,
    *,
    batch_size: int = 4,
    hooks=None,
    progress: bool = False,
    mask: torch.Tensor | None = None,
    text: TextWindows | None = None,
    **window_and_cap,
) -> pd.DataFrame:
    """Per-site contribution norms over a dataset, streamed in bounded memory.

    ``inputs``: texts (one document each), one text, or a LongTensor of token ids (``mask``: the
    real ones). Documents are read under ``text`` (a :class:`~depthscope.analyses.text_settings.
    TextWindows`; None: the defaults every free-text analysis shares: the BOS token prepended to
    every window, documents longer than ``window`` split into windows, each a fresh context);
    ``window`` and ``max_tokens`` (at most that many tokens read, cut inside a document) may be
    given as keywords. ``hooks`` (site -> fn) go to :meth:`HookedModel.residual_stream`.

    Returns a long DataFrame with one row per ``(site, positions)``, ``positions`` in
    ``("rest", "first")``, columns: ``site, label, layer, sublayer, depth, positions,
    n_tokens`` (real tokens averaged), the mean per-token metrics :data:`NORM_METRICS`
    (``stream_norm, update_norm, relative_update, cos_update_stream, growth, block_influence,
    attn_share, effective_write, effective_relative, median_abs``), the massive-activation
    columns ``max_abs, max_abs_doc, max_abs_window, max_abs_position, max_abs_dim,
    max_abs_token_id, max_over_median`` (the location of the largest ``|h|``: document, window,
    position in the window, dimension and token there), ``n_undefined`` (tokens with a zero
    denominator, see the module doc), ``n_docs`` and ``n_windows`` (documents and windows
    read), and for every metric of :data:`NORM_METRICS` ``<metric>_se`` (the standard error of
    its mean, clustered by document), ``<metric>_lo`` and ``<metric>_hi`` (the 95% interval,
    Student t over the documents, or over the windows of a single document, cut to the metric's
    range; NaN below 10 clusters, the notes say why; :mod:`depthscope.analyses.intervals`), and
    ``ci_n``, ``ci_unit``, ``ci_method``: the clusters and the method of every metric's interval.
    ``attn_share`` of layer ``l`` is on both its rows.
    ``df.attrs`` holds ``model``, ``layout`` and ``notes``.
    """
    check_has_blocks(model)
    window, max_tokens = window_keywords(window_and_cap)
    text = text_settings(inputs, text)
    bar = progress_bar(max_tokens or (text.max_tokens if text else None), desc="norms", unit="tok", enabled=progress)
    batches = norm_batches(model, inputs, batch_size, window, max_tokens, mask, text=text)
    totals, reader = _accumulate(model, batches, hooks, bar, progress)
    bar.close()
    if totals.seen == 0:
        raise InputError("empty input: no real tokens to measure")
    df = totals.frame(model)
    df.attrs.update(table_attrs(model, reader))
    add_notes(df, totals.notes)
    return df


def _accumulate(model, batches, hooks, bar, progress: bool = False) -> tuple[_Totals, object]:
    """One forward per batch, its metrics added to the running totals (the per-site readers made
    from the first batch); ``(totals, readers)``."""
    totals, reader = _Totals(model.n_sites), None
    for batch, rs in stream_batches(model, batches, hooks, progress=progress):
        resid, real = rs.resid, batch.counted.to(rs.resid.device)  # the positions that count
        bar.update(int(real.sum()))
        if reader is None:
            reader = readers(model, norm_sample(resid, real))
        m = chunked_metrics(resid, reader)
        check_norms_finite(model, m["stream_norm"], real)
        rs.resid = None  # free the big tensor before the next forward
        del resid
        totals.add(m, undefined_tokens(m, reader), real, batch, rs.input_ids)
    return totals, reader


class _Totals:
    """Running sums per (site, position group) over batches, and the table they make."""

    def __init__(self, S: int):
        G = len(POSITION_GROUPS)
        self.sums = {k: torch.zeros(S, G, dtype=torch.float64) for k in NORM_METRICS}
        self.counts = {k: torch.zeros(S, G, dtype=torch.float64) for k in NORM_METRICS}
        self.n_tok = torch.zeros(S, G, dtype=torch.float64)
        self.n_und = torch.zeros(S, G, dtype=torch.float64)
        self.best = torch.full((S, G), -1.0, dtype=torch.float64)
        self.loc = torch.full((S, G, 5), -1, dtype=torch.long)  # doc, window, position, dim, token id
        self.seen = 0
        # per window and per document: sums and counts for the intervals
        self.docs, self.windows = ClusterSums(), ClusterSums()
        self.notes: list[str] = []

    def add(self, m: dict, und: torch.Tensor, real: torch.Tensor, batch, input_ids: torch.Tensor) -> None:
        """One batch's per-token metrics ``m`` ([S, B, P] each), undefined-token flags and real-token mask."""
        B, P = real.shape
        pos = torch.arange(P, device=real.device)
        groups = torch.stack([real & (pos >= 1), real & (pos == 0)], 0)  # [G, B, P]
        self.seen += int(real.sum())
        rows = {}
        for k in NORM_METRICS:
            v = m[k]  # [S, B, P]
            ok = ~torch.isnan(v)
            # per batch row (window), then summed over rows: [S, G, B]
            sums = torch.stack([torch.where(ok & gr, v, 0.0).sum(2) for gr in groups], 1).cpu()
            counts = torch.stack([(ok & gr).sum(2) for gr in groups], 1).double().cpu()
            self.sums[k] += sums.sum(2)
            self.counts[k] += counts.sum(2)
            rows[k] = (sums.permute(2, 0, 1).numpy(), counts.permute(2, 0, 1).numpy())  # [B, S, G]
        keep = [b for b in range(B) if bool(real[b].any())]
        if len(keep) < B:
            rows = {k: (s[keep], n[keep]) for k, (s, n) in rows.items()}
        self.windows.add([(batch.doc_index[b], batch.window_index[b]) for b in keep], rows)
        self.docs.add([batch.doc_index[b] for b in keep], rows)
        for g in range(len(POSITION_GROUPS)):
            self.n_tok[:, g] += float(groups[g].sum())
            self.n_und[:, g] += (und & groups[g]).sum((1, 2)).double().cpu()
            vals = torch.where(groups[g], m["max_abs"], torch.full_like(m["max_abs"], -1.0)).flatten(1)
            v, flat = vals.max(1)  # [S]
            better = v.cpu() > self.best[:, g]
            if bool(better.any()):
                b_i, p_i = flat // P, flat % P
                dims = m["max_abs_dim"].flatten(1).gather(1, flat[:, None])[:, 0]
                doc = torch.tensor(batch.doc_index, device=b_i.device)[b_i]
                win = torch.tensor(batch.window_index, device=b_i.device)[b_i]
                tok = input_ids[b_i, p_i]
                new = torch.stack([doc, win, p_i, dims, tok.to(b_i.device)], 1).cpu()
                self.best[:, g] = torch.where(better, v.cpu(), self.best[:, g])
                self.loc[:, g] = torch.where(better[:, None], new, self.loc[:, g])

    def frame(self, model) -> pd.DataFrame:
        """The table: per position group and site the means, the largest activation and its
        location, the undefined-token count, and each mean's interval."""
        frames = []
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        sf = site_frame(range(model.n_sites), model.n_layers)
        for g, name in enumerate(POSITION_GROUPS):
            f = sf.copy()
            f["positions"] = name
            f["n_tokens"] = self.n_tok[:, g].numpy().astype(np.int64)
            for k in NORM_METRICS:
                c = self.counts[k][:, g]
                f[k] = torch.where(c > 0, self.sums[k][:, g] / c.clamp_min(1), nan).numpy()
            has = self.best[:, g] >= 0
            f["max_abs"] = torch.where(has, self.best[:, g], nan).numpy()
            for j, col in enumerate(
                ["max_abs_doc", "max_abs_window", "max_abs_position", "max_abs_dim", "max_abs_token_id"]
            ):
                f[col] = self.loc[:, g, j].numpy()
            med, mx = f["median_abs"].to_numpy(float), f["max_abs"].to_numpy(float)
            f["max_over_median"] = np.where(med > 0, mx / np.where(med > 0, med, 1.0), np.nan)
            f["n_undefined"] = self.n_und[:, g].numpy().astype(np.int64)
            frames.append(f)
        df = pd.concat(frames, ignore_index=True)
        return pd.concat([df, self.intervals(df)], axis=1)

    def intervals(self, df: pd.DataFrame) -> pd.DataFrame:
        """``n_docs``, ``n_windows`` and per metric ``_se``, ``_lo``, ``_hi`` for the rows of ``df``
        (site-major within each position group, as :meth:`frame` lays them out)."""
        clusters = pick_clusters(self.docs, self.windows)
        extra = {"n_docs": self.docs.n_clusters, "n_windows": self.windows.n_clusters}
        ci, self.notes = cluster_provenance(
            self.docs, self.windows, "the intervals of the means (<metric>_lo, <metric>_hi)"
        )
        for k in NORM_METRICS:
            se, g = clusters.se(k)  # [S, G]
            se, g = se.T.reshape(-1), g.T.reshape(-1)  # group-major, as the rows
            for suffix, col in interval_columns(df[k].to_numpy(float), se, g, METRIC_BOUNDS[k]).items():
                extra[f"{k}_{suffix}"] = col
        return pd.DataFrame({**extra, **ci}, index=df.index)
