"""benchmarks/bench_job_flops.py, the main job's arithmetic floor: its counting mode counts a
product's FLOPs exactly (torch's formulas, and 2 x the matrix for a matrix-vector product), and
labels it by the stage, task and phase functions on the stack (the outermost phase wins); end to
end on a tiny Llama, every stage and probe phase is there and the lens counts at least its
unembedding products. The figures for the embedded model are in docs/benchmarks.md."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    monkeypatch.setenv("DEPTHSCOPE_PROBE_DTYPE", "float32")  # benchmarks._common pins it: undone after the test
    import benchmarks.bench_job_flops as bench

    return bench


def test_counts_and_labels_products(bench):
    a, b, v = torch.randn(5, 7), torch.randn(7, 3), torch.randn(7)
    mode = bench.counting_mode()

    def fit_sites():
        return a @ b, torch.mv(a, v)

    def out_of_fold():
        return fit_sites()

    def fit_task(td):
        return fit_sites(), out_of_fold(), torch.bmm(a[None], b[None])

    def run_probe_job():
        return fit_task(types.SimpleNamespace(task="upos"))

    def _lens():
        return torch.addmm(torch.zeros(5, 3), a, b)

    with mode:
        run_probe_job()
        _lens()
    mm, mv = 2 * 5 * 7 * 3, 2 * 5 * 7
    assert mode.flops == {
        ("probes", "upos", "per-site probes"): mm + mv,
        ("probes", "upos", "out-of-fold refits"): mm + mv,  # fit_sites inside out_of_fold is a refit
        ("probes", "upos", "cumulative, other"): mm,
        ("lens", "", ""): mm,
    }


def test_job_on_a_tiny_llama(bench, tiny_llama_dir, tmp_path, one_thread):
    out = tmp_path / "flops.json"
    run_args = "--max-train-sentences 20 --max-test-sentences 10 --lens-tokens 40 --norms-tokens 40"
    bench.main(["--tasks", "upos", "--json", str(out), "--run-args", f"--model {tiny_llama_dir} {run_args}"])
    got = json.loads(out.read_text())
    rows = {(r["stage"], r["task"], r["phase"]): r for r in got["rows"]}
    phases = {"extraction", "penalty search", "per-site probes", "out-of-fold refits", "stacking", "scalar mix"}
    assert phases <= {p for (s, _, p) in rows if s == "probes"}
    stages = [r for r in got["rows"] if not r["task"] and not r["phase"] and r["stage"] != "total"]
    assert {r["stage"] for r in stages} == {"lens", "norms", "probes"}
    total = rows[("total", "", "")]
    assert total["tflop"] == pytest.approx(sum(r["tflop"] for r in stages))
    # each floor is the stage's count over the rate measured in the same run (the rates themselves are this
    # machine's and its load's, so no ratio between them is asserted: a busy core moves them)
    for r in stages:
        assert r["tflop"] > 0
        for dtype in ("float32", "bfloat16"):
            assert r[f"floor_cpu_s_{dtype}"] == pytest.approx(r["tflop"] * 1e12 / got["rates"][dtype], rel=1e-9)
    # the lens decodes its text (capped at 40 tokens: at least 30 here) at each of the 7 sites (3 layers)
    # through the 64 x vocab unembedding
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    assert rows[("lens", "", "")]["tflop"] * 1e12 >= 2 * 30 * 7 * 64 * vocab
    assert 0 < total["share_of_floor"] <= 1 and got["rates"]["float32"] > 0
