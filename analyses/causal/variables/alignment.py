"""Distributed alignment search (Geiger et al. 2023): learn the subspace of a residual site that a
variable lives in, on train examples, and measure its interchange intervention accuracy (IIA) on
test examples, beside seeded random subspaces of the same dimension (:data:`N_RANDOM` of them: the
table's ``iia_random`` is their mean IIA, ``iia_random_min`` and ``iia_random_max`` their range).

>>> from depthscope.analyses import das
>>> res = das(model, train, test, sites="10.mlp,20.mlp", positions="SUBJ", dim=1)
>>> res.table[["label", "position", "iia", "iia_low", "iia_high", "iia_random"]]
>>> res.subspaces["10.mlp", "SUBJ"].basis          # [d, 1]: the learned direction

=============================  ================================================================
:func:`das`                    one row per (site, position) (the columns of
                               :func:`~depthscope.analyses.causal.variables.iia.interchange`) and
                               the learned :class:`~depthscope.analyses.causal.variables.subspaces.Subspace` s
:class:`DasResult`             ``table`` and ``subspaces`` (by ``(site label, position)``)
:func:`measure_subspaces`      the IIA of learned subspaces on other examples (the columns of
                               :func:`das`, no random control): where ``localize`` chooses its
                               best site on a held-out slice of the train examples
:func:`random_basis`           a seeded random orthonormal basis ``[d, k]``
:func:`random_control`         the IIA of :data:`N_RANDOM` seeded random bases: mean, min, max
=============================  ================================================================

Method, per site and position. The intervention is ``h' = h_base + R Rᵀ (h_source - h_base)``
at the base's position, ``R`` a ``[d, k]`` matrix with orthonormal columns
(``torch.nn.utils.parametrizations.orthogonal``;
:class:`~depthscope.hooks.interventions.RotatedSwap` while it trains,
:class:`~depthscope.hooks.interventions.SubspaceSwap` at test time). ``R`` is trained with Adam
to maximise the log-probability (over the whole vocabulary) of each train example's ``label`` at the base's last
position; nothing else is trained (the model's parameters are out of autograd), and the test
examples are read only after training ends. ``boundless=True`` (Boundless DAS, Wu et al. 2023)
learns a full rotation and a boundary ``b``: the rotated dimensions ``i`` are mixed in with the
weight ``sigmoid((b - i) / t)``, the temperature ``t`` falling from 1 to 0.05 over training and
``b / d`` added to the loss (a smaller subspace is preferred); at test time the first
``round(b)`` dimensions are swapped whole, and ``dim`` reports that count.

Cost. The source vectors at every site are read once (one forward per prompt); the base's key/
value cache before the intervened position is computed once per batch
(:mod:`depthscope.analyses.causal.variables.swaps`), so a training step is one forward of the positions from
the intervened one on and one backward from the logits down to the site (no gradient below it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.causal.variables.config import LocalizeConfig
from depthscope.analyses.causal.variables.counterfactuals import as_counterfactuals, split_examples, tokenize_examples
from depthscope.analyses.causal.variables.iia import (
    _scores,
    _variable,
    finish,
    iia_columns,
    parse_positions,
    resid_sites,
    unchanged,
)
from depthscope.analyses.causal.variables.subspaces import Subspace
from depthscope.analyses.causal.variables.swaps import Runner, frozen, make_batches, site_vectors
from depthscope.common.errors import InputError
from depthscope.common.progress import track
from depthscope.hooks.interventions import RotatedSwap, SubspaceSwap
from depthscope.hooks.model_checks import require_decoder
from depthscope.hooks.sites import site_labels

__all__ = ["das", "DasResult", "measure_subspaces", "random_basis", "random_control", "N_RANDOM"]

#: Boundless DAS: the final temperature of the boundary's sigmoid
FINAL_TEMPERATURE = 0.05
#: the random control: how many seeded random bases are measured per site and position
N_RANDOM = 5


@dataclass
class DasResult:
    """``table``: one row per (site, position); ``subspaces``: the learned subspace of each, by
    ``(site label, position)``; ``info``: the data and settings."""

    table: pd.DataFrame
    subspaces: dict[tuple[str, str], Subspace] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def random_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """A seeded random ``[d, k]`` basis with orthonormal columns (QR of a Gaussian matrix)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def random_control(measure, d: int, k: int, seed: int, n: int = N_RANDOM) -> dict:
    """The IIA of ``n`` random ``[d, k]`` bases (seeds ``seed + 1`` .. ``seed + n``; ``measure(basis)``
    gives per-example hits): ``iia_random`` (their mean), ``iia_random_min``, ``iia_random_max``,
    ``n_random``. One draw can land near the variable's direction or far from it by chance; the
    range says how much the control itself varies."""
    iias = [float(np.mean(measure(random_basis(d, k, seed + i)))) for i in range(1, n + 1)]
    return {"iia_random": sum(iias) / n, "iia_random_min": min(iias), "iia_random_max": max(iias), "n_random": n}


def _target(batch) -> torch.Tensor:
    return batch.candidates.gather(1, batch.label[:, None])[:, 0]


def _train(runner: Runner, source: torch.Tensor, site: int, k: int, cfg: LocalizeConfig, seed: int) -> RotatedSwap:
    """``R`` for one site, trained on the runner's (train) batches."""
    torch.manual_seed(seed)
    d = source.shape[-1]
    rot = RotatedSwap(d, d if cfg.boundless else k, cfg.boundless).to(source.device)
    opt = torch.optim.Adam(rot.parameters(), lr=cfg.lr)
    n_steps = cfg.epochs * len(runner.batches)
    gen = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(cfg.epochs):
        for i in torch.randperm(len(runner.batches), generator=gen).tolist():
            b = runner.batches[i]
            if cfg.boundless:  # geometric from 1 to FINAL_TEMPERATURE
                rot.temperature = FINAL_TEMPERATURE ** (step / max(n_steps - 1, 1))
            src = source[b.rows]
            logits = runner.logits(i, site, rot, src)
            loss = torch.nn.functional.cross_entropy(logits, _target(b))
            if cfg.boundless:
                loss = loss + rot.boundary / d
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    return rot


def _test(runner: Runner, source: torch.Tensor, site: int, r: torch.Tensor):
    """Per-example hits, logit differences and output-token hits of the interchange within ``r`` ``[d, k]``."""
    with torch.no_grad():
        return _scores(runner, site, SubspaceSwap(r), source)


def _hits(runner: Runner, source: torch.Tensor, site: int, r: torch.Tensor):
    """Per-example hits of the interchange within ``r``."""
    return _test(runner, source, site, r)[0]


def _values(source: torch.Tensor, examples, r: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean coordinates of the train sources per value (their label, as the candidate's text)."""
    coords = source @ r.to(source.device)
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(str(e.label), []).append(i)
    return {v: coords[rows].mean(0).detach().cpu() for v, rows in groups.items()}


@dataclass
class _Split:
    """One split at one position: its runner and its source vectors ``[sites, n, d]``."""

    runner: Runner
    source: torch.Tensor


def _split(model, tex, sites, position, cfg) -> _Split:
    _, source = site_vectors(model, tex, sites, position, cfg.batch_size)
    return _Split(Runner(model, make_batches(model, tex, position, cfg.batch_size)), source)


def _position(model, data: tuple, sites: list[int], position: str, k: int, cfg: LocalizeConfig) -> tuple[list, dict]:
    """Rows and subspaces of one position: train, then test and the random control."""
    exs, tex_train, tex_test, p_index = data
    with torch.no_grad():
        tr, te = _split(model, tex_train, sites, position, cfg), _split(model, tex_test, sites, position, cfg)
        floor = unchanged(te.runner)
    rows, subs = [], {}
    labels = site_labels(model.n_layers)
    for j, site in enumerate(track(sites, desc=f"DAS at {position}", unit="site", enabled=cfg.progress)):
        seed = cfg.seed * 1_000_003 + 7919 * site + 104_729 * p_index
        with frozen(model), torch.enable_grad():
            rot = _train(tr.runner, tr.source[j], site, k, cfg, seed)
        r = rot.basis()
        scores = _test(te.runner, te.source[j], site, r)
        rand = random_control(partial(_hits, te.runner, te.source[j], site), model.d_model, max(r.shape[1], 1), seed)
        row = {"site": site, "position": position, "dim": r.shape[1], **iia_columns(*scores)}
        row.update(rand, iia_unchanged=floor)
        rows.append(row)
        info = {"model": model.name, "method": "boundless das" if cfg.boundless else "das", "iia": row["iia"]}
        info.update(n_train=len(tex_train), iia_random=row["iia_random"])
        values = _values(tr.source[j], exs, r)
        subs[labels[site], position] = Subspace(site, labels[site], position, r, values, info)
    return rows, subs


def das(model, train, test=None, sites="resid", positions="END", dim: int = 1, *, boundless=False, config=None):
    """DAS at every residual site of ``sites`` and named position of ``positions`` (see the module
    docstring): trained on ``train``, measured on ``test`` (counterfactual examples: ``.jsonl``
    paths or lists; ``test`` None: a seeded split of ``train`` by ``config.train_fraction``).
    ``config`` (:class:`LocalizeConfig`): epochs, learning rate, batch size, seed, progress; its
    ``dim`` and ``boundless`` are overridden by the arguments. Returns a :class:`DasResult`."""
    cfg = config or LocalizeConfig()
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise InputError(f"dim must be an integer >= 1, got {dim!r}")
    if dim > model.d_model:
        raise InputError(f"dim {dim} is more than the model's width {model.d_model}")
    cfg = replace(cfg, dim=dim, boundless=bool(boundless), method="das")
    require_decoder(model, "DAS")
    exs = as_counterfactuals(train, "train")
    exs_test = as_counterfactuals(test, "test") if test is not None else None
    if exs_test is None:
        exs, exs_test = split_examples(exs, cfg.train_fraction, cfg.seed)
    names = parse_positions(positions)
    tex_train, tex_test = tokenize_examples(model, exs, names), tokenize_examples(model, exs_test, names)
    site_ids = resid_sites(model, sites)
    rows, subs = [], {}
    for p_index, position in enumerate(names):
        got_rows, got_subs = _position(model, (exs, tex_train, tex_test, p_index), site_ids, position, dim, cfg)
        rows += got_rows
        subs.update(got_subs)
    method = "boundless das" if boundless else "das"
    table = finish(rows, model.n_layers, method=method, n_train=len(exs), n_test=len(exs_test), variable=_variable(exs))
    info = {"epochs": cfg.epochs, "lr": cfg.lr, "batch_size": cfg.batch_size, "seed": cfg.seed, "dim": dim}
    return DasResult(table, subs, {**info, "boundless": bool(boundless), "n_train": len(exs), "n_test": len(exs_test)})


def measure_subspaces(model, examples, subspaces, *, config: LocalizeConfig | None = None) -> pd.DataFrame:
    """The IIA of each learned subspace (``subspaces``: :class:`Subspace` s, or the values of
    :attr:`DasResult.subspaces`) on the counterfactual ``examples``: one row per subspace with the
    columns of :func:`das` (``iia_random`` NaN: no random control; ``n_train`` 0: nothing trained
    here). ``config``: batch size."""
    cfg = config or LocalizeConfig()
    subs = list(subspaces.values()) if isinstance(subspaces, dict) else list(subspaces)
    exs = as_counterfactuals(examples)
    names = list(dict.fromkeys(sub.position for sub in subs))
    tex = tokenize_examples(model, exs, names)
    rows = []
    with torch.no_grad():
        for position in names:
            here = [sub for sub in subs if sub.position == position]
            data = _split(model, tex, [sub.site for sub in here], position, cfg)
            floor = unchanged(data.runner)
            for j, sub in enumerate(here):
                scores = _test(data.runner, data.source[j], sub.site, sub.basis)
                row = {"site": sub.site, "position": position, "dim": sub.dim, **iia_columns(*scores)}
                rows.append({**row, "iia_unchanged": floor})
    nan = float("nan")
    const = {"method": "das", "n_train": 0, "n_random": 0, "iia_random": nan, "iia_random_min": nan}
    return finish(rows, model.n_layers, **const, iia_random_max=nan, n_test=len(exs), variable=_variable(exs))
