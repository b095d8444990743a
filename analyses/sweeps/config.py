"""The sweeps room's settings (``depthscope sweep``): torch-free, checked on construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.sweeps.ray_engine import RayEngine, require_ray
from depthscope.common.errors import InputError
from depthscope.common.settings import Checked, changed_flags, comma_list, setting
from depthscope.probes.config import ProbeConfig

#: what a sweep runs on each checkpoint, and the metric it draws by default
ANALYSES = ("lens", "norms", "probe")
DEFAULT_METRIC = {"lens": "kl_to_final", "norms": "stream_norm", "probe": "accuracy"}
#: the sweep settings of the probe analysis, and of the text analyses (lens, norms)
PROBE_FIELDS = ("tasks", "train", "test", "max_train_sentences", "max_test_sentences", "probe")
TEXT_FIELDS = ("text", "max_docs")
ENGINES = ("local", "ray")


@dataclass(frozen=True)
class SweepJobConfig(Checked):
    """``analysis`` (lens, norms or probe) on every checkpoint. lens/norms read ``text`` (a file, one
    document per line; default the bundled EWT sample's text), at most ``max_docs`` documents;
    probe reads ``train``/``test`` (default the bundled EWT sample) for ``tasks``, with ``probe``
    (the :class:`ProbeConfig` of ``depthscope probe`` / ``run_probes``: the same protocol and
    defaults). ``metric``: the column drawn across checkpoints (default per analysis, ``DEFAULT_METRIC``).
    ``engine``: ``local`` (one checkpoint after another) or ``ray`` (the :class:`RayEngine` ``ray``).
    Checked on construction; the fields declare the ``sweep`` options."""

    analysis: str = setting("lens", "--analysis", "-a", help="lens | norms | probe")
    text: Path | None = setting(
        None, "--text", help="Plain text for lens/norms (one document per line); default: the bundled EWT sample."
    )
    max_docs: int = setting(200, "--max-docs", min=1, help="Use at most this many documents of --text.")
    tasks: Sequence[str] = setting(
        ("upos",),
        "--task",
        param="task",
        cli_type=str,
        show=",".join,
        parse=lambda text: tuple(comma_list(text) or ()),
        help="Probe tasks, comma-separated (probe).",
    )
    train: Path | None = setting(None, "--train", help="CoNLL-U/JSONL train file (probe); default: bundled EWT sample.")
    test: Path | None = setting(None, "--test", help="CoNLL-U/JSONL test file (probe); default: bundled EWT sample.")
    max_train_sentences: int | None = setting(
        None, "--max-train-sentences", min=1, help="Cap probe train data at N sentences (probe)."
    )
    max_test_sentences: int | None = setting(
        None, "--max-test-sentences", min=1, help="Cap probe test data at N sentences (probe)."
    )
    probe: ProbeConfig = setting(factory=ProbeConfig)
    metric: str | None = setting(
        None, "--metric", help="Metric for the checkpoint x depth heatmap (default per analysis)."
    )
    allow_mixed: bool = setting(
        False, "--allow-mixed", help="Allow checkpoints of different architectures or tokenizers."
    )
    overwrite: bool = setting(False, "--overwrite", help="Replace another sweep's results in --out.")
    engine: str = setting(
        "local",
        "--engine",
        choices=ENGINES,
        help="local (one checkpoint after another) or ray (one Ray task per checkpoint).",
    )
    ray: RayEngine = setting(factory=RayEngine)

    def check(self) -> None:
        """A known analysis, the probe settings, no setting of another analysis (none is silently
        ignored), Ray settings only with ``engine="ray"``, and Ray installed for it."""
        if self.analysis not in ANALYSES:
            raise InputError(f"--analysis must be one of {', '.join(ANALYSES)}, not {self.analysis!r}")
        self.probe.validate()
        wrong = changed_flags(self, TEXT_FIELDS if self.analysis == "probe" else PROBE_FIELDS)
        if wrong:
            needs = "--analysis lens or norms" if self.analysis == "probe" else "--analysis probe"
            raise InputError(f"{', '.join(wrong)} only apply to {needs} (this sweep runs {self.analysis})")
        if self.engine == "local" and (self.ray.address is not None or self.ray.gpus_per_task):
            raise InputError("--address and --gpus-per-task need --engine ray")
        if self.engine == "ray":
            require_ray()  # refused before any work when Ray is not installed
