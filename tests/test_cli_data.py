"""``depthscope data``: the bundled samples' table, one sample's absolute path for the shell,
a clear error for an unknown name, and ``--copy``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.probes import sample_data

runner = CliRunner()
NAMES = ["ewt_train", "ewt_test", "gum_train", "gum_test"]
# from probes/data/README.md
SENTENCES = {"ewt_train": 327, "ewt_test": 153, "gum_train": 214, "gum_test": 96}


def test_table_lists_every_sample_with_counts_licence_and_path():
    r = runner.invoke(app, ["data"])
    assert r.exit_code == 0, r.output
    rows = {ln.split("│")[1].strip(): ln for ln in r.output.splitlines() if ln.count("│") >= 5}
    assert sorted(rows) == sorted(NAMES)
    for name, path in sample_data().items():
        cells = [c.strip() for c in rows[name].split("│")[1:-1]]
        assert cells[0] == name and int(cells[1]) == SENTENCES[name] and int(cells[2]) > 10 * SENTENCES[name]
        assert cells[3] == str(Path(path).resolve())
        assert cells[4] == ("CC BY-SA 4.0" if name.startswith("ewt") else "CC BY-NC-SA 4.0")
    assert "non-commercial" in r.output and "README.md" in r.output


def test_a_name_prints_only_its_absolute_path():
    for name, path in sample_data().items():
        r = runner.invoke(app, ["data", name])
        assert r.exit_code == 0, r.output
        assert r.output == f"{Path(path).resolve()}\n"
    assert runner.invoke(app, ["data", "gum-test"]).output.strip().endswith("gum_sample_test.conllu")


def test_an_unknown_name_is_an_error_listing_the_valid_ones():
    r = runner.invoke(app, ["data", "ewt_dev"])
    assert r.exit_code == 2
    assert "no bundled sample named 'ewt_dev'" in r.output and all(n in r.output for n in NAMES)
    assert "Traceback" not in r.output


def test_copy_into_a_folder(tmp_path):
    dest = tmp_path / "samples"
    r = runner.invoke(app, ["data", "--copy", str(dest)])
    assert r.exit_code == 0, r.output
    copies = [Path(p) for p in r.output.split()]
    assert [p.name for p in copies] == [Path(sample_data()[n]).name for n in NAMES]
    for name, copy in zip(NAMES, copies):
        assert copy.read_bytes() == Path(sample_data()[name]).read_bytes()
    assert "CC BY-NC-SA 4.0" in (dest / "README.md").read_text()  # the attribution travels with them
    assert runner.invoke(app, ["data", "--copy", str(dest)]).exit_code == 0  # again: same files, fine
    (dest / "ewt_sample_test.conllu").write_text("mine\n")
    r = runner.invoke(app, ["data", "ewt_test", "--copy", str(dest)])
    assert r.exit_code == 1 and "--force" in r.output and (dest / "ewt_sample_test.conllu").read_text() == "mine\n"
    r = runner.invoke(app, ["data", "ewt_test", "--copy", str(dest), "--force"])
    assert r.exit_code == 0 and r.output.strip() == str((dest / "ewt_sample_test.conllu").resolve())
    r = runner.invoke(app, ["data", "--copy", str(dest / "README.md")])
    assert r.exit_code == 1 and "--copy" in r.output and "not a folder" in r.output


def test_the_installed_command_gives_a_path_for_the_shell(tmp_path):
    exe = Path(sys.executable).with_name("depthscope")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "depthscope.analyses.cli"]
    env = {**os.environ, "DEPTHSCOPE_PROGRESS": "0"}
    done = subprocess.run([*cmd, "data", "ewt_train"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert done.stdout.count("\n") == 1 and path.is_absolute() and path.is_file()
    assert path.read_text(encoding="utf-8").startswith("# newdoc")
    bad = subprocess.run([*cmd, "data", "nope"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "ewt_train" in bad.stderr and "Traceback" not in bad.stderr


def test_data_imports_no_heavy_library():
    from tests.test_cli_fast import run_cli

    res = run_cli("data", "ewt_train")
    assert res["code"] == 0 and res["heavy"] == [] and "data" in res["commands"]
