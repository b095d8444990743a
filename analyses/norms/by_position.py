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
    stream_batch,
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
    S = model.n_sites
    frames = []
    seq = 0
    reader = None
    sf = site_frame(range(S), model.n_layers)
    tok = model.tokenizer
    for batch in norm_batches(model, inputs, batch_size, window, max_tokens, mask):
        rs = stream_batch(model, batch, hooks)
        resid, real = rs.resid, rs.mask
        if reader is None:
            reader = readers(model, norm_sample(resid, real.to(resid.device)))
        m = chunked_metrics(resid, reader)
        check_norms_finite(model, m["stream_norm"], real)
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
    df.attrs.update(table_attrs(model, reader))
    return df
