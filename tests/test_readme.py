"""The README's examples work as written.

Its Python blocks run in order in one namespace, in a temporary working directory (``slow``:
they load the real default model). Its shell blocks' commands must exist and run on files that
ship: each ``depthscope`` command line names a real sub-command whose ``--help`` works and whose
options include every ``--option`` the line uses, every input file it names is a bundled sample
(``$(depthscope data NAME)``, which resolves to an existing file), and each ``make`` target is in
the Makefile. The README stays a guide: at most 250 lines.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from command_lines import check_options

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README.read_text(encoding="utf-8")) if kind == lang]


def command_lines(program: str) -> list[list[str]]:
    """Shell lines of the README's bash blocks that run ``program`` (continuations joined,
    comments dropped), split into words."""
    out = []
    for body in blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == program:
                out.append(words)
    return out


INPUT_OPTIONS = {"--text", "--train", "--test", "--dev", "--data", "--checkpoint-dir"}
DATA_REF = re.compile(r"^\$\(depthscope data (\w+)\)$")


def test_readme_has_the_blocks_this_test_reads():
    assert len(blocks("python")) >= 4
    assert len(command_lines("depthscope")) >= 9 and len(command_lines("make")) >= 2
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_input_files_of_command_lines_ship():
    """Every input file a README command line reads is a bundled sample, named through
    ``depthscope data NAME`` (the command prints its path), or an output of an earlier line."""
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    written = set()
    for words in command_lines("depthscope"):
        for opt, value in zip(words[2:], words[3:]):
            if opt in INPUT_OPTIONS:
                ref = DATA_REF.match(value)
                if ref is None:
                    assert value in written, (
                        f"`{' '.join(words)}` reads {value}, which neither ships nor is written above"
                    )
                    continue
                r = CliRunner().invoke(app, ["data", ref.group(1)])
                assert r.exit_code == 0 and Path(r.output.strip()).is_file(), r.output
            if opt == "--out":
                written.add(value)


def test_depthscope_command_lines_name_real_commands_and_options():
    import typer.main
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    group = typer.main.get_command(app)
    runner = CliRunner()
    for words in command_lines("depthscope"):
        name = words[1]
        if name.startswith("-"):  # an option of the group itself (--version, --help)
            assert runner.invoke(app, words[1:]).exit_code == 0, words
            continue
        assert name in group.commands, f"README runs `depthscope {name}`, which does not exist"
        r = runner.invoke(app, [name, "--help"])
        assert r.exit_code == 0, r.output
        check_options(group, words, "README")


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for words in command_lines("make"):
        assert set(words[1:]) <= targets, f"README runs `{' '.join(words)}`; Makefile targets: {sorted(targets)}"


@pytest.mark.slow
def test_python_blocks_run_as_written(tmp_path, monkeypatch, default_model):
    """``default_model`` only makes the session's one load happen first (the blocks load it again
    from the cache) and marks this test slow."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, code in enumerate(blocks("python")):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
    # what the blocks and the prose around them claim
    assert namespace["rs"].resid.shape[0] == 61 and namespace["early"].resid.shape[0] == 2
    assert len(namespace["lens"]) == 61 and list(namespace["res"].summary["task"]) == ["upos"]
    heads = namespace["heads"]
    assert len(heads) == 270 and (tmp_path / "ioi_heads.png").is_file()
    top = heads.loc[heads["fraction_recovered"].idxmax()]
    assert (top["point"], top["head"]) == ("23.heads", 3) and round(top["fraction_recovered"], 2) == 0.55
    rho = namespace["estimate"]["fraction_recovered"].corr(heads["fraction_recovered"], method="spearman")
    assert round(rho, 2) == 0.98
    assert namespace["run"]["5.pattern"].shape[:2] == (2, 9) and namespace["g"].grad("15.attn_out").shape[-1] == 576
    assert len(namespace["out"].text) == 1
