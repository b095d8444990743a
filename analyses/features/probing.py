"""Which depth encodes a property, at the level of SAE features: sparse probing beside the dense
probe, and the feature lens.

=========================  ==================================================================
offers                     what
=========================  ==================================================================
:func:`sparse_probing`     for a word-level task (``upos``, ``xpos``, ``feats:Number``...),
                           at each residual site with an SAE: accuracy of probes on the
                           ``k`` best features (k = 1, 2, 4, ...) beside the dense linear
                           probe on the whole stream, and per tag the best single feature
:func:`feature_lens`       the top tokens of features' decoder directions read through the
                           model's final norm and unembedding (the logit lens of a feature)
:class:`SparseProbing`     ``by_k`` and ``by_tag`` tables (shared site columns)
=========================  ==================================================================

Sparse probing follows Gurnee et al. 2023 ("Finding neurons in a haystack"): for each tag, the
features are ranked by the difference of their mean activation on words with the tag and on the
others (train words only); a ``k``-feature probe for the task is a multinomial logistic
regression on the union of every tag's ``k`` best features, scored by accuracy on the test
words; per tag, a one-vs-rest logistic regression on its ``k`` best features is scored by F1.
The dense probe is the same multinomial regression on the standardised stream (all ``d_model``
dimensions). Word vectors are the activation of each word's last token (the token an SAE sees);
tags with fewer than ``min_count`` train words are left out, with their words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.preprocessing import StandardScaler

from depthscope.common.errors import InputError
from depthscope.common.progress import track
from depthscope.hooks.sae import SAE
from depthscope.hooks.sites import parse_site
from depthscope.probes import word_features

SPARSE_KS = (1, 2, 4, 8, 16, 32)
SITE_COLUMNS = ["site", "label", "layer", "sublayer", "depth"]


@dataclass
class SparseProbing:
    """``by_k``: one row per (site, k) with ``accuracy``, ``n_features``, ``dense_accuracy``,
    ``majority``; ``by_tag``: one row per (site, tag, k) with ``f1``, ``dense_f1`` and, at
    ``k = 1``, the ``feature`` index."""

    by_k: pd.DataFrame
    by_tag: pd.DataFrame


def _labels(wf, task: str, min_count: int, keep: set | None = None):
    if task not in wf.index.columns:
        raise InputError(f"sparse probing needs a word-level task with gold labels (upos, xpos, ...); got {task!r}")
    y = wf.index[task].astype(str).to_numpy()
    if keep is None:
        tags, counts = np.unique(y[y != "_"], return_counts=True)
        keep = set(tags[counts >= min_count])
    if len(keep) < 2:
        raise InputError(f"{task}: fewer than two tags with at least {min_count} train words")
    return y, keep


class _Probe:
    """Logistic regression (scikit-learn's default L2 penalty, lbfgs: deterministic) on features
    divided by their train standard deviation: SAE activations differ in scale by orders of
    magnitude, which stalls lbfgs, and the penalty then weighs every feature alike, as the dense
    probe's standardised stream does."""

    def __init__(self, x, y):
        self.scale = StandardScaler(with_mean=False).fit(x)
        self.lr = LogisticRegression(max_iter=2000).fit(self.scale.transform(x), y)

    def predict(self, x):
        return self.lr.predict(self.scale.transform(x))


def _fit(x_train, y_train) -> _Probe:
    return _Probe(x_train, y_train)


def _ranked(f: np.ndarray, y: np.ndarray, tags: list) -> dict:
    """Per tag, feature indices by decreasing mean-activation difference (tag words vs the rest)."""
    out = {}
    for t in tags:
        on = y == t
        out[t] = np.argsort(-(f[on].mean(0) - f[~on].mean(0)), kind="stable")
    return out


def _site_rows(xtr, ytr, xte, yte, sae: SAE, ks):
    """The by-k and by-tag rows of one site (without the site columns)."""
    with torch.no_grad():
        ftr, fte = (sae.encode(torch.as_tensor(x)).float().numpy() for x in (xtr, xte))
    tags = sorted(set(ytr))
    scaler = StandardScaler().fit(xtr)
    dense = _fit(scaler.transform(xtr), ytr)
    dense_pred = dense.predict(scaler.transform(xte))
    dense_f1 = {t: f1_score(yte == t, dense_pred == t, zero_division=0) for t in tags}
    ranked = _ranked(ftr, ytr, tags)
    by_k, by_tag = [], []
    for k in ks:
        cols = np.unique(np.concatenate([ranked[t][:k] for t in tags]))
        probe = _fit(ftr[:, cols], ytr)
        acc = float((probe.predict(fte[:, cols]) == yte).mean())
        dense_acc = float((dense_pred == yte).mean())
        by_k.append({"k": k, "n_features": len(cols), "accuracy": acc, "dense_accuracy": dense_acc})
        for t in tags:
            top = ranked[t][:k]
            one = _fit(ftr[:, top], ytr == t)
            f1 = f1_score(yte == t, one.predict(fte[:, top]), zero_division=0)
            row = {"tag": t, "k": k, "f1": float(f1), "dense_f1": float(dense_f1[t])}
            by_tag.append(row | ({"feature": int(top[0])} if k == 1 else {}))
    return by_k, by_tag


def sparse_probing(
    model, saes: Mapping, train, test, *, task: str = "upos", ks: Sequence[int] = SPARSE_KS, min_count: int = 10,
    progress: bool = False,
) -> SparseProbing:  # fmt: skip
    """Sparse probing of ``task`` at each residual site of ``saes`` ({site: SAE}); ``train`` and
    ``test``: CoNLL-U paths or parsed sentences (see :func:`depthscope.probes.word_features`)."""
    if not saes:
        raise InputError("sparse probing needs at least one SAE: {site: SAE}")
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise InputError(f"ks must be positive integers, got {ks!r}")
    sites = {parse_site(s, model.n_layers): sae for s, sae in saes.items()}
    order = sorted(sites)
    wtr = word_features(model, train, sites=order, progress=progress)
    wte = word_features(model, test, sites=order, progress=progress)
    ytr, keep = _labels(wtr, task, min_count)
    yte, _ = _labels(wte, task, min_count, keep)
    mtr, mte = np.isin(ytr, list(keep)), np.isin(yte, list(keep))
    majority = float((yte[mte] == pd.Series(ytr[mtr]).mode()[0]).mean())
    by_k, by_tag = [], []
    for i, s in enumerate(track(order, desc="sparse probing", unit="site", enabled=progress)):
        cols = wtr.sites.iloc[i][SITE_COLUMNS].to_dict()
        sae = sites[s]
        if sae.d_in != wtr.features.shape[-1]:
            raise InputError(f"the SAE at site {s} reads d_in={sae.d_in}, the stream has {wtr.features.shape[-1]}")
        rows_k, rows_t = _site_rows(wtr.features[i][mtr], ytr[mtr], wte.features[i][mte], yte[mte], sae, ks)
        by_k += [{**cols, "task": task, **r, "majority": majority} for r in rows_k]
        by_tag += [{**cols, "task": task, **r} for r in rows_t]
    return SparseProbing(pd.DataFrame(by_k), pd.DataFrame(by_tag))


@torch.no_grad()
def feature_lens(model, sae: SAE, features: Sequence[int], *, top: int = 10) -> pd.DataFrame:
    """The ``top`` tokens of each feature's decoder direction ``W_dec[f]`` through the model's final
    norm and unembedding (``model.decode``): one row per (feature, rank) with ``token``,
    ``token_id`` and ``logit``."""
    if not model.can_decode:
        raise InputError(f"{model.name} has no final norm -> unembedding to read features through")
    feats = [int(f) for f in features]
    bad = [f for f in feats if not 0 <= f < sae.d_sae]
    if bad:
        raise InputError(f"features {bad} out of range 0..{sae.d_sae - 1}")
    if sae.d_out != model.d_model:
        raise InputError(f"the SAE writes d_out={sae.d_out}, the stream has d_model={model.d_model}")
    direction = sae.W_dec[feats].to(device=model.device, dtype=model.dtype)
    logits = model.decode(direction[:, None, :])[:, 0].float()
    val, idx = logits.topk(min(top, logits.shape[-1]), dim=-1)
    tok = model.tokenizer
    rows = []
    for r, f in enumerate(feats):
        for rank, (v, i) in enumerate(zip(val[r].tolist(), idx[r].tolist())):
            text = tok.decode([i]) if tok is not None else str(i)
            rows.append({"feature": f, "rank": rank, "token": text, "token_id": i, "logit": v})
    return pd.DataFrame(rows)
