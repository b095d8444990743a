"""The probe settings: configuration objects whose defaults are the only defaults (the command
line, the report, sweeps and the building blocks read them), loose overrides validated by name,
and no work or validation in ``__init__`` (scikit-learn's estimator convention)."""

from __future__ import annotations

import inspect
import os

import pytest
import typer

from depthscope.common.errors import InputError
from depthscope.probes import DataConfig, ExtractionConfig, ProbeConfig, run_probes
from depthscope.probes.run import resolve_configs

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
EWT_TRAIN = os.path.join(UD, "ewt_tiny_train.conllu")
EWT_TEST = os.path.join(UD, "ewt_tiny_test.conllu")


def command_defaults(name: str) -> dict:
    from depthscope.analyses.cli import app

    cmd = typer.main.get_command(app).commands[name]
    return {p.name: p.default for p in cmd.params}


def test_probe_command_defaults_are_the_config_defaults():
    from depthscope.analyses.commands.probe import job_config
    from depthscope.analyses.jobs.configs import ProbeJobConfig

    cfg = job_config(command_defaults("probe"))
    assert cfg.probe == ProbeConfig()
    assert cfg.extraction == ExtractionConfig()
    assert cfg.data == DataConfig()
    assert cfg == ProbeJobConfig()  # tasks and data files: the job's defaults too


def test_run_command_and_report_share_the_defaults():
    from depthscope.analyses.report.main_job import ReportConfig

    d = command_defaults("run")
    assert d["max_epochs"] == ProbeConfig().max_epochs  # one protocol: the report trains as `probe` does
    assert "epochs" not in d and "epochs" not in command_defaults("probe")  # renamed: max_epochs is a cap
    assert d["seed"] == ProbeConfig().seed == command_defaults("probe")["seed"]
    assert d["max_train_sentences"] == DataConfig().max_train_sentences
    assert d["max_test_sentences"] == DataConfig().max_test_sentences
    assert "task" in d and "tasks" not in d  # --task everywhere
    cfg = ReportConfig()
    assert (cfg.probe, cfg.extraction, cfg.data) == (ProbeConfig(), ExtractionConfig(), DataConfig())


def test_every_probe_and_run_option_has_help():
    from depthscope.analyses.cli import app

    group = typer.main.get_command(app)
    for name in ("probe", "run", "sweep"):
        for p in group.commands[name].params:
            if getattr(p, "param_type_name", "") == "option":
                assert p.help, (name, p.name)


def test_building_blocks_default_to_the_config():
    from depthscope.probes import BatchedProbe, fit_cumulative, online_codelength, train_probe
    from depthscope.probes.solvers.base import TrainSettings
    from depthscope.probes.solvers.classifiers import numeric_l2

    cfg = ProbeConfig()
    # train_probe's training settings are a TrainSettings (overridable by keyword), whose
    # defaults are the config's
    assert inspect.signature(train_probe).parameters["settings"].default is None
    ts = TrainSettings()
    assert (ts.max_epochs, ts.tol, ts.gtol, ts.solver, ts.lr, ts.min_steps, ts.batch_size) == (
        cfg.max_epochs,
        cfg.tol,
        cfg.gtol,
        cfg.solver,
        cfg.lr,
        cfg.min_steps,
        cfg.batch_size,
    )
    assert TrainSettings.from_config(cfg) == ts
    for fn in (fit_cumulative, online_codelength):  # settings come in a ProbeConfig, no defaults of their own
        params = inspect.signature(fn).parameters
        assert "config" in params and not {"epochs", "max_epochs", "l2", "lr", "hidden", "kind"} & set(params)
    bp = inspect.signature(BatchedProbe.__init__).parameters
    # a probe built by hand has a number; runs choose theirs per task ("auto")
    assert cfg.l2 == "auto" and (bp["l2"].default, bp["hidden"].default) == (numeric_l2(cfg.l2), cfg.hidden)


def test_init_does_no_work_and_validate_checks():
    bad = ProbeConfig(probe="svm")  # stored as given, like a scikit-learn estimator
    assert bad.probe == "svm"
    for c, match in [
        (bad, "probe"),
        (ProbeConfig(precision="half"), "precision"),
        (ProbeConfig(l2="cv"), "l2"),
        (ProbeConfig(max_epochs=0), "max_epochs"),
        (ProbeConfig(solver="sgd"), "solver"),
        (ProbeConfig(probe="mlp", solver="subspace"), "fits linear probes"),
        (ProbeConfig(probe="mlp", solver="lbfgs"), "fits linear probes"),
        (ProbeConfig(l2_folds=1), "l2_folds"),
        (ProbeConfig(stack_folds=1), "stack_folds"),
        (ProbeConfig(stack_l2=0), "stack_l2"),
        (ProbeConfig(stack_l2=float("nan")), "stack_l2"),
        (ExtractionConfig(pooling="max"), "pooling"),
        (ExtractionConfig(store_dtype="int8"), "store_dtype"),
        (ExtractionConfig(context="page"), "context"),
        (DataConfig(overlap="merge"), "overlap"),
        (DataConfig(max_train_sentences=0), "max_train"),
    ]:
        with pytest.raises(InputError, match=match):
            c.validate()
    assert ProbeConfig(l2="dev").validate().l2 == "dev"
    assert ProbeConfig(l2="auto").validate().l2 == "auto"


def test_overrides_apply_by_field_and_unknown_names_are_rejected():
    cfg, ext, dat = resolve_configs(
        ProbeConfig(max_epochs=6, seed=3), None, None, pooling="mean", max_train_sentences=50
    )
    assert (cfg.max_epochs, cfg.seed, ext.pooling, dat.max_train_sentences) == (6, 3, "mean", 50)
    assert ext.store_dtype == ExtractionConfig().store_dtype and dat.overlap == DataConfig().overlap
    cfg, _, _ = resolve_configs(ProbeConfig(max_epochs=6), max_epochs=3)  # a loose setting wins over the object
    assert cfg.max_epochs == 3
    # rejected before any model is loaded or file read (model None would load the default model)
    want = r"unknown probe setting\(s\) epochz; valid: probe, l2, l2_folds, solver, max_epochs"
    with pytest.raises(InputError, match=want):
        run_probes(None, "upos", EWT_TRAIN, EWT_TEST, epochz=3)
    with pytest.raises(InputError, match="dtype"):
        run_probes(None, "upos", EWT_TRAIN, EWT_TEST, dtype="float32")  # renamed: store_dtype
    with pytest.raises(InputError, match="probe must be one of"):
        run_probes(None, "upos", EWT_TRAIN, EWT_TEST, config=ProbeConfig(probe="svm"))
    with pytest.raises(InputError, match="expected a ProbeConfig"):
        run_probes(None, "upos", EWT_TRAIN, EWT_TEST, config=ExtractionConfig())


def test_run_probes_with_a_config_object_records_precision(tiny_factory, tmp_path):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    res = run_probes(
        m,
        "upos",
        EWT_TRAIN,
        EWT_TEST,
        config=ProbeConfig(max_epochs=5, l2=1e-3, cumulative=False),
        extraction=ExtractionConfig(store_dir=str(tmp_path)),
        progress=False,
    )
    want = "float32"  # the default on every machine, whatever the CPU's flags
    assert (res.summary["precision"] == want).all() and res.info["precision"] == want
    assert res.info["probe_device"] == "cpu"  # ProbeConfig.device's default: features in RAM
    assert res.summary["expected_layer_delta"].isna().all()  # cumulative=False was honoured
    res_bf = run_probes(
        m,
        "upos",
        EWT_TRAIN,
        EWT_TEST,
        config=ProbeConfig(max_epochs=5, l2=1e-3, precision="bfloat16"),
        store_dir=str(tmp_path),
        progress=False,
    )
    assert res_bf.summary["precision"].iloc[0] == "bfloat16"


def test_probes_never_import_analyses():
    """Data flows one way: probes/ computes, the probe job (analyses/jobs/probe.py) writes."""
    import ast
    from pathlib import Path

    import depthscope.probes.config as config

    for path in Path(config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else (["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else [])
            )
            for m in mods:
                assert "analyses" not in m, (path.name, m)
    from depthscope.probes import ProbeResults

    assert not hasattr(ProbeResults, "write")  # writing tables and figures is the job's


def test_default_precision_does_not_depend_on_the_cpu(tiny_factory, tmp_path, monkeypatch):
    """On a CPU that reports native bf16 (faked here), the default config still stores and fits
    features in float32 and gives the same numbers as on any other machine; only an explicit
    ``precision="auto"`` follows the CPU rule."""
    import torch

    from depthscope.probes.solvers import cpu

    m = tiny_factory("llama", n_layers=1, d_model=32)
    cfg = ProbeConfig(max_epochs=5, l2=1e-3, cumulative=False, control=False)

    def run(config):
        return run_probes(m, "upos", EWT_TRAIN, EWT_TEST, config=config, store_dir=str(tmp_path), progress=False)

    monkeypatch.delenv(cpu.ENV, raising=False)
    plain = run(cfg).by_site
    monkeypatch.setattr(cpu, "precision_rule", lambda *a, **k: (torch.bfloat16, "faked native bf16"))
    faked = run(cfg)
    assert (faked.summary["precision"] == "float32").all()
    pd_cols = ["site", "accuracy"]
    assert faked.by_site[pd_cols].equals(plain[pd_cols])
    assert (
        run(ProbeConfig(max_epochs=5, l2=1e-3, cumulative=False, control=False, precision="auto"))
        .summary["precision"]
        .iloc[0]
        == "bfloat16"
    )
