"""Checkpoint sweeps over a real (tiny) training run: one combined table, resume without loss
or duplication, failures recorded, mixed series refused, conflicting outputs detected."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from depthscope.analyses.sweeps.series import (
    OutputConflict,
    SweepError,
    combine,
    discover_checkpoints,
    parse_step,
    sweep,
)

TEXT = [
    "The cat sat on the mat. The dog sat on the log. The cat and the dog sat together.",
    "A bird flew over the house and sang. The bird sang again in the morning.",
] * 20


@pytest.fixture(scope="module")
def series(tmp_path_factory, tokenizer):
    from depthscope.hooks.toy import train_tiny_series

    d = tmp_path_factory.mktemp("series")
    train_tiny_series(d, TEXT, tokenizer, steps=60, save_every=20, d_model=32, n_layers=2, batch_size=8)
    return d


def stream_and_loss(model, texts):
    """A small analysis: mean stream norm per site and the model's own next-token loss."""
    rs = model.residual_stream(texts)
    m = rs.mask
    norms = rs.resid.norm(dim=-1)[:, m].mean(dim=1)
    logits = rs.logits[:, :-1][m[:, 1:]]
    target = rs.input_ids[:, 1:][m[:, 1:]]
    loss = torch.nn.functional.cross_entropy(logits, target).item()
    df = rs.site_frame()
    df["stream_norm"] = norms.numpy()
    df["loss"] = loss
    return {"by_site": df}


def test_parse_step_and_discovery(series, tmp_path):
    assert parse_step("step100") == 100
    assert parse_step("checkpoint-2000") == 2000
    assert parse_step("global_step30") == 30
    assert parse_step("model.gguf") is None
    cks = discover_checkpoints(checkpoint_dir=series)
    assert [c.step for c in cks] == [0, 20, 40, 60]  # numeric order, not 0, 20, 40, 60 as strings
    assert [c.name for c in cks] == ["step0", "step20", "step40", "step60"]
    with pytest.raises(SweepError):
        discover_checkpoints(checkpoint_dir=tmp_path)
    with pytest.raises(SweepError):
        discover_checkpoints()


def test_sweep_table_and_training_signal(series, tmp_path):
    cks = discover_checkpoints(checkpoint_dir=series)
    res = sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:4], progress=False)
    assert res.ok and res.done == [c.name for c in cks]
    df = res.tables["by_site"]
    assert list(df.columns[:7]) == ["checkpoint", "step", "site", "label", "layer", "sublayer", "depth"]
    assert len(df) == 4 * 5  # 4 checkpoints x (2 layers -> 5 sites)
    assert df["step"].tolist() == sorted(df["step"].tolist())
    loss = df.groupby("step")["loss"].first()
    assert loss[60] < loss[0] - 1.0  # a real training run: the loss fell
    on_disk = pd.read_parquet(tmp_path / "out" / "sweep_by_site.parquet")
    pd.testing.assert_frame_equal(on_disk, df)
    assert (tmp_path / "out" / "sweep_by_site.csv").is_file()


def test_resume_after_interruption(series, tmp_path):
    cks = discover_checkpoints(checkpoint_dir=series)
    calls = []
    interrupt = {"on": True}

    def flaky(model, **kw):
        calls.append(1)
        if interrupt["on"] and len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C during the third checkpoint
        return stream_and_loss(model, **kw)

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        sweep(cks, flaky, out, texts=TEXT[:4], progress=False)
    assert sorted(p.name for p in (out / "checkpoints").glob("*.done.json")) == ["step0.done.json", "step20.done.json"]
    assert not list(out.rglob(".*.tmp*")) and not [p for p in out.rglob("*") if p.name.startswith(".")]

    interrupt["on"] = False
    res = sweep(cks, flaky, out, texts=TEXT[:4], progress=False)
    assert res.skipped == ["step0", "step20"] and res.done == ["step40", "step60"]
    df = res.tables["by_site"]
    assert len(df) == 20 and not df.duplicated(["checkpoint", "site"]).any()
    full = sweep(cks, stream_and_loss, tmp_path / "ref", texts=TEXT[:4], progress=False).tables["by_site"]
    pd.testing.assert_frame_equal(df.reset_index(drop=True), full.reset_index(drop=True))


def test_failed_checkpoint_recorded_and_sweep_goes_on(series, tmp_path):
    bad = tmp_path / "step30"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    cks = discover_checkpoints([series / "step0", bad, series / "step60"])
    res = sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:2], progress=False)
    assert not res.ok and list(res.failed) == ["step30"] and "config.json" in res.failed["step30"]
    assert res.done == ["step0", "step60"]
    rec = json.loads((tmp_path / "out" / "checkpoints" / "step30.failed.json").read_text())
    assert rec["spec"] == str(bad)
    assert set(res.tables["by_site"]["checkpoint"]) == {"step0", "step60"}


def test_mixed_series_refused(series, tmp_path, tokenizer):
    from conftest import make_tiny

    other = tmp_path / "step99"
    make_tiny("gpt2", vocab_size=len(tokenizer), n_layers=2, d_model=32).save_pretrained(other)
    tokenizer.save_pretrained(other)
    cks = discover_checkpoints([series / "step0", other])
    res = sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:2], progress=False)
    assert "mixed series" in res.failed["step99"]
    res2 = sweep(cks, stream_and_loss, tmp_path / "out2", texts=TEXT[:2], progress=False, allow_mixed=True)
    assert res2.ok


def test_output_conflict(series, tmp_path):
    cks = discover_checkpoints([series / "step0"])
    sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:2], progress=False)
    with pytest.raises(OutputConflict):
        sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:3], progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("someone else's")
    with pytest.raises(OutputConflict):
        sweep(cks, stream_and_loss, tmp_path / "other", texts=TEXT[:2], progress=False)
    res = sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:3], progress=False, overwrite=True)
    assert res.done == ["step0"]
    assert len(combine(tmp_path / "out")["by_site"]) == 5


def test_sweep_plots(series, tmp_path):
    from depthscope.analyses.sweeps.plots import plot_checkpoint_heatmap, plot_final_site_over_training

    cks = discover_checkpoints(checkpoint_dir=series)
    df = sweep(cks, stream_and_loss, tmp_path / "out", texts=TEXT[:2], progress=False).tables["by_site"]
    p = plot_checkpoint_heatmap(df, "stream_norm", tmp_path / "h.png")
    q = plot_final_site_over_training(df, "stream_norm", tmp_path / "l.png")
    assert p.stat().st_size > 5000 and q.stat().st_size > 5000
    with pytest.raises(KeyError):
        plot_checkpoint_heatmap(df, "nope", tmp_path / "x.png")


def test_sweep_cli_probe_takes_the_probe_protocol(series, tmp_path):
    """``depthscope sweep --analysis probe`` takes the probe options of ``depthscope probe``
    (cap, fold draws, seed) and they reach every checkpoint's run; options of another analysis
    are refused, not ignored."""
    import os

    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    ud = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
    out = tmp_path / "sweep"
    args = ["sweep", str(series / "step0"), str(series / "step60"), "--analysis", "probe", "--task", "upos"]
    args += ["--train", os.path.join(ud, "ewt_tiny_train.conllu"), "--test", os.path.join(ud, "ewt_tiny_test.conllu")]
    args += ["--max-train-sentences", "20", "--max-epochs", "7", "--stack-draws", "1", "--stack-folds", "3"]
    args += ["--stack-l2", "0.05", "--seed", "3", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    summ = pd.read_parquet(out / "sweep_summary.parquet")
    assert len(summ) == 2
    assert (summ["max_epochs"] == 7).all() and (summ["stack_draws"] == 1).all() and (summ["seed"] == 3).all()
    assert (summ["stack_folds"] == 3).all() and (summ["stack_l2"] == 0.05).all()
    for bad, flag in (
        (["--analysis", "lens", "--seed", "3"], "--seed"),
        (["--analysis", "norms", "--stack-folds", "3"], "--stack-folds"),
        (["--analysis", "lens", "--stack-l2", "0.1"], "--stack-l2"),
        (["--analysis", "probe", "--max-docs", "5"], "--max-docs"),
    ):
        r = CliRunner().invoke(app, ["sweep", str(series / "step0"), *bad, "--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and flag in r.output and "only apply to" in r.output and "Traceback" not in r.output
        assert not (tmp_path / "x").exists()  # refused before any output


def test_norms_sweep_plots_the_tokens_after_the_first(series, tmp_path, monkeypatch):
    """The norms table has a row per (site, positions); the heatmap across checkpoints draws the
    ``rest`` rows only, so the attention sink at position 0 is not averaged into it."""
    from depthscope.analyses.jobs.configs import SweepJobConfig
    from depthscope.analyses.jobs.sweep import sweep_job
    from depthscope.analyses.sweeps import plots as sweep_plots

    drawn = []
    real = sweep_plots.plot_checkpoint_heatmap
    monkeypatch.setattr(
        sweep_plots, "plot_checkpoint_heatmap", lambda df, *a, **k: drawn.append(df) or real(df, *a, **k)
    )
    text = tmp_path / "t.txt"
    text.write_text("\n".join(TEXT[:2]), encoding="utf-8")
    cks = discover_checkpoints(checkpoint_dir=series)
    res = sweep_job(cks, SweepJobConfig(analysis="norms", text=text, max_docs=2), tmp_path / "out")
    assert set(res.tables["by_site"]["positions"]) == {"rest", "first"}
    assert len(drawn) == 1 and set(drawn[0]["positions"]) == {"rest"}
