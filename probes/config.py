"""Probe settings as configuration objects: their defaults are depthscope's only defaults.

=====================  ========================================================================
object                 holds
=====================  ========================================================================
``ProbeConfig``        the classifier and its training: kind, L2 (or ``"auto"``: per task on
                       held-out data), solver, convergence tolerances, the epoch cap, Adam's
                       steps/step size/batch, hidden units, control task, cumulative scoring,
                       MDL, seed, compute precision
``ExtractionConfig``   how activations are taken: pooling, sites, context, store folder and
                       dtype, batch and passage lengths, BOS, memory for resident features
``DataConfig``         what data is used: sentence caps per split, train/test overlap, coref
                       pair sampling
``override(configs,
kw)``                  new configs with loose keyword settings applied; an unknown name is an
                       :class:`~depthscope.common.errors.InputError` that lists the valid ones
=====================  ========================================================================

They follow scikit-learn's estimator conventions: hyper-parameters only, stored as given, no
work and no validation in ``__init__``; ``validate()`` checks them when a run starts.
``run_probes``, ``depthscope probe``, ``depthscope run``, sweeps and the probe job read these
defaults (the command-line options take theirs from here), so every entry point runs the
same protocol. Probes are trained to convergence (``max_epochs`` is only a cap that warns), so
the answer does not depend on how long training runs (it did with a fixed 12 or 6 epochs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

PROBES = ("linear", "mlp")
#: span pooling: one row per span (last, first, mean subword) or its subwords (attn)
POOLINGS = ("last", "first", "mean", "attn")
#: passages a span is seen in: its sentence, or its document up to the sentence
CONTEXTS = ("sentence", "document")
OVERLAP = ("drop", "keep", "error")
PRECISIONS = ("auto", "float32", "bfloat16")
STORE_DTYPES = ("float16", "float32")
SOLVERS = ("auto", "subspace", "lbfgs", "adam")
#: the penalties ``l2="auto"`` chooses from, per task, by held-out accuracy (mean over sites):
#: half-decades around 1e-3, the value EWT dev picked at most sites for upos on the default model
#: (weaker penalties, 1e-4 and below, leave near-separable problems that take hundreds of passes
#: to converge, for no held-out gain there)
L2_GRID = (3e-3, 1e-2, 3e-2, 1e-1)
#: where the grid may grow: when the best held-out accuracy is at an end of the values tried,
#: the next half-decade beyond it is tried too (one at a time, up to the ladder's ends), so the
#: grid's ends do not decide the penalty
L2_LADDER = (1e-4, 3e-4, 1e-3) + L2_GRID + (3e-1, 1.0, 3.0)
#: the penalty is chosen on this many evenly spaced sites (first and last included)
L2_SITES = 16


def _error(msg: str) -> Exception:
    from depthscope.common.errors import InputError  # here, not at import: this module stays import-cheap

    return InputError(msg)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise _error(f"{name} must be one of {allowed}, got {value!r}")


def check_number(name: str, value, *, minimum: float = 1, integer: bool = True, allow_none: bool = False) -> None:
    """The one numeric check of every configuration: ``value`` is a finite number (an integer when
    ``integer``) of at least ``minimum`` (``minimum=0.0`` with ``integer=False``: greater than 0),
    or None when ``allow_none``; else an :class:`~depthscope.common.errors.InputError` naming it."""
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = value >= minimum
    elif ok:
        ok = value > 0 if minimum == 0.0 else value >= minimum
    if not ok:
        what = "an integer" if integer else "a finite number"
        bound = f">= {minimum}" if integer or minimum != 0.0 else "> 0"
        raise _error(f"{name} must be {what} {bound}, got {value!r}")


def _positive(name: str, value, *, allow_none: bool = False) -> None:
    check_number(name, value, minimum=0.0, integer=False, allow_none=allow_none)


@dataclass
class ProbeConfig:
    """The probe and its training (one protocol for every entry point).

    ``probe``: ``linear`` (softmax regression) or ``mlp`` (one hidden ReLU layer of ``hidden``
    units). ``l2``: the penalty on mean cross-entropy (scikit-learn ``C = 1 / (2 * l2 *
    n_train)``), or ``"auto"``: one value per task from ``L2_GRID`` (grown along ``L2_LADDER``
    while the best is at an end of the values tried): the strongest value whose held-out
    accuracy, averaged over sites (on the dev split when there is one, else over ``l2_folds``
    folds of train), is within one standard error of the best (the one-standard-error rule);
    the per-site probes, the control
    task, the cumulative and scalar mixes and MDL all use it. ``"dev"`` is the same, and
    requires a dev split. ``solver``: ``subspace`` (full batch, per-site linear probes
    over resident features: :mod:`depthscope.probes.solvers.subspace`; the scalar mixes, which it does not
    fit, by L-BFGS), ``lbfgs`` (full batch, every linear probe over resident features, K-FAC
    preconditioned), ``adam`` (minibatch) or ``auto`` (``subspace``, or ``adam`` where features
    are not resident or the probe is an MLP); the two full-batch solvers need ``probe="linear"``. Training stops when
    every probe has converged (largest gradient entry <= ``gtol``, or relative objective change
    <= ``tol`` twice in a row; :mod:`depthscope.probes.solvers.training`), or at ``max_epochs`` passes
    over train, with a warning and ``converged = False`` in the tables. ``lr``, ``min_steps``,
    ``batch_size`` (None: :func:`~depthscope.probes.solvers.training.auto_batch`): the Adam solver's.
    ``control``: train Hewitt & Liang's control task beside (selectivity); ``cumulative``:
    Tenney's cumulative scoring and scalar mix (E_Delta, E_s); ``stack_draws``: how many fold
    draws the cumulative probes are stacked on, their test accuracies averaged (each draw
    refits the per-site probes on each fold: more draws, less of the draw's noise in E_Delta);
    ``stack_folds``: the folds of train each draw's out-of-fold predictions come from (more
    folds: fold probes nearer the full-train ones, less noise per draw, one more refit each);
    ``stack_l2``: the ridge on the cumulative probes' stacking weights (adjacent sites'
    predictions are nearly collinear; a stronger ridge spreads weight over more sites and, on
    the bundled sample, raises both the last prefix's accuracy and E_Delta: see
    ``docs/tenney_comparison.md``, Stability);
    ``mdl``: online codelengths
    (ten more fits). ``seed``: sampling, control labels and training. ``precision``: what the
    resident features and their products are stored and computed in: ``float32`` (the default,
    on every machine, so results never depend on the CPU), ``bfloat16``, or ``auto`` (bfloat16
    where the CPU multiplies it natively: :func:`~depthscope.probes.solvers.cpu.resolve_precision`).
    """

    probe: str = "linear"
    l2: float | str = "auto"
    l2_folds: int = 2
    solver: str = "auto"
    max_epochs: int = 200
    tol: float = 1e-5
    gtol: float = 5e-4
    min_steps: int = 100
    lr: float = 1e-2
    batch_size: int | None = None
    hidden: int = 256
    control: bool = True
    cumulative: bool = True
    stack_draws: int = 2
    stack_folds: int = 2
    stack_l2: float = 1e-2
    mdl: bool = False
    seed: int = 0
    precision: str = "float32"

    def validate(self) -> ProbeConfig:
        _choice("probe", self.probe, PROBES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("solver", self.solver, SOLVERS)
        if self.solver in ("subspace", "lbfgs") and self.probe != "linear":
            raise _error(
                f"solver {self.solver!r} fits linear probes; probe={self.probe!r} trains with 'adam' (or 'auto')"
            )
        numeric = isinstance(self.l2, (int, float)) and not isinstance(self.l2, bool)
        if not (self.l2 in ("auto", "dev") or (numeric and math.isfinite(self.l2) and self.l2 >= 0)):
            raise _error(f"l2 must be a finite non-negative number, 'auto' or 'dev', got {self.l2!r}")
        for name in ("max_epochs", "hidden"):
            check_number(name, getattr(self, name))
        check_number("l2_folds", self.l2_folds, minimum=2)
        check_number("stack_draws", self.stack_draws)
        check_number("stack_folds", self.stack_folds, minimum=2)
        _positive("stack_l2", self.stack_l2)
        for name in ("lr", "tol", "gtol"):
            _positive(name, getattr(self, name))
        check_number("batch_size", self.batch_size, allow_none=True)
        check_number("seed", self.seed, minimum=0)
        if not isinstance(self.min_steps, int) or self.min_steps < 0:
            raise _error(f"min_steps must be a non-negative integer, got {self.min_steps!r}")
        if not isinstance(self.l2_folds, int) or self.l2_folds < 2:
            raise _error(f"l2_folds must be an integer >= 2, got {self.l2_folds!r}")
        if not isinstance(self.max_epochs, int):
            raise _error(f"max_epochs must be a positive integer, got {self.max_epochs!r}")
        return self


@dataclass
class ExtractionConfig:
    """How activations are extracted and held.

    ``pooling``: ``last`` | ``first`` | ``mean`` | ``attn`` (span subwords). ``sites``:
    indices or labels (None: all 2L+1). ``context``: ``sentence`` or ``document`` for every
    task (None: document for coref, sentence otherwise). ``store_dir``: the activation store
    (None: ``<cache>/activations``), reused on re-runs; ``store_dtype``: its values (float16 or
    float32). ``batch_tokens``: padded tokens per forward batch; ``max_tokens``: passage cap
    (and the model's context). ``bos``: when the tokenizer adds no special token at the start
    (SmolLM2, GPT-2), prepend its BOS (else EOS) token, as TransformerLens does by default, so
    the first word is not the model's attention sink (without it, from SmolLM2-135M's 11.mlp
    the first word's upos accuracy falls from ~0.80 to ~0.67). ``resident_bytes``: memory for
    the standardised features held in RAM during fitting (else streamed from the store).
    ``shards``: write the store as this many shards (corpus slices, :mod:`.shards`; a re-run
    redoes only missing ones); ``engine``: ``local`` or ``ray`` (one Ray task per shard on a
    local Ray with ``workers`` CPUs, each loading the model from its source).
    """

    pooling: str = "last"
    sites: Sequence | None = None
    context: str | None = None
    store_dir: str | None = None
    store_dtype: str = "float16"
    batch_tokens: int = 2048
    max_tokens: int = 512
    bos: bool = True
    resident_bytes: float = 4e9
    shards: int = 1
    engine: str = "local"
    workers: int = 2

    def validate(self) -> ExtractionConfig:
        _choice("pooling", self.pooling, POOLINGS)
        _choice("store_dtype", self.store_dtype, STORE_DTYPES)
        if self.context is not None:
            _choice("context", self.context, CONTEXTS)
        _choice("engine", self.engine, ("local", "ray"))
        for name in ("batch_tokens", "max_tokens", "shards", "workers"):
            check_number(name, getattr(self, name))
        _positive("resident_bytes", self.resident_bytes)
        return self


@dataclass
class DataConfig:
    """Which examples are used.

    ``max_train_sentences`` / ``max_test_sentences`` / ``max_dev_sentences``: caps per split
    (whole documents, seeded; None: all). ``overlap``: test sentences whose text also occurs in
    train are ``drop``-ped (with a warning), ``keep``-t (warning) or an ``error``.
    ``coref_window``: a coref pair's first mention at most this many sentences before the
    second; ``coref_neg_ratio``: negatives sampled per positive pair.
    """

    max_train_sentences: int | None = None
    max_test_sentences: int | None = None
    max_dev_sentences: int | None = None
    overlap: str = "drop"
    coref_window: int = 2
    coref_neg_ratio: float = 1.0

    def validate(self) -> DataConfig:
        _choice("overlap", self.overlap, OVERLAP)
        for name in ("max_train_sentences", "max_test_sentences", "max_dev_sentences"):
            check_number(name, getattr(self, name), allow_none=True)
        _positive("coref_neg_ratio", self.coref_neg_ratio)
        if not isinstance(self.coref_window, int) or self.coref_window < 0:
            raise _error(f"coref_window must be a non-negative integer, got {self.coref_window!r}")
        return self


def field_names(cls) -> list:
    return [f.name for f in fields(cls)]


def override(configs: Sequence, overrides: dict) -> list:
    """Copies of ``configs`` (dataclass instances) with each loose ``name=value`` of
    ``overrides`` applied to the config that has that field; an unknown name raises
    :class:`~depthscope.common.errors.InputError` listing every valid one."""
    owner = {}
    for i, c in enumerate(configs):
        for n in field_names(type(c)):
            owner.setdefault(n, i)
    unknown = sorted(set(overrides) - set(owner))
    if unknown:
        valid = ", ".join(n for c in configs for n in field_names(type(c)))
        raise _error(f"unknown probe setting(s) {', '.join(unknown)}; valid: {valid}")
    out = list(configs)
    for i, c in enumerate(configs):
        mine = {k: v for k, v in overrides.items() if owner[k] == i}
        if mine:
            out[i] = dataclasses.replace(c, **mine)
    return out
