"""Fitting one task's probes: the L2 penalty chosen on held-out data, per-site probes with control
heads, cumulative mixes, MDL.

=======================================  =======================================================
``fit_task(td, frame, n_layers, config,  the task's ``by_site`` rows, its summary row and its
options)``                               ``mixing`` rows (None without cumulative scoring);
                                         ``options``: a :class:`FitOptions`
``choose_l2(td, config)``                one L2 for the task: a :class:`L2Choice` (the grid
                                         value with the best held-out accuracy, mean over sites)
``fit_sites(td, config, l2, progress=,  per-site probes: the task's labels and its control
start=)``                                labels as two heads of one batched fit, scored on test:
                                         a :class:`SiteFit`; ``start``: a warm start
``probe_sites(td, frame, config,         the penalty, the per-site probes at it and their
options)``                               ``by_site`` rows: a :class:`SiteProbes` (the first
                                         half of ``fit_task``; sparse probing's dense probe)
``warm_start(probe, start)``             start a per-site probe's real head from the penalty
                                         search's probes at the chosen value (fewer passes,
                                         the same optimum)
=======================================  =======================================================

The protocol (every entry point): ``l2="auto"`` picks ONE penalty per task from ``L2_GRID``,
the one whose probes have the best held-out accuracy averaged over ``L2_SITES`` evenly spaced
sites (dev split when given, else ``l2_folds`` folds of train), trying further half-decades of
``L2_LADDER`` while the best is at an end of the values tried, and taking the strongest value
within one standard error of the best (the one-standard-error rule);
the per-site probes, their control task, the cumulative probes, the scalar mix and MDL all use
it, and every probe is trained to convergence (:mod:`depthscope.probes.solvers.training`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from depthscope.common.runtime import release_memory
from depthscope.probes.config import L2_GRID, L2_LADDER, L2_SITES, ProbeConfig
from depthscope.probes.encoding import TaskData
from depthscope.probes.mdl import online_codelength
from depthscope.probes.metrics import accuracy, macro_f1
from depthscope.probes.mixing import CumulativeFit, fit_cumulative
from depthscope.probes.solvers.classifiers import BatchedProbe, site_probe
from depthscope.probes.solvers.training import TrainLog, log_probs, predict, train_kwargs, train_probe
from depthscope.probes.store.features import Features, Resident
from depthscope.probes.summaries import cumulative_summary, mixing_rows, site_rows, summary_row


def pick_l2(acc: np.ndarray, n_heldout: int | None = None) -> int:
    """Index of the penalty (values ascending) to use, from the mean held-out accuracy ``acc``
    of each: the strongest penalty whose accuracy is within one standard error of the best
    (the one-standard-error rule of cross-validation, as glmnet's ``lambda.1se``; the standard
    error ``sqrt(a (1 - a) / n_heldout)`` at the best accuracy ``a``), so a difference the
    held-out sample cannot resolve does not buy a weaker penalty (and the hundreds of passes a
    near-separable probe needs). ``n_heldout`` None: the best value itself (ties, within 1e-9,
    to the strongest)."""
    acc = np.asarray(acc, dtype=np.float64)
    best = acc.max()
    se = float(np.sqrt(best * (1 - best) / n_heldout)) if n_heldout else 0.0
    return int(np.flatnonzero(acc >= best - se - 1e-9)[-1])


@dataclass
class L2Choice:
    """The task's penalty ``l2``, how it was chosen (``on``: ``given``, ``dev`` or ``k folds of
    train``), the held-out accuracy (mean over sites) of each value tried (empty if given) and
    how many of the search's probes stopped at the epoch cap before converging."""

    l2: float
    on: str
    heldout: dict
    not_converged: int = 0  # probes of the penalty search that stopped at the cap (all values, splits)
    start: dict | None = None  # the chosen value's probes ("W", "b"), mean over the splits: a warm start


def l2_sites(n_sites: int, k: int = L2_SITES) -> np.ndarray:
    """The sites the penalty is chosen on: ``k`` evenly spaced, first and last included (all
    when there are at most ``k``)."""
    return np.unique(np.round(np.linspace(0, n_sites - 1, min(k, n_sites))).astype(np.int64))


class HeldOut(NamedTuple):
    """One held-out split of the penalty search: probes train on ``train`` (labels ``y_train``)
    and are scored on ``held()`` (labels ``y_held``), built only once the probes are trained, so
    that a fold's training copy and its held-out copy are never in memory together."""

    train: Features
    y_train: np.ndarray
    held: Callable[[], Features]
    y_held: np.ndarray


def _path(td: TaskData, cfg: ProbeConfig, train: Features, y_train, values, start, progress: bool):
    """Probes trained on ``train`` at each penalty of ``values``, in that order, each fit
    warm-started from the previous optimum (``start``: a state dict to begin from, or None).
    Returns ``({value: state dict}, probes that stopped at the cap unconverged)``."""
    yt = torch.as_tensor(np.asarray(y_train))[:, None]
    states, prev, stuck = {}, start, 0
    for v in values:
        p = site_probe(train, td.n_classes, cfg, l2=v)
        if prev is not None:
            p.load_state_dict(prev)
            p.l2.fill_(v)
        lg = train_probe(p, train, yt, progress=progress, desc=f"{td.task} L2 {v:g}", **train_kwargs(cfg))
        stuck += int((~lg.converged).sum())
        states[v] = prev = {k: t.clone() for k, t in p.state_dict().items()}
    return states, stuck


def _heldout_accuracy(td: TaskData, cfg: ProbeConfig, held: Features, y_held, states: dict) -> dict:
    """``{value: accuracy on held, mean over sites}`` of the probes ``states`` (state dicts by penalty)."""
    yh = torch.from_numpy(np.asarray(y_held))
    acc = {}
    for v, st in states.items():
        p = site_probe(held, td.n_classes, cfg, l2=v)
        p.load_state_dict(st)
        pred, _ = predict(p, held)
        acc[v] = float(accuracy(pred[:, :, 0], yh).mean())
    return acc


def _splits(td: TaskData, cfg: ProbeConfig, resident_bytes: float):
    """The held-out splits the penalty is chosen on: ``(on, [() -> HeldOut])`` (dev, else
    ``l2_folds`` folds of train), on the sites of :func:`l2_sites` when resident. Each split is
    built when called, so only one fold's copy of the features is held at a time."""
    feats = td.feats
    train = feats["train"]
    sites = l2_sites(train.n_sites)

    def narrow(f):
        return f.with_sites(sites) if f.resident is not None and f.sites is None else f

    if "dev" in feats and feats["dev"] is not None and len(feats["dev"]):
        dev = feats["dev"]
        return "dev", [lambda: HeldOut(narrow(train), td.y["train"], lambda: narrow(dev), td.y["dev"])]
    k, n = cfg.l2_folds, len(train)
    fold = np.random.default_rng([cfg.seed, 4242]).permutation(n) % k
    base = narrow(train)

    def split(i: int) -> HeldOut:
        tr, ho = np.flatnonzero(fold != i), np.flatnonzero(fold == i)
        ftr = narrow(base.subset(tr, max_bytes=resident_bytes, seed=cfg.seed))
        return HeldOut(
            ftr,
            td.y["train"][tr],
            lambda: narrow(base.subset(ho, max_bytes=resident_bytes, seed=cfg.seed)),
            td.y["train"][ho],
        )

    return f"{k} folds of train", [lambda i=i: split(i) for i in range(k)]


def choose_l2(td: TaskData, cfg: ProbeConfig, *, resident_bytes: float = 4e9, progress: bool = False) -> L2Choice:
    """The task's L2 penalty (see the module docstring): ``L2_GRID`` as a regularisation path
    (strongest first), then, while the best mean held-out accuracy is at an end of the values
    tried, the next ``L2_LADDER`` value beyond that end (warm-started from the end's optimum);
    of the values tried, the strongest within one standard error of the best
    (:func:`pick_l2`)."""
    if cfg.l2 not in ("auto", "dev"):
        return L2Choice(float(cfg.l2), "given", {})
    on, splits = _splits(td, cfg, resident_bytes)
    acc: dict = {}
    states: list = [{} for _ in splits]
    stuck, n_held = 0, [0] * len(splits)

    def run(values, start_at):
        nonlocal stuck
        for i, build in enumerate(splits):
            train, y_train, held, y_held = build()
            n_held[i] = len(y_held)
            st, n = _path(td, cfg, train, y_train, values, states[i].get(start_at), progress)
            del train  # the fold's training copy goes before its held-out copy is made
            a = _heldout_accuracy(td, cfg, held(), y_held, st)
            states[i].update(st)
            stuck += n
            for v, x in a.items():
                acc[v] = acc.get(v, 0.0) + x / len(splits)

    run(sorted(L2_GRID, reverse=True), None)
    ladder = sorted(L2_LADDER)
    while True:  # grow the values tried while the most accurate one is at an end
        tried = sorted(acc)
        top = tried[pick_l2([acc[v] for v in tried])]
        i = ladder.index(top) if top in ladder else -1
        if top == tried[-1] and 0 <= i < len(ladder) - 1:
            run([ladder[i + 1]], top)
        elif top == tried[0] and i > 0:
            run([ladder[i - 1]], top)
        else:
            break
    chosen = tried[pick_l2([acc[v] for v in tried], sum(n_held))]
    return L2Choice(float(chosen), on, {float(v): float(acc[v]) for v in tried}, stuck, _mean_state(states, chosen))


def _mean_state(states: list, value) -> dict | None:
    """The linear probes the penalty search fitted at ``value``, weights and biases averaged over
    its held-out splits (None when a split has none, or the probes are not linear)."""
    got = [st.get(value) for st in states]
    if not got or any(not isinstance(g, dict) or "W" not in g or "b" not in g for g in got):
        return None
    return {k: torch.stack([g[k] for g in got]).mean(0) for k in ("W", "b")}


def warm_start(p: BatchedProbe, start: dict | None) -> bool:
    """Start head 0 of the per-site linear probe ``p`` from ``start`` (:attr:`L2Choice.start`): the
    penalty search's probes at the same penalty on part of train, at every site or at the sites of
    :func:`l2_sites` (then each site takes the nearest one's: adjacent sites' probes are alike).
    The objective is convex and every probe trains to convergence, so a start changes only how
    many passes that takes. Returns whether ``p`` was started (False: shapes do not match)."""
    if start is None or p.kind != "linear" or p.mix_mask is not None:
        return False
    W, b = start["W"], start["b"]
    S, F_, C = p.U, p.W.shape[1], p.C
    if W.dim() != 3 or W.shape[1:] != (F_, C) or b.shape[1:] != (1, C):
        return False
    if W.shape[0] == S:
        near = torch.arange(S)
    else:
        sites = torch.from_numpy(l2_sites(S, W.shape[0]))
        if len(sites) != W.shape[0]:
            return False
        near = (torch.arange(S)[:, None] - sites[None, :]).abs().argmin(1)
    with torch.no_grad():
        p.W[:, :, :C] = W[near].to(p.W.dtype)
        p.b[:, :, :C] = b[near].to(p.b.dtype)
    return True


@dataclass
class SiteFit:
    """Per-site predictions: test ``[S, N]``, train ``[S, N]``, control test ``[S, N]`` (None
    without control), the L2 used, and the training log (convergence per site)."""

    test: torch.Tensor
    train: torch.Tensor
    control_test: torch.Tensor | None
    l2: float
    log: TrainLog
    test_log_probs: torch.Tensor | None = None  # [S, N, C] of the real head
    state: dict | None = None  # the real head's probes (a one-head state dict)


def fit_sites(
    td: TaskData, cfg: ProbeConfig, l2: float, *, progress: bool = False, start: dict | None = None
) -> SiteFit:
    """Per-site probes at penalty ``l2``: the task's labels and (with ``cfg.control``) its control
    labels as two heads of one batched fit, predicted on test and train; ``start``: the real
    head's warm start (:func:`warm_start`)."""
    feats = td.feats
    label_sets = [td.y["train"]] + ([td.ctrl["train"]] if cfg.control else [])
    y_heads = np.stack(label_sets, 1)
    p = site_probe(feats["train"], td.n_classes, cfg, l2=l2, n_heads=y_heads.shape[1])
    warm_start(p, start)
    log = train_probe(
        p, feats["train"], torch.from_numpy(y_heads), progress=progress, desc=f"{td.task} probes", **train_kwargs(cfg)
    )
    lp_te = log_probs(p, feats["test"])  # [S, N, G, C]
    pred_te = lp_te.argmax(-1)
    pred_tr, _ = predict(p, feats["train"])
    ctrl = pred_te[:, :, 1] if cfg.control else None
    return SiteFit(pred_te[:, :, 0], pred_tr[:, :, 0], ctrl, l2, log, lp_te[:, :, 0].contiguous(), _head(p, 0))


def _head(p: BatchedProbe, g: int) -> dict | None:
    """Head ``g`` of a linear probe as the state dict of a one-head probe (None for MLPs)."""
    if p.kind != "linear":
        return None
    C = p.C
    st = {k: v.clone() for k, v in p.state_dict().items()}
    st["W"] = st["W"][:, :, g * C : (g + 1) * C].clone()
    st["b"] = st["b"][:, :, g * C : (g + 1) * C].clone()
    st["l2"] = st["l2"][g : g + 1].clone()
    return st


@dataclass(frozen=True)
class FitOptions:
    """How :func:`fit_task` runs, besides the :class:`ProbeConfig`: the store's ``pooling`` (a
    table column), the memory for resident features (``resident_bytes``), their precision
    (``dtype``, None: float32) and progress bars."""

    pooling: str
    resident_bytes: float = 4e9
    dtype: torch.dtype | None = None
    progress: bool = False


@dataclass
class SiteProbes:
    """One task's per-site probes as :func:`~depthscope.probes.run_probes` fits them: the penalty
    (``choice``), the fit (``fit``: predictions, log, the real head's weights) and the ``by_site``
    rows (``by_site``, the shared site columns and the scores)."""

    choice: L2Choice
    fit: SiteFit
    by_site: pd.DataFrame


def probe_sites(td: TaskData, frame, cfg: ProbeConfig, options: FitOptions) -> SiteProbes:
    """The per-site probes of one task, the first half of :func:`fit_task`: the penalty
    (:func:`choose_l2`), the per-site probes at it (:func:`fit_sites`, warm-started from the
    search) and their ``by_site`` rows (``frame``: the shared site columns of the features'
    sites). Every entry point that reports a per-site probe (``run_probes``, sparse probing's
    dense probe) calls this, so their numbers agree at the same sites, data and settings."""
    choice = choose_l2(td, cfg, resident_bytes=options.resident_bytes, progress=options.progress)
    release_memory()  # each phase's freed working set back to the OS: the next allocates other sizes
    fit = fit_sites(td, replace(cfg, l2=choice.l2), choice.l2, progress=options.progress, start=choice.start)
    release_memory()
    df = site_rows(td.task, frame, td, _site_scores(td, fit), fit.l2, probe=cfg.probe, pooling=options.pooling)
    df["converged"] = fit.log.converged
    df["epochs"] = fit.log.unit_epochs if fit.log.unit_epochs is not None else fit.log.epochs
    return SiteProbes(choice, fit, df)


def fit_task(td: TaskData, frame, n_layers: int, cfg: ProbeConfig, options: FitOptions) -> dict:
    """``{"by_site", "summary", "mixing"}`` of one task (see :func:`~depthscope.probes.run_probes`):
    the penalty and the per-site probes (:func:`probe_sites`), cumulative scoring and MDL, then
    the task's features are released."""
    sites = probe_sites(td, frame, cfg, options)
    choice, fit, df = sites.choice, sites.fit, sites.by_site
    cfg = replace(cfg, l2=choice.l2)
    cum = _cumulative(td, cfg, fit, options.progress)
    if cum is None:
        cum_summ, mix_df = cumulative_summary(None, None, cfg.seed), None
    else:
        cum_summ, mix_df = (
            cumulative_summary(frame["depth"].to_numpy(), cum, cfg.seed),
            mixing_rows(td.task, frame, cum),
        )
    summ = summary_row(
        td.task, df, td, n_layers, cum_summ, probe=cfg.probe, pooling=options.pooling, control=cfg.control
    )
    summ.update(_training_summary(cfg, choice, fit.log, cum))
    resident = td.feats["train"].resident  # what the products computed in (float32 when streamed)
    summ["precision"] = str(resident.dtype).replace("torch.", "") if resident is not None else "float32"
    if cfg.mdl:
        _add_mdl(df, td, cfg, options)
    for f in td.feats.values():  # the task is done: free its resident features and their Gram
        f.resident = None
        f._gram = None
        f.store.release()
    release_memory()
    return {"by_site": df, "summary": summ, "mixing": mix_df}


def _site_scores(td: TaskData, fit: SiteFit) -> dict:
    """The per-site scores of the ``by_site`` rows: test accuracy and macro-F1, the control
    task's test accuracy (NaN without control) and train accuracy."""
    y = td.y
    yte = torch.from_numpy(y["test"])
    acc = accuracy(fit.test, yte).numpy()
    control = (
        accuracy(fit.control_test, torch.from_numpy(td.ctrl["test"])).numpy()
        if fit.control_test is not None
        else np.full(len(acc), np.nan)
    )
    return {
        "accuracy": acc,
        "macro_f1": macro_f1(fit.test, yte, td.n_eval_classes).numpy(),
        "control_accuracy": control,
        "train_accuracy": accuracy(fit.train, torch.from_numpy(y["train"])).numpy(),
    }


def _cumulative(td: TaskData, cfg: ProbeConfig, fit: SiteFit, progress: bool) -> CumulativeFit | None:
    """Cumulative scoring and the scalar mix (None when off, or with a single site), warm-started
    from the per-site probes' test predictions and weights."""
    feats, y = td.feats, td.y
    if not cfg.cumulative or feats["train"].n_sites < 2:
        return None
    return fit_cumulative(
        feats["train"],
        y["train"],
        feats["test"],
        y["test"],
        n_classes=td.n_classes,
        n_eval_classes=td.n_eval_classes,
        config=cfg,
        test_log_probs=fit.test_log_probs,
        init=fit.state,
        progress=progress,
        desc=f"{td.task} cumulative",
    )


def _add_mdl(df, td: TaskData, cfg: ProbeConfig, options: FitOptions) -> None:
    """The online code length columns of the ``by_site`` rows (``cfg.mdl``)."""
    res = online_codelength(
        td.feats["train"],
        td.y["train"],
        n_classes=td.n_classes,
        config=cfg,
        resident=Resident(options.resident_bytes, options.dtype),
        progress=options.progress,
    )
    df["mdl_online_bits"] = res.online_bits
    df["mdl_uniform_bits"] = res.uniform_bits
    df["mdl_compression"] = res.compression


def _training_summary(cfg: ProbeConfig, choice: L2Choice, sites: TrainLog, cumulative: CumulativeFit | None) -> dict:
    """The summary's training columns: the penalty and how it was chosen, convergence, passes."""
    cum = cumulative.log if cumulative is not None else None
    cum_mix = cumulative.mix_log if cumulative is not None else None
    logs = [lg for lg in (sites, cum, cum_mix) if lg is not None]
    return {
        "l2": choice.l2,
        "l2_chosen_on": choice.on,
        "l2_heldout_accuracy": "; ".join(f"{k:g}: {v:.4f}" for k, v in choice.heldout.items()),
        "l2_search_not_converged": choice.not_converged,
        "converged": all(lg.all_converged for lg in logs),
        "hit_max_epochs": any(lg.hit_cap for lg in logs),
        "n_not_converged": int(sum((~lg.converged).sum() for lg in logs)),
        "epochs_sites": sites.epochs,
        "epochs_cumulative": cum.epochs if cum is not None else np.nan,
        "epochs_mix": cum_mix.epochs if cum_mix is not None else np.nan,
        "mix_note": cum_mix.note if cum_mix is not None else "",
        "max_epochs": cfg.max_epochs,
        "stack_draws": cfg.stack_draws if cum is not None else np.nan,
        "stack_folds": cfg.stack_folds if cum is not None else np.nan,
        "stack_l2": cfg.stack_l2 if cum is not None else np.nan,
        "mix_starts": cfg.mix_starts if cum_mix is not None else np.nan,
        "seed": cfg.seed,
        "solver": sites.solver,
    }
