"""The command line answers ``--help`` without importing heavy libraries (torch, transformers,
TransformerLens, scikit-learn, matplotlib): every command module imports them inside its
command body (pandas is allowed: configuration dataclasses may live beside ``jobs/base.py``).
Checked by module presence in a fresh interpreter, not by timing. Also: every public name of
the lazily importing packages resolves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ["torch", "transformers", "transformer_lens", "sklearn", "matplotlib"]

PROBE = """
import json, sys
sys.argv = ["depthscope", *json.loads(sys.argv[1])]
from depthscope.analyses.cli import app, main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
names = sorted(app.registered_commands[i].name for i in range(len(app.registered_commands)))
print(json.dumps({"code": code, "heavy": [m for m in HEAVY if m in sys.modules], "commands": names}))
"""


def run_cli(*args: str) -> dict:
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    done = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_imports_no_heavy_library():
    res = run_cli("--help")
    assert res["code"] == 0
    assert res["heavy"] == []
    assert {"info", "run", "lens", "lens-train", "norms", "probe", "sweep", "toy-series"} <= set(res["commands"])


@pytest.mark.parametrize("command", ["info", "run", "lens", "lens-train", "norms", "probe", "sweep", "toy-series"])
def test_command_help_imports_no_heavy_library(command):
    res = run_cli(command, "--help")
    assert res["code"] == 0
    assert res["heavy"] == [], f"depthscope {command} --help imports {res['heavy']}: import them inside the command"


def test_package_imports_stay_light_and_every_public_name_resolves():
    code = (
        "import sys, json\n"
        "import depthscope.hooks as h, depthscope.probes as p, depthscope.analyses as a\n"
        f"light = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "bad = [f'{m.__name__}.{n}' for m in (h, p, a) for n in m.__all__ if getattr(m, n, None) is None]\n"
        "print(json.dumps({'light': light, 'bad': bad, 'arch': h.arch.__name__, 'run': p.run.__name__}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["light"] == []  # measured before any public name is used
    assert res["bad"] == []
    assert (res["arch"], res["run"]) == ("depthscope.hooks.arch", "depthscope.probes.run")  # submodules, as before
