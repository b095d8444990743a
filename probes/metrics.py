"""Scores of predicted classes: accuracy and macro-F1 per unit, as scikit-learn defines them."""

from __future__ import annotations

import torch


def accuracy(preds: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Accuracy (= micro-F1 for single-label classification) per unit: preds ``[U, N]``."""
    return (preds == torch.as_tensor(y)[None]).float().mean(1)


def macro_f1(preds: torch.Tensor, y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Macro-F1 per unit over the classes present in the gold labels or the predictions
    (scikit-learn's ``f1_score(average="macro")``). ``n_classes`` must exceed every index."""
    y = torch.as_tensor(y, dtype=torch.long)
    U, N = preds.shape
    Ct = n_classes
    flat = (torch.arange(U)[:, None] * Ct * Ct + y[None] * Ct + preds).reshape(-1)
    conf = torch.bincount(flat, minlength=U * Ct * Ct).reshape(U, Ct, Ct).double()
    tp = conf.diagonal(dim1=1, dim2=2)
    rows, cols = conf.sum(2), conf.sum(1)
    denom = rows + cols
    f1 = torch.where(denom > 0, 2 * tp / denom.clamp_min(1), torch.zeros_like(tp))
    present = denom > 0
    return (f1.sum(1) / present.sum(1).clamp_min(1)).float()
