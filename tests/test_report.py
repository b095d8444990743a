"""The main job end to end on a tiny model with the bundled sample (the real default model runs
it through `make report`), the report drawn from the tables, and the sweep CLI on a real tiny
training run."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.analyses.report import ReportConfig, lens_findings, probe_findings, render_report, run_report
from depthscope.probes import DataConfig, ProbeConfig


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, tiny_factory):
    out = tmp_path_factory.mktemp("report")
    model = tiny_factory("llama", n_layers=2)
    cfg = ReportConfig(
        lens_tokens=200,
        norms_tokens=300,
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


def test_report_text_is_computed_from_the_tables(report_dir):
    md = (report_dir / "report.md").read_text()
    assert "## Which depth encodes which property" in md
    summ = pd.read_parquet(report_dir / "probes_summary.parquet")
    for t in summ.itertuples():
        e = "n/a" if np.isnan(t.expected_layer_delta) else f"{t.expected_layer_delta:.2f}"  # n/a: gain too small
        assert f"{t.task} (E_Δ = {e}, 95% interval " in md
    html = (report_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 5
    # change a table, redraw: the text follows the numbers
    lens = pd.read_parquet(report_dir / "lens_by_site.parquet")
    lens.loc[0, "kl_to_final"] = 123.456
    lens.to_parquet(report_dir / "lens_by_site.parquet", index=False)
    render_report(report_dir)
    assert "KL = 123.46 nats" in (report_dir / "report.md").read_text()


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
