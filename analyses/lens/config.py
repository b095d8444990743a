"""The lens room's settings: frozen dataclasses, torch-free, checked on construction; their fields
declare the ``lens`` and ``lens-train`` options (flags, defaults, bounds, help).

=============================  ==================================================================
:class:`LensConfig`            what ``depthscope lens`` computes
:class:`LensTrainConfig`       what ``depthscope lens-train`` trains (holds a TunedLensTraining)
:class:`TunedLensTraining`     the settings, each bounded (steps, tokens, learning rates, seed)
:func:`training_bytes`         the memory a training run takes: the stream cache and one step
:func:`check_memory`           refuse a run whose memory exceeds what this machine has available
=============================  ==================================================================

:func:`depthscope.analyses.lens.tuned.train_tuned_lens` takes it; ``depthscope lens-train``
builds it from its options (:class:`LensTrainConfig` holds it).
The bounds declared here are constants (a step count that finishes, token counts that fit some
machine); what a model needs of this machine's memory is :func:`check_memory`, called once the
model (its width, sites and vocabulary) is known and before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.defaults import DEFAULT_PROMPT, MAX_TOP_K
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.settings import BATCH, SEED, TOKENS, Checked, Limit, comma_list, memory_bytes, setting

MATMUL_DTYPES = ("auto", "bfloat16", "float32")
#: Adam steps: Belrose et al. train 250; a run of 100000 steps takes days on a CPU
STEPS = Limit(100_000, "a tuned lens converges in hundreds of steps; 100000 already take days")
#: tokens whose streams are cached: 2**24 is 16M tokens, terabytes of streams for a 30-layer model
CACHE_TOKENS = Limit(2**24, "the cache holds every site's stream of each token (see check_memory)")
#: tokens per step: each takes a vocabulary's logits at every site
STEP_TOKENS = Limit(2**16, "each token of a step takes a vocabulary of logits at every site")
#: learning rates: Adam moves each parameter by about lr per step; above 1 it diverges
LR = Limit(1.0, "Adam moves each parameter by about lr per step; larger rates diverge")
#: float32 bytes, and the vocabulary-sized buffers one step holds per token and site (logits,
#: probabilities, their gradient)
FLOAT_BYTES, STEP_BUFFERS = 4, 3


@dataclass(frozen=True)
class TunedLensTraining(Checked):
    """The trainer's settings (the only defaults: the ``lens-train`` command reads them).

    ``sites``: the sites to translate (default all 2L+1; the last keeps the identity). ``steps``
    Adam steps on ``tokens_per_step`` tokens each (x all sites), drawn without replacement from a
    cache of the first ``cache_tokens`` tokens, epoch after epoch. Learning rates: ``lr`` for the
    (RMS-scaled) biases, ``weight_lr`` for the d x d matrices, with ``warmup`` steps of linear
    warm-up then linear decay to 0 at ``steps``. ``window`` / ``batch_size`` /
    ``max_batch_tokens``: how the cache is read (documents cut into windows of at most ``window``
    tokens). A checkpoint every ``checkpoint_every`` steps; ``resume`` continues from one.
    ``matmul_dtype``: "auto" (bfloat16 if the CPU has native bfloat16 matmuls, else float32),
    "bfloat16" or "float32".
    """

    sites: tuple | None = setting(
        None, "--sites", cli_type=str | None, parse=comma_list, help="Comma-separated sites to translate; default all."
    )
    steps: int = setting(
        250,
        "--steps",
        min=0,
        cli_min=1,
        max=STEPS,
        help="Adam steps (bounded; each trains every site on --tokens-per-step tokens).",
    )
    tokens_per_step: int = setting(
        8, "--tokens-per-step", min=1, max=STEP_TOKENS, help="Tokens per step (x all sites)."
    )
    cache_tokens: int = setting(
        2048,
        "--cache-tokens",
        min=1,
        max=CACHE_TOKENS,
        help="Tokens whose streams are captured once and trained on (their memory is checked against the machine's).",
    )
    lr: float = setting(3e-2, "--lr", positive=True, max=LR, help="Learning rate of the (RMS-scaled) biases.")
    weight_lr: float = setting(3e-3, "--weight-lr", positive=True, max=LR, help="Learning rate of the d x d matrices.")
    warmup: int = setting(10, min=0, max=STEPS)
    window: int | None = setting(256, min=2, max=TOKENS)
    batch_size: int = setting(8, min=1, max=BATCH)
    max_batch_tokens: int = setting(1024, min=1, max=TOKENS)
    checkpoint_every: int = setting(25, "--checkpoint-every", min=1, help="Steps between checkpoints.")
    resume: bool = setting(True, "--resume/--no-resume", help="Continue from a checkpoint in OUT (default).")
    seed: int = setting(0, min=0, max=SEED)
    matmul_dtype: str = "auto"

    def check(self) -> None:
        """``matmul_dtype`` is one of :data:`MATMUL_DTYPES`."""
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise InputError(f"matmul_dtype must be auto, bfloat16 or float32, got {self.matmul_dtype!r}")


def training_bytes(cfg: TunedLensTraining, *, sites: int, d_model: int, vocab: int) -> tuple[int, int]:
    """The bytes a training run of ``cfg`` holds: the stream cache (``cache_tokens`` x ``sites``
    (the trained sites and the last) x ``d_model`` floats) and one step (``tokens_per_step`` x
    ``sites`` x (:data:`STEP_BUFFERS` vocabulary-sized buffers + the step's streams))."""
    cache = cfg.cache_tokens * sites * d_model * FLOAT_BYTES
    step = cfg.tokens_per_step * sites * (STEP_BUFFERS * vocab + 2 * d_model) * FLOAT_BYTES
    return cache, step


def check_memory(cfg: TunedLensTraining, *, sites: int, d_model: int, vocab: int, available: int | None = None) -> None:
    """Refuse ``cfg`` when its stream cache and one step (:func:`training_bytes`) need more than
    the ``available`` memory (default: this machine's available memory; unknown: no check), with
    the largest ``--cache-tokens`` and ``--tokens-per-step`` that fit named. Called once the model
    is known, before the cache is allocated."""
    available = memory_bytes("available") if available is None else available
    if available is None:
        return
    cache, step = training_bytes(cfg, sites=sites, d_model=d_model, vocab=vocab)
    if cache + step <= available:
        return
    gib = 2**30
    fit_cache = max(0, (available - step) // (sites * d_model * FLOAT_BYTES))
    fit_step = max(0, (available - cache) // (sites * (STEP_BUFFERS * vocab + 2 * d_model) * FLOAT_BYTES))
    raise InputError(
        f"--cache-tokens {cfg.cache_tokens} and --tokens-per-step {cfg.tokens_per_step} need "
        f"{(cache + step) / gib:.2f} GiB ({cache / gib:.2f} GiB of cached streams: tokens x {sites} sites x "
        f"d_model {d_model} x 4 bytes; {step / gib:.2f} GiB per step: tokens x {sites} sites x vocabulary "
        f"{vocab} logits) but this machine has {available / gib:.2f} GiB available; at most about "
        f"--cache-tokens {fit_cache} with these --tokens-per-step, or --tokens-per-step {fit_step} with this cache"
    )


@dataclass(frozen=True)
class LensConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.lens.lens_job` computes. ``sites``: labels/indices
    (None: all); ``text``: how the text is read (the BOS rule, window, stride and caps every
    free-text analysis shares; ``max_tokens`` counts the positions decoded); ``tuned``: a tuned
    lens folder to compare with the plain logit lens; ``source``: the text's name (figure title);
    ``top_k`` at most :data:`MAX_TOP_K`. Checked on construction; the fields declare the ``lens``
    options."""

    prompt: str = setting(
        DEFAULT_PROMPT, "--prompt", "-p", help="Prompt for the per-token heatmap and rank trajectories."
    )
    sites: Sequence | None = setting(
        None,
        "--sites",
        cli_type=str | None,
        parse=comma_list,
        help="Comma-separated sites (e.g. 'embed,10.attn,29.mlp'); default all.",
    )
    batch_size: int = setting(8, "--batch-size", min=1, max=BATCH, help="Windows per forward pass.")
    text: TextWindows = setting(factory=TextWindows)
    first_position: bool = setting(
        True,
        "--first-position/--skip-first-position",
        help="Include position 0 of every window (default) or skip it (attention sink).",
    )
    top_k: int = setting(
        5,
        "--top-k",
        min=1,
        max=MAX_TOP_K,
        help=f"Top tokens per position and site in the token table (at most {MAX_TOP_K} and the vocabulary).",
    )
    tuned: Path | None = setting(
        None, "--tuned", help="A tuned lens folder (from lens-train) to compare with the plain logit lens."
    )
    source: str | None = None
    progress: bool = False

    def check(self) -> None:
        """``top_k`` at most :data:`MAX_TOP_K`; a prompt."""
        if self.top_k > MAX_TOP_K:
            raise InputError(f"top_k must be at most {MAX_TOP_K} (three table columns each), got {self.top_k}")
        if not self.prompt:
            raise InputError("the prompt is empty")


@dataclass(frozen=True)
class LensTrainConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.lens.lens_train_job` trains: ``training`` (the
    trainer's settings, :class:`~depthscope.analyses.lens.config.TunedLensTraining`) and
    ``eval_tokens`` held-out tokens (from the last tenth of the documents) to compare it with the logit lens (0: no
    comparison). Checked on construction; the fields declare the ``lens-train`` options."""

    training: TunedLensTraining = setting(factory=TunedLensTraining)
    eval_tokens: int = setting(
        128,
        "--eval-tokens",
        min=0,
        help="Held-out tokens (the last tenth of the documents) to compare with the logit lens; 0 to skip.",
    )
    progress: bool = True

    def check(self) -> None:
        """The trainer's settings too."""
        self.training.validate()
