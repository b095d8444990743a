"""The settings of SAE and transcoder training (``depthscope sae train``, ``depthscope
transcoders train``), apart from the trainer so that the
command line reads them without importing torch.

=========================  ==================================================================
:class:`SaeTrainConfig`    latents, k, tokens, held-out tokens, epochs, batch size, learning
                           rate, AuxK coefficient, dead-latent window, seed, and how the text
                           is read (a :class:`~depthscope.analyses.text_settings.TextWindows`)
``TranscoderTrainConfig``  the same, plus which layers (``--layers``) and the disk one
                           pass's activation store may take (``--store-gb``)
:func:`parse_layers`       ``"0,3,5-7"`` / ``"all"`` -> layer numbers
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


def parse_layers(spec: str | None, n_layers: int) -> list[int]:
    """``"all"``/None -> every layer; ``"0,3,5-7"`` -> ``[0, 3, 5, 6, 7]`` (checked against
    ``n_layers``, sorted, de-duplicated)."""
    if spec is None or str(spec).strip().lower() == "all":
        return list(range(n_layers))
    out = set()
    for part in str(spec).split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or (b and not b.isdigit()) or (b and int(b) < int(a)):
            raise InputError(f"--layers {spec!r}: write layer numbers and ranges such as 0,3,5-7, or all")
        out.update(range(int(a), int(b or a) + 1))
    bad = sorted(i for i in out if i >= n_layers)
    if bad:
        raise InputError(f"--layers {spec!r}: layers {bad} out of range 0..{n_layers - 1}")
    return sorted(out)


def _check_layers(name: str, value) -> None:
    parse_layers(value, 1 << 30)  # the syntax; the range is checked against the model


@dataclass(frozen=True)
class TranscoderTrainConfig(SaeTrainConfig):
    """What ``depthscope transcoders train`` trains: one TopK transcoder per layer (``l.mlp_in`` ->
    ``l.mlp_out``) with :class:`SaeTrainConfig`'s settings, on ``layers`` (None: all)."""

    layers: str | None = setting(
        None, "--layers", check=_check_layers, help="Layers to train, e.g. 0,3,5-7 (default: all)."
    )
    store_gb: float = setting(
        4.0,
        "--store-gb",
        positive=True,
        max=10_000.0,
        help="Disk one pass's activation store may take (GB): layers are collected in groups that fit.",
    )
