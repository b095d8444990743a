"""The main job: one model, one data set, every analysis, one report.

``run_report(out_dir)`` (``depthscope run``) takes the embedded default model and the bundled
UD English EWT sample unless told otherwise, and runs, in order:

1. the logit lens at every site over the sample's text (plus the token view of one prompt),
2. contribution norms over the same text (plus the per-position view and direct logit
   attribution of one prompt),
3. probes (upos, deprel, a morphological feature; entity and coref when GUM-style data with
   ``Entity=`` annotations is given),

writes every table (Parquet + CSV, the shared tidy schema) and plot (PNG and SVG) into
``out_dir``, and then ``report.md`` and ``report.html`` that answer "which depth encodes which
property" with sentences computed from the tables. Both open with a table of contents; the HTML
embeds the SVG figures (and links both files), the markdown shows the PNGs. Lens and norms
curves carry 95% intervals of each site's mean, clustered by document
(:mod:`depthscope.analyses.intervals`), and the sentences quote them. The report is drawn from
the tables on disk only (``render_report(out_dir)`` redraws it without a model). Its settings
are :class:`~depthscope.analyses.jobs.configs.ReportConfig` (importable from here too).

The report is built in three steps, one module each:

- :mod:`depthscope.analyses.report.findings`: the sentences, pure functions of the tables;
- :mod:`depthscope.analyses.report.data`: reads a run folder into plain page data;
- ``templates/report.html.j2`` and ``templates/report.md.j2``: the layout (Jinja2, the HTML
  autoescaped), rendered and written here by :func:`render_report`.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2
from markupsafe import Markup, escape
from rich.console import Console

from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import DEFAULT_TARGET, LensConfig, NormsConfig, ProbeJobConfig, ReportConfig
from depthscope.analyses.jobs.lens import lens_job
from depthscope.analyses.jobs.norms import norms_job
from depthscope.analyses.jobs.probe import resolve_inputs, run_probe_job
from depthscope.analyses.report.data import FIGURES, Page, build_page
from depthscope.analyses.report.findings import (
    SCORES_DISAGREE,
    lens_findings,
    norm_findings,
    probe_findings,
    probe_table,
)
from depthscope.analyses.samples import conllu_documents, sample_texts
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.files import atomic_text, json_text
from depthscope.common.resume import Stages, file_digests, stage_key
from depthscope.common.runtime import peak_memory, release_memory, reset_peak_memory
from depthscope.hooks import load_model
from depthscope.hooks.stream_identity import store_digest
from depthscope.probes import sample_data

TEMPLATES = Path(__file__).with_name("templates")

__all__ = [
    "DEFAULT_TARGET",
    "FIGURES",
    "SCORES_DISAGREE",
    "ReportConfig",
    "lens_findings",
    "norm_findings",
    "probe_findings",
    "probe_table",
    "render_report",
    "run_report",
    "sample_texts",
]


# ---------------------------------------------------------------------------- the job
def run_report(out_dir: str | Path, config: ReportConfig | None = None, *, progress: bool = True, model=None) -> Path:
    """Run every analysis and write tables, plots, ``report.md`` and ``report.html``; returns the
    path of ``report.html``. With ``config.resume`` (the default) each stage it finishes (the
    lens, the norms, each probe task, the causal section) is recorded in ``out_dir``, and a stage an earlier run there
    finished with the same weights, text or data, settings and code is reused instead of computed
    (:mod:`depthscope.common.resume`; ``run.json``'s ``reused`` names them)."""
    cfg = config or ReportConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say, clock = _Say(progress), _Clock()
    say(f"loading model {cfg.model or 'default (SmolLM2-135M-Instruct)'}")
    ours = model is None  # a model loaded here is freed once the probes' activations are extracted
    with clock("load"):
        model = model or load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, stream=cfg.stream)
    inputs = _inputs(cfg)
    meta = _run_meta(model, cfg, inputs)
    output = Output(out)  # one writer per table and figure across the three jobs
    stages = _Stages(Stages(out, reuse=cfg.resume), model, output, say)
    docs = inputs.texts  # each stage reads its first tokens of the text, cut inside a document
    if model.unembed.decodes_stream:
        with clock("lens"):
            lens = LensConfig(prompt=cfg.prompt, text=TextWindows(max_tokens=cfg.lens_tokens))
            stages.run("lens", lambda: _lens(model, cfg, docs, lens, output, say), docs=docs, config=lens)
    with clock("norms"):
        norms = NormsConfig(prompt=cfg.prompt, target=cfg.target, text=TextWindows(max_tokens=cfg.norms_tokens))
        stages.run("norms", lambda: _norms(model, cfg, docs, norms, output, say), docs=docs, config=norms)
    with clock("probes"):
        say(f"probes: {', '.join(inputs.tasks)}")
        if ours and not cfg.causal:  # nothing after the extraction needs it: hand over the only reference
            model = _once(model)
        probe_result = run_probe_job(model, inputs.probe_job, output, progress=progress)
    meta["probe_precision"] = probe_result.summary["precision"]
    stages.reused += [f"probes {t}" for t in probe_result.summary["reused"]]
    if probe_result.summary["reused"]:
        say(f"probes reused from an earlier run in this folder: {', '.join(probe_result.summary['reused'])}")
    if cfg.causal:
        from depthscope.analyses.jobs.causal import report_causal  # lazy: only --causal pays for concept_erasure

        with clock("causal"):
            say(f"causal: LEACE erasure per site, loss on {cfg.causal_tokens} held-out tokens")
            job = inputs.probe_job
            stages.run(
                "causal",
                lambda: report_causal(model, job, cfg.causal_tokens, output, progress=progress),
                data=file_digests({"train": inputs.train, "test": inputs.test, "dev": cfg.dev}),
                job=replace(job, resume=True),  # whether the run may reuse stages is not an input
                tokens=cfg.causal_tokens,
            )
    meta["reused"] = stages.reused
    meta["seconds"] = clock.seconds()
    meta["cpu_seconds"] = clock.cpu_seconds()
    meta["peak_memory_gib"] = clock.peak_gib()
    meta["protocol"] = _protocol(cfg)
    atomic_text(out / "run.json", json_text(meta, indent=1))
    say("writing report")
    path = render_report(out)
    say(f"done in {meta['seconds']['total']:.0f} s: {path}")
    return path


def _once(model):
    """A loader (:func:`~depthscope.probes.store.extraction.resolve_model`) that returns ``model``
    once and keeps no reference to it: the probes then hold the job's only reference, which they
    drop after extracting the activations, so the model's memory is free while they train."""
    held = [model]
    return lambda: held.pop()


@dataclass(frozen=True)
class _Inputs:
    """The data files, running text, probe job and task list a report runs on."""

    train: str
    test: str
    texts: list[str]
    probe_job: ProbeJobConfig
    tasks: list[str]


def _inputs(cfg: ReportConfig) -> _Inputs:
    """``cfg``'s data with the defaults filled in: the bundled EWT sample for missing files, the
    running text of the probe data when ``cfg`` gives no texts, the probe job's task list."""
    sample = sample_data()
    train = cfg.train or str(sample["ewt_train"])
    test = cfg.test or str(sample["ewt_test"])
    texts = list(cfg.texts) if cfg.texts else conllu_documents(train) + conllu_documents(test)
    probe_job = ProbeJobConfig(
        tasks=cfg.tasks,
        train=train,
        test=test,
        dev=cfg.dev,
        probe=cfg.probe,
        extraction=cfg.extraction,
        data=cfg.data,
        resume=cfg.resume,
    )
    return _Inputs(train, test, texts, probe_job, resolve_inputs(probe_job)[0])


def _run_meta(model, cfg: ReportConfig, inputs: _Inputs) -> dict:
    """The run's description for ``run.json`` (the report's introduction reads it)."""
    return {
        "model": model.name,
        "model_source": model.source,
        "family": model.arch.family,
        "n_layers": model.n_layers,
        "d_model": model.d_model,
        "n_sites": model.n_sites,
        "train": inputs.train,
        "test": inputs.test,
        "tasks": inputs.tasks,
        "prompt": cfg.prompt,
        "target": cfg.target,
    }


def _protocol(cfg: ReportConfig) -> str:
    """One sentence on the probe settings the run used (the report's introduction can quote it):
    the full protocol unless a setting was changed, and how the fast path was checked."""
    p = cfg.probe
    return (
        f"Probe settings: l2 {p.l2}, stack_draws {p.stack_draws}, stack_folds {p.stack_folds}, "
        f"stack_l2 {p.stack_l2:g}, control {'on' if p.control else 'off'}, max_epochs {p.max_epochs}, "
        f"precision {p.precision} (the defaults are the full protocol; benchmarks/bench_main_job.py checks that "
        f"each task's E_Delta agrees within 0.1 block with a run of the full protocol before its speed-ups)."
    )


def _lens(model, cfg: ReportConfig, docs: Sequence[str], lens: LensConfig, output: Output, say: _Say) -> None:
    """The logit lens over the first ``cfg.lens_tokens`` tokens of ``docs``."""
    say(f"logit lens over the first {cfg.lens_tokens} tokens of the text at {model.n_sites} sites")
    res = lens_job(model, docs, lens, output)
    say(f"logit lens: {res.summary['n_positions']} positions read")


def _norms(model, cfg: ReportConfig, docs: Sequence[str], norms: NormsConfig, output: Output, say: _Say) -> None:
    """Contribution norms over the first ``cfg.norms_tokens`` tokens of ``docs``."""
    say(f"contribution norms over the first {cfg.norms_tokens} tokens of the text")
    norms_job(model, docs, norms, output)


class _Stages:
    """The report's lens, norms and causal stages, each run or reused (:mod:`depthscope.common.resume`):
    reused when an earlier run in the folder wrote its files from the same weights (their digest,
    :func:`~depthscope.hooks.stream_identity.store_digest`: no block read for a streamed model),
    the same device, documents and settings, and the same code."""

    def __init__(self, stages: Stages, model, output: Output, say: _Say):
        self.stages, self.output, self.say, self.reused = stages, output, say, []
        param = next(model.hf_model.parameters(), None)
        self.model = (store_digest(model), str(param.device) if param is not None else "") if stages else None

    def run(self, name: str, compute, **inputs) -> None:
        """``compute()`` unless stage ``name`` with these ``inputs`` can be reused; then record it."""
        key = stage_key(stage=name, model=self.model, **inputs) if self.stages else None
        if key and self.stages.files(name, key) is not None:
            self.say(f"{name}: reused from an earlier run in this folder (same model, text, settings and code)")
            self.reused.append(name)
            return
        n = len(self.output.written)
        compute()
        if key:
            self.stages.record_files(name, key, self.output.written[n:])


class _Say:
    """Progress lines on stderr, or nothing when ``on`` is false."""

    def __init__(self, on: bool):
        self.on = on
        self.console = Console(stderr=True) if on else None

    def __call__(self, msg: str):
        if self.on:
            self.console.print(f"[bold cyan]depthscope[/] {msg}")


class _Clock:
    """Wall-clock and CPU seconds (this process's, all threads) and the peak resident memory of
    each named step of the run, and the totals since construction; each step's freed memory goes
    back to the OS at its end (:func:`~depthscope.common.runtime.release_memory`), so it does not
    add to the next step's peak."""

    def __init__(self):
        self.start, self.cpu_start = time.time(), time.process_time()
        self.steps: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.peak: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t, c = time.time(), time.process_time()
        reset_peak_memory()
        yield
        self.peak[name] = peak_memory()
        release_memory()
        self.steps[name] = time.time() - t
        self.cpu[name] = time.process_time() - c

    def peak_gib(self) -> dict[str, float]:
        """Each step's peak resident memory in GiB, to a hundredth (``run.json``'s
        ``peak_memory_gib``; where the peak cannot be reset, a step's figure is the process's
        peak so far), and the largest."""
        out = {k: round(v / 2**30, 2) for k, v in self.peak.items()}
        out["total"] = max(out.values(), default=0.0)
        return out

    def seconds(self) -> dict[str, float]:
        """Each step's seconds and the total, rounded to a tenth (as ``run.json`` records them)."""
        out = {k: round(v, 1) for k, v in self.steps.items()}
        out["total"] = round(time.time() - self.start, 1)
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """Each step's CPU seconds and the total, rounded to a tenth (``run.json``'s ``cpu_seconds``)."""
        out = {k: round(v, 1) for k, v in self.cpu.items()}
        out["total"] = round(time.process_time() - self.cpu_start, 1)
        return out


# ---------------------------------------------------------------------------- rendering
def render_report(out_dir: str | Path) -> Path:
    """Write ``report.md`` and ``report.html`` from the tables and plots in ``out_dir``.

    Both open with a table of contents (sections and figures). The HTML embeds each figure's
    SVG (vector; the PNG when no SVG is there) and links both files; the markdown shows the PNG
    and links the SVG."""
    out = Path(out_dir)
    page = build_page(out)
    atomic_text(out / "report.md", render_page(page, "report.md.j2"))
    path = out / "report.html"
    atomic_text(path, render_page(page, "report.html.j2"))
    return path


def render_page(page: Page, template: str) -> str:
    """``page`` laid out by the template named ``template`` (in ``templates/``)."""
    return _environment().get_template(template).render(page=page)


@functools.cache
def _environment() -> jinja2.Environment:
    """The templates' environment: HTML autoescaped, markdown not; block tags take their own
    line (``trim_blocks``, ``lstrip_blocks``) so the markdown's blank lines are the template's."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=jinja2.select_autoescape(disabled_extensions=("md.j2",), default=True),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["inline_code"] = inline_code
    return env


def inline_code(text: str) -> Markup:
    """Markdown inline text as HTML: escaped, with `` `code` `` spans as ``<code>``."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text))))
