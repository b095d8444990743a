"""The figure of :func:`depthscope.analyses.causal.erasure.layers.layer_interventions`, drawn from its table only.

=========================  ====================================================================
:func:`plot_layers`        two panels against the intervened block: next-token cross-entropy
                           (skip, swap; the unmodified model as a line) and top-1 agreement with
                           the unmodified model
=========================  ====================================================================
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from depthscope.analyses.style import plt, savefig
from depthscope.common.errors import InputError

__all__ = ["plot_layers"]

STYLE = {
    "skip": dict(color="#1f77b4", marker="o", label="skip block l (identity)"),
    "swap": dict(color="#d62728", marker="^", label="swap blocks l, l+1"),
}


def plot_layers(df: pd.DataFrame, path: str | Path, *, title: str | None = None) -> Path:
    """Cross-entropy and top-1 agreement per block for each intervention of ``df`` (a
    :func:`~depthscope.analyses.causal.erasure.layers.layer_interventions` table), saved to ``path``."""
    need = {"layer", "intervention", "cross_entropy", "top1_agreement"}
    if not need <= set(df.columns):
        raise InputError(f"a layer-interventions table needs the columns {sorted(need)}")
    fig, (ax_ce, ax_agree) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, style in STYLE.items():
        part = df[df["intervention"] == kind].sort_values("layer")
        if len(part):
            ax_ce.plot(part["layer"], part["cross_entropy"], lw=1.2, ms=4, **style)
            ax_agree.plot(part["layer"], part["top1_agreement"], lw=1.2, ms=4, **style)
    base = df[df["intervention"] == "none"]
    if len(base):
        ax_ce.axhline(float(base["cross_entropy"].iloc[0]), color="#333333", ls="--", lw=1, label="unmodified")
    ax_ce.set_ylabel("next-token cross-entropy (nats)")
    ax_agree.set_ylabel("top-1 agreement with the unmodified model")
    ax_agree.set_ylim(0, 1.02)
    for ax in (ax_ce, ax_agree):
        ax.set_xlabel("block l")
    ax_ce.legend(frameon=False, fontsize=8)
    fig.suptitle(title or "blocks skipped and swapped")
    fig.tight_layout()
    savefig(fig, path)
    return Path(path)
