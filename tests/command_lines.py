"""What the README and docs tests check of a ``depthscope`` command line in a shell block; valid
input files for tests that need a command's required input."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path


def check_options(group, words: list[str], where: str) -> None:
    """``words`` (``["depthscope", NAME, ...]``) uses only options that ``depthscope NAME`` has,
    and gives each of its required options."""
    name, line = words[1], " ".join(words)
    command = group.commands[name]
    if hasattr(command, "commands"):  # a group (``depthscope sae train``): its sub-command's options
        command, name = command.commands[words[2]], f"{name} {words[2]}"
        words = words[1:]
    params = command.params
    known = {o for p in params for o in (*p.opts, *p.secondary_opts)}
    used = {w.split("=")[0] for w in words[2:] if w.startswith("-")}
    assert used <= known, f"{where}: `depthscope {name}` has no option {sorted(used - known)}: {line}"
    required = [p.opts for p in params if p.required and p.opts[0].startswith("-")]
    missing = [o[0] for o in required if not set(o) & used]
    assert not missing, f"{where}: `depthscope {name}` needs {missing}: {line}"


@functools.cache
def dataset_files() -> dict[str, str]:
    """A valid prompt-pairs file (``--pairs``) and counterfactual-examples file (``--examples``),
    made once per session in a temporary folder, for tests that need a command's required input."""
    folder = Path(tempfile.mkdtemp(prefix="depthscope-datasets-"))
    pair = {
        "clean": "When Mary and John went out, John gave it to",
        "corrupted": "When Mary and John went out, Mary gave it to",
        "target": " Mary",
        "foil": " John",
    }
    example = {"base": "The cat", "source": "The dog", "candidates": [" Mary", " John"], "label": " John"}
    (folder / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    (folder / "examples.jsonl").write_text("".join(json.dumps(example) + "\n" for _ in range(20)))
    return {"pairs": str(folder / "pairs.jsonl"), "examples": str(folder / "examples.jsonl")}
