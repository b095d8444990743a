"""Contribution norms per token: one row per (sequence, position, site), for prompts and short texts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.norms.metrics import NORM_METRICS, chunked_metrics, readers
from depthscope.analyses.norms.streaming import (
    Inputs,
    check_has_blocks,
    check_norms_finite,
    norm_batches,
    norm_sample,
    stream_batches,
    table_attrs,
)
from depthscope.common.errors import InputError
from depthscope.hooks.sites import site_frame


def norms_by_position(
    model,
    inputs: Inputs,
    *,
    batch_size: int = 4,
    window: int | None = None,
    max_tokens: int | None = 4096,
    hooks=None,
    mask: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Per-token contribution metrics: one row per ``(sequence, position, site)``.

    Meant for prompts and short texts (heatmaps, the per-token identity); its size is
    ``tokens x sites`` rows, so ``max_tokens`` (default 4096; None for no limit) caps it.
    Columns: ``sequence`` (row in input order), ``doc, window, position, token_id, token``,
    the shared site columns, the per-token metrics (:data:`NORM_METRICS`), ``max_abs`` and
    ``max_abs_dim``. Undefined ratios are NaN (module doc).
    """
    check_has_blocks(model)
    sf = site_frame(range(model.n_sites), model.n_layers)
    frames = []
    reader = None
    for batch, rs in stream_batches(model, norm_batches(model, inputs, batch_size, window, max_tokens, mask), hooks):
        if reader is None:  # which norm reads each write: found (and verified) on the first batch
            reader = readers(model, norm_sample(rs.resid, rs.mask.to(rs.resid.device)))
        m = chunked_metrics(rs.resid, reader)
        check_norms_finite(model, m["stream_norm"], rs.mask)
        for b in range(rs.mask.shape[0]):
            frames.append(_sequence_frame(model.tokenizer, sf, m, batch, rs, b, len(frames)))
    if not frames:
        raise InputError("empty input: no real tokens to measure")
    df = _site_columns_after_token(pd.concat(frames, ignore_index=True), sf)
    df.attrs.update(table_attrs(model, reader))
    return df


def _sequence_frame(tok, sf: pd.DataFrame, m: dict, batch, rs, b: int, seq: int) -> pd.DataFrame:
    """The rows of batch row ``b`` (sequence number ``seq``): its real positions x all sites,
    site-major, with the token and every per-token metric of ``m``."""
    S = len(sf)
    n = int(rs.mask[b].cpu().sum())
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
    return f


def _site_columns_after_token(df: pd.DataFrame, sf: pd.DataFrame) -> pd.DataFrame:
    """Columns in table order: sequence and token columns, the site columns, then the metrics."""
    first = ["sequence", "doc", "window", "position", "token_id"] + (["token"] if "token" in df else [])
    return df[first + list(sf.columns) + [c for c in df.columns if c not in first and c not in sf.columns]]
