"""Class 2 of issue 15: every numeric option is validated. Negative, NaN and infinite values (and
0 unless ``--help`` says what 0 means) are refused with a clear message before any model loads,
for every command and every int/float option, found by introspecting the typer app (a new
option is covered without editing this test). The configuration objects check the same for
Python callers."""

from __future__ import annotations

import math
import re
import typing

import pytest
from command_lines import dataset_files
from typer.testing import CliRunner

from depthscope.analyses.cli import _numeric, app
from depthscope.common.errors import InputError

runner = CliRunner()


def numeric_options():
    import inspect

    import typer

    for cmd in app.registered_commands:
        fn = cmd.callback
        hints = typing.get_type_hints(fn)
        for name, p in inspect.signature(fn).parameters.items():
            kind = _numeric(hints.get(name))
            if kind is not None and isinstance(p.default, typer.models.OptionInfo):
                flag = next(d for d in p.default.param_decls if d.startswith("--"))
                yield pytest.param(cmd.name, flag, kind, p.default, id=f"{cmd.name} {flag}")


OPTIONS = list(numeric_options())


def test_the_options_are_found():
    ids = {(c, f) for c, f, *_ in (o.values for o in OPTIONS)}
    assert {("lens", "--window"), ("lens", "--threads"), ("probe", "--max-epochs"), ("lens-train", "--lr")} <= ids
    assert len(ids) >= 25


class Reached(Exception):
    """Valid options reach the output folder's claim, the last step before any compute."""


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model was loaded for an invalid option")

    def stop(*a, **k):
        raise Reached()

    monkeypatch.setattr("depthscope.hooks.load_model", boom)
    monkeypatch.setattr("depthscope.analyses.commands.common.load", boom)
    monkeypatch.setattr("depthscope.analyses.jobs.base.prepare_output", stop)


def _refused(r, flag):
    assert r.exit_code == 2, (flag, r.output)
    assert "Traceback" not in r.output
    assert flag in r.output or flag.lstrip("-").replace("-", "_") in r.output, r.output


def _required(command):
    """The least arguments a command needs besides the option tested (none touch a model)."""
    return {
        "lens": ["--text", "x.txt"],
        "norms": ["--text", "x.txt"],
        "lens-train": ["--text", "x.txt"],
        "sweep": ["--analysis", "lens", "--out", "o"],
        "toy-series": ["--out", "o"],
        "circuit": ["--pairs", dataset_files()["pairs"], "--in-sample"],
        "localize": ["--examples", dataset_files()["examples"]],
    }.get(command, [])


@pytest.mark.parametrize("command,flag,kind,info", OPTIONS)
@pytest.mark.parametrize("bad", ["-1", "-5", "nan", "inf", "-inf"])
def test_bad_numbers_are_refused(command, flag, kind, info, bad, tmp_path):
    if kind is int and bad in ("nan", "inf", "-inf"):
        bad = bad.replace("nan", "1.5").replace("-inf", "-1e400").replace("inf", "1e400")
    r = runner.invoke(app, [command, *_required(command), flag, bad])
    _refused(r, flag)


@pytest.mark.parametrize("command,flag,kind,info", OPTIONS)
def test_zero_is_refused_or_documented(command, flag, kind, info):
    r = runner.invoke(app, [command, *_required(command), flag, "0"])
    if r.exit_code == 2 and "Traceback" not in r.output and flag in r.output:
        return  # refused
    assert isinstance(r.exception, Reached) or r.exit_code == 2, r.output  # accepted: stopped before compute
    assert re.search(r"\b0\b", info.help or ""), f"{command} {flag} takes 0 but --help does not say what it means"


def test_a_default_is_never_silently_substituted():
    """``0`` used to mean "default" for --threads and --window: now it is refused."""
    for args in (["lens", "--text", "x", "--window", "0"], ["lens", "--text", "x", "--threads", "0"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and "greater than or equal to" in r.output


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "-0.5", "x"])
def test_probe_l2_is_checked(value):
    r = runner.invoke(app, ["probe", "--l2", value])
    assert r.exit_code == 2 and "--l2 must be" in r.output and "Traceback" not in r.output


def test_probe_l2_zero_and_dev_are_accepted_by_the_config():
    from depthscope.analyses.commands.probe import job_config
    from tests.test_probes_config import command_defaults

    for v in ("0", "dev", "1e-3"):
        job_config({**command_defaults("probe"), "l2": v})


def _configs():
    from depthscope.analyses.jobs.configs import LensConfig, LensTrainConfig, NormsConfig, PatchConfig
    from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

    return [LensConfig, LensTrainConfig, NormsConfig, PatchConfig, ProbeConfig, ExtractionConfig, DataConfig]


@pytest.mark.parametrize("cls", _configs(), ids=lambda c: c.__name__)
def test_configs_refuse_bad_numbers_for_python_callers(cls):
    import dataclasses

    cls().validate()  # the defaults are valid
    numeric = [
        f.name
        for f in dataclasses.fields(cls)
        if isinstance(getattr(cls(), f.name), (int, float)) and not isinstance(getattr(cls(), f.name), bool)
    ]
    numeric = [n for n in numeric if n != "seed"] + (["seed"] if hasattr(cls(), "seed") else [])
    assert numeric
    for name in numeric:
        for bad in (-1, math.nan, math.inf, -math.inf):
            with pytest.raises(InputError, match=name):
                dataclasses.replace(cls(), **{name: bad}).validate()


def test_top_k_is_bounded():
    from depthscope.analyses.jobs.configs import MAX_TOP_K, LensConfig

    with pytest.raises(InputError, match=f"at most {MAX_TOP_K}"):
        LensConfig(top_k=999999).validate()
    r = runner.invoke(app, ["lens", "--text", "x", "--top-k", "999999"])
    assert r.exit_code == 2 and "--top-k" in r.output
