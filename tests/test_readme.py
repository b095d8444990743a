"""The README's examples work as written.

Its Python blocks run in order in one namespace, in a temporary working directory (``slow``:
they load the real default model). Its shell blocks are not run, but every command they name
must exist: each ``depthscope`` command line names a real sub-command whose ``--help`` works and
whose options include every ``--option`` the line uses; each ``make`` target is in the Makefile.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

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


def test_readme_has_the_blocks_this_test_reads():
    assert len(blocks("python")) >= 2
    assert len(command_lines("depthscope")) >= 9 and len(command_lines("make")) >= 2


def test_depthscope_command_lines_name_real_commands_and_options():
    import typer.main
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    group = typer.main.get_command(app)
    runner = CliRunner()
    for words in command_lines("depthscope"):
        name = words[1]
        assert name in group.commands, f"README runs `depthscope {name}`, which does not exist"
        r = runner.invoke(app, [name, "--help"])
        assert r.exit_code == 0, r.output
        known = {o for p in group.commands[name].params for o in (*p.opts, *p.secondary_opts)}
        used = {w.split("=")[0] for w in words[2:] if w.startswith("-")}
        assert used <= known, f"`depthscope {name}` has no option {sorted(used - known)} (README: {' '.join(words)})"


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
    # what the blocks claim
    assert namespace["rs"].resid.shape[0] == 61 and namespace["early"].resid.shape[0] == 2
    assert namespace["real"].resid.shape[1] == int(namespace["rs"].mask.sum())
    ablated, n = namespace["without_mlp5"].logits[0], int(namespace["rs"].mask[0].sum())
    assert not ablated.equal(namespace["rs"].logits[0, :n])  # removing MLP 5's write changes the output
    assert len(namespace["lens"]) == 61 and list(namespace["res"].summary["task"]) == ["upos"]
