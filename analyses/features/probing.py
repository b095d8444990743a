"""Which depth encodes a property, at the level of SAE features: sparse probing beside the project's
probe, and the feature lens.

=========================  ==================================================================
offers                     what
=========================  ==================================================================
:func:`sparse_probing`     for a task of one span per example (``upos``, ``xpos``,
                           ``feats:Number``, ``entity``...), at each residual site with an
                           SAE: accuracy of probes on the ``k`` best features (k = 1, 2, 4,
                           ...) beside the dense probe on the whole stream (``run_probes``'s,
                           same words, same penalty rule), and per tag the best single feature
:func:`feature_lens`       the top tokens of features' decoder directions read through the
                           model's final norm and unembedding (the logit lens of a feature)
:class:`SparseProbing`     ``by_k``, ``by_tag`` and ``dense`` tables (shared site columns)
=========================  ==================================================================

One probe: the dense probe *is* :func:`~depthscope.probes.run_probes`'s per-site probe. The task's
examples are taken, encoded and standardised by :func:`~depthscope.probes.prepare_task` (the same
words: spans no subword covers are dropped, test labels unseen in train count as errors) and
fitted by :func:`~depthscope.probes.fitting.probe_sites` (the penalty chosen by the
one-standard-error rule on held-out folds, the per-site probes and their control task, trained to
convergence), so at the same sites, data and settings its ``dense`` rows are ``run_probes``'s
``by_site`` rows. The penalty is chosen over the SAE sites (as ``run_probes(..., sites=...)``
chooses it over the sites it probes).

Sparse probing follows Gurnee et al. 2023 ("Finding neurons in a haystack"): for each tag with at
least ``min_count`` train examples, the SAE's features are ranked by the difference of their mean
activation on the tag's train examples and on the others; a ``k``-feature probe for the task is
a multinomial logistic regression on the union of every such tag's ``k`` best features, scored by
accuracy on the same test examples as the dense probe; per tag, a one-vs-rest logistic regression
on its ``k`` best features is scored by F1. Every example stays in train and test whatever its
tag (``min_count`` decides only which tags rank features and get ``by_tag`` rows), so the
k-feature accuracy and the dense accuracy share their words and their majority baseline. The
sparse probes are scikit-learn's ``LogisticRegression`` with the dense probe's objective: features
standardised with train's mean and standard deviation, the task's chosen penalty on the mean
cross-entropy (``C = 1 / (2 * l2 * n_train)``), lbfgs to convergence, so a k-feature probe and
the dense one differ only in what they read. The SAE reads each example's raw (unstandardised)
stream vector from the probes' activation store, pooled as ``pooling`` says (``last``: the span's
last token, the token an SAE sees at that position); a store kept as float16 (the default)
gives it float16-rounded activations, ``store_dtype="float32"`` the full ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.preprocessing import StandardScaler

from depthscope.common.errors import InputError
from depthscope.common.progress import track
from depthscope.hooks.sae import SAE, sae_point
from depthscope.hooks.sites import SITE_COLUMNS, parse_site, site_frame
from depthscope.probes.corpora.tasks import is_tree_task, task_family
from depthscope.probes.fitting import FitOptions, probe_sites
from depthscope.probes.run import prepare_task, resolve_configs
from depthscope.probes.store.extraction import resolve_model

SPARSE_KS = (1, 2, 4, 8, 16, 32)
#: task families whose examples are two spans (an arc, a mention pair) or whole trees: no single
#: stream vector per example for an SAE to read
MULTI_SPAN = ("deprel", "coref", "structural", "depth")
#: rows of SAE codes encoded at once (bounded memory: rows x d_sae floats)
CODE_BYTES = 2**28
#: lbfgs iterations of a sparse probe (a k-feature probe that stops short is ``converged = False``)
MAX_ITER = 2000


@dataclass
class SparseProbing:
    """``by_k``: one row per (site, k) with ``accuracy``, ``n_features``, ``dense_accuracy``,
    ``majority``, ``l2``, ``n_train``, ``n_test``, ``converged``; ``by_tag``: one row per (site,
    tag, k) with ``f1``, ``dense_f1`` and, at ``k = 1``, the ``feature`` index; ``dense``: the
    dense probe's rows, ``run_probes``'s ``by_site`` columns (accuracy, macro_f1,
    control_accuracy, selectivity, l2, ...)."""

    by_k: pd.DataFrame
    by_tag: pd.DataFrame
    dense: pd.DataFrame


def _check_saes(saes: Mapping, n_layers: int) -> dict:
    """``{site index: SAE}`` from ``{site name: SAE}``: every SAE reads the residual stream, and
    the site it names in its config (when it names one) is the one it is given for."""
    if not saes:
        raise InputError("sparse probing needs at least one SAE: {site: SAE}")
    out = {}
    for name, sae in saes.items():
        try:
            site = parse_site(name, n_layers)
        except (KeyError, IndexError) as e:
            raise InputError(str(e).strip("'\"")) from None
        if not isinstance(sae, SAE):
            raise InputError(f"site {name!r}: expected a depthscope.hooks.SAE, got {type(sae).__name__}")
        if sae.is_transcoder:
            raise InputError(f"site {name!r}: a transcoder reads the MLP's input, not the residual stream")
        if sae.hook_name is not None:
            own = sae_point(sae, n_layers).site
            if own != site:
                where = f"site {own}" if own is not None else "a point off the residual stream"
                raise InputError(f"the SAE given for site {name!r} was trained at {sae.hook_name!r} ({where})")
        out[site] = sae
    return out


def _check_task(task: str, ext) -> None:
    """Refuse what gives no single stream vector per example before anything is extracted."""
    if is_tree_task(task) or task_family(task) in MULTI_SPAN:
        raise InputError(
            f"sparse probing reads one stream vector per example; task {task!r} has two spans or whole trees "
            f"(use a word or span task: upos, xpos, feats:<Feature>, entity, a one-span jiant task)"
        )
    if ext.pooling == "attn":
        raise InputError("sparse probing needs one stream vector per span: pooling 'last', 'first' or 'mean'")


def _check_ks(ks, d_sae: int) -> list[int]:
    """``ks`` sorted and de-duplicated: integers from 1 to the SAEs' largest ``d_sae``."""
    got = [ks] if isinstance(ks, (str, bytes, int)) else list(ks)
    if not got or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d_sae for k in got):
        raise InputError(f"ks must be integers from 1 to the SAEs' d_sae ({d_sae}), got {ks!r}")
    return sorted({int(k) for k in got})


def _raw_chunks(features, site: int, rows: int) -> Iterator[np.ndarray]:
    """The examples' raw (unstandardised) stream vectors at the store's ``site``, float32
    ``[<= rows, d]`` in example order."""
    store = features.store
    starts = store.row_start[features.span_ids[:, 0]]
    for a in range(0, len(starts), rows):
        x = np.asarray(store.feats[starts[a : a + rows], site], dtype=np.float32)
        store.release()  # copied: the store's pages need not stay mapped
        yield x


def _codes(sae: SAE, features, site: int) -> Iterator[np.ndarray]:
    """The SAE's codes of the examples, in chunks of bounded size ``[rows, d_sae]``."""
    rows = max(1, CODE_BYTES // (4 * max(sae.d_sae, sae.d_in)))
    with torch.no_grad():
        for x in _raw_chunks(features, site, rows):
            yield sae.encode(torch.from_numpy(x).to(sae.W_enc.device)).float().cpu().numpy()


def _ranked(sae: SAE, features, site: int, y: np.ndarray, tags: list[int], top: int) -> dict:
    """Per tag, the ``top`` features by decreasing difference of mean activation on the tag's
    train examples and on the others (one pass over the codes, class sums only)."""
    n_class = int(y.max()) + 1
    sums = np.zeros((n_class, sae.d_sae), dtype=np.float64)
    a = 0
    for f in _codes(sae, features, site):
        onehot = np.zeros((len(f), n_class))
        onehot[np.arange(len(f)), y[a : a + len(f)]] = 1.0
        sums += onehot.T @ f.astype(np.float64)
        a += len(f)
    total, count = sums.sum(0), np.bincount(y, minlength=n_class)
    out = {}
    for t in tags:
        diff = sums[t] / count[t] - (total - sums[t]) / max(len(y) - count[t], 1)
        out[t] = np.argsort(-diff, kind="stable")[:top]
    return out


def _columns(sae: SAE, features, site: int, cols: np.ndarray) -> np.ndarray:
    """The codes of features ``cols`` for every example, ``[n, len(cols)]``."""
    return np.concatenate([f[:, cols] for f in _codes(sae, features, site)])


def _fit(x: np.ndarray, y: np.ndarray, C: float):
    """``(predict, converged)``: a logistic regression on ``x`` standardised with its own mean
    and standard deviation (the dense probe's standardisation; constant columns stay 0)."""
    scale = StandardScaler().fit(x)
    lr = LogisticRegression(C=C, max_iter=MAX_ITER).fit(scale.transform(x), y)
    return (lambda z: lr.predict(scale.transform(z))), bool(np.all(lr.n_iter_ < MAX_ITER))


@dataclass(frozen=True)
class _Site:
    """What the sparse probes of one site read: the ranked features' codes on train and test (the
    SAE's features ``ids``, one column each), the labels (class indices; test labels unseen in
    train are >= the number of classes), per ranked tag its columns in rank order, the dense
    probe's test predictions and the penalty as scikit-learn's ``C``."""

    ftr: np.ndarray
    fte: np.ndarray
    ytr: np.ndarray
    yte: np.ndarray
    ranked: dict
    ids: np.ndarray
    dense_pred: np.ndarray
    C: float


def _site_rows(s: _Site, ks: Sequence[int], classes: list) -> tuple[list, list]:
    """The by-k and by-tag rows of one site (without the site columns)."""
    by_k, by_tag = [], []
    dense_f1 = {t: f1_score(s.yte == t, s.dense_pred == t, zero_division=0) for t in s.ranked}
    for k in ks:
        cols = np.unique(np.concatenate([r[:k] for r in s.ranked.values()]))
        predict, ok = _fit(s.ftr[:, cols], s.ytr, s.C)
        acc = float((predict(s.fte[:, cols]) == s.yte).mean())
        row = {"k": k, "n_features": len(cols), "accuracy": acc}
        for t, r in s.ranked.items():
            one, ok_t = _fit(s.ftr[:, r[:k]], s.ytr == t, s.C)
            ok = ok and ok_t
            f1 = f1_score(s.yte == t, one(s.fte[:, r[:k]]), zero_division=0)
            tag = {"tag": classes[t], "k": k, "f1": float(f1), "dense_f1": float(dense_f1[t])}
            by_tag.append(tag | ({"feature": int(s.ids[r[0]])} if k == 1 else {}))
        by_k.append(row | {"converged": ok})
    return by_k, by_tag


def _site(sae: SAE, td, pos: int, tags: list[int], top: int, dense_pred: np.ndarray, C: float) -> _Site:
    """The :class:`_Site` of store site ``pos``: the tags' ``top`` best features ranked on train
    and their codes read on both splits."""
    ytr = td.y["train"]
    ranked = _ranked(sae, td.feats["train"], pos, ytr, tags, top)
    feats = np.unique(np.concatenate(list(ranked.values())))
    where = {f: i for i, f in enumerate(feats.tolist())}
    local = {t: np.array([where[f] for f in r.tolist()], dtype=np.int64) for t, r in ranked.items()}
    ftr = _columns(sae, td.feats["train"], pos, feats)
    fte = _columns(sae, td.feats["test"], pos, feats)
    return _Site(ftr, fte, ytr, td.y["test"], local, feats, dense_pred, C)


def sparse_probing(
    model, saes: Mapping, train, test, dev=None, *, task: str = "upos", ks: Sequence[int] = SPARSE_KS, **settings
) -> SparseProbing:
    """Sparse probing of ``task`` at each residual site of ``saes`` ({site: SAE}), beside the
    dense probe (see the module docstring). ``train``/``test``/``dev``: CoNLL-U or jiant JSONL
    paths or parsed corpora, as for :func:`~depthscope.probes.run_probes`. ``settings``:
    ``min_count`` (tags with fewer train examples rank no features; default 10), ``progress``
    (default False), and what ``run_probes`` takes: ``config`` / ``extraction`` / ``data`` and
    any of their fields by name (``max_train_sentences=200``, ``pooling="mean"``,
    ``store_dtype="float32"``, ``l2=1e-2``); the sites are the SAEs'."""
    min_count = settings.pop("min_count", 10)
    progress = bool(settings.pop("progress", False))
    if not isinstance(min_count, int) or isinstance(min_count, bool) or min_count < 1:
        raise InputError(f"min_count must be a positive integer, got {min_count!r}")
    if "sites" in settings:
        raise InputError("sparse probing probes the SAEs' sites: give them as the keys of saes, not sites=")
    cfg, ext, dat = resolve_configs(**settings)
    if cfg.l2 == "dev" and dev is None:
        raise InputError("l2='dev' picks the penalty on a dev split: pass dev=")
    if cfg.probe not in ("linear", "mlp"):
        raise InputError(f"the dense probe is one kind, 'linear' or 'mlp'; got probe={cfg.probe!r}")
    _check_task(task, ext)
    model = resolve_model(model)
    sites = _check_saes(saes, model.n_layers)
    order = sorted(sites)
    ks = _check_ks(ks, max(sae.d_sae for sae in sites.values()))
    ext = replace(ext, sites=order)
    td = prepare_task(
        model, task, train, test, dev, config=cfg, extraction=ext, data=dat, progress=progress, stream=("test",)
    )
    if td.feats["train"].n_spans != 1:
        raise InputError(f"sparse probing reads one stream vector per example; task {task!r} has two spans")
    if list(td.feats["train"].store.sites) != order:
        raise AssertionError(f"the store holds sites {td.feats['train'].store.sites}, asked for {order}")
    for s, sae in sites.items():
        if sae.d_in != td.feats["train"].d:
            raise InputError(f"the SAE at site {s} reads d_in={sae.d_in}, the stream has {td.feats['train'].d}")
    frame = site_frame(order, model.n_layers)
    dense = probe_sites(td, frame, cfg, FitOptions(ext.pooling, ext.resident_bytes, progress=progress))
    return _tables(td, sites, order, dense, ks, min_count, progress)


def _tables(td, sites: dict, order: list, dense, ks: Sequence[int], min_count: int, progress: bool) -> SparseProbing:
    """The by-k and by-tag tables over the sites, from the task's data and its dense probes."""
    tags = [t for t in range(td.n_classes) if td.counts[t] >= min_count]
    if len(tags) < 2:
        raise InputError(f"task {td.task!r}: fewer than two tags with at least {min_count} train examples")
    l2 = dense.choice.l2
    C = np.inf if l2 == 0 else 1.0 / (2.0 * l2 * len(td.y["train"]))
    run = {"task": td.task, "l2": l2, "n_train": len(td.y["train"]), "n_test": len(td.y["test"])}
    by_k, by_tag = [], []
    for i, s in enumerate(track(order, desc="sparse probing", unit="site", enabled=progress)):
        cols = dense.by_site.iloc[i][SITE_COLUMNS].to_dict()
        pred = dense.fit.test[i].numpy()
        rows_k, rows_t = _site_rows(_site(sites[s], td, i, tags, max(ks), pred, C), ks, list(td.classes))
        dense_acc = float(dense.by_site["accuracy"].iloc[i])  # the dense table's own number
        by_k += [{**cols, **run, **r, "dense_accuracy": dense_acc, "majority": td.majority_accuracy} for r in rows_k]
        by_tag += [{**cols, "task": td.task, **r} for r in rows_t]
    return SparseProbing(pd.DataFrame(by_k), pd.DataFrame(by_tag), dense.by_site.reset_index(drop=True))


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
