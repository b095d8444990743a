"""The main job's settings (``depthscope run``): torch-free, checked on construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from depthscope.analyses.defaults import DEFAULT_PROMPT, DEFAULT_TARGET, RESUME_HELP, tasks_setting
from depthscope.common.settings import Checked, setting
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig


@dataclass(frozen=True)
class ReportConfig(Checked):
    """What ``depthscope run`` runs: the model (None: the embedded default; ``stream``: its weights
    streamed, as ``--stream``), the probe data files
    (None: the bundled EWT sample), the running text for the lens and norms (None: the probe
    data's text, capped at ``lens_tokens`` / ``norms_tokens``), the prompt and DLA target,
    the probe job's settings, ``causal`` (the causal section on ``causal_tokens`` tokens), and
    ``resume`` (reuse the stages an earlier run in the folder finished with the same inputs).
    Checked on construction; the fields with a flag declare ``run`` options (the model's are
    :class:`ModelSpec`'s, the data files and the text ``run``'s own)."""

    model: str | None = None
    device: str = "cpu"  # cpu, cuda, cuda:N, mps, auto
    dtype: str = "float32"  # float32, bfloat16, float16
    stream: bool | None = None  # the blocks streamed from the files (None: when they do not fit; forward-only)
    train: str | None = None
    test: str | None = None
    dev: str | None = None
    texts: Sequence[str] | None = None
    tasks: Sequence[str] | None = tasks_setting(
        "Probe tasks, comma-separated (default: upos,deprel,feats:Number; +entity,coref with GUM data)."
    )
    prompt: str = setting(DEFAULT_PROMPT, "--prompt", help="Prompt for the per-token views and DLA.")
    target: str = setting(DEFAULT_TARGET, "--target", help="Target token for DLA.")
    lens_tokens: int = setting(1500, "--lens-tokens", min=1, help="Tokens of text for the logit lens.")
    norms_tokens: int = setting(4000, "--norms-tokens", min=1, help="Tokens of text for contribution norms.")
    causal: bool = setting(
        False,
        "--causal/--no-causal",
        help="Also the 'Encoded vs used' section: LEACE erasure of each word task at every site, its effect on "
        "probes and on the model's loss (1 + 3 forward passes per site and task over --causal-tokens tokens).",
    )
    causal_tokens: int = setting(
        1000, "--causal-tokens", min=1, help="Held-out tokens (test sentences) for the causal section's loss."
    )
    resume: bool = setting(True, "--resume/--no-resume", help=RESUME_HELP)
    # the probe section's settings: the same objects, with the same defaults, as `depthscope probe`
    probe: ProbeConfig = setting(factory=ProbeConfig)
    extraction: ExtractionConfig = setting(factory=ExtractionConfig)
    data: DataConfig = setting(factory=DataConfig)
