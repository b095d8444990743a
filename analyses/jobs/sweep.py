"""The sweep job: one analysis over a checkpoint series, its combined tables and its figures.

| name | what |
|---|---|
| :func:`sweep_inputs` | the keyword inputs of :func:`depthscope.analyses.sweeps.series.sweep` for the analysis |
| :func:`sweep_job` | runs the sweep (resumable, local or Ray) and draws ``sweep_<metric>*.png`` |

Its settings (the analysis, its inputs: text or probe data, and the plotted metric) are
:class:`~depthscope.analyses.jobs.configs.SweepJobConfig`.
"""

from __future__ import annotations

from pathlib import Path

from depthscope.analyses.jobs.base import JobResult
from depthscope.analyses.jobs.configs import DEFAULT_METRIC, SweepJobConfig
from depthscope.analyses.samples import sample_texts
from depthscope.analyses.sweeps import plots as sweep_plots
from depthscope.analyses.sweeps.series import sweep
from depthscope.analyses.text import read_documents
from depthscope.probes import sample_data


def sweep_inputs(config: SweepJobConfig) -> dict:
    """The analysis' inputs, read before any checkpoint loads."""
    if config.analysis in ("lens", "norms"):
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
    """Sweep ``config.analysis`` over ``checkpoints`` into ``out`` (see
    :func:`~depthscope.analyses.sweeps.series.sweep`: resumable, failures recorded) and draw the
    checkpoint heatmaps and curves. ``engine`` (None: the config's, ``config.ray`` when
    ``config.engine`` is ``ray``) runs the checkpoints. Summary:
    the names of the checkpoints done, skipped (already finished) and failed (with their errors)."""
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
