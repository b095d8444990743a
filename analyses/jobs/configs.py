"""The settings of every job: one frozen dataclass per analysis, torch-free, checked on
construction, whose fields declare the command-line options (default, flag, bounds, help:
:func:`depthscope.common.settings.setting`). Each is defined in its room's ``config`` module;
this module defines the two that belong to no room and gathers the rest, so the commands find
every configuration in one place.

The commands import this module to build their options, so ``depthscope --help`` imports no
torch, pandas or matplotlib; the job modules beside it import those at their top.

=========================  ====================================================================
:class:`ModelSpec`         the model every command loads: ``--model``, ``--device``, ``--dtype``,
                           ``--threads``
:class:`CacheConfig`       :func:`~depthscope.analyses.jobs.cache.cache_job` (``depthscope cache``)
:class:`TextWindows`       ``text_settings.py``: how every free-text analysis reads its text (held by
                           the configs of ``cache``, ``lens``, ``norms``, ``layers``, ``sae train``)
:class:`LensConfig`        ``lens/config.py``: :func:`~depthscope.analyses.jobs.lens.lens_job`
:class:`LensTrainConfig`   ``lens/config.py``: :func:`~depthscope.analyses.jobs.lens.lens_train_job`
:class:`NormsConfig`       ``norms/config.py``: :func:`~depthscope.analyses.jobs.norms.norms_job`
:class:`PatchConfig`       ``circuits/patching/config.py``: :func:`~depthscope.analyses.jobs.patch.patch_job`
:class:`CircuitConfig`     ``circuits/edges/config.py``: :func:`~depthscope.analyses.jobs.circuit.circuit_job`
:class:`ProbeJobConfig`    ``probing/config.py``: :func:`~depthscope.analyses.jobs.probe.run_probe_job`
:class:`SweepJobConfig`    ``sweeps/config.py``: :func:`~depthscope.analyses.jobs.sweep.sweep_job`
:class:`ReportConfig`      ``report/config.py``: :func:`~depthscope.analyses.report.main_job.run_report`
:class:`LayersConfig`      ``causal/erasure/config.py``: :func:`~depthscope.analyses.jobs.layers.layers_job`
:class:`CausalConfig`      ``causal/erasure/config.py``: :func:`~depthscope.analyses.causal.erasure.used.causal_tests`
:class:`LocalizeConfig`    ``causal/variables/config.py``: :func:`~depthscope.analyses.jobs.localize.localize_job`
:class:`SaeTrainConfig`    ``features/config.py``: :func:`~depthscope.analyses.features.training.train_topk`;
                           its subclass ``TranscoderTrainConfig``:
                           :func:`~depthscope.analyses.jobs.transcoders.transcoders_train_job`
=========================  ====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from depthscope.analyses.causal.erasure.config import CausalConfig, LayersConfig
from depthscope.analyses.causal.variables.config import LocalizeConfig
from depthscope.analyses.circuits.edges.config import CircuitConfig
from depthscope.analyses.circuits.features.config import AttributeConfig
from depthscope.analyses.circuits.patching.config import PatchConfig
from depthscope.analyses.defaults import (
    DEFAULT_PROMPT,
    DEFAULT_TARGET,
    IOI_CLEAN,
    IOI_CORRUPTED,
    MAX_TOP_K,
    RESUME_HELP,
)
from depthscope.analyses.features.config import SaeTrainConfig, TranscoderTrainConfig
from depthscope.analyses.lens.config import LensConfig, LensTrainConfig
from depthscope.analyses.norms.config import NormsConfig
from depthscope.analyses.probing.config import ProbeJobConfig
from depthscope.analyses.report.config import ReportConfig
from depthscope.analyses.sweeps.config import (
    ANALYSES,
    DEFAULT_METRIC,
    ENGINES,
    PROBE_FIELDS,
    TEXT_FIELDS,
    SweepJobConfig,
)
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.settings import CPUS, TOKENS, Checked, comma_list, setting

__all__ = [
    "ANALYSES",
    "DEFAULT_METRIC",
    "DEFAULT_PROMPT",
    "DEFAULT_TARGET",
    "ENGINES",
    "IOI_CLEAN",
    "IOI_CORRUPTED",
    "MAX_TOP_K",
    "PROBE_FIELDS",
    "RESUME_HELP",
    "TEXT_FIELDS",
    "AttributeConfig",
    "CacheConfig",
    "CausalConfig",
    "CircuitConfig",
    "LayersConfig",
    "LensConfig",
    "LensTrainConfig",
    "LocalizeConfig",
    "ModelSpec",
    "NormsConfig",
    "PatchConfig",
    "ProbeJobConfig",
    "ReportConfig",
    "SaeTrainConfig",
    "TranscoderTrainConfig",
    "SweepJobConfig",
    "TextWindows",
]


@dataclass(frozen=True)
class ModelSpec(Checked):
    """Which model a job runs, where, in what precision, and torch's CPU threads: the ``--model``,
    ``--device``, ``--dtype``, ``--threads`` and ``--stream`` options of every command that loads a model."""

    model: str | None = setting(
        None,
        "--model",
        "-m",
        help="Model spec: a folder, a .gguf, a cached hub id, or 'default' (SmolLM2-135M).",
    )
    device: str = setting(
        "cpu", "--device", help="Where the model runs: cpu, cuda, cuda:N, mps, or auto (a GPU when torch sees one)."
    )
    dtype: str = setting(
        "float32",
        "--dtype",
        help="Precision of the model's weights: float32, bfloat16 or float16 (metrics are reduced in float32).",
    )
    threads: int | None = setting(
        None,
        "--threads",
        min=1,
        max=CPUS,
        help="torch CPU threads (default: the cores free now, i.e. the CPUs less the load average, at most "
        "torch's choice; more threads than free cores spin-wait on a shared machine; at most 4 per CPU).",
    )
    stream: bool | None = setting(
        None,
        "--stream/--no-stream",
        help="Stream the blocks' weights from the checkpoint's files, one block resident at a time (exact). "
        "Default: stream only a model whose weights do not fit in memory, printing the plan; --no-stream "
        "refuses such a model.",
    )


@dataclass(frozen=True)
class CacheConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.cache.cache_job` writes: the hook ``points`` (``resid``:
    the 2L+1 residual sites; else a comma list of point names and group words, e.g.
    ``resid,1.z``) of every token of the text read under ``text`` (the BOS rule, windows and
    caps every free-text analysis shares), into an activation cache
    (:mod:`depthscope.hooks.activation_cache`), ``chunk_tokens`` padded tokens per forward pass
    and chunk. Checked on construction; the fields declare the ``cache`` options."""

    points: str = setting(
        "resid",
        "--points",
        help="Hook points: 'resid' (every residual site), 'all', or a comma list of points and those words "
        "(e.g. '0.mlp,5.z' or 'resid,1.z').",
    )
    chunk_tokens: int = setting(
        1024, "--chunk-tokens", min=1, max=TOKENS, help="Padded tokens per forward pass and per chunk written."
    )
    text: TextWindows = setting(factory=TextWindows)
    progress: bool = False

    def check(self) -> None:
        """Some points."""
        if not comma_list(self.points):
            raise InputError("--points is empty: give 'resid' or a comma list of hook points")
