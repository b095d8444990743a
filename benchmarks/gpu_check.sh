#!/usr/bin/env bash
# The GPU check in one command: the CUDA tests, then the GPU figures of benchmarks/bench_gpu.py.
# Usage: [PYTHON=python3] bash benchmarks/gpu_check.sh OUT_DIR [bench_gpu options, e.g. --only mainjob]
# Writes OUT_DIR/tests.log, OUT_DIR/bench.log and OUT_DIR/gpu.json; each stage is time-limited
# (TEST_S, BENCH_S seconds) so that a stuck stage still leaves the other's output.
set -o pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [bench_gpu options]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"${PYTHON:-python3}" -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA GPU')"
timeout "${TEST_S:-180}" "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -rs tests/test_devices.py tests/test_probe_device.py tests/test_span_rows.py \
    2>&1 | tee "$out/tests.log" | tail -15
timeout "${BENCH_S:-420}" "${PYTHON:-python3}" -m benchmarks.bench_gpu --out "$out" "$@" 2>&1 | tee "$out/bench.log" \
    | grep -v "^activation patching: "
