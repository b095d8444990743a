#!/usr/bin/env bash
# Build the virtual environment that tests/test_tuned_lens_interop.py runs the tuned-lens package
# in (the test skips, saying so, while it is absent). A separate environment: tuned-lens 0.2.0
# requires wandb, datasets, torchdata, plotly and accelerate for its training scripts, none of
# which depthscope needs; its lens classes (tuned_lens.nn) import only torch, transformers,
# numpy and huggingface-hub. So the package goes in without its dependencies, beside exactly
# those four, at the versions of the environment that runs depthscope (the same torch and
# transformers compute the same model), torch as a CPU build.
#
#   bash scripts/tunedlens_venv.sh [VENV]      # or: make tunedlens-venv
#
# VENV: the folder (default $DEPTHSCOPE_TUNEDLENS_VENV, else ~/.cache/depthscope-tests/tunedlens-venv,
# where the test looks). PYTHON: the python that runs depthscope (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${DEPTHSCOPE_TUNEDLENS_VENV:-$HOME/.cache/depthscope-tests/tunedlens-venv}}
PY=${PYTHON:-.venv/bin/python}
TUNED_LENS=${DEPTHSCOPE_TUNED_LENS:-tuned-lens==0.2.0}
pins=$("$PY" -c "
import importlib.metadata as m
print(' '.join(f'{p}=={m.version(p).split(\"+\")[0]}' for p in ('torch', 'transformers', 'numpy', 'huggingface-hub')))
")
rm -f "$VENV/.built"
"$PY" -m venv --clear "$VENV"
"$VENV/bin/python" -m pip install -q $pins safetensors
"$VENV/bin/python" -m pip install -q --no-deps "$TUNED_LENS"
"$VENV/bin/python" -c "import tuned_lens, transformers, torch; print('tuned-lens', tuned_lens.__file__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "$TUNED_LENS $pins" > "$VENV/.built"
