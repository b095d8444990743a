"""The report's content as plain data, read from the files a run wrote.

:func:`read_run` loads ``run.json`` and the tidy tables of a run folder; :func:`build_page` turns
them into a :class:`Page`: the title, the introduction, one :class:`Section` per analysis (its
findings from :mod:`depthscope.analyses.report.findings`, the probe table, the figures present
on disk with their embedded data) and the list of tables. The templates in ``templates/`` lay a
page out as HTML and markdown; nothing here writes markup, except the markdown of the
introduction (backticks around file and model names), which the HTML template turns into
``<code>``.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from depthscope.analyses.intervals import MIN_UNITS, too_few
from depthscope.analyses.report.findings import (
    causal_findings,
    lens_findings,
    norm_findings,
    probe_findings,
    probe_table,
)
from depthscope.analyses.tables import read_table
from depthscope.probes.corpora.tasks import pipeline_rank

#: the report's sections: (anchor id, title, [(figure file, caption), ...])
FIGURES = [
    (
        "probes",
        "Which depth encodes which property",
        [
            ("probes_overview.png", "All tasks on one depth axis: E_Δ with its 95% interval and E_s"),
            ("probes_tenney.png", "Tenney-style summary: cumulative gain Δ per depth, E_Δ and E_s marked"),
            ("probes_accuracy.png", "Probe accuracy (majority baseline dotted) and selectivity in points per site"),
        ],
    ),
    (
        "lens",
        "How the prediction forms: logit lens",
        [
            ("lens_metrics.png", "Lens metrics against depth, with 95% intervals of each site's mean (bands)"),
            ("lens_top1_heatmap.png", "Top-1 token per position and site for the prompt"),
            ("lens_rank_trajectory.png", "Rank of each next token through depth"),
        ],
    ),
    (
        "norms",
        "How the stream gets there: contribution norms",
        [
            ("norms_stream_growth.png", "Stream norm against depth, with 95% intervals (bands)"),
            ("norms_update_norms.png", "Attention and MLP write norms per layer, with 95% intervals"),
            ("norms_relative_update.png", "Relative update and cosine to the stream, with 95% intervals (bands)"),
            ("norms_position_heatmap.png", "Stream norm per position and site"),
            ("norms_dla.png", "Direct logit attribution for the prompt"),
        ],
    ),
]

#: the "Encoded vs used" section, after the probes' and only when the run wrote ``causal`` (``run --causal``)
CAUSAL = (
    "causal",
    "Encoded vs used: causal erasure per depth",
    [("causal_encoded_used.png", "Probe accuracy before and after LEACE erasure, and the loss its erasure costs")],
)

#: the anchor of the closing "Tables" section (the same in HTML and in GitHub's markdown)
TABLES_ID = "tables"

#: the introduction's paragraph on how the probes are fitted and scored
PROBE_METHOD = (
    " Probes are trained to convergence (max_epochs is only a cap), with one L2 penalty per task chosen on "
    "held-out data; cumulative scoring stacks the converged per-site probes (a convex fit on out-of-fold "
    "predictions), so E_Δ does not depend on the optimiser; the cumulative score is the soft accuracy (the mean "
    "probability of the gold label: Tenney's argmax accuracy moves E_Δ with the fold draw and the stacking ridge, "
    "and is in the table beside it); E_Δ intervals are 95% bootstraps over test examples and fold draws."
)

#: the introduction's note on the default model's quantised weights
GGUF_NOTE = (
    " The default model's weights are a Q4_1 GGUF file, dequantised to float32 (so they differ slightly "
    "from the original checkpoint)."
)

#: the introduction's paragraph on the lens and norms bands; ``{counts}`` names their clusters
BANDS = (
    " Lens and norms curves show per-site means over tokens; their bands are 95% intervals of each mean "
    "with documents as clusters (tokens of one text are correlated, so they are not counted as independent "
    "draws): mean ± t × the cluster-robust standard error ({counts})."
)

__all__ = ["FIGURES", "TABLES_ID", "Figure", "Page", "RunTables", "Section", "Table", "build_page", "read_run"]


# ---------------------------------------------------------------------------- reading a run
@dataclass
class RunTables:
    """What a run folder holds for the report: ``run.json`` and the tables each section reads
    (None where the run did not write one), and the model's depth in blocks."""

    meta: dict
    lens_by_site: pd.DataFrame | None
    norms: pd.DataFrame | None
    by_site: pd.DataFrame | None
    summary: pd.DataFrame | None
    n_layers: int


def _load(out: Path, name: str) -> pd.DataFrame | None:
    """The table ``name`` of ``out`` (Parquet, else CSV), or None when neither file is there."""
    for ext in (".parquet", ".csv"):
        p = out / f"{name}{ext}"
        if p.is_file():
            return read_table(p)
    return None


def read_run(out: Path) -> RunTables:
    """Read ``run.json`` and the lens, norms and probe tables of the run folder ``out``. The depth
    comes from ``run.json``, else from the first table that has a ``layer`` column, else is 1."""
    meta = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
    lens_by_site, norms = _load(out, "lens_by_site"), _load(out, "norms_by_site")
    by_site, summary = _load(out, "probes_by_site"), _load(out, "probes_summary")
    n_layers = int(meta.get("n_layers", 0)) or None
    if n_layers is None:
        for df in (lens_by_site, norms, by_site):
            if df is not None:
                n_layers = int(df["layer"].max()) + 1
                break
    return RunTables(meta, lens_by_site, norms, by_site, summary, n_layers or 1)


# ---------------------------------------------------------------------------- page data
@dataclass(frozen=True)
class Figure:
    """One figure: its PNG and SVG file names, caption, anchor id, and the image the HTML
    embeds (the SVG when the run wrote one, else the PNG) as a data URI."""

    png: str
    svg: str
    caption: str
    anchor: str
    has_svg: bool
    data_uri: str

    @property
    def main(self) -> str:
        """The file the embedded image links to."""
        return self.svg if self.has_svg else self.png


@dataclass(frozen=True)
class Table:
    """A table as text: column names and the cells of each row, as the markdown shows them
    (floats with 3 decimals, NaN as "nan") and as the HTML shows them (NaN as "NaN")."""

    columns: list[str]
    md_rows: list[list[str]]
    html_rows: list[list[str]]


@dataclass(frozen=True)
class Section:
    """One section: anchor id, title, markdown heading anchor, findings, optional table, figures."""

    key: str
    title: str
    slug: str
    lines: list[str]
    table: Table | None = None
    figures: list[Figure] = field(default_factory=list)


@dataclass(frozen=True)
class Page:
    """The whole report: title, introduction (markdown inline text), sections, and the closing
    sentence listing the run's tables."""

    title: str
    intro: str
    sections: list[Section]
    tables_line: str
    tables_id: str = TABLES_ID


def build_page(out: str | Path) -> Page:
    """The report of the run folder ``out`` as plain data: everything the templates show."""
    out = Path(out)
    run = read_run(out)
    findings = {
        "probes": probe_findings(run.summary, run.by_site, run.n_layers) if run.by_site is not None else [],
        "lens": lens_findings(run.lens_by_site, run.n_layers),
        "norms": norm_findings(run.norms, run.n_layers),
    }
    table = _probe_table(run)
    sections = [
        Section(
            key=key,
            title=title,
            slug=slug(title),
            lines=findings[key],
            table=table if key == "probes" else None,
            figures=[figure(out, png, cap) for png, cap in figs if (out / png).is_file()],
        )
        for key, title, figs in FIGURES
    ]
    causal = _load(out, "causal")
    if causal is not None:
        key, title, figs = CAUSAL
        figs = [figure(out, png, cap) for png, cap in figs if (out / png).is_file()]
        sections.insert(1, Section(key, title, slug(title), causal_findings(causal), figures=figs))
    csvs = ", ".join(sorted(p.name for p in out.glob("*.csv")))
    return Page(
        title=f"depthscope report: {run.meta.get('model', 'model')}",
        intro=intro_text(run.meta, run.lens_by_site, run.norms),
        sections=sections,
        tables_line=f"All numbers above come from the tidy tables in this folder (Parquet and CSV): {csvs}.",
    )


def _probe_table(run: RunTables) -> Table | None:
    """The probe summary table (:func:`probe_table`), tasks in pipeline order, or None without one."""
    if run.summary is None or not len(run.summary):
        return None
    df = probe_table(run.summary, run.n_layers)
    return table_text(df.sort_values("task", key=lambda s: s.map(pipeline_rank), kind="stable"))


def table_text(df: pd.DataFrame) -> Table:
    """``df``'s cells as text, for markdown and for HTML (:class:`Table`)."""
    rows = list(df.itertuples(index=False))
    return Table(
        columns=[str(c) for c in df.columns],
        md_rows=[[_md_cell(v) for v in r] for r in rows],
        html_rows=[[_html_cell(v) for v in r] for r in rows],
    )


def _md_cell(v) -> str:
    """A markdown table cell: floats with 3 decimals, anything else as text."""
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _html_cell(v) -> str:
    """An HTML table cell, written as pandas' ``to_html`` writes it: floats with 3 decimals,
    missing values as "NaN" (None as "None")."""
    if v is None:
        return "None"
    if isinstance(v, float):
        return "NaN" if v != v else f"{v:.3f}"  # v != v: NaN
    return str(v)


def figure(out: Path, png: str, caption: str) -> Figure:
    """The figure ``png`` of ``out`` with its SVG twin's name and the image to embed."""
    svg = Path(png).with_suffix(".svg").name
    has_svg = (out / svg).is_file()
    data = base64.b64encode((out / (svg if has_svg else png)).read_bytes()).decode()
    kind = "svg+xml" if has_svg else "png"
    return Figure(png, svg, caption, figure_id(png), has_svg, f"data:image/{kind};base64,{data}")


def figure_id(png: str) -> str:
    """The HTML anchor of a figure."""
    return "fig-" + Path(png).stem


def slug(title: str) -> str:
    """The anchor a markdown renderer (GitHub's rule) gives a heading."""
    s = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return s.replace(" ", "-")


# ---------------------------------------------------------------------------- introduction
def intro_text(meta: dict, lens_by_site: pd.DataFrame | None, norms: pd.DataFrame | None) -> str:
    """The introduction (markdown inline text): the model and data, how depth is counted, how
    probes are scored, what the bands are, and the run time."""
    intro = (
        f"Model `{meta.get('model', '?')}` ({meta.get('family', '?')}, {meta.get('n_layers', '?')} blocks, "
        f"d_model {meta.get('d_model', '?')}, {meta.get('n_sites', '?')} residual sites). "
        f"Probe data: `{Path(str(meta.get('train', '?'))).name}` → `{Path(str(meta.get('test', '?'))).name}`. "
        f"Depth is in blocks: embedding 0, after block l's attention l + 0.5, after its MLP l + 1."
    )
    if "gguf" in str(meta.get("model", "")).lower() or meta.get("model") == "smollm2-135m":  # the default model
        intro += GGUF_NOTE
    intro += PROBE_METHOD
    units = [(what, _clusters(df)) for what, df in (("lens", lens_by_site), ("norms", norms))]
    counts = "; ".join(f"{what}: {u}" for what, u in units if u is not None)
    if counts:
        intro += BANDS.format(counts=counts)
    if meta.get("seconds"):
        intro += f" Run time: {meta['seconds'].get('total', '?')} s."
    if meta.get("reused"):
        intro += (
            f" Reused from an earlier run in this folder, with the same model, data, settings and code: "
            f"{', '.join(meta['reused'])}."
        )
    return intro


def _clusters(df: pd.DataFrame | None) -> str | None:
    """The clusters of ``df``'s intervals in words ("12 documents", or "14 windows of one
    document" for a single text; "...: fewer than 10, so no interval" below
    :data:`~depthscope.analyses.intervals.MIN_UNITS`), or None when it has no interval columns."""
    if df is None or not len(df) or "n_docs" not in df.columns:
        return None
    docs, windows = int(df["n_docs"].iloc[0]), int(df.get("n_windows", df["n_docs"]).iloc[0])
    if docs == 1 and windows <= 1:
        return "a single window, so no interval"
    n, unit = (windows, "windows of one document") if docs == 1 else (docs, "documents")
    return f"{n} {unit}" + (f": fewer than {MIN_UNITS}, so no interval" if too_few(n) else "")
