"""Issue 68: every bad input on the new surfaces gets a clear answer. Edited resume records are
recomputed, a used folder refuses other circuit settings and no figure outlives its table, broken
tuned-lens folders and missing shards are named, summaries are strict JSON, another model's edge
table is refused, ``depthscope sae evaluate`` exists, and the roots export what the changelog names."""

from __future__ import annotations

import ast
import importlib
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from depthscope.common import resume
from depthscope.common.errors import CheckpointError, InputError
from depthscope.common.files import json_text
from depthscope.common.resume import Stages, sealed, unsealed
from tests.command_lines import dataset_files
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- 1. resume records
def test_a_stage_record_edited_by_hand_is_recomputed(tmp_path, caplog):
    stages = Stages(tmp_path)
    stages.keep_tables("lens", "k1", {"t": pd.DataFrame({"x": [1.0]})})
    record = next((tmp_path / resume.FOLDER).glob("*.json"))
    body = json.loads(record.read_text())
    body["key"] = "k2"  # the record now claims other inputs, its digest unchanged
    record.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        assert stages.tables("lens", "k2") is None
    assert "fails its digest" in caplog.text


def test_sealed_records_round_trip_and_any_edit_fails():
    rec = sealed({"key": "k", "effect": {"used": 0.5, "lo": float("nan")}})
    assert unsealed(json.dumps(rec))["effect"]["used"] == 0.5
    for edit in ({"used": 0.6, "lo": None}, {}):
        assert unsealed(json.dumps({**rec, "effect": edit})) is None
    assert unsealed("{half") is None and unsealed("[1]") is None
    assert unsealed(json.dumps({"key": "k", "effect": {}})) is None  # a record without its digest


def test_an_edited_causal_site_record_is_recomputed(tmp_path, monkeypatch, caplog):
    from depthscope.analyses.causal.erasure import used

    calls = []

    def effect(model, held, site, erasers, cfg):
        calls.append(site)
        return {"used": 0.25}

    monkeypatch.setattr(used, "_site_effect", effect)
    eraser = SimpleNamespace(left=torch.ones(2), right=torch.ones(2), bias=torch.zeros(2))
    held = SimpleNamespace(records=tmp_path, fingerprint="fp")
    model = SimpleNamespace(n_layers=2)
    run = lambda: used._resumed_effect(model, held, "upos", 1, [eraser], None)  # noqa: E731
    assert run() == {"used": 0.25} and run() == {"used": 0.25} and len(calls) == 1  # the second is resumed
    (path,) = tmp_path.rglob("*.json")
    for edit in ({"used": 9.0}, {}):
        path.write_text(json.dumps({**json.loads(path.read_text()), "effect": edit}))
        with caplog.at_level(logging.WARNING, logger="depthscope"):
            assert run() == {"used": 0.25}
        assert "fails its digest" in caplog.text
    assert len(calls) == 3


# ----------------------------------------------------------------------------- 2. reruns into a used folder
def _no_model(monkeypatch):
    from depthscope.analyses.commands import common

    def boom(*a, **k):
        raise InputError("no model in this test")

    monkeypatch.setattr(common, "load", boom)


def test_circuit_refuses_other_settings_in_a_used_folder(tmp_path, monkeypatch, capsys):
    _no_model(monkeypatch)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "edges.csv").write_text("an earlier run's table")  # the folder keeps its marker
    args = ["circuit", "--pairs", dataset_files()["pairs"], "--in-sample", "--out", tmp_path / "c"]
    code, out, err = run_cli([*args, "--method", "eap"], monkeypatch, capsys)
    assert code != 0 and "no model in this test" in out + err  # the folder is claimed first
    code, out, err = run_cli([*args, "--method", "eap"], monkeypatch, capsys)
    assert "holds the results" not in out + err  # the same settings: accepted
    code, out, err = run_cli([*args, "--method", "eap-ig"], monkeypatch, capsys)
    assert code != 0 and "holds the results of another depthscope circuit" in out + err
    assert "method eap" in out + err and "Traceback" not in out + err
    code, out, err = run_cli([*args, "--method", "eap-ig", "--force"], monkeypatch, capsys)
    assert "holds the results" not in out + err


def test_a_run_without_plots_removes_the_earlier_runs_figures(tmp_path):
    from depthscope.analyses.jobs import Output

    for f in ("circuit.png", "circuit.svg", "circuit.html", "edges.parquet"):
        (tmp_path / f).write_text("old")
    Output(tmp_path).drop("circuit", "circuit.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edges.parquet"]
    Output(None).drop("circuit")  # no folder: nothing to do


# ----------------------------------------------------------------------------- 4. tuned-lens folders
def _params(tmp_path, state, n=2, d=3) -> Path:
    folder = tmp_path / "tl"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"d_model": d, "num_hidden_layers": n}))
    torch.save(state, folder / "params.pt")
    return folder


def _good(n=2, d=3) -> dict:
    return {**{f"{i}.weight": torch.eye(d) for i in range(n)}, **{f"{i}.bias": torch.zeros(d) for i in range(n)}}


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda s: {**s, "1.bias": [0.0, 0.0, 0.0]}, ["'1.bias'", "got list"]),
        (lambda s: {**s, "0.weight": torch.ones(3, 3, dtype=torch.long)}, ["'0.weight'", "torch.int64"]),
        (lambda s: {**s, 7: torch.zeros(3)}, ["key 7", "not a string"]),
        (lambda s: {**s, "2.weight": torch.eye(3)}, ["extra keys ['2.weight']"]),
        (lambda s: {k: v for k, v in s.items() if k != "1.weight"}, ["missing ['1.weight']"]),
        (lambda s: [1, 2], ["holds a list"]),
    ],
)
def test_a_malformed_params_pt_names_the_file_and_the_key(tmp_path, edit, words):
    from depthscope.analyses.lens.interop import _read_params

    folder = _params(tmp_path, edit(_good()))
    with pytest.raises(CheckpointError) as e:
        _read_params(folder, 2, 3, True)
    assert "params.pt" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("lacking", ["params.pt", "config.json"])
def test_a_tuned_lens_folder_missing_one_file_is_told_which(tmp_path, lacking):
    from depthscope.analyses.lens.lenses import TunedLens

    folder = _params(tmp_path, _good())
    (folder / lacking).unlink()
    with pytest.raises(CheckpointError, match=f"tuned-lens package lens without its {lacking}"):
        TunedLens.load(folder)


# ----------------------------------------------------------------------------- 5. missing shards
def test_a_shard_the_index_lists_and_that_is_absent_is_named(tmp_path):
    from depthscope.hooks.loading import _weight_files
    from depthscope.hooks.streaming import _weight_index

    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    for read in (_weight_files, _weight_index):
        with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors") as e:
            read(tmp_path)
        assert "00001" not in str(e.value)


# ----------------------------------------------------------------------------- 7. small ones
def test_summaries_are_strict_json(tmp_path):
    from depthscope.analyses.jobs import Output

    obj = {"cpr_random": float("nan"), "x": [np.float32("inf"), np.float64(1.5)], "p": Path("a")}
    assert json.loads(json_text(obj)) == {"cpr_random": None, "x": [None, 1.5], "p": "a"}
    path = Output(tmp_path).json(obj, "circuit_summary")
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_a_gap_within_bfloat16_rounding_is_flagged():
    from depthscope.analyses.circuits.edges.faithfulness import gap_warning

    assert "within the rounding of bfloat16" in gap_warning(2.0, 1.99, torch.bfloat16)
    assert gap_warning(2.0, 1.99, torch.float32) is None
    assert gap_warning(2.0, 0.5, torch.bfloat16) is None


def test_another_models_edge_table_is_refused():
    from depthscope.analyses.circuits.edges.faithfulness import check_edge_model
    from depthscope.analyses.circuits.edges.graph import CircuitGraph

    graph, model = CircuitGraph(2, 4), SimpleNamespace(name="tiny-a")
    ours = pd.DataFrame({"score": [0.0]})
    ours.attrs.update(model="tiny-a", n_layers=2, n_heads=4)
    check_edge_model(ours, model, graph)
    check_edge_model(pd.DataFrame({"score": [0.0]}), model, graph)  # a table with no record: the rows decide
    for attrs in ({"model": "tiny-b"}, {"model": "tiny-a", "n_layers": 3}):
        theirs = ours.copy()
        theirs.attrs = {**ours.attrs, **attrs}
        with pytest.raises(InputError, match="scored on another model"):
            check_edge_model(theirs, model, graph)


def test_sae_evaluate_on_the_command_line(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from depthscope.hooks import save_sae
    from tests.test_sae import random_sae

    sae = save_sae(random_sae(64, 16, "standard", hook_name="blocks.1.hook_resid_post"), tmp_path / "sae")
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. The dog sat on the log. " * 8)
    args = ["sae", "evaluate", "--model", tiny_llama_dir, "--sae", sae, "--text", text, "--eval-tokens", 40]
    code, out, err = run_cli([*args, "--out", tmp_path / "o"], monkeypatch, capsys)
    assert code == 0, out + err
    table = pd.read_parquet(tmp_path / "o" / "sae_metrics.parquet")
    assert len(table) == 1 and np.isfinite(table["variance_explained"]).all()
    code, out, err = run_cli([*args[:5], tmp_path / "nothing", *args[6:], "--out", tmp_path / "p"], monkeypatch, capsys)
    assert code != 0 and "no SAE folder" in out + err and "Traceback" not in out + err


#: names the changelog puts in backticks that are public functions or classes of depthscope but
#: no API of their own (a column, a setting, a module, a helper of a checked API), and why
NOT_API = {
    "ModelInfo": "a record inside the probe results",
    "PatchOptions": "the patching functions' keyword check, named in passing",
    "Solver": "the interface of the probes' solvers, internal",
    "block_order": "a setting",
    "lbfgs": "a module",
    "mix_spread": "a column",
    "unembed_hash": "a field of tuned-lens's config.json",
    "run": "a command",
    "best_sites": "a field of localize's summary (and the job's helper that fills it)",
    "sealed": "the resume records' digest helper, internal (common.resume)",
    "unsealed": "the resume records' digest check, internal (common.resume)",
}


def _defined() -> set[str]:
    out = set()
    for package in ("common", "hooks", "probes", "analyses"):
        for path in (ROOT / package).rglob("*.py"):
            if "commands" not in path.parts:
                tree = ast.parse(path.read_text())
                out |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return {n for n in out if not n.startswith("_")}


def _resolves(dotted: str) -> bool:
    """Whether ``depthscope.pkg.module.name`` (a module path, then a name) imports."""
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def test_the_roots_export_every_public_name_the_changelog_names():
    roots = ("common", "hooks", "probes", "analyses")
    exported = {r: set(importlib.import_module(f"depthscope.{r}").__all__) for r in roots}
    every = set().union(*exported.values())
    defined, gaps = _defined(), []
    for tick in re.findall(r"`([^`\n]+)`", (ROOT / "CHANGELOG.md").read_text()):
        m = re.match(r"^(?:depthscope\.(\w+)\.[\w.]*?)?([A-Za-z_]\w*)(\(|$)", tick)
        if not m or m.group(2) not in defined or m.group(2) in NOT_API:
            continue
        root, name = m.group(1), m.group(2)
        if "." in tick.split("(")[0][len("depthscope.") :] and _resolves(tick.split("(")[0]):
            continue  # named by its full path, where it is
        if name not in (exported.get(root, every) if root else every):
            gaps.append(tick)
    assert not gaps, f"the changelog names public names that no package root exports: {sorted(set(gaps))}"
