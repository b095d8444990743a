"""Headline numbers of a contribution-norms table: the stream's growth rate per block and a summary."""

from __future__ import annotations

import numpy as np
import pandas as pd


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
