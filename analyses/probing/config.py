"""The probe job's settings (``depthscope probe``): torch-free, checked on construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.defaults import RESUME_HELP, data_file_setting, tasks_setting
from depthscope.common.errors import InputError
from depthscope.common.settings import Checked, setting
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig


@dataclass(frozen=True)
class ProbeJobConfig(Checked):
    """What the probe job runs: ``tasks`` (None:
    :data:`~depthscope.analyses.jobs.probe.DEFAULT_TASKS`, + entity and coref with GUM-style
    data), ``train`` / ``test`` / ``dev`` files (None: the bundled sample; no
    dev), the settings objects, ``plots``, and ``resume`` (keep each task's tables in the output
    folder as it finishes, and reuse those of a run with the same inputs:
    :mod:`depthscope.common.resume`). Checked on construction (the settings, and that the data
    files exist, before the model loads); the fields declare the ``probe`` options."""

    tasks: Sequence[str] | None = tasks_setting(
        "Comma-separated tasks: upos, xpos, feats:Number, feats:Tense, ..., deprel, deprel:base, structural, "
        "depth (Hewitt & Manning's structural probes), entity, coref (GUM), or any name with a jiant edge-probing "
        ".jsonl. Default: upos,deprel,feats:Number "
        "(+entity,coref with GUM data)."
    )
    train: str | Path | None = data_file_setting(
        "train", "Train file (CoNLL-U or jiant .jsonl). Default: the bundled sample."
    )
    test: str | Path | None = data_file_setting(
        "test", "Test file (CoNLL-U or jiant .jsonl). Default: the bundled sample."
    )
    dev: str | Path | None = data_file_setting(
        "dev", "Dev file, used to choose the L2 penalty per task (--l2 auto); else folds of train."
    )
    probe: ProbeConfig = setting(factory=ProbeConfig)
    extraction: ExtractionConfig = setting(factory=ExtractionConfig)
    data: DataConfig = setting(factory=DataConfig)
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the figures.")
    resume: bool = setting(True, "--resume/--no-resume", help=RESUME_HELP)

    def check(self) -> None:
        """The settings objects, and the data files exist."""
        self.probe.validate()
        self.extraction.validate()
        self.data.validate()
        for name in ("train", "test", "dev"):
            p = getattr(self, name)
            if isinstance(p, (str, Path)) and not Path(p).is_file():
                raise InputError(f"--{name}: no such file: {p}")
