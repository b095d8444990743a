"""The tuned-lens trainer's settings: one frozen dataclass, torch-free, checked on construction;
its fields declare the ``lens-train`` options (flags, defaults, bounds, help).

:func:`depthscope.analyses.tuned_lens.train_tuned_lens` takes it; ``depthscope lens-train``
builds it from its options (:class:`depthscope.analyses.jobs.configs.LensTrainConfig` holds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from depthscope.common.errors import InputError
from depthscope.common.settings import Checked, comma_list, setting

MATMUL_DTYPES = ("auto", "bfloat16", "float32")


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
        help="Adam steps (bounded; each trains every site on --tokens-per-step tokens).",
    )
    tokens_per_step: int = setting(8, "--tokens-per-step", min=1, help="Tokens per step (x all sites).")
    cache_tokens: int = setting(
        2048, "--cache-tokens", min=1, help="Tokens whose streams are captured once and trained on."
    )
    lr: float = setting(3e-2, "--lr", positive=True, help="Learning rate of the (RMS-scaled) biases.")
    weight_lr: float = setting(3e-3, "--weight-lr", positive=True, help="Learning rate of the d x d matrices.")
    warmup: int = setting(10, min=0)
    window: int | None = setting(256, min=1)
    batch_size: int = setting(8, min=1)
    max_batch_tokens: int = setting(1024, min=1)
    checkpoint_every: int = setting(25, "--checkpoint-every", min=1, help="Steps between checkpoints.")
    resume: bool = setting(True, "--resume/--no-resume", help="Continue from a checkpoint in OUT (default).")
    seed: int = 0
    matmul_dtype: str = "auto"

    def check(self) -> None:
        """``matmul_dtype`` is one of :data:`MATMUL_DTYPES`."""
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise InputError(f"matmul_dtype must be auto, bfloat16 or float32, got {self.matmul_dtype!r}")
