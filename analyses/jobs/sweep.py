"""The sweep job: one analysis over a checkpoint series, its combined tables and its figures.

| name | what |
|---|---|
| :class:`SweepJobConfig` | the analysis, its inputs (text or probe data) and the plotted metric |
| :func:`sweep_inputs` | the keyword inputs of :func:`depthscope.analyses.sweep.sweep` for the analysis |
| :func:`sweep_job` | runs the sweep (resumable, local or Ray) and draws ``sweep_<metric>*.png`` |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from depthscope.analyses.jobs.base import JobResult
from depthscope.probes.config import ProbeConfig

ANALYSES = ("lens", "norms", "probe")
DEFAULT_METRIC = {"lens": "kl_to_final", "norms": "stream_norm", "probe": "accuracy"}


@dataclass
class SweepJobConfig:
    """``analysis`` (lens, norms or probe) on every checkpoint. lens/norms read ``text`` (a file, one
    document per line; default the bundled EWT sample's text), at most ``max_docs`` documents;
    probe reads ``train``/``test`` (default the bundled EWT sample) for ``tasks``, with ``probe``
    (the :class:`ProbeConfig` of ``depthscope probe`` / ``run_probes``: the same protocol and
    defaults). ``metric``: the column drawn across checkpoints (default per analysis, ``DEFAULT_METRIC``)."""

    analysis: str = "lens"
    text: Path | None = None
    max_docs: int = 200
    tasks: Sequence[str] = ("upos",)
    train: Path | None = None
    test: Path | None = None
    max_train_sentences: int | None = None
    max_test_sentences: int | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    metric: str | None = None
    allow_mixed: bool = False
    overwrite: bool = False

    def validate(self) -> SweepJobConfig:
        from depthscope.common.errors import InputError
        from depthscope.probes.config import check_number

        if self.analysis not in ANALYSES:
            raise InputError(f"--analysis must be one of {', '.join(ANALYSES)}, not {self.analysis!r}")
        check_number("max_docs", self.max_docs)
        check_number("max_train_sentences", self.max_train_sentences, allow_none=True)
        check_number("max_test_sentences", self.max_test_sentences, allow_none=True)
        self.probe.validate()
        return self


def sweep_inputs(config: SweepJobConfig) -> dict:
    """The analysis' inputs, read before any checkpoint loads."""
    if config.analysis in ("lens", "norms"):
        from depthscope.analyses.text import read_documents

        if config.text is None:
            from depthscope.analyses.report import sample_texts

            docs = sample_texts()
        else:
            docs = read_documents(config.text)
        return {"texts": docs[: config.max_docs]}
    from depthscope.probes import sample_data

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
    resumable, failures recorded) and draw the checkpoint heatmaps and curves. Summary: the names of
    the checkpoints done, skipped (already finished) and failed (with their errors)."""
    from depthscope.analyses.plots import sweep as sweep_plots
    from depthscope.analyses.sweep import sweep

    config.validate()
    out = Path(out)
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
