"""The settings of the causal erasure tests (``depthscope causal``), torch-free so ``--help`` stays light.

=========================  ====================================================================
:class:`CausalConfig`      tasks, train/test files, the held-out text, the random controls, the
                           bootstrap, the forward batch and the probe, extraction and data
                           settings of ``depthscope probe`` (the same objects and defaults)
:class:`LayersConfig`      what ``depthscope layers`` computes: every block skipped, every pair of
                           neighbours swapped
=========================  ====================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.settings import BATCH, Checked, Limit, comma_list, setting
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

#: single-vector poolings: one feature per word, so one eraser per site
WORD_POOLINGS = ("last", "first", "mean")
#: the kinds of random erasure (:func:`~depthscope.analyses.causal.erasure.erasers.random_erasure`)
CONTROL_KINDS = ("raw", "whitened")
#: random erasures per site by default: the interval of ``used`` resamples them, and with 4 it
#: covers at 94% or more of its nominal 95% at the control spreads measured on the default model
#: (3: 93%, 2: 91%, 1: 81%; ``benchmarks/bench_controls.py``, docs/causal.md "How many controls")
CONTROLS_DEFAULT = 4


@dataclass(frozen=True)
class CausalConfig(Checked):
    """What :func:`~depthscope.analyses.causal.erasure.used.causal_tests` runs: ``tasks`` (None: ``upos``),
    ``train`` / ``test`` (None: the bundled EWT sample), ``text`` (a plain-text file, one
    document per line, for the model's loss; None: the test sentences) of which the first
    ``max_text_tokens`` predicted tokens are used, cut inside a document (None: all; read as
    every free-text analysis reads text, :func:`~depthscope.analyses.causal.erasure.loss.held_out`), ``controls`` seeded
    random erasures of the same rank per site (``control``: ``raw``, their edit as large as
    LEACE's in the stream's units, or ``whitened``), ``bootstrap`` resamples of the held-out
    documents and the controls for the interval of ``used``, ``batch_size`` documents per forward pass, and the probe,
    extraction and data settings of ``depthscope probe``. Checked on construction (the data
    files exist, a word pooling) before any model loads; the fields declare the ``causal`` options."""

    tasks: Sequence[str] | None = setting(
        None,
        "--task",
        "-t",
        param="task",
        cli_type=str | None,
        parse=comma_list,
        help="Comma-separated word tasks, one label per word: upos, xpos, feats:Number, ..., entity (GUM). "
        "Default: upos.",
    )
    train: str | Path | None = setting(
        None, "--train", cli_type=Path | None, help="Train file (CoNLL-U). Default: the bundled EWT sample."
    )
    test: str | Path | None = setting(
        None, "--test", cli_type=Path | None, help="Test file (CoNLL-U). Default: the bundled EWT sample."
    )
    text: str | Path | None = setting(
        None,
        "--text",
        cli_type=Path | None,
        help="Held-out text for the model's next-token loss (one document per line, or a .conllu); "
        "default: the test sentences.",
    )
    max_text_tokens: int | None = setting(
        None,
        "--max-text-tokens",
        min=1,
        help="Use the first this many predicted tokens of the held-out text, cut inside a document (default: all); "
        "each site costs 1 + --controls passes over them.",
    )
    controls: int = setting(
        CONTROLS_DEFAULT,
        "--controls",
        min=1,
        max=Limit(100, "random erasures per site; each is one more pass over the text"),
        help=f"Seeded random erasures of the same rank per site (the control of 'used'; default {CONTROLS_DEFAULT}, "
        "see docs/causal.md); the interval of 'used' resamples them, so it needs at least 2.",
    )
    control: str = setting(
        "raw",
        "--control",
        choices=CONTROL_KINDS,
        help="The random erasures: raw (default; removed orthogonally, their edit as large as LEACE's in the "
        "stream's units) or whitened (LEACE's own form in whitened coordinates).",
    )
    bootstrap: int = setting(
        1000,
        "--bootstrap",
        min=0,
        max=Limit(100_000, "resamples of the held-out documents"),
        help="Bootstrap resamples of the held-out documents for the interval of 'used' (0: none).",
    )
    batch_size: int = setting(16, "--batch-size", min=1, max=BATCH, help="Documents per forward pass.")
    probe: ProbeConfig = setting(factory=ProbeConfig)
    extraction: ExtractionConfig = setting(factory=ExtractionConfig)
    data: DataConfig = setting(factory=DataConfig)
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the figure.")

    def check(self) -> None:
        """The settings objects, a linear probe, a word pooling, and the files exist."""
        self.probe.validate()
        self.extraction.validate()
        self.data.validate()
        if self.probe.probe != "linear":
            raise InputError("causal tests fit linear probes (LEACE removes linear information): leave out --probe")
        if self.extraction.pooling not in WORD_POOLINGS:
            raise InputError(
                f"causal tests need one vector per word: --pooling must be one of {', '.join(WORD_POOLINGS)}, "
                f"not {self.extraction.pooling!r}"
            )
        for name in ("train", "test", "text"):
            p = getattr(self, name)
            if isinstance(p, (str, Path)) and not Path(p).is_file():
                raise InputError(f"--{name}: no such file: {p}")


@dataclass(frozen=True)
class LayersConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.layers.layers_job` computes: every block skipped and
    every pair of neighbouring blocks swapped, scored on the text read under ``text`` (the BOS
    rule, window, stride and caps every free-text analysis shares); ``source``: its name, recorded
    in the summary. Checked on construction; the fields declare the ``layers`` options."""

    batch_size: int = setting(4, "--batch-size", min=1, max=BATCH, help="Windows per forward pass.")
    text: TextWindows = setting(factory=TextWindows)
    progress: bool = False
    source: str | None = None
