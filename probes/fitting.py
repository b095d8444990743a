"""Fitting one task's probes: per-site probes with control heads, cumulative mixes, MDL.

=======================================  =======================================================
``fit_task(td, frame, n_layers, config,  the task's ``by_site`` rows, its summary row and its
pooling=, resident_bytes=, progress=)``  ``mixing`` rows (None without cumulative scoring)
``fit_sites(td, config, progress=)``     per-site probes: the task's labels and its control
                                         labels as heads of one batched fit (x the L2 grid with
                                         ``l2="dev"``), scored on test: a :class:`SiteFit`
``pick_l2(acc_dev)``                     per site, the grid column with the best dev accuracy
``train_kwargs(config)``                 the training settings the building blocks take
=======================================  =======================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .classifiers import BatchedProbe
from .config import L2_GRID, ProbeConfig
from .encoding import TaskData
from .metrics import accuracy, macro_f1
from .mixing import fit_cumulative
from .summaries import cumulative_summary, mixing_rows, site_rows, summary_row
from .training import predict, train_probe


def train_kwargs(cfg: ProbeConfig) -> dict:
    """The settings ``train_probe``-based building blocks take, from ``cfg``."""
    return dict(epochs=cfg.epochs, min_steps=cfg.min_steps, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed)


def pick_l2(acc_dev: torch.Tensor) -> torch.Tensor:
    """Per site, the L2 strength (column of ``acc_dev [S, len(L2_GRID)]``, grid ascending)
    with the best dev accuracy; ties go to the strongest L2, the simplest probe."""
    n = acc_dev.shape[1]
    return (n - 1) - acc_dev.flip(1).argmax(1)


@dataclass
class SiteFit:
    """Per-site predictions of the chosen heads: test ``[S, N]``, train ``[S, N]``, control
    test ``[S, N]`` (None without control) and the L2 each site's real head used ``[S]``."""

    test: torch.Tensor
    train: torch.Tensor
    control_test: torch.Tensor | None
    l2: np.ndarray


def _pick(pred_dev, y_dev, offset: int, nl: int) -> torch.Tensor:
    acc = torch.stack([accuracy(pred_dev[:, :, offset + k], torch.from_numpy(y_dev)) for k in range(nl)], 1)
    return pick_l2(acc) + offset


def fit_sites(td: TaskData, cfg: ProbeConfig, *, progress: bool = False) -> SiteFit:
    feats = td.feats
    S = feats["train"].n_sites
    l2_values = list(L2_GRID) if cfg.l2 == "dev" else [float(cfg.l2)]
    nl = len(l2_values)
    label_sets = [td.y["train"]] + ([td.ctrl["train"]] if cfg.control else [])
    y_heads = np.stack([ys for ys in label_sets for _ in l2_values], 1)  # heads: label set x L2
    p = BatchedProbe(
        n_sites=S,
        d=feats["train"].d,
        n_spans=feats["train"].n_spans,
        n_classes=td.n_classes,
        n_heads=y_heads.shape[1],
        kind=cfg.probe,
        hidden=cfg.hidden,
        attn_pool=feats["train"].tokens,
        l2=l2_values * len(label_sets),
        seed=cfg.seed,
    )
    train_probe(
        p, feats["train"], torch.from_numpy(y_heads), progress=progress, desc=f"{td.task} probes", **train_kwargs(cfg)
    )
    pred_te, _ = predict(p, feats["test"])
    pred_tr, _ = predict(p, feats["train"])
    if cfg.l2 == "dev":
        pred_dev, _ = predict(p, feats["dev"])
        pick_real = _pick(pred_dev, td.y["dev"], 0, nl)
        pick_ctrl = _pick(pred_dev, td.ctrl["dev"], nl, nl) if cfg.control else None
    else:
        pick_real = torch.zeros(S, dtype=torch.long)
        pick_ctrl = torch.full((S,), nl, dtype=torch.long) if cfg.control else None
    ar = torch.arange(S)
    ctrl_te = pred_te[ar, :, pick_ctrl] if cfg.control else None
    return SiteFit(
        pred_te[ar, :, pick_real], pred_tr[ar, :, pick_real], ctrl_te, np.asarray(l2_values)[pick_real.numpy()]
    )


def fit_task(
    td: TaskData,
    frame,
    n_layers: int,
    cfg: ProbeConfig,
    *,
    pooling: str,
    resident_bytes: float = 4e9,
    dtype=None,
    progress: bool = False,
) -> dict:
    """``{"by_site", "summary", "mixing"}`` of one task (see :func:`~depthscope.probes.run_probes`)."""
    task, feats, y = td.task, td.feats, td.y
    fit = fit_sites(td, cfg, progress=progress)
    yte = torch.from_numpy(y["test"])
    acc = accuracy(fit.test, yte).numpy()
    scores = {
        "accuracy": acc,
        "macro_f1": macro_f1(fit.test, yte, td.n_eval_classes).numpy(),
        "control_accuracy": (
            accuracy(fit.control_test, torch.from_numpy(td.ctrl["test"])).numpy()
            if fit.control_test is not None
            else np.full(len(acc), np.nan)
        ),
        "train_accuracy": accuracy(fit.train, torch.from_numpy(y["train"])).numpy(),
    }
    df = site_rows(task, frame, td, scores, fit.l2, probe=cfg.probe, pooling=pooling)

    cum_summ, mix_df = cumulative_summary(None, None, cfg.seed), None
    if cfg.cumulative and feats["train"].n_sites >= 2:
        # the mixes use the median of the sites' penalties (= l2 unless l2="dev")
        cum = fit_cumulative(
            feats["train"],
            y["train"],
            feats["test"],
            y["test"],
            n_classes=td.n_classes,
            n_eval_classes=td.n_eval_classes,
            config=replace(cfg, l2=float(np.median(fit.l2))),
            progress=progress,
            desc=f"{task} cumulative",
        )
        depths = frame["depth"].to_numpy()
        cum_summ = cumulative_summary(depths, cum, cfg.seed)
        mix_df = mixing_rows(task, frame, cum)
    summ = summary_row(task, df, td, n_layers, cum_summ, probe=cfg.probe, pooling=pooling, control=cfg.control)
    resident = feats["train"].resident  # what the products computed in (float32 when streamed)
    summ["precision"] = str(resident.dtype).replace("torch.", "") if resident is not None else "float32"
    if cfg.mdl:
        from .mdl import online_codelength

        res = online_codelength(
            feats["train"],
            y["train"],
            n_classes=td.n_classes,
            config=replace(cfg, l2=float(np.median(fit.l2))),
            max_bytes=resident_bytes,
            dtype=dtype,
            progress=progress,
        )
        df["mdl_online_bits"] = res.online_bits
        df["mdl_uniform_bits"] = res.uniform_bits
        df["mdl_compression"] = res.compression
    for f in feats.values():
        f.resident = None
    return {"by_site": df, "summary": summ, "mixing": mix_df}
