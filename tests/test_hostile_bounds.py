"""Every number a user can type has an upper bound, declared once beside the
setting and checked for the command line and the Python API alike. Values past int64 or the float
range, NaN, infinities and text are refused with a message naming the option (exit 2, no
traceback, before any model loads), for every numeric option of every command, found by
introspecting the typer app; the bounds the machine sets (CPUs, memory) and the model sets (the
tuned lens's memory) are named in their messages."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import typing

import numpy as np
import pytest
import typer
from command_lines import dataset_files
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.common.errors import InputError
from depthscope.common.settings import Opt

runner = CliRunner()
#: the values every numeric option refuses: past int64, negative, past the float range, NaN, text
HOSTILE = [str(10**30), "-1", "1e309", "nan", "abc"]


def numeric_options():
    """(command, flag, kind, a valid value: the default, else the least) of every int/float option
    of every registered command."""
    import inspect

    groups = [(f"{g.name} ", g.typer_instance) for g in app.registered_groups]  # depthscope sae train
    for prefix, cmd in [("", c) for c in app.registered_commands] + [
        (p, c) for p, t in groups for c in t.registered_commands
    ]:
        command = prefix + cmd.name
        hints = typing.get_type_hints(cmd.callback)
        for name, p in inspect.signature(cmd.callback).parameters.items():
            kind = Opt(name, hints.get(name), None).kind
            if kind is not None and isinstance(p.default, typer.models.OptionInfo):
                flag = next(d for d in p.default.param_decls if d.startswith("--"))
                least = p.default.default if p.default.default is not None else (p.default.min or 1)
                yield pytest.param(command, flag, kind, least, id=f"{command} {flag}")


OPTIONS = list(numeric_options())


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


def _required(command):
    """The least arguments a command needs besides the option tested (none touch a model)."""
    return {
        "lens": ["--text", "x.txt"],
        "norms": ["--text", "x.txt"],
        "lens-train": ["--text", "x.txt"],
        "sweep": ["--analysis", "probe", "--out", "o"],
        "toy-series": ["--out", "o"],
        "cache": ["--text", "x.txt", "--out", "o"],
        "layers": ["--text", "x.txt"],
        "sae train": ["--site", "1.mlp", "--text", "x.txt"],
        "sae evaluate": ["--sae", "x.txt", "--text", "x.txt"],
        "transcoders train": ["--text", "x.txt"],
        "attribute": ["--transcoders", "x.txt", "--prompt", "The capital of France is"],
        "circuit": ["--pairs", dataset_files()["pairs"], "--in-sample"],
        "localize": ["--examples", dataset_files()["examples"]],
    }.get(command, [])


def _invoke(command, *args):
    """``depthscope command`` with ``args`` in the test's working folder (a text file there)."""
    with open("x.txt", "w") as f:
        f.write("The capital of France is Paris.\n")
    return runner.invoke(app, [*command.split(), *_required(command), *args])


def _refused(r, flag, *words):
    """Exit 2, no traceback, the flag and ``words`` in the message (unwrapped from rich's box)."""
    assert r.exit_code == 2, (flag, r.output, r.exception)
    assert "Traceback" not in r.output
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", r.output).split())
    assert flag in text, text
    for w in words:
        assert w in text, (w, text)


def test_every_command_with_numbers_is_covered():
    commands = {c for c, *_ in (o.values for o in OPTIONS)}
    assert {"lens", "lens-train", "norms", "patch", "probe", "run", "sweep", "toy-series"} <= commands
    assert len(OPTIONS) >= 50


@pytest.mark.parametrize("command,flag,kind,default", OPTIONS)
@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_numbers_are_refused_before_any_model(command, flag, kind, default, bad):
    _refused(_invoke(command, flag, bad), flag)


@pytest.mark.parametrize("command,flag,kind,default", OPTIONS)
def test_in_bounds_values_still_reach_the_work(command, flag, kind, default):
    """The checks refuse only what is out of bounds: the option's default (or its least value
    where it has none) passes them, up to the output folder's claim."""
    r = _invoke(command, flag, str(default))
    assert isinstance(r.exception, Reached), r.output


# --------------------------------------------------------------------- the Python API, same bounds
def _config_classes():
    from depthscope.analyses.jobs.configs import (
        LensConfig,
        LensTrainConfig,
        ModelSpec,
        NormsConfig,
        PatchConfig,
        ProbeJobConfig,
        ReportConfig,
        SweepJobConfig,
        TextWindows,
    )
    from depthscope.analyses.lens.config import TunedLensTraining
    from depthscope.analyses.sweeps.ray_engine import RayEngine
    from depthscope.probes.config import DataConfig, ExtractionConfig, ProbeConfig

    return [
        ModelSpec,
        LensConfig,
        LensTrainConfig,
        TunedLensTraining,
        NormsConfig,
        PatchConfig,
        ProbeJobConfig,
        ProbeConfig,
        ExtractionConfig,
        DataConfig,
        SweepJobConfig,
        RayEngine,
        ReportConfig,
        TextWindows,
    ]


def _numeric_fields(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        if any(a in (int, float) for a in args):
            yield f.name


def _make(cls, **kw):
    """``cls`` with ``kw``, validated (a Checked class on construction)."""
    obj = cls(**kw)
    return obj.validate() if hasattr(obj, "validate") else obj


FIELDS = [
    pytest.param(cls, name, id=f"{cls.__name__}.{name}") for cls in _config_classes() for name in _numeric_fields(cls)
]


def test_every_numeric_field_is_found():
    names = {p.id for p in FIELDS}
    assert {"ModelSpec.threads", "ProbeConfig.seed", "ProbeConfig.l2", "RayEngine.gpus_per_task"} <= names
    assert {"TunedLensTraining.cache_tokens", "ProbeConfig.min_steps", "DataConfig.coref_window"} <= names


@pytest.mark.parametrize("cls,name", FIELDS)
@pytest.mark.parametrize(
    "bad",
    [10**30, 10**400, -(10**400), 1e309, -math.inf, math.nan, "1e30", True],
    ids=["1e30", "1e400", "-1e400", "1e309", "-inf", "nan", "text", "bool"],
)
def test_python_callers_get_the_same_refusals(cls, name, bad):
    """Each value is refused by an InputError naming the field: huge integers do not overflow a
    float conversion, and no other exception escapes."""
    with pytest.raises(InputError, match=name):
        _make(cls, **{name: bad})


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_defaults_are_within_their_bounds(cls):
    _make(cls)


def test_numpy_integers_are_numbers():
    from depthscope.probes.config import ProbeConfig

    ProbeConfig(seed=np.int64(3), stack_draws=np.int32(4)).validate()


# --------------------------------------------------------------------- the machine's bounds: CPUs
def _cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def test_threads_are_bounded_by_the_cpus():
    from depthscope.analyses.jobs.configs import ModelSpec

    top = 4 * _cpus()
    ModelSpec(threads=top)
    with pytest.raises(InputError, match=f"at most {top} .4 x the {_cpus()} CPUs"):
        ModelSpec(threads=top + 1)
    assert isinstance(_invoke("lens", "--threads", str(top)).exception, Reached)
    _refused(_invoke("lens", "--threads", str(top + 1)), "--threads", f"at most {top}", "CPUs")
    _refused(_invoke("probe", "--workers", str(top + 1)), "--workers", "CPUs")


def test_set_threads_checks_before_torch_sees_the_count(monkeypatch):
    import torch

    from depthscope.common.threads import set_threads

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    for bad in (0, 10**30, 4 * _cpus() + 1, 2.0, "8"):
        with pytest.raises(InputError, match="threads"):
            set_threads(bad)
    set_threads(1)
    assert seen == [1]


@pytest.mark.parametrize("load,torch_threads,want", [(0.0, 2, 2), (0.4, 2, 2), (1.0, 2, 1), (6.0, 2, 1), (0.0, 1, 1)])
def test_without_threads_a_command_takes_the_free_cores(monkeypatch, load, torch_threads, want):
    """No ``--threads``: torch's count, but no more than the CPUs less the other processes running
    now (two CPUs here)."""
    import torch

    from depthscope.common import threads

    seen = []
    monkeypatch.setattr(threads, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "_others_running", lambda: load)
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    assert threads.free_cores() == max(1, min(2, int(2 - load + 0.5)))
    assert isinstance(_invoke("lens").exception, Reached)
    assert seen == [want]
    seen.clear()
    assert isinstance(_invoke("lens", "--threads", "2").exception, Reached)
    assert seen == [2]  # a given count is taken as it is


# ------------------------------------------------------ steps, draws, seeds, penalties, GPUs
@pytest.mark.parametrize(
    "command,flag,value,words",
    [
        ("lens-train", "--steps", "1000000000", ["at most 100000"]),
        ("toy-series", "--steps", str(2**63), ["100000", "hundreds of steps"]),
        ("probe", "--stack-draws", "1000000", ["at most 100", "refits"]),
        ("probe", "--stack-folds", "1000", ["at most 20"]),
        ("probe", "--max-epochs", str(10**9), ["at most 100000"]),
        ("sweep", "--seed", str(2**32), ["at most 4294967295", "seed range"]),
        ("run", "--seed", str(10**30), ["at most 4294967295"]),
        ("lens-train", "--cache-tokens", str(10**12), [f"at most {2**24}"]),
        ("lens-train", "--tokens-per-step", str(10**9), [f"at most {2**16}"]),
        ("lens-train", "--lr", "1e30", ["at most 1", "diverge"]),
        ("probe", "--stack-l2", "1e20", ["at most 1000", "class prior"]),
        ("patch", "--batch-tokens", str(10**12), [f"at most {2**20}"]),
        ("lens", "--batch-size", str(10**9), ["at most 4096"]),
    ],
)
def test_bounds_are_named(command, flag, value, words):
    _refused(_invoke(command, flag, value), flag, *words)


def test_the_sweep_seed_is_refused_up_front_not_per_checkpoint():
    """``--seed 1e30`` is refused before any checkpoint runs, not recorded as every checkpoint's failure."""
    for value in ("1e30", str(10**30)):
        r = _invoke("sweep", "--seed", value)
        _refused(r, "--seed")
    assert isinstance(_invoke("sweep", "--seed", str(2**32 - 1)).exception, Reached)


@pytest.mark.parametrize("value", ["1e20", "1001", "1e309"])
def test_l2_is_bounded_where_a_probe_means_something(value):
    from depthscope.probes.config import L2_MAX, ProbeConfig

    r = _invoke("probe", "--l2", value)
    assert r.exit_code == 2 and "--l2 must be" in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(InputError, match="l2 must be"):
        ProbeConfig(l2=float(value)).validate()
    ProbeConfig(l2=L2_MAX.get()).validate()
    ProbeConfig(l2=0.0).validate()


@pytest.mark.parametrize("value,words", [("2.5", "whole number"), ("1e-9", "at least 0.01"), ("1e308", "at most 16")])
def test_gpus_per_task(value, words):
    from depthscope.analyses.sweeps.ray_engine import RayEngine

    _refused(_invoke("sweep", "--engine", "ray", "--gpus-per-task", value), "--gpus-per-task", words)
    with pytest.raises(InputError, match="gpus_per_task"):
        RayEngine(gpus_per_task=float(value))
    for ok in (0, 0.01, 0.5, 1, 2.0, 16):
        assert RayEngine(gpus_per_task=ok).gpus_per_task == ok


# ----------------------------------------------------- the tuned lens's memory, from the model
def test_training_bytes_are_the_tensors_the_trainer_allocates():
    """The cache part of :func:`training_bytes` is the bytes of the trainer's two stream tensors
    (``X`` [trained sites, n, d] and the final streams [n, d], float32), measured on real tensors."""
    import torch

    from depthscope.analyses.lens.config import TunedLensTraining, training_bytes

    cfg = TunedLensTraining(cache_tokens=300, tokens_per_step=7)
    trained, d, vocab = 5, 24, 100
    X, F = torch.empty(trained, cfg.cache_tokens, d), torch.empty(cfg.cache_tokens, d)
    cache, step = training_bytes(cfg, sites=trained + 1, d_model=d, vocab=vocab)
    assert cache == X.nbytes + F.nbytes
    logits = torch.empty(cfg.tokens_per_step * (trained + 1), vocab)
    assert step >= 3 * logits.nbytes  # logits, probabilities and their gradient at least


def test_check_memory_refuses_what_does_not_fit_and_names_what_would():
    from depthscope.analyses.lens.config import TunedLensTraining, check_memory, training_bytes

    shape = dict(sites=61, d_model=576, vocab=49152)  # SmolLM2-135M: 30 layers, 2L+1 sites
    cfg = TunedLensTraining(cache_tokens=2**24, tokens_per_step=2**16)
    cache, step = training_bytes(cfg, **shape)
    with pytest.raises(InputError, match=r"--cache-tokens .* GiB available") as e:
        check_memory(cfg, **shape, available=cache + step - 1)
    assert "d_model 576" in str(e.value) and "vocabulary 49152" in str(e.value)
    check_memory(cfg, **shape, available=cache + step)
    small = TunedLensTraining()
    check_memory(small, **shape, available=sum(training_bytes(small, **shape)))


# ------------------------------------------------------------------ the real entry point, quickly
@pytest.mark.parametrize(
    "args",
    [
        ["lens", "--text", "x.txt", "--threads", str(10**30)],
        ["lens-train", "--text", "x.txt", "--cache-tokens", "1e30"],
        ["sweep", "--analysis", "probe", "--out", "o", "--seed", str(10**30)],
        ["sweep", "--analysis", "lens", "--out", "o", "--engine", "ray", "--gpus-per-task", "1e308"],
    ],
    ids=lambda a: " ".join(a[:1] + a[-2:-1]),
)
def test_the_installed_command_refuses_without_a_traceback(args, tmp_path):
    code = "from depthscope.analyses.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and args[-2] in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
