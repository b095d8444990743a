"""The settings of SAE training (``depthscope sae train``), apart from the trainer so that the
command line reads them without importing torch.

=========================  ==================================================================
:class:`SaeTrainConfig`    latents, k, tokens, held-out tokens, epochs, batch size, learning
                           rate, AuxK coefficient, dead-latent window, seed, and how the text
                           is read (a :class:`~depthscope.analyses.text_settings.TextWindows`)
=========================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.settings import Checked, setting


@dataclass(frozen=True)
class SaeTrainConfig(Checked):
    """What :func:`train_topk` trains; the fields declare the ``sae train`` options."""

    latents: int = setting(4608, "--latents", min=1, max=1 << 20, help="Number of SAE latents (d_sae).")
    k: int = setting(32, "--k", min=1, max=4096, help="Active latents per token (TopK).")
    tokens: int = setting(
        150_000,
        "--tokens",
        min=1,
        max=100_000_000,
        help="Training tokens read from the text (each window's first position, the BOS, left out).",
    )
    eval_tokens: int = setting(
        8192, "--eval-tokens", min=1, max=10_000_000, help="Held-out tokens (the text after the training tokens)."
    )
    epochs: int = setting(8, "--epochs", min=1, max=1000, help="Passes over the training tokens.")
    batch_size: int = setting(1024, "--batch-size", min=1, max=65536, help="Tokens per optimiser step.")
    lr: float = setting(1e-3, "--lr", positive=True, max=1.0, help="Adam learning rate (at most 1).")
    aux_coef: float = 1 / 32
    dead_tokens: int = setting(
        50_000,
        "--dead-tokens",
        min=1,
        max=1_000_000_000,
        help="A latent is dead after this many tokens unfired.",
    )
    seed: int = setting(0, "--seed", min=0, help="Seed of the initialisation and the row order.")
    text: TextWindows = setting(factory=TextWindows)
    progress: bool = False

    def check(self) -> None:
        """k at most the number of latents; the token counts are ``tokens`` and ``eval_tokens``."""
        if self.k > self.latents:
            raise InputError(f"--k {self.k} exceeds --latents {self.latents}")
        if self.text.max_tokens is not None:
            raise InputError("an SAE reads --tokens and --eval-tokens tokens of the text: leave text.max_tokens out")
