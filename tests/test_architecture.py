"""The shape of the code, as docs/architecture.md states it: one-way imports between the rooms,
forward hooks registered only by the hook engine, short functions, the command layer small.
Each limit is measured by scripts/code_limits.py (``python scripts/code_limits.py`` prints the
offenders); mccabe complexity <= 15 is ruff's C901 (pyproject.toml), run by ``make lint``."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("code_limits", ROOT / "scripts" / "code_limits.py")
limits = importlib.util.module_from_spec(_spec)
sys.modules["code_limits"] = limits
_spec.loader.exec_module(limits)

# The rooms, lowest first: a module may import its own room and any lower one, never a higher one.
# (prefix of the dotted name below ``depthscope.``, rank); the longest matching prefix wins.
RANKS = {
    "common": 0,
    "hooks": 1,
    "probes.config": 2,
    "probes.corpora": 3,
    "probes.store": 4,
    "probes.solvers": 5,
    "probes": 6,  # the science: encoding, fitting, mixing, mdl, metrics, summaries, run
    "analyses.tables": 7,
    "analyses.text": 7,
    "analyses.text_settings": 7,
    "analyses.intervals": 7,
    "analyses.samples": 7,
    "analyses.defaults": 7,
    "analyses": 8,  # the rooms' science and settings: lens, norms, circuits, causal, features, sweeps, probing
    "analyses.style": 9,  # the figures: each room's plots, drawn from its tables
    "analyses.lens.plots": 9,
    "analyses.norms.plots": 9,
    "analyses.circuits.patching.plots": 9,
    "analyses.circuits.patching.path_plots": 9,
    "analyses.circuits.edges.plots": 9,
    "analyses.circuits.edges.html": 9,
    "analyses.circuits.features.plots": 9,
    "analyses.circuits.features.html": 9,
    "analyses.causal.erasure.plots": 9,
    "analyses.causal.erasure.layer_plots": 9,
    "analyses.causal.variables.localize_plots": 9,
    "analyses.features.plots": 9,
    "analyses.sweeps.plots": 9,
    "analyses.probing.plots": 9,
    "analyses.jobs": 10,
    "analyses.report": 11,  # orchestration of the main job, then rendering
    "analyses.report.config": 8,  # its settings, which the jobs' index gathers
    "analyses.commands": 12,
    "analyses.cli": 12,
}


def _rank(module: str) -> int:
    name = module.removeprefix("depthscope.")
    best = max((p for p in RANKS if name == p or name.startswith(p + ".")), key=len)
    return RANKS[best]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["depthscope", *parts])


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every depthscope module ``path`` imports (module level or inside functions), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("depthscope.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("depthscope."):
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _package_inits() -> set[str]:
    """Package __init__ modules re-export their rooms lazily; they are not a layer of their own."""
    return {"depthscope.common", "depthscope.hooks", "depthscope.probes", "depthscope.analyses"}


def test_imports_flow_one_way():
    upward = []
    for path in limits.source_files():
        me = _module_name(path)
        if me in _package_inits():
            continue
        for line, target in _imports(path):
            if _rank(target) > _rank(me):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert upward == [], "imports against the one-way flow (docs/architecture.md):\n" + "\n".join(upward)


def test_rank_table_knows_the_packages():
    """A module outside every listed room would be ranked by a too-general prefix by accident."""
    assert _rank("depthscope.probes.corpora.conllu") == RANKS["probes.corpora"]
    assert _rank("depthscope.analyses.jobs.probe") == RANKS["analyses.jobs"]
    assert _rank("depthscope.probes.configuration") == RANKS["probes"]  # a prefix is a whole name part
    with pytest.raises(ValueError):
        _rank("depthscope.elsewhere")


def test_forward_hooks_are_registered_only_by_the_hook_engine():
    assert limits.hook_registrations_outside_hooks(limits.source_files()) == []
    in_hooks = [
        f"{p.relative_to(ROOT)}"
        for p in limits.source_files(["hooks"])
        if any(call in p.read_text() for call in limits.HOOK_CALLS)
    ]
    assert in_hooks == ["hooks/engine.py"]


def test_functions_are_short_and_take_few_parameters():
    fns = limits.functions(limits.source_files())
    long = [f for f in fns if f.lines > limits.LONG]
    assert [f for f in long if f.lines > limits.TOO_LONG] == []
    assert len(long) <= limits.MAX_LONG, sorted((f.lines, f.path, f.name) for f in long)
    many = [f for f in fns if f.params > limits.MANY_PARAMS]
    assert len(many) <= limits.MAX_MANY_PARAMS, sorted((f.params, f.path, f.name) for f in many)


def test_command_layer_is_thin():
    assert limits.command_lines() <= limits.MAX_COMMAND_LINES
