"""Figures of SAE features per depth, drawn from :func:`~depthscope.analyses.features.probing.sparse_probing`'s
``by_k`` table, :func:`~depthscope.analyses.jobs.sae.sae_train_job`'s ``sae_training`` table and
:func:`~depthscope.analyses.jobs.transcoders.transcoders_train_job`'s ``transcoder_metrics`` table only.

=============================  ==============================================================
:func:`plot_sparse_probing`    accuracy of the k-feature probes against depth, one line per k,
                               the dense linear probe and the majority baseline beside them
:func:`plot_sae_training`      reconstruction (variance explained) and dead latents per step
:func:`plot_transcoder_metrics`
                               a transcoder set's core metrics per layer: variance explained
                               of the MLP output, CE loss score, L0 and dead latents
=============================  ==============================================================
"""

from __future__ import annotations

import pandas as pd

from depthscope.analyses.style import depth_axis, plt, savefig, sns
from depthscope.common.errors import InputError

__all__ = ["plot_sparse_probing", "plot_sae_training", "plot_transcoder_metrics"]


def plot_sparse_probing(by_k: pd.DataFrame, path, *, n_layers: int | None = None):
    """Accuracy against depth for each k (the k best features per tag), the dense probe (black)
    and the majority baseline (dotted)."""
    if by_k.empty:
        raise InputError("no sparse-probing rows to plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    ks = sorted(by_k["k"].unique())
    colours = sns.color_palette("viridis", len(ks))
    for k, colour in zip(ks, colours):
        d = by_k[by_k["k"] == k].sort_values("depth")
        ax.plot(d["depth"], d["accuracy"], marker="o", ms=4, color=colour, label=f"{k} feature{'s' if k > 1 else ''}")
    dense = by_k.drop_duplicates("depth").sort_values("depth")
    ax.plot(dense["depth"], dense["dense_accuracy"], marker="s", ms=4, color="black", label="dense linear probe")
    ax.axhline(float(by_k["majority"].iloc[0]), color="#777777", ls=":", lw=1, label="majority")
    task = by_k["task"].iloc[0] if "task" in by_k else ""
    ax.set_ylabel(f"{task} accuracy")
    ax.set_title("Sparse probing: the k best SAE features vs the whole stream")
    depth_axis(ax, n_layers)
    ax.legend(fontsize=8, frameon=False)
    savefig(fig, path)
    return path


def plot_sae_training(log: pd.DataFrame, path):
    """Variance explained (train batches) and the fraction of dead latents against the step."""
    if log.empty:
        raise InputError("no training log rows to plot")
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(log["step"], log["variance_explained"], color="#3b4cc0")
    a.set_xlabel("step")
    a.set_ylabel("variance explained (batch)")
    b.plot(log["step"], log["dead_fraction"], color="#b40426")
    b.set_xlabel("step")
    b.set_ylabel("dead latents (fraction)")
    fig.tight_layout()
    savefig(fig, path)
    return path


def plot_transcoder_metrics(table: pd.DataFrame, path):
    """Per layer: variance explained of the MLP output and the CE loss score (against zero
    ablation; 1 = splicing costs nothing), then L0 and the fraction of dead latents."""
    if table.empty:
        raise InputError("no transcoder metrics rows to plot")
    d = table.sort_values("layer")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(d["layer"], d["variance_explained"], marker="o", ms=4, color="#3b4cc0", label="variance explained")
    a.plot(d["layer"], d["ce_loss_score"], marker="s", ms=4, color="#b40426", label="CE loss score")
    a.axhline(1.0, color="#777777", ls=":", lw=1)
    a.set_xlabel("layer")
    a.set_ylabel("score")
    a.legend(fontsize=8, frameon=False)
    b.plot(d["layer"], d["l0"], marker="o", ms=4, color="#2a9d8f", label="L0 (active latents)")
    b.set_xlabel("layer")
    b.set_ylabel("L0 (active latents per token)", color="#2a9d8f")
    b.set_ylim(0, max(1.0, float(d["l0"].max())) * 1.15)  # TopK: a flat line at k, from zero
    dead = b.twinx()
    dead.plot(d["layer"], d["dead_fraction"], ls="--", color="#777777", label="dead latents")
    dead.set_ylim(0, 1)
    dead.set_ylabel("dead latents (fraction)", color="#777777")
    fig.suptitle("Transcoders per layer (MLP input -> MLP output)", fontsize=10)
    fig.tight_layout()
    savefig(fig, path)
    return path
