"""Probe settings as configuration objects: their defaults are depthscope's only defaults.

=====================  ========================================================================
object                 holds
=====================  ========================================================================
``ProbeConfig``        the classifier and its training: kind, L2 (or ``"auto"``: per task on
                       held-out data), solver, convergence tolerances, the epoch cap, Adam's
                       steps/step size/batch, hidden units, control task, cumulative scoring,
                       MDL, seed, compute precision, the probe solvers' device
``ExtractionConfig``   how activations are taken: pooling, sites, context, store folder and
                       dtype, batch and passage lengths, BOS, memory for resident features
``DataConfig``         what data is used: sentence caps per split, train/test overlap, coref
                       pair sampling
``override(configs,
kw)``                  new configs with loose keyword settings applied; an unknown name is an
                       :class:`~depthscope.common.errors.InputError` that lists the valid ones
=====================  ========================================================================

They follow scikit-learn's estimator conventions: hyper-parameters only, stored as given
(frozen), no work and no validation in ``__init__``; ``validate()`` checks them when a run
starts. Each field declares its bounds and, for the settings the command line offers, its flag
and help (:func:`~depthscope.common.settings.setting`): ``run_probes``, ``depthscope probe``,
``depthscope run``, sweeps and the probe job read these defaults, so every entry point runs the
same protocol. Probes are trained to convergence (``max_epochs`` is only a cap that warns), so
the answer does not depend on how long training runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from depthscope.common.errors import InputError
from depthscope.common.settings import CPUS, SEED, TOKENS, Limit, Settings, comma_list, memory_bytes, setting
from depthscope.hooks.sites import check_site_names

PROBES = ("linear", "mlp")
#: ``probe`` settings: one kind, or ``both`` (a linear and an MLP probe fitted in one run, on one extraction)
PROBE_CHOICES = PROBES + ("both",)
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
#: the strongest penalty a probe takes (``--l2``, ``--stack-l2``): on standardised features a
#: probe's weights shrink as 1/l2, and from about 1 upwards it predicts the class prior (the
#: majority baseline) whatever the site; at 1e5 and beyond the solvers no longer converge, and
#: at 1e20 the accuracy falls below the majority baseline. 1e3 keeps the ladder's top (3) far inside.
L2_MAX = Limit(1e3, "stronger penalties leave a probe that predicts the class prior, then stop converging")
#: Adam learning rates, tolerances: a relative change or gradient entry of 1 is no convergence test
UNIT = Limit(1.0, "a learning rate or tolerance above 1 does not converge to anything")
#: passes and steps: probes converge in tens to hundreds of passes; a cap beyond this only hangs
MAX_EPOCHS = Limit(100_000, "probes converge in tens to hundreds of passes; more would only run for days")
#: fold draws and folds: each draw refits every site probe on each fold
MAX_DRAWS = Limit(100, "each draw refits every site probe on each fold; 100 draws take 100 x the time of one")
MAX_STARTS = Limit(16, "each start costs one scalar-mix fit; on the bundled sample every start found the same mix")
MAX_FOLDS = Limit(20, "each fold refits every site probe; beyond 20 the fold probes differ by under 5% of the data")
#: memory for resident features: at most this machine's (never below the 4 GB default, which
#: streams what does not fit)
RESIDENT = Limit(
    lambda: max(4e9, memory_bytes("total") or 2**50),
    lambda: f"this machine's memory, {(memory_bytes('total') or 0) / 2**30:.1f} GiB",
)


def probe_kinds(probe: str) -> tuple:
    """The probe kinds a ``probe`` setting fits: ``both`` is :data:`PROBES`, else the one named."""
    return PROBES if probe == "both" else (probe,)


def parse_l2(text: str) -> float | str:
    """The ``--l2`` option's value: ``auto``, ``dev`` or a finite number >= 0."""
    try:
        l2 = text if text in ("auto", "dev") else float(text)
    except ValueError:
        raise InputError(f"--l2 must be a number, 'auto' or 'dev', got {text!r}") from None
    if l2 not in ("dev", "auto"):
        check_l2("--l2", l2)
    return l2


def check_l2(name: str, l2) -> None:
    """``l2`` is a penalty from 0 (none) to :data:`L2_MAX`, ``"auto"`` or ``"dev"``."""
    if l2 in ("auto", "dev"):
        return
    numeric = isinstance(l2, (int, float)) and not isinstance(l2, bool)
    if not (numeric and (isinstance(l2, int) or math.isfinite(l2)) and l2 >= 0):
        raise InputError(f"{name} must be a finite number >= 0 (0: no penalty), 'auto' or 'dev', got {l2!r}")
    if l2 > L2_MAX.get():
        raise InputError(f"{name} must be at most {L2_MAX.get():g} ({L2_MAX.reason()}), got {l2!r:.40}")


@dataclass(frozen=True)
class ProbeConfig(Settings):
    """The probe and its training (one protocol for every entry point).

    ``probe``: ``linear`` (softmax regression), ``mlp`` (one hidden ReLU layer of ``hidden``
    units) or ``both`` (each task fitted with each, on one extraction; the tables' ``probe``
    column tells them apart). ``probe_rank``: the rows of the structural probes' map
    (tasks ``structural`` and ``depth``, :mod:`depthscope.probes.structural`). ``l2``: the
    penalty on mean cross-entropy (scikit-learn ``C = 1 / (2 * l2 * n_train)``), or
    ``"auto"``: one value per task from ``L2_GRID`` (grown along ``L2_LADDER``
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
    ``device``: where the resident features are held and the full-batch solvers compute over
    them: ``cpu`` (the default), ``cuda``, ``cuda:N`` or ``auto`` (the first GPU when torch sees
    one, else the CPU); the features are copied there once, the probes' parameters stay on the
    CPU between fits. A GPU that is not there is a
    :class:`~depthscope.hooks.devices.DeviceError` when the settings are checked.
    """

    probe: str = setting(
        "linear",
        "--probe",
        choices=PROBE_CHOICES,
        help="linear (softmax regression), mlp (one hidden layer), or both (the two side by side, one extraction).",
    )
    l2: float | str = setting(
        "auto",
        "--l2",
        cli_type=str,
        show=str,
        parse=parse_l2,
        help="L2 penalty on mean cross-entropy (sklearn C = 1/(2*l2*n); 0: none), or 'auto': one per task from "
        "the grid 3e-3 .. 1e-1 (L2_GRID, grown by half-decades from 1e-4 to 3 while the best is at its end) "
        "by held-out accuracy (on --dev when given, else on folds of train).",
    )
    l2_folds: int = setting(2, min=2, max=MAX_FOLDS)
    solver: str = setting("auto", choices=SOLVERS)
    max_epochs: int = setting(
        200,
        "--max-epochs",
        min=1,
        max=MAX_EPOCHS,
        help="Cap on passes over train: probes train until they converge; "
        "hitting the cap warns and is recorded (converged=False).",
    )
    tol: float = setting(1e-5, positive=True, max=UNIT)
    gtol: float = setting(5e-4, positive=True, max=UNIT)
    min_steps: int = setting(100, min=0, max=MAX_EPOCHS)
    lr: float = setting(1e-2, positive=True, max=UNIT)
    batch_size: int | None = setting(None, min=1, max=TOKENS)
    hidden: int = setting(256, min=1, max=Limit(2**16, "hidden units; 65536 are already 65536 x d weights per site"))
    probe_rank: int = setting(
        64,
        "--probe-rank",
        min=1,
        max=Limit(4096, "rows of the structural probes' map; beyond the model width they add nothing"),
        help="Rank of the structural probes' linear map B (tasks structural, depth; Hewitt & Manning 2019).",
    )
    control: bool = True
    cumulative: bool = True
    stack_draws: int = setting(
        2,
        "--stack-draws",
        min=1,
        max=MAX_DRAWS,
        help="Fold draws the cumulative probes (E_Delta) are stacked on; their accuracies are averaged and "
        "the interval resamples them. Each draw refits every site probe on each fold.",
    )
    stack_folds: int = setting(
        2,
        "--stack-folds",
        min=2,
        max=MAX_FOLDS,
        help="Folds of train each fold draw's out-of-fold predictions come from (more folds: less noise "
        "per draw in E_Delta, one more refit of every site probe each).",
    )
    #: folds of train the scalar mix is refitted without, one at a time, for E_s's range and the spread
    #: of its weights (0: no refits; each costs about half a mix fit, warm-started; probes/mixing.py)
    mix_folds: int = setting(
        0,
        "--mix-folds",
        min=0,
        max=MAX_FOLDS,
        help="Refit the scalar mix without each of this many folds of train: the range of E_s over the "
        "refits (expected_layer_mix_lo/_hi; 0: none, 2 or more: that many refits).",
    )
    #: starts of the scalar mix's fit on all of train (the uniform mix, then seeded random mixes; the lowest
    #: objective is kept, and the summary's mix_note says when two starts end at different mixes that tie).
    #: One by default: on the bundled sample a second start found the same mix (docs/tenney_comparison.md)
    mix_starts: int = setting(
        1,
        "--mix-starts",
        min=1,
        max=MAX_STARTS,
        help="Starts of the scalar mix's fit (the uniform mix, then seeded random ones): the lowest objective "
        "is kept, and mix_note says when two tie at different weights. Each start costs one mix fit.",
    )
    stack_l2: float = setting(
        1e-2,
        "--stack-l2",
        positive=True,
        max=L2_MAX,
        help="Ridge (> 0; 0 is refused) on the cumulative probes' stacking weights (stronger: weight spread "
        "over more sites; E_Delta depends on it, see docs/tenney_comparison.md).",
    )
    mdl: bool = setting(
        False, "--mdl/--no-mdl", help="Also compute MDL online codelength (Voita & Titov 2020); costly."
    )
    seed: int = setting(
        0, "--seed", min=0, max=SEED, help="Seed for sampling, control tasks and training (0 .. 2**32-1)."
    )
    precision: str = setting(
        "float32",
        "--precision",
        choices=PRECISIONS,
        help="Feature precision: float32 (the default on every machine), bfloat16, or auto "
        "(bfloat16 only on CPUs with native bf16, see depthscope.probes.solvers.cpu).",
    )
    device: str = setting(
        "cpu",
        "--probe-device",
        param="probe_device",
        help="Where the probes' resident features live and their solvers compute: cpu (default), cuda, cuda:N, "
        "or auto (a GPU when torch sees one). The features are copied there once per task.",
    )

    def check(self) -> None:
        """The solver fits the probe kind; ``l2`` is a penalty (at most :data:`L2_MAX`) or a rule."""
        if self.solver in ("subspace", "lbfgs") and self.probe != "linear":
            raise InputError(
                f"solver {self.solver!r} fits linear probes; probe={self.probe!r} trains with 'adam' (or 'auto')"
            )
        check_l2("l2", self.l2)
        if self.device != "cpu":
            probe_device(self.device)


def probe_device(name: str):
    """The ``torch.device`` of a ``ProbeConfig.device`` value (``cpu``, ``cuda``, ``cuda:N``,
    ``auto``); a GPU that is not there, or another kind of device, is a
    :class:`~depthscope.hooks.devices.DeviceError` naming ``--probe-device``. Imports torch (this
    module does not otherwise: the command line's options are built from it)."""
    from depthscope.hooks.devices import DeviceError, resolve_device

    try:
        dev = resolve_device(name)
    except DeviceError as e:  # its message names the model's --device option
        msg = str(e).replace("--device", "--probe-device")
        raise DeviceError(msg if msg.startswith("--probe-device") else f"--probe-device {name}: {msg}") from None
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(
            f"--probe-device {name}: the probe solvers run on cpu or cuda (they compute partly in float64)"
        )
    return dev


@dataclass(frozen=True)
class ExtractionConfig(Settings):
    """How activations are extracted and held.

    ``pooling``: ``last`` | ``first`` | ``mean`` | ``attn`` (span subwords). ``sites``:
    indices or labels (None: all 2L+1). ``context``: ``sentence`` or ``document`` for every
    task (None: document for coref, sentence otherwise). ``store_dir``: the activation store
    (None: ``<cache>/activations``), reused on re-runs; ``store_dtype``: its values (float16 or
    float32). ``batch_tokens``: padded tokens per forward batch; ``max_tokens``: passage cap
    (and the model's context). ``bos``: when the tokenizer adds no special token at the start
    (SmolLM2, GPT-2), prepend its BOS (else EOS) token, as TransformerLens does by default, so
    the first word is not the model's attention sink (whose stream is a poor feature of the
    word). ``resident_bytes``: memory for
    the standardised features held in RAM during fitting (else streamed from the store).
    ``shards``: write the store as this many shards (corpus slices, :mod:`.shards`; a re-run
    redoes only missing ones); ``engine``: ``local`` or ``ray`` (one Ray task per shard on a
    local Ray with ``workers`` CPUs, each loading the model from its source).
    """

    pooling: str = setting(
        "last",
        "--pooling",
        choices=POOLINGS,
        help="Span pooling: last (default for decoders), first, mean, attn (self-attentive).",
    )
    sites: Sequence | None = setting(
        None,
        "--sites",
        cli_type=str | None,
        parse=comma_list,
        check=lambda name, value: check_site_names(value),
        help="Comma-separated residual sites (embed, <layer>.attn, <layer>.mlp, or indices 0..2L); default all 2L+1.",
    )
    context: str | None = setting(
        None,
        "--context",
        choices=CONTEXTS,
        help="sentence or document for every task (default: document for coref only).",
    )
    store_dir: str | None = setting(
        None,
        "--store",
        cli_type=Path | None,
        help="Activation store folder (default: <cache>/activations); reused on re-runs.",
    )
    store_dtype: str = setting(
        "float16",
        "--float32/--float16",
        choices=STORE_DTYPES,
        cli_type=bool,
        show=lambda dtype: dtype == "float32",
        parse=lambda wide: "float32" if wide else "float16",
        help="Store activations as float32 (default float16).",
    )
    batch_tokens: int = setting(2048, min=1, max=TOKENS)
    max_tokens: int = setting(512, min=1, max=TOKENS)
    bos: bool = setting(
        True,
        "--bos/--no-bos",
        help="Prepend the BOS (else EOS) token when the tokenizer adds none, so no word is the attention sink.",
    )
    resident_bytes: float = setting(4e9, positive=True, max=RESIDENT)
    shards: int = setting(
        1,
        "--shards",
        min=1,
        max=Limit(4096, "one shard per corpus slice; more only add files and model loads"),
        help="Write the activation store as N shards (a re-run redoes only missing ones; 1: one store).",
    )
    engine: str = setting(
        "local", "--engine", choices=("local", "ray"), help="Extraction engine: local, or ray (one Ray task per shard)."
    )
    workers: int = setting(2, "--workers", min=1, max=CPUS, help="CPUs of the local Ray (--engine ray).")


@dataclass(frozen=True)
class DataConfig(Settings):
    """Which examples are used.

    ``max_train_sentences`` / ``max_test_sentences`` / ``max_dev_sentences``: caps per split
    (whole documents, seeded; None: all). ``overlap``: test sentences whose text also occurs in
    train are ``drop``-ped (with a warning), ``keep``-t (warning) or an ``error``.
    ``coref_window``: a coref pair's first mention at most this many sentences before the
    second; ``coref_neg_ratio``: negatives sampled per positive pair.
    """

    max_train_sentences: int | None = setting(
        None, "--max-train-sentences", min=1, help="Cap train at N sentences (whole documents, seeded)."
    )
    max_test_sentences: int | None = setting(None, "--max-test-sentences", min=1, help="Cap test at N sentences.")
    max_dev_sentences: int | None = setting(None, "--max-dev-sentences", min=1, help="Cap dev at N sentences.")
    overlap: str = setting(
        "drop",
        "--overlap",
        choices=OVERLAP,
        help="Test sentences also in train: drop (default), keep, or error.",
    )
    coref_window: int = setting(2, min=0, max=Limit(1000, "sentences between mentions; a document is shorter"))
    coref_neg_ratio: float = setting(1.0, positive=True, max=Limit(1000, "negatives per positive pair"))


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
        raise InputError(f"unknown probe setting(s) {', '.join(unknown)}; valid: {valid}")
    out = list(configs)
    for i, c in enumerate(configs):
        mine = {k: v for k, v in overrides.items() if owner[k] == i}
        if mine:
            out[i] = dataclasses.replace(c, **mine)
    return out
