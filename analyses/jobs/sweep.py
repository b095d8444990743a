"""The sweep job: one analysis over a checkpoint series, its combined tables and its figures.

| name | what |
|---|---|
| :class:`SweepJobConfig` | the analysis, its inputs (text or probe data) and the plotted metric |
| :func:`sweep_inputs` | the keyword inputs of :func:`depthscope.analyses.sweep.sweep` for the analysis |
| :func:`sweep_job` | runs the sweep (resumable, local or Ray) and draws ``sweep_<metric>*.png`` |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.jobs.base import JobResult
from depthscope.analyses.samples import sample_texts
from depthscope.analyses.sweep_ray import RayEngine, require_ray
from depthscope.common.errors import InputError
from depthscope.common.settings import Checked, changed_flags, comma_list, setting
from depthscope.probes import sample_data
from depthscope.probes.config import ProbeConfig

ANALYSES = ("lens", "norms", "probe")
DEFAULT_METRIC = {"lens": "kl_to_final", "norms": "stream_norm", "probe": "accuracy"}
#: the settings of the probe analysis, and of the text analyses (lens, norms)
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


def sweep_inputs(config: SweepJobConfig) -> dict:
    """The analysis' inputs, read before any checkpoint loads."""
    if config.analysis in ("lens", "norms"):
        # lazy: torch; --help imports this module for its configuration
        from depthscope.analyses.text import read_documents

        docs = sample_texts() if config.text is None else read_documents(config.text)
        return {"texts": docs[: config.max_docs]}
    sample = sample_data()
    return dict(
        tasks=list(config.tasks),
        train=str(config.train or sample["ewt_train"]),
        test=str(config.test or sample["ewt_test"]),
        max_train_sentences=config.max_train_sentences,
        max_test_sentences=config.max_test_sentences,
        config=config.probe,
    )


def sweep_job(checkpoints, config: SweepJobConfig, out: Path, *, load=None, engine=None) -> JobResult:
    """Sweep ``config.analysis`` over ``checkpoints`` into ``out`` (see :func:`~depthscope.analyses.sweep.sweep`:
    resumable, failures recorded) and draw the checkpoint heatmaps and curves. ``engine`` (None:
    the config's, ``config.ray`` when ``config.engine`` is ``ray``) runs the checkpoints. Summary:
    the names of the checkpoints done, skipped (already finished) and failed (with their errors)."""
    # lazy: torch, pandas, matplotlib; --help imports this module for its configuration
    from depthscope.analyses.plots import sweep as sweep_plots
    from depthscope.analyses.sweep import sweep

    out = Path(out)
    if engine is None and config.engine == "ray":
        engine = config.ray
    result = sweep(
        checkpoints,
        config.analysis,
        out,
        allow_mixed=config.allow_mixed,
        overwrite=config.overwrite,
        load=load,
        engine=engine,
        **sweep_inputs(config),
    )
    files: list[Path] = []
    by_site = result.tables.get("by_site")
    if by_site is not None and len(by_site):
        m = config.metric or DEFAULT_METRIC[config.analysis]
        if config.analysis == "probe":
            for t in by_site["task"].unique():
                part = by_site[by_site["task"] == t]
                path = out / f"sweep_{m}_{t}.png"
                files.append(sweep_plots.plot_checkpoint_heatmap(part, m, path, title=f"{t}: {m} across checkpoints"))
            summ = result.tables.get("summary")
            if summ is not None and len(summ):
                path = out / "sweep_expected_layer.png"
                files.append(sweep_plots.plot_metric_over_training(summ, "expected_layer_delta", path))
        else:
            if "positions" in by_site.columns:  # norms: the tokens after the first (position 0 is a sink)
                by_site = by_site[by_site["positions"] == "rest"]
            files.append(sweep_plots.plot_checkpoint_heatmap(by_site, m, out / f"sweep_{m}.png"))
            files.append(sweep_plots.plot_final_site_over_training(by_site, m, out / f"sweep_{m}_lines.png"))
    summary = {"done": list(result.done), "skipped": list(result.skipped), "failed": dict(result.failed)}
    return JobResult(tables=dict(result.tables), summary=summary, files=files)
