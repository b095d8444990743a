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
the tables on disk only (``render_report(out_dir)`` redraws it without a model).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from depthscope.analyses.jobs.lens import DEFAULT_PROMPT
from depthscope.analyses.tables import read_table
from depthscope.common.files import atomic_text
from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

DEFAULT_TARGET = " Paris"


# ---------------------------------------------------------------------------- data
def _conllu_texts(path: str | Path, sentences_per_doc: int = 6) -> list[str]:
    """Documents of running text from a CoNLL-U file: ``# text`` lines grouped by ``# newdoc``
    (or every ``sentences_per_doc`` sentences when the file marks no documents)."""
    docs: list[list[str]] = [[]]
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("# newdoc") and docs[-1]:
            docs.append([])
        elif line.startswith("# text = "):
            if len(docs[-1]) >= sentences_per_doc:
                docs.append([])
            docs[-1].append(line[len("# text = ") :].strip())
    return [" ".join(d) for d in docs if d]


def sample_texts() -> list[str]:
    """Running text of the bundled EWT sample (train and test parts)."""
    from depthscope.probes import sample_data

    s = sample_data()
    return _conllu_texts(s["ewt_train"]) + _conllu_texts(s["ewt_test"])


@dataclass
class ReportConfig:
    model: str | None = None
    device: str = "cpu"  # cpu, cuda, cuda:N, mps, auto
    dtype: str = "float32"  # float32, bfloat16, float16
    train: str | None = None
    test: str | None = None
    dev: str | None = None
    texts: Sequence[str] | None = None
    tasks: Sequence[str] | None = None
    prompt: str = DEFAULT_PROMPT
    target: str = DEFAULT_TARGET
    lens_tokens: int = 1500
    norms_tokens: int = 4000
    # the probe section's settings: the same objects, with the same defaults, as `depthscope probe`
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    extraction: ExtractionConfig = field(default_factory=ExtractionConfig)
    data: DataConfig = field(default_factory=DataConfig)


def _cap_texts(texts: Sequence[str], tokenizer, max_tokens: int) -> list[str]:
    out, n = [], 0
    for t in texts:
        k = len(tokenizer(t, add_special_tokens=False)["input_ids"])
        if n and n + k > max_tokens:
            break
        out.append(t)
        n += k
    return out


# ---------------------------------------------------------------------------- the job
def run_report(out_dir: str | Path, config: ReportConfig | None = None, *, progress: bool = True, model=None) -> Path:
    """Run every analysis and write tables, plots, ``report.md`` and ``report.html``; returns the
    path of ``report.html``."""
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.lens import LensConfig, lens_job
    from depthscope.analyses.jobs.norms import NormsConfig, norms_job
    from depthscope.analyses.jobs.probe import ProbeJobConfig, resolve_inputs, run_probe_job
    from depthscope.hooks import load_model

    cfg = config or ReportConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    say = _Say(progress)
    output = Output(out)  # one writer per table and figure across the three jobs

    t0 = time.time()
    say(f"loading model {cfg.model or 'default (SmolLM2-135M-Instruct)'}")
    model = model or load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    timings["load"] = time.time() - t0

    from depthscope.probes import sample_data

    sample = sample_data()
    train = cfg.train or str(sample["ewt_train"])
    test = cfg.test or str(sample["ewt_test"])
    texts = list(cfg.texts) if cfg.texts else _conllu_texts(train) + _conllu_texts(test)
    probe_job = ProbeJobConfig(
        tasks=cfg.tasks, train=train, test=test, dev=cfg.dev, probe=cfg.probe, extraction=cfg.extraction, data=cfg.data
    )
    tasks = resolve_inputs(probe_job)[0]

    meta = {
        "model": model.name,
        "model_source": model.source,
        "family": model.arch.family,
        "n_layers": model.n_layers,
        "d_model": model.d_model,
        "n_sites": model.n_sites,
        "train": train,
        "test": test,
        "tasks": tasks,
        "prompt": cfg.prompt,
        "target": cfg.target,
    }

    # 1. logit lens
    if model.unembed.decodes_stream:
        t = time.time()
        lens_docs = _cap_texts(texts, model.tokenizer, cfg.lens_tokens)
        say(f"logit lens over {len(lens_docs)} documents (at most {cfg.lens_tokens} tokens) at {model.n_sites} sites")
        lens_job(model, lens_docs, LensConfig(prompt=cfg.prompt), output)
        timings["lens"] = time.time() - t

    # 2. contribution norms
    t = time.time()
    norms_docs = _cap_texts(texts, model.tokenizer, cfg.norms_tokens)
    say(f"contribution norms over {len(norms_docs)} documents (at most {cfg.norms_tokens} tokens)")
    norms_job(model, norms_docs, NormsConfig(prompt=cfg.prompt, target=cfg.target), output)
    timings["norms"] = time.time() - t

    # 3. probes
    t = time.time()
    say(f"probes: {', '.join(tasks)}")
    probe_result = run_probe_job(model, probe_job, output, progress=progress)
    meta["probe_precision"] = probe_result.summary["precision"]
    timings["probes"] = time.time() - t

    meta["seconds"] = {k: round(v, 1) for k, v in timings.items()}
    meta["seconds"]["total"] = round(time.time() - t0, 1)
    atomic_text(out / "run.json", json.dumps(meta, indent=1))
    say("writing report")
    path = render_report(out)
    say(f"done in {meta['seconds']['total']:.0f} s: {path}")
    return path


class _Say:
    def __init__(self, on: bool):
        self.on = on
        if on:
            from rich.console import Console

            self.console = Console(stderr=True)

    def __call__(self, msg: str):
        if self.on:
            self.console.print(f"[bold cyan]depthscope[/] {msg}")


# ---------------------------------------------------------------------------- findings
def _fmt(x, nd=2):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def probe_table(summary: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    """The probe summary as the report shows it: readable column names, the E_Δ interval, the
    scalar-mix E_s, selectivity in points, the chosen penalty and convergence."""
    s = summary
    g = lambda c: s[c] if c in s else pd.Series([np.nan] * len(s), index=s.index)  # noqa: E731
    t = pd.DataFrame({"task": s["task"]})
    t["E_Δ (blocks)"] = g("expected_layer_delta")
    t["E_Δ 95% interval"] = [
        f"[{_fmt(a, 1)}, {_fmt(b, 1)}]" for a, b in zip(g("expected_layer_delta_lo"), g("expected_layer_delta_hi"))
    ]
    t["E_Δ / depth"] = g("expected_layer_delta") / n_layers
    t["E_Δ argmax accuracy (blocks)"] = g("expected_layer_delta_hard")
    t["E_s (blocks)"] = g("expected_layer_mix")
    t["total gain (soft, points)"] = 100 * g("total_delta")
    t["best site"] = g("best_label")
    t["best accuracy (%)"] = 100 * g("best_accuracy")
    t["majority (%)"] = 100 * g("majority_accuracy")
    t["max selectivity (points)"] = 100 * g("max_selectivity")
    t["L2"] = [f"{v:g}" if np.isfinite(v) else "n/a" for v in g("l2").astype(float)]
    t["converged"] = ["yes" if v is True or v == 1 else "no" for v in g("converged")]
    t["n train"] = g("n_train")
    t["n test"] = g("n_test")
    return t.reset_index(drop=True)


#: blocks by which the argmax-accuracy E_Delta must differ from the soft one (and lie outside its interval) for the
#: report to say so
SCORES_DISAGREE = 1.0


def probe_findings(summary: pd.DataFrame, by_site: pd.DataFrame, n_layers: int) -> list[str]:
    out = []
    if summary is None or not len(summary):
        return out
    s = summary.copy()
    s = s.sort_values("expected_layer_delta")

    def interval(r):
        lo, hi = (
            getattr(r, "expected_layer_delta_lo", float("nan")),
            getattr(r, "expected_layer_delta_hi", float("nan")),
        )
        return f", 95% interval [{_fmt(lo)}, {_fmt(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else ""

    parts = [f"{r.task} (E_Δ = {_fmt(r.expected_layer_delta)}{interval(r)})" for r in s.itertuples()]
    out.append(
        "Ordered by the expected layer of their cumulative gains, the properties emerge as: " + ", ".join(parts) + "."
    )
    if "expected_layer_delta_lo" in s:
        wide = s[(s["expected_layer_delta_hi"] - s["expected_layer_delta_lo"]) > 0.25 * n_layers]
        if len(wide):
            out.append(
                "E_Δ is unstable for " + ", ".join(wide["task"]) + ": its bootstrap interval over the test "
                "examples spans more than a quarter of the depth (small total gain against noisy per-site gains); "
                "read the per-site accuracies instead."
            )
    if "expected_layer_delta_meaningful" in s:
        weak = s[~s["expected_layer_delta_meaningful"].astype(bool)]
        for r in weak.itertuples():
            out.append(
                f"{r.task}: the total cumulative gain is {_fmt(100 * r.total_delta, 1)} points, too small for "
                "E_Δ to mean a depth (the embedding already decodes most of it)."
            )
    if {"expected_layer_delta_hard", "expected_layer_delta_lo", "expected_layer_delta_hi"} <= set(s.columns):
        for r in s.itertuples():
            soft, hard = r.expected_layer_delta, r.expected_layer_delta_hard
            if not (np.isfinite(soft) and np.isfinite(hard)) or abs(hard - soft) < SCORES_DISAGREE:
                continue
            if r.expected_layer_delta_lo <= hard <= r.expected_layer_delta_hi:
                continue
            when = "earlier" if hard < soft else "later"
            why = " (later sites make the probe surer without changing many of its decisions)" if hard < soft else ""
            out.append(
                f"{r.task}: scored on the argmax accuracy (Tenney's score), E_Δ is {_fmt(hard)} blocks against "
                f"{_fmt(soft)} on the soft accuracy: the decisions are settled {when} than the probability of the "
                f"gold label{why}."
            )
    if "converged" in s and not s["converged"].astype(bool).all():
        out.append(
            "Some probes stopped at max_epochs before converging ("
            + ", ".join(s[~s["converged"].astype(bool)]["task"])
            + "): raise --max-epochs before reading these numbers."
        )
    first, last = s.iloc[0], s.iloc[-1]
    if len(s) > 1:
        gap = last.expected_layer_delta - first.expected_layer_delta
        out.append(
            f"{first.task} is resolved earliest, at "
            f"{_fmt(first.expected_layer_delta / n_layers * 100, 0)}% of the depth; "
            f"{last.task} latest, at {_fmt(last.expected_layer_delta / n_layers * 100, 0)}% "
            f"({_fmt(gap)} blocks later)."
        )
    for r in s.itertuples():
        t = by_site[by_site["task"] == r.task]
        if not len(t):
            continue
        best = t.loc[t["accuracy"].idxmax()]
        emb = t[t["site"] == 0]["accuracy"]
        sel = best.get("selectivity", float("nan"))
        line = (
            f"{r.task}: best accuracy {_fmt(best['accuracy'] * 100, 1)}% at {best['label']} (depth {best['depth']:g}), "
            f"selectivity there {_fmt(sel * 100, 1)} points"
        )
        if len(emb):
            line += f"; the embedding alone gives {_fmt(float(emb.iloc[0]) * 100, 1)}%"
        out.append(line + ".")
    return out


def _ci(row, col: str, nd: int = 2, scale: float = 1.0) -> str:
    """The text ``(95% interval [lo, hi])`` for ``row[col]`` (times ``scale``), empty when the
    table has no interval for it."""
    lo, hi = row.get(f"{col}_lo", float("nan")), row.get(f"{col}_hi", float("nan"))
    try:
        ok = np.isfinite(lo) and np.isfinite(hi)
    except TypeError:
        ok = False
    return f" (95% interval [{_fmt(lo * scale, nd)}, {_fmt(hi * scale, nd)}])" if ok else ""


def lens_findings(lens_by_site: pd.DataFrame | None, n_layers: int) -> list[str]:
    out = []
    if lens_by_site is None or not len(lens_by_site):
        return out
    d = lens_by_site.sort_values("site")
    emb = d.iloc[0]
    out.append(
        f"Decoded directly, the embedding is far from the final prediction: KL = {_fmt(emb['kl_to_final'])} nats"
        f"{_ci(emb, 'kl_to_final')}, top-1 agreement {_fmt(emb['top1_agreement'] * 100, 0)}%"
        f"{_ci(emb, 'top1_agreement', 0, 100)}."
    )
    half = d[d["top1_agreement"] >= 0.5]
    if len(half):
        h = half.iloc[0]
        out.append(
            f"The lens first agrees with the model's own top-1 on half the tokens at {h['label']} "
            f"(depth {h['depth']:g} of {n_layers}; {_fmt(h['top1_agreement'] * 100, 0)}%"
            f"{_ci(h, 'top1_agreement', 0, 100)})."
        )
    mid = d.iloc[len(d) // 2]
    out.append(
        f"Half-way ({mid['label']}), KL to the final distribution is {_fmt(mid['kl_to_final'])} nats"
        f"{_ci(mid, 'kl_to_final')} and the next-token cross-entropy {_fmt(mid['cross_entropy'])} nats"
        f"{_ci(mid, 'cross_entropy')}, against {_fmt(d.iloc[-1]['cross_entropy'])} at the output"
        f"{_ci(d.iloc[-1], 'cross_entropy')}."
    )
    drops = d["kl_to_final"].diff(-1)  # how much KL falls from each site to the next
    if drops.notna().any():
        i = drops.idxmax()
        nxt = d.loc[d.index[d.index.get_loc(i) + 1]] if d.index.get_loc(i) + 1 < len(d) else None
        if nxt is not None:
            out.append(
                f"The largest single drop in KL ({_fmt(drops[i])} nats) comes from "
                f"{nxt['label']} ({nxt['sublayer']} write)."
            )
    return out


def norm_findings(norms: pd.DataFrame, n_layers: int) -> list[str]:
    out = []
    if norms is None or not len(norms):
        return out
    d = norms
    if "positions" in d.columns:
        d = d[d["positions"] == "rest"]
    d = d.sort_values("site")
    e, f = d.iloc[0]["stream_norm"], d.iloc[-1]["stream_norm"]
    if e > 0 and f > 0:
        from depthscope.analyses.norms import fit_growth_rate

        fit = fit_growth_rate(norms)
        b0 = d[d["label"] == "0.mlp"]["stream_norm"]
        line = f"The stream's norm goes from {_fmt(e)} at the embedding"
        if len(b0):
            line += f" to {_fmt(float(b0.iloc[0]))} after block 0"
        line += (
            f" and {_fmt(f)}{_ci(d.iloc[-1], 'stream_norm')} after the last block; a log-linear fit over the block "
            f"outputs gives ×{_fmt(fit['rate'], 3)} per block (R² {_fmt(fit['r2'])})."
        )
        out.append(line)
    if "attn_share" in d.columns:
        share = d[d["sublayer"] == "attn"]["attn_share"].mean()
        out.append(
            f"Attention writes {_fmt(share * 100, 0)}% of the per-layer update norm on average, "
            f"MLPs {_fmt((1 - share) * 100, 0)}%."
        )
    upd = d.dropna(subset=["relative_update"])
    if len(upd):
        big = upd.loc[upd["relative_update"].idxmax()]
        out.append(
            f"The largest write relative to the stream is {big['label']} (‖u‖/‖h‖ = {_fmt(big['relative_update'])}"
            f"{_ci(big, 'relative_update')})."
        )
    if "cos_update_stream" in d.columns:
        erase = upd[upd["cos_update_stream"] < -0.2]
        if len(erase):
            out.append(
                f"{len(erase)} sublayer{'s' if len(erase) != 1 else ''} write{'' if len(erase) != 1 else 's'} "
                f"against the stream (cosine < -0.2), most strongly "
                f"{erase.loc[erase['cos_update_stream'].idxmin(), 'label']}."
            )
    if "positions" in norms.columns and (norms["positions"] == "first").any():
        first = norms[norms["positions"] == "first"].sort_values("site")
        ratio = first["stream_norm"].to_numpy()[-1] / max(d["stream_norm"].to_numpy()[-1], 1e-9)
        mx = first["stream_norm"].max() / max(d["stream_norm"].max(), 1e-9)
        out.append(
            f"The first position (attention sink) reaches up to {_fmt(mx, 1)}× the norm of other tokens "
            f"(×{_fmt(ratio, 1)} after the last block)."
        )
    return out


# ---------------------------------------------------------------------------- rendering
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


def _load(out: Path, name: str) -> pd.DataFrame | None:
    for ext in (".parquet", ".csv"):
        p = out / f"{name}{ext}"
        if p.is_file():
            return read_table(p)
    return None


def render_report(out_dir: str | Path) -> Path:
    """Write ``report.md`` and ``report.html`` from the tables and plots in ``out_dir``.

    Both open with a table of contents (sections and figures). The HTML embeds each figure's
    SVG (vector; the PNG when no SVG is there) and links both files; the markdown shows the PNG
    and links the SVG."""
    from depthscope.probes.corpora.tasks import pipeline_rank

    out = Path(out_dir)
    meta = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
    L = int(meta.get("n_layers", 0)) or None
    lens_by_site = _load(out, "lens_by_site")
    norms = _load(out, "norms_by_site")
    by_site = _load(out, "probes_by_site")
    summary = _load(out, "probes_summary")
    if L is None:
        for df in (lens_by_site, norms, by_site):
            if df is not None:
                L = int(df["layer"].max()) + 1
                break
    L = L or 1

    table = None
    if summary is not None and len(summary):
        table = probe_table(summary, L).sort_values("task", key=lambda s: s.map(pipeline_rank), kind="stable")
    findings = {
        "probes": probe_findings(summary, by_site, L) if by_site is not None else [],
        "lens": lens_findings(lens_by_site, L),
        "norms": norm_findings(norms, L),
    }
    sections = [
        _Section(key, title, findings[key], table if key == "probes" else None, _present(out, figs))
        for key, title, figs in FIGURES
    ]

    head = f"depthscope report: {meta.get('model', 'model')}"
    intro = _intro(meta, lens_by_site, norms)
    tables = sorted(p.name for p in out.glob("*.csv"))
    tables_line = (
        "All numbers above come from the tidy tables in this folder (Parquet and CSV): " + ", ".join(tables) + "."
    )
    atomic_text(out / "report.md", _markdown(head, intro, sections, tables_line))
    path = out / "report.html"
    atomic_text(path, _html(out, head, intro, sections, tables_line))
    return path


@dataclass
class _Section:
    key: str  # the anchor id
    title: str
    lines: list[str]
    table: pd.DataFrame | None
    figures: list[tuple[str, str]]  # (png file, caption)


TABLES_ID = "tables"


def _present(out: Path, figs) -> list[tuple[str, str]]:
    return [(f, cap) for f, cap in figs if (out / f).is_file()]


def _figure_id(png: str) -> str:
    return "fig-" + Path(png).stem


def _intro(meta: dict, lens_by_site: pd.DataFrame | None, norms: pd.DataFrame | None) -> str:
    intro = (
        f"Model `{meta.get('model', '?')}` ({meta.get('family', '?')}, {meta.get('n_layers', '?')} blocks, "
        f"d_model {meta.get('d_model', '?')}, {meta.get('n_sites', '?')} residual sites). "
        f"Probe data: `{Path(str(meta.get('train', '?'))).name}` → `{Path(str(meta.get('test', '?'))).name}`. "
        f"Depth is in blocks: embedding 0, after block l's attention l + 0.5, after its MLP l + 1."
    )
    if "gguf" in str(meta.get("model", "")).lower() or meta.get("model") == "smollm2-135m":  # the default model
        intro += (
            " The default model's weights are a Q4_1 GGUF file, dequantised to float32 (so they differ slightly "
            "from the original checkpoint)."
        )
    intro += (
        " Probes are trained to convergence (max_epochs is only a cap), with one L2 penalty per task chosen on "
        "held-out data; cumulative scoring stacks the converged per-site probes (a convex fit on out-of-fold "
        "predictions), so E_Δ does not depend on the optimiser; the cumulative score is the soft accuracy (the mean "
        "probability of the gold label: Tenney's argmax accuracy moves E_Δ with the fold draw and the stacking ridge, "
        "and is in the table beside it); E_Δ intervals are 95% bootstraps over test examples and fold draws."
    )
    units = [(what, _clusters(df)) for what, df in (("lens", lens_by_site), ("norms", norms))]
    units = [(what, u) for what, u in units if u is not None]
    if units:
        counts = "; ".join(f"{what}: {u}" for what, u in units)
        intro += (
            " Lens and norms curves show per-site means over tokens; their bands are 95% intervals of each mean "
            "with documents as clusters (tokens of one text are correlated, so they are not counted as independent "
            f"draws): mean ± t × the cluster-robust standard error ({counts})."
        )
    if meta.get("seconds"):
        intro += f" Run time: {meta['seconds'].get('total', '?')} s."
    return intro


def _clusters(df: pd.DataFrame | None) -> str | None:
    """The clusters of ``df``'s intervals in words ("12 documents", or "4 windows of one
    document" for a single text), or None when it has no interval columns."""
    if df is None or not len(df) or "n_docs" not in df.columns:
        return None
    docs, windows = int(df["n_docs"].iloc[0]), int(df.get("n_windows", df["n_docs"]).iloc[0])
    if docs == 1:
        return f"{windows} windows of one document" if windows > 1 else "a single window, so no interval"
    return f"{docs} documents"


def _slug(title: str) -> str:
    """The anchor a markdown renderer (GitHub's rule) gives a heading."""
    s = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return s.replace(" ", "-")


def _markdown(head: str, intro: str, sections: list[_Section], tables_line: str) -> str:
    md = [f"# {head}", "", intro, "", "## Contents", ""]
    for sec in sections:
        md.append(f"1. [{sec.title}](#{_slug(sec.title)})")
    md += [f"1. [Tables](#{_slug('Tables')})", ""]
    for sec in sections:
        md += [f"## {sec.title}", ""]
        md += [f"- {ln}" for ln in sec.lines] + ([""] if sec.lines else [])
        if sec.table is not None:
            md += [_md_table(sec.table), ""]
        for f, cap in sec.figures:
            md += [f"![{cap}]({f})", "", f"*{cap}* ([SVG]({Path(f).with_suffix('.svg').name}))", ""]
    md += ["## Tables", "", tables_line]
    return "\n".join(md)


CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "img{max-width:100%;border:1px solid #ddd;margin:.5em 0;background:#fff}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:right}th{background:#f3f3f3}table{font-size:.85em}"
    "figure{margin:1em 0}figcaption{color:#555;font-size:.9em}"
    "nav#contents{background:#f7f7f7;border:1px solid #e3e3e3;padding:.4em 1.2em;margin:1.2em 0}"
    "nav#contents h2{font-size:1.1em;margin:.4em 0}nav#contents ol{margin:.3em 0}"
    "nav#contents ul{margin:.1em 0 .4em;font-size:.92em}nav#contents li{margin:.15em 0}"
    "a{color:#1f5fa8}figcaption a{margin-left:.3em}div.wide{overflow-x:auto;margin:1em 0}"
)


def _html(out: Path, head: str, intro: str, sections: list[_Section], tables_line: str) -> str:
    esc = html.escape
    toc = ["<nav id='contents' aria-label='Contents'><h2>Contents</h2><ol>"]
    for sec in sections:
        toc.append(f"<li><a href='#{sec.key}'>{esc(sec.title)}</a>")
        if sec.figures:
            toc.append(
                "<ul>"
                + "".join(f"<li><a href='#{_figure_id(f)}'>{esc(cap)}</a></li>" for f, cap in sec.figures)
                + "</ul>"
            )
        toc.append("</li>")
    toc.append(f"<li><a href='#{TABLES_ID}'>Tables</a></li></ol></nav>")
    h = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(head)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{esc(head)}</h1>",
        f"<p>{_md_inline(intro)}</p>",
        "".join(toc),
    ]
    for sec in sections:
        h.append(f"<section id='{sec.key}'><h2>{esc(sec.title)}</h2>")
        if sec.lines:
            h.append("<ul>" + "".join(f"<li>{esc(ln)}</li>" for ln in sec.lines) + "</ul>")
        if sec.table is not None:
            table = sec.table.to_html(index=False, float_format=lambda x: f"{x:.3f}", border=0)
            h.append(f"<div class='wide'>{table}</div>")
        for f, cap in sec.figures:
            h.append(_html_figure(out, f, cap))
        h.append("</section>")
    h.append(f"<section id='{TABLES_ID}'><h2>Tables</h2><p>{esc(tables_line)}</p></section>")
    h.append("</body></html>")
    return "\n".join(h)


def _html_figure(out: Path, png: str, cap: str) -> str:
    """One figure: its SVG embedded (the PNG when there is no SVG), with links to both files."""
    esc = html.escape
    svg = Path(png).with_suffix(".svg").name
    if (out / svg).is_file():
        data, kind, main = base64.b64encode((out / svg).read_bytes()).decode(), "svg+xml", svg
        links = f"<a href='{esc(svg)}'>SVG</a> <a href='{esc(png)}'>PNG</a>"
    else:
        data, kind, main = base64.b64encode((out / png).read_bytes()).decode(), "png", png
        links = f"<a href='{esc(png)}'>PNG</a>"
    return (
        f"<figure id='{_figure_id(png)}'><a href='{esc(main)}'>"
        f"<img alt='{esc(cap)}' src='data:image/{kind};base64,{data}'></a>"
        f"<figcaption>{esc(cap)} {links}</figcaption></figure>"
    )


def _md_table(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in df.itertuples(index=False):
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in r]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_inline(s: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(s))
