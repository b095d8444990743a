"""A job run again in its output folder reuses the stages it finished (depthscope.common.resume):
the main job's lens, norms and each probe task, and `depthscope probe`'s tasks. Reused results
equal a fresh run's; a change of inputs, settings or code, and a missing or edited file, mean
the stage is computed again; a run killed mid-probes keeps the tasks it finished."""

from __future__ import annotations

import json
import logging
import shutil

import pandas as pd
import pytest
from conftest import run_cli

from depthscope.analyses.report.main_job import ReportConfig, run_report
from depthscope.common import resume
from depthscope.common.resume import Stages, stage_key
from depthscope.probes import DataConfig, ProbeConfig

TABLES = ("lens_by_site", "norms_by_site", "dla", "probes_by_site", "probes_summary", "probes_mixing")


def _cfg(**kw) -> ReportConfig:
    return ReportConfig(
        tasks=kw.pop("tasks", ("upos", "feats:Number")),
        lens_tokens=200,
        norms_tokens=200,
        data=DataConfig(max_train_sentences=30, max_test_sentences=15),
        probe=kw.pop("probe", ProbeConfig(max_epochs=15, stack_draws=1)),
        **kw,
    )


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory("llama", n_layers=2)


@pytest.fixture(scope="module")
def fresh(model, tmp_path_factory):
    """A first run in a new folder: every stage computed and recorded."""
    out = tmp_path_factory.mktemp("fresh")
    run_report(out, _cfg(), progress=False, model=model)
    return out


def _tables(out):
    return {t: pd.read_parquet(out / f"{t}.parquet") for t in TABLES}


def _meta(out) -> dict:
    return json.loads((out / "run.json").read_text())


def _again(fresh, tmp_path, model, **kw):
    """A copy of the fresh run's folder, run again with ``kw`` changed."""
    out = tmp_path / "again"
    shutil.copytree(fresh, out)
    run_report(out, _cfg(**kw), progress=False, model=model)
    return out


def test_a_second_run_reuses_every_stage_and_gives_the_same_tables(fresh, model, tmp_path):
    assert _meta(fresh)["reused"] == []
    out = _again(fresh, tmp_path, model)
    assert _meta(out)["reused"] == ["lens", "norms", "probes upos", "probes feats:Number"]
    for name, df in _tables(out).items():
        pd.testing.assert_frame_equal(df, _tables(fresh)[name], obj=name)
    assert "Reused from an earlier run in this folder" in (out / "report.md").read_text()


def test_no_resume_computes_everything_and_records_it_for_the_next_run(fresh, model, tmp_path):
    out = _again(fresh, tmp_path, model, resume=False)
    assert _meta(out)["reused"] == []
    run_report(out, _cfg(), progress=False, model=model)
    assert _meta(out)["reused"] == ["lens", "norms", "probes upos", "probes feats:Number"]


def test_a_changed_prompt_recomputes_the_lens_and_norms_and_keeps_the_probes(fresh, model, tmp_path):
    out = _again(fresh, tmp_path, model, prompt="Hello there, my")
    assert _meta(out)["reused"] == ["probes upos", "probes feats:Number"]


def test_changed_probe_settings_recompute_the_probes(fresh, model, tmp_path):
    out = _again(fresh, tmp_path, model, probe=ProbeConfig(max_epochs=15, stack_draws=2))
    assert _meta(out)["reused"] == ["lens", "norms"]


def test_other_weights_reuse_nothing(fresh, tiny_factory, tmp_path):
    other = tiny_factory("llama", n_layers=2, seed=1)
    assert _meta(_again(fresh, tmp_path, other))["reused"] == []


def test_an_edited_or_missing_file_recomputes_its_stage(fresh, model, tmp_path, caplog):
    out = tmp_path / "again"
    shutil.copytree(fresh, out)
    (out / "lens_by_site.csv").write_text("edited\n")
    kept = sorted((out / resume.FOLDER).glob("probes_upos-*.by_site.parquet"))
    assert len(kept) == 1
    kept[0].unlink()
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        run_report(out, _cfg(), progress=False, model=model)
    assert _meta(out)["reused"] == ["norms", "probes feats:Number"]
    assert "missing or changed since an earlier run wrote it" in caplog.text
    pd.testing.assert_frame_equal(pd.read_csv(out / "lens_by_site.csv"), pd.read_csv(fresh / "lens_by_site.csv"))


def test_a_run_killed_mid_probes_keeps_the_tasks_it_finished(fresh, model, tmp_path, monkeypatch):
    from depthscope.probes import run as probe_run

    out = tmp_path / "killed"
    real = probe_run._probe_task

    def killed_at_number(run, got, task):
        if task == "feats:Number":
            raise KeyboardInterrupt
        return real(run, got, task)

    monkeypatch.setattr(probe_run, "_probe_task", killed_at_number)
    with pytest.raises(KeyboardInterrupt):
        run_report(out, _cfg(), progress=False, model=model)
    monkeypatch.setattr(probe_run, "_probe_task", real)
    run_report(out, _cfg(), progress=False, model=model)
    assert _meta(out)["reused"] == ["lens", "norms", "probes upos"]
    for name, df in _tables(out).items():
        pd.testing.assert_frame_equal(df, _tables(fresh)[name], obj=name)


def test_other_code_reuses_nothing(fresh, model, tmp_path, monkeypatch):
    monkeypatch.setattr(resume, "code_digest", lambda: "0" * 64)
    assert _meta(_again(fresh, tmp_path, model))["reused"] == []


def test_the_code_digest_covers_every_package():
    digest = resume.code_digest()
    assert len(digest) == 64 and digest == resume.code_digest()
    assert stage_key(a=1) != stage_key(a=2) and stage_key(a=1, b=2) == stage_key(b=2, a=1)


def test_stage_records_of_tables(tmp_path, caplog):
    stages = Stages(tmp_path)
    df = pd.DataFrame({"site": [0, 1], "x": [0.5, 1.5]}).astype({"x": "float32"})
    stages.keep_tables("probes feats:Number", "k1", {"by_site": df, "mixing": None})
    got = stages.tables("probes feats:Number", "k1")
    pd.testing.assert_frame_equal(got["by_site"], df)
    assert got["mixing"] is None
    assert stages.tables("probes feats:Number", "k2") is None  # another key
    assert stages.tables("probes feats_Number", "k1") is None  # another name, another file
    record = next((tmp_path / resume.FOLDER).glob("*.json"))
    record.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        assert stages.tables("probes feats:Number", "k1") is None
    assert "cannot be read" in caplog.text
    assert Stages(None).tables("x", "k") is None and not Stages(None)


def test_probe_cli_resumes_its_tasks(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe"
    args = ["probe", "--model", tiny_llama_dir, "--task", "upos", "--max-train-sentences", "20"]
    args += ["--max-test-sentences", "10", "--max-epochs", "10", "--no-plots", "--out", out]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    first = pd.read_parquet(out / "probes_by_site.parquet")
    code, stdout, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    assert "(same model, data, settings and code): upos; --no-resume" in stdout
    pd.testing.assert_frame_equal(pd.read_parquet(out / "probes_by_site.parquet"), first)
    code, stdout, err = run_cli(args + ["--no-resume"], monkeypatch, capsys)
    assert code == 0 and "reused" not in stdout


def test_run_cli_continues_a_killed_run_and_refuses_other_data_in_its_folder(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    from depthscope.probes import sample_data

    out = tmp_path / "run"
    args = ["run", "--model", tiny_llama_dir, "--task", "upos", "--max-train-sentences", "20"]
    args += ["--max-test-sentences", "10", "--max-epochs", "10", "--lens-tokens", "100", "--norms-tokens", "100"]
    code, _, err = run_cli([*args, "--out", out], monkeypatch, capsys)
    assert code == 0, err
    for f in ("run.json", "report.md", "report.html", "probes_summary.csv"):  # as if killed before its end
        (out / f).unlink()
    code, stdout, err = run_cli([*args, "--out", out], monkeypatch, capsys)
    assert code == 0, err
    assert _meta(out)["reused"] == ["lens", "norms", "probes upos"]
    assert (out / "probes_summary.csv").is_file()
    (out / "run.json").unlink()
    data = sample_data()
    other = ["--data", data["gum_train"], "--data", data["gum_test"]]
    code, stdout, err = run_cli([*args, *other, "--out", out], monkeypatch, capsys)
    assert code == 1 and "holds the results of another depthscope run (model" in stdout + err, stdout + err


def test_the_causal_section_is_a_stage_too(model, tmp_path):
    out = tmp_path / "causal"
    cfg = _cfg(tasks=("upos",), causal=True, causal_tokens=40)
    run_report(out, cfg, progress=False, model=model)
    first = pd.read_parquet(out / "causal.parquet")
    run_report(out, cfg, progress=False, model=model)
    assert _meta(out)["reused"] == ["lens", "norms", "probes upos", "causal"]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "causal.parquet"), first)
    run_report(out, _cfg(tasks=("upos",), causal=True, causal_tokens=30), progress=False, model=model)
    assert _meta(out)["reused"] == ["lens", "norms", "probes upos"]
