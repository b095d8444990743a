"""benchmarks/bench_gpu.py, the script the lent GPU runs, runs end to end on a CPU (its
``--quick`` mode over a tiny Llama config): every section yields finite figures, the capture and
lens rows compare the right things, and the three probe fits agree. The GPU figures themselves
are in docs/benchmarks.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import make_tiny


@pytest.fixture
def bench_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    # benchmarks._common pins the probe precision for the process: undone after the test
    monkeypatch.setenv("DEPTHSCOPE_PROBE_DTYPE", "float32")
    import benchmarks.bench_gpu as bench

    return bench


def test_bench_gpu_quick_on_cpu(bench_gpu, tmp_path, tiny_tokenizer, one_thread):
    model_dir = tmp_path / "tiny"
    make_tiny("llama", vocab_size=len(tiny_tokenizer)).config.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    bench_gpu.main(["--model-dir", str(model_dir), "--quick", "--rounds", "1", "--shapes", "135m", "--device", "cpu",
                    "--out", str(out)])  # fmt: skip
    rows = json.loads((out / "gpu.json").read_text())["rows"]
    figures = [r["figure"] for r in rows]
    assert not [f for f in figures if "FAILED" in f], figures
    sections = ["GEMM rate", "capture / bare forward", "logit lens / floor", "residual sites of one pair",
                "patching a dataset", "probe fit per site: GPU / this machine's CPU", "GPU / scikit-learn"]  # fmt: skip
    for s in sections:
        assert any(s in f for f in figures), (s, figures)
    ratios = [r["ratio"] for r in rows if not r["figure"].startswith("GEMM")]
    assert all(math.isfinite(x) and x > 0 for x in ratios), rows
    agree = next(r for r in rows if "this machine's CPU" in r["figure"])["note"]
    assert float(agree.rsplit("agree to ", 1)[1].split()[0]) < 1e-4, agree  # the same solver on the same data
    assert not list(out.glob("profile_*")), "the opt-in sections ran unasked"
    bench_gpu.main(["--model-dir", str(model_dir), "--quick", "--device", "cpu", "--only", "profile",
                    "--out", str(out)])  # fmt: skip
    for arm in ("bare", "capture", "lens"):
        assert "aten::" in (out / f"profile_{arm}.txt").read_text()
