"""The main job end to end on a tiny model with the bundled sample (the real default model runs
it through `make report`), the report drawn from the tables, and the sweep CLI on a real tiny
training run."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.analyses.report.main_job import ReportConfig, lens_findings, probe_findings, render_report, run_report
from depthscope.probes import DataConfig, ProbeConfig


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, tiny_factory):
    out = tmp_path_factory.mktemp("report")
    model = tiny_factory("llama", n_layers=2)
    cfg = ReportConfig(
        lens_tokens=3000,  # at least 10 documents: the lens means get intervals
        norms_tokens=800,  # three documents: the norms intervals are withheld, and the report says so
        data=DataConfig(max_train_sentences=40, max_test_sentences=20),
        probe=ProbeConfig(max_epochs=20),
    )
    run_report(out, cfg, progress=False, model=model)
    return out


def test_report_files_and_tables(report_dir):
    for name in [
        "lens_by_site",
        "lens_tokens",
        "norms_by_site",
        "norms_by_position",
        "dla",
        "probes_by_site",
        "probes_summary",
    ]:
        assert (report_dir / f"{name}.parquet").is_file() and (report_dir / f"{name}.csv").is_file(), name
    lens = pd.read_parquet(report_dir / "lens_by_site.parquet")
    assert list(lens.columns[:5]) == ["site", "label", "layer", "sublayer", "depth"]
    assert len(lens) == 5
    summ = pd.read_parquet(report_dir / "probes_summary.parquet")
    assert set(summ["task"]) == {"upos", "deprel", "feats:Number"}
    meta = json.loads((report_dir / "run.json").read_text())
    assert meta["n_layers"] == 2 and meta["seconds"]["total"] > 0
    peak = meta["peak_memory_gib"]  # each stage's own peak, and the largest
    assert set(peak) == set(meta["seconds"]) and min(peak.values()) > 0
    assert peak["total"] == max(v for k, v in peak.items() if k != "total")


def test_report_text_is_computed_from_the_tables(report_dir, tmp_path):
    md = (report_dir / "report.md").read_text()
    assert "## Which depth encodes which property" in md
    summ = pd.read_parquet(report_dir / "probes_summary.parquet")
    for t in summ.itertuples():
        e = "n/a" if np.isnan(t.expected_layer_delta) else f"{t.expected_layer_delta:.2f}"  # n/a: gain too small
        assert f"{t.task} (E_Δ = {e}, 95% interval " in md
    html = (report_dir / "report.html").read_text()
    assert html.count("data:image/svg+xml;base64,") >= 5  # the vector figures embedded
    # change a table (in a copy of the folder), redraw: the text follows the numbers
    copy = tmp_path / "copy"
    shutil.copytree(report_dir, copy)
    lens = pd.read_parquet(copy / "lens_by_site.parquet")
    lens.loc[0, "kl_to_final"] = 123.456
    lens.to_parquet(copy / "lens_by_site.parquet", index=False)
    render_report(copy)
    assert "KL = 123.46 nats" in (copy / "report.md").read_text()


class _Anchors(HTMLParser):
    """Element ids, in-page links (``#...``) and file links of an HTML page."""

    def __init__(self):
        super().__init__()
        self.ids, self.local, self.files, self.in_nav = set(), [], [], False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "nav":
            self.in_nav = True
        href = a.get("href")
        if tag == "a" and href:
            if href.startswith("#"):
                self.local.append((href[1:], self.in_nav))
            else:
                self.files.append(href)

    def handle_endtag(self, tag):
        if tag == "nav":
            self.in_nav = False


def test_report_contents_and_vector_figures(report_dir):
    """The HTML opens with a table of contents whose links all resolve to element ids (one per
    section, one per figure); every PNG figure the report refers to has an SVG sibling that
    parses as XML, and the HTML embeds and links it; the markdown has a contents list too."""
    import xml.etree.ElementTree as ET

    page = (report_dir / "report.html").read_text()
    parsed = _Anchors()
    parsed.feed(page)
    toc = [a for a, in_nav in parsed.local if in_nav]
    assert page.index("<nav id='contents'") < page.index("<section")  # at the top, before the sections
    assert {"probes", "lens", "norms", "tables"} <= set(toc)
    assert sum(a.startswith("fig-") for a in toc) >= 5
    missing = [a for a, _ in parsed.local if a not in parsed.ids]
    assert not missing, missing
    md = (report_dir / "report.md").read_text()
    pngs = set(re.findall(r"\]\(([\w.-]+\.png)\)", md)) | {f for f in parsed.files if f.endswith(".png")}
    assert {"lens_metrics.png", "norms_stream_growth.png", "probes_overview.png"} <= pngs
    for png in pngs:
        svg = report_dir / png.replace(".png", ".svg")
        assert (report_dir / png).is_file() and svg.is_file(), png
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg"), png
        assert svg.name in parsed.files and f"({svg.name})" in md, png
        assert f"id='fig-{svg.stem}'" in page
    # the markdown's contents list points at its headings (GitHub's anchors)
    assert "## Contents" in md
    assert "1. [How the prediction forms: logit lens](#how-the-prediction-forms-logit-lens)" in md
    # the interval bands are drawn (filled areas in the vector figures) where there are intervals
    assert "PolyCollection" in (report_dir / "lens_metrics.svg").read_text()
    for name in ("norms_stream_growth", "norms_relative_update"):  # under 10 documents: none
        assert "PolyCollection" not in (report_dir / f"{name}.svg").read_text(), name


def test_report_intervals_in_tables_and_text(report_dir):
    """The lens table carries per-site intervals around its means (10 documents or more), the
    norms table over fewer than 10 documents withholds them (NaN) with its n and method named; the report
    quotes the ones there are and says what the bands are and why some are missing."""
    lens = pd.read_parquet(report_dir / "lens_by_site.parquet")
    norms = pd.read_parquet(report_dir / "norms_by_site.parquet")
    for c in ["kl_to_final", "cross_entropy", "top1_agreement"]:
        ok = lens[c + "_se"].notna()
        assert ok.any() and (lens[c + "_lo"][ok] <= lens[c][ok]).all() and (lens[c][ok] <= lens[c + "_hi"][ok]).all()
    assert (lens["n_docs"] >= 10).all() and (lens["ci_n"] == lens["n_docs"]).all()
    n = int(norms["n_docs"].iloc[0])  # the norms' token cap reaches into a few documents only
    assert n < 10 and (norms["n_docs"] == n).all() and (norms["ci_n"] == n).all()
    assert set(norms["ci_unit"]) == {"documents"}
    assert norms["stream_norm_se"].notna().any() and norms["stream_norm_lo"].isna().all()
    md = (report_dir / "report.md").read_text()
    emb = lens.sort_values("site").iloc[0]
    assert f"KL = {emb['kl_to_final']:.2f} nats (95% interval [{emb['kl_to_final_lo']:.2f}, " in md
    n_lens = int(lens["n_docs"].iloc[0])
    assert f"lens: {n_lens} documents; norms: {n} documents: fewer than 10, so no interval" in md
    last = norms[norms["positions"] == "rest"].sort_values("site").iloc[-1]
    assert f"and {last['stream_norm']:.2f} after the last block;" in md  # quoted without an interval


def test_probe_findings_say_when_the_two_scores_disagree():
    """The report says when Tenney's argmax E_Delta lies more than a block from the soft one and
    outside its interval (GUM coref on the decoder: 1.94 against 5.56), and not otherwise."""
    summ = pd.DataFrame(
        {
            "task": ["coref", "upos"],
            "expected_layer_delta": [5.56, 3.33],
            "expected_layer_delta_lo": [5.2, 3.0],
            "expected_layer_delta_hi": [6.0, 3.6],
            "expected_layer_delta_hard": [1.94, 3.06],
        }
    )
    by_site = pd.DataFrame(
        {"task": ["coref", "upos"], "site": [0, 0], "label": ["embed"] * 2, "depth": [0.0] * 2, "accuracy": [0.7, 0.9]}
    )
    text = " ".join(probe_findings(summ, by_site, 30))
    assert "coref: scored on the argmax accuracy (Tenney's score), E_Δ is 1.94 blocks against 5.56" in text
    assert "settled earlier" in text and "upos: scored on the argmax" not in text
    summ.loc[1, "expected_layer_delta_hard"] = 5.0  # later, and outside [3.0, 3.6]
    text = " ".join(probe_findings(summ, by_site, 30))
    assert "upos: scored on the argmax accuracy (Tenney's score), E_Δ is 5.00 blocks against 3.33" in text
    assert "settled later" in text
    summ.loc[0, "expected_layer_delta_lo"] = 1.0  # inside the interval: nothing to say
    assert "coref: scored" not in " ".join(probe_findings(summ, by_site, 30))


def test_lens_findings_values():
    df = pd.DataFrame(
        {
            "site": [0, 1, 2],
            "label": ["embed", "0.attn", "0.mlp"],
            "layer": [-1, 0, 0],
            "sublayer": ["embed", "attn", "mlp"],
            "depth": [0, 0.5, 1.0],
            "kl_to_final": [5.0, 4.0, 0.0],
            "top1_agreement": [0.1, 0.6, 1.0],
            "cross_entropy": [9.0, 7.0, 3.0],
        }
    )
    text = " ".join(lens_findings(df, 1))
    assert "KL = 5.00" in text and "at 0.attn" in text and "from 0.mlp" in text


def test_run_cli_refuses_a_foreign_output_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("someone else's")
    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path)])
    assert res.exit_code != 0
    assert "not empty" in str(res.exception) or "not empty" in res.output
    res = CliRunner().invoke(app, ["run", "--data", "only-one.conllu", "--out", str(tmp_path / "new")])
    assert res.exit_code != 0


def test_sweep_cli_lens_on_training_series(tmp_path, tokenizer):
    from depthscope.hooks.toy import train_tiny_series

    texts = ["The cat sat on the mat. The dog sat on the log."] * 30
    train_tiny_series(
        tmp_path / "ckpts", texts, tokenizer, steps=20, save_every=10, d_model=32, n_layers=2, batch_size=8
    )
    text = tmp_path / "text.txt"
    text.write_text("\n".join(texts[:4]))
    args = [
        "sweep",
        "--checkpoint-dir",
        str(tmp_path / "ckpts"),
        "--analysis",
        "lens",
        "--text",
        str(text),
        "--out",
        str(tmp_path / "sweep"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(tmp_path / "sweep" / "sweep_by_site.parquet")
    assert sorted(df["step"].unique().tolist()) == [0, 10, 20]
    assert len(df) == 3 * 5
    last = df[df["site"] == 4].sort_values("step")
    assert (last["kl_to_final"].abs() < 1e-4).all()  # the last site is the model itself
    assert last["cross_entropy"].iloc[-1] < last["cross_entropy"].iloc[0]  # training lowered the loss
    assert (tmp_path / "sweep" / "sweep_kl_to_final.png").is_file()
    res2 = CliRunner().invoke(app, args)  # resume: nothing left to do
    assert res2.exit_code == 0 and "0 checkpoints done, 3 already finished" in res2.output
    assert len(pd.read_parquet(tmp_path / "sweep" / "sweep_by_site.parquet")) == 15


def test_a_figure_is_drawn_once_for_its_png_and_svg(tmp_path):
    """Output.figure saves the PNG and its SVG twin from one drawing (style.savefig writes both);
    a plot function that saves some other way still gets its SVG from a second call."""
    import xml.etree.ElementTree as ET

    from depthscope.analyses.jobs import Output
    from depthscope.analyses.style import plt, savefig

    calls = []

    def plot(path):
        calls.append(path)
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        savefig(fig, path)

    def plain(path):
        calls.append(path)
        fig, ax = plt.subplots()
        fig.savefig(path)
        plt.close(fig)

    out = Output(tmp_path)
    png = out.figure(plot, name="one")
    assert len(calls) == 1 and png.is_file() and ET.parse(png.with_suffix(".svg")).getroot().tag.endswith("svg")
    out.figure(plain, name="two")
    assert len(calls) == 3 and (tmp_path / "two.svg").is_file()


def test_a_model_the_job_loaded_is_freed_before_the_probes_train(tiny_llama_dir, tmp_path, monkeypatch):
    """The job's only reference goes to the probes as a one-shot loader: once its activations are
    extracted nothing holds the model, so its memory is free while the probes train."""
    import weakref

    import depthscope.analyses.report.main_job as report
    import depthscope.probes.run as probe_run

    refs, alive_at_fit = [], []
    load, fit = report.load_model, probe_run.fit_task

    def loading(*a, **kw):
        m = load(*a, **kw)
        refs.append(weakref.ref(m))
        return m

    def fitting(*a, **kw):
        alive_at_fit.append(refs[0]() is not None)
        return fit(*a, **kw)

    monkeypatch.setattr(report, "load_model", loading)
    monkeypatch.setattr(probe_run, "fit_task", fitting)
    cfg = ReportConfig(
        model=str(tiny_llama_dir),
        tasks=["upos"],
        lens_tokens=100,
        norms_tokens=100,
        data=DataConfig(max_train_sentences=20, max_test_sentences=10),
        probe=ProbeConfig(max_epochs=3, l2=1e-3, cumulative=False),
    )
    run_report(tmp_path / "out", cfg, progress=False)
    assert len(refs) == 1 and alive_at_fit == [False]
