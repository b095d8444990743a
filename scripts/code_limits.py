"""The code-shape limits of docs/architecture.md, measured: long functions, long parameter lists,
function-local imports, forward hooks registered outside hooks/, the size of analyses/commands.

    python scripts/code_limits.py            # the totals and every function over a limit
    python scripts/code_limits.py probes/    # only the files under these paths

tests/test_architecture.py asserts the same numbers; mccabe complexity is ruff's C901 (pyproject.toml).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "hooks", "probes", "analyses")
LONG = 60  # lines; a function longer than this needs a reason (at most MAX_LONG of them)
TOO_LONG = 100  # lines; no function is longer
MANY_PARAMS = 8  # named parameters besides self/cls (at most MAX_MANY_PARAMS functions over it)
MAX_LONG = 10
MAX_MANY_PARAMS = 5
MAX_COMMAND_LINES = 1100
HOOK_CALLS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook")


@dataclass(frozen=True)
class Function:
    path: str
    line: int
    name: str
    lines: int
    params: int


def source_files(paths: list[str] | None = None) -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    if paths:
        wanted = [(ROOT / p).resolve() for p in paths]
        files = [f for f in files if any(f == w or w in f.parents for w in wanted)]
    return files


def functions(files: list[Path]) -> list[Function]:
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                named = a.posonlyargs + a.args + a.kwonlyargs
                n = len(named)  # as pylint's and ruff's too-many-arguments count: not *args, **kwargs
                if named and named[0].arg in ("self", "cls"):
                    n -= 1
                rel = str(path.relative_to(ROOT))
                out.append(Function(rel, node.lineno, node.name, node.end_lineno - node.lineno + 1, n))
    return out


def local_imports(files: list[Path]) -> list[str]:
    """Imports inside a function body, as 'path:line'."""
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        out.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    return sorted(set(out))


def hook_registrations_outside_hooks(files: list[Path]) -> list[str]:
    out = []
    for path in files:
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "hooks":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(call in line for call in HOOK_CALLS):
                out.append(f"{rel}:{i}")
    return out


def command_lines() -> int:
    return sum(len(p.read_text().splitlines()) for p in (ROOT / "analyses" / "commands").rglob("*.py"))


def main(argv: list[str]) -> int:
    files = source_files(argv or None)
    fns = functions(files)
    long = sorted((f for f in fns if f.lines > LONG), key=lambda f: -f.lines)
    many = sorted((f for f in fns if f.params > MANY_PARAMS), key=lambda f: -f.params)
    print(
        f"functions over {LONG} lines: {len(long)} (limit {MAX_LONG}), over {TOO_LONG}: "
        f"{sum(f.lines > TOO_LONG for f in long)} (limit 0)"
    )
    for f in long:
        print(f"  {f.lines:4d} lines  {f.path}:{f.line} {f.name}")
    print(f"functions with over {MANY_PARAMS} parameters: {len(many)} (limit {MAX_MANY_PARAMS})")
    for f in many:
        print(f"  {f.params:4d} params {f.path}:{f.line} {f.name}")
    imports = local_imports(files)
    print(f"function-local imports: {len(imports)}")
    hooks = hook_registrations_outside_hooks(files)
    print(f"forward hooks registered outside hooks/: {len(hooks)} {' '.join(hooks)}")
    print(f"analyses/commands: {command_lines()} lines (limit {MAX_COMMAND_LINES})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
