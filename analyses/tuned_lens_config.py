"""The tuned-lens trainer's settings: one dataclass, torch-free (the command line reads its defaults).

:func:`depthscope.analyses.tuned_lens.train_tuned_lens` takes it; ``depthscope lens-train``
builds it from its options (:class:`depthscope.analyses.jobs.lens.LensTrainConfig` holds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from depthscope.common.errors import InputError
from depthscope.probes.config import check_number


@dataclass(frozen=True)
class TunedLensTraining:
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

    sites: tuple | None = None
    steps: int = 250
    tokens_per_step: int = 8
    cache_tokens: int = 2048
    lr: float = 3e-2
    weight_lr: float = 3e-3
    warmup: int = 10
    window: int | None = 256
    batch_size: int = 8
    max_batch_tokens: int = 1024
    checkpoint_every: int = 25
    resume: bool = True
    seed: int = 0
    matmul_dtype: str = "auto"

    def validate(self) -> TunedLensTraining:
        """Raise :class:`InputError` on a setting that would give no or a wrong lens; returns self."""
        check_number("steps", self.steps, minimum=0)
        check_number("warmup", self.warmup, minimum=0)
        for name in ("tokens_per_step", "cache_tokens", "checkpoint_every", "batch_size", "max_batch_tokens"):
            check_number(name, getattr(self, name))
        check_number("window", self.window, allow_none=True)
        for name in ("lr", "weight_lr"):
            check_number(name, getattr(self, name), minimum=0.0, integer=False)
        if self.matmul_dtype not in ("auto", "bfloat16", "float32"):
            raise InputError(f"matmul_dtype must be auto, bfloat16 or float32, got {self.matmul_dtype!r}")
        return self
