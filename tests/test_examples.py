"""The scripts in ``examples/`` run as documented.

Fast tier: every ``examples/*.py`` (found with a glob, so a new script without an entry in
``FAST`` fails) runs as a subprocess of this venv's python on a tiny random Llama saved as a
Hugging Face folder (``--model <folder>``), with small caps, in a temporary folder; it must exit 0
and write the files it promises. The runs go two at a time (each subprocess on one torch thread:
most of a run is importing torch and transformers), so the module takes about as long as its
slowest half. ``slow``: the steering example on the real default model (no ``--model``), whose
sentiment score must rise with the steering scale. Static checks: every script has a module
docstring with a "Run" section and takes ``--model`` and ``--out``, and ``examples/README.md``
lists every script.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
TIMEOUT = 600  # seconds per script: a hung run fails instead of blocking the suite

# script -> (cheap arguments for the tiny model, files it must write under --out)
FAST = {
    "circuit_graphs.py": (
        ["--n-pairs", "2", "--random-draws", "1"],
        [
            "ioi_pairs.jsonl",
            "edges.csv",
            "edges.parquet",
            "faithfulness.csv",
            "faithfulness.parquet",
            "faithfulness_curve.png",
            "circuit.png",
            "circuit.html",
        ],
    ),
    "ioi_dataset.py": (
        ["--n-pairs", "4", "--sites", "embed,1.mlp"],
        [
            "ioi_pairs.jsonl",
            "ioi_heads.csv",
            "ioi_heads.parquet",
            "ioi_sites.csv",
            "ioi_sites.parquet",
            "ioi_heads.png",
            "ioi_sites.png",
            "ioi_attribution_vs_exact.png",
        ],
    ),
    "ioi_patching.py": (
        ["--positions", "last"],
        [
            "ioi_sites.csv",
            "ioi_sites.parquet",
            "ioi_heads.csv",
            "ioi_heads.parquet",
            "ioi_sites.png",
            "ioi_heads.png",
            "ioi_attribution_vs_exact.png",
        ],
    ),
    "tenney_probing.py": (
        ["--max-train-sentences", "5", "--max-test-sentences", "5", "--max-epochs", "10"],
        [
            "probes_by_site.csv",
            "probes_by_site.parquet",
            "probes_summary.csv",
            "probes_summary.parquet",
            "probes_mixing.csv",
            "probes_mixing.parquet",
            "probes_accuracy.png",
            "probes_tenney.png",
        ],
    ),
    "lens_over_checkpoints.py": (
        ["--steps", "10", "--save-every", "5", "--max-tokens", "300"],
        [
            "checkpoints/step0/config.json",
            "checkpoints/step10/config.json",
            "sweep/sweep_by_site.csv",
            "sweep/sweep_by_site.parquet",
            "lens_kl_by_step.png",
            "lens_kl_heatmap.png",
        ],
    ),
    "steering_generation.py": (
        ["--max-new-tokens", "4", "--max-prompts", "2", "--scales=-2,0,2"],
        ["steering.csv", "steering.parquet", "steering_vector.csv", "steering_vector.parquet", "steering.png"],
    ),
    "own_probe.py": (
        ["--max-train-sentences", "20", "--max-test-sentences", "10"],
        ["own_probe.csv", "own_probe.parquet", "own_probe.png"],
    ),
    "causal_per_depth.py": (
        ["--max-train-sentences", "20", "--max-test-sentences", "5", "--controls", "1", "--max-text-tokens", "60"],
        ["causal.csv", "causal.parquet", "causal_encoded_used.png"],
    ),
    "localize_agreement.py": (
        ["--n", "24", "--sites", "embed,1.mlp", "--das-sites", "1.mlp", "--epochs", "1", "--probe-sentences", "10"],
        [
            "agreement.jsonl",
            "localize.csv",
            "localize.parquet",
            "localize_probes.parquet",
            "localize_das.parquet",
            "localize_three_curves.png",
            "localize_das.png",
        ],
    ),
    "sae_features.py": (
        ["--sites", "1.mlp,2.mlp", "--latents", "64", "--k", "4", "--tokens", "1500", "--eval-tokens", "300"],
        [
            "saes/1.mlp/sae/cfg.json",
            "saes/2.mlp/sae/sae_weights.safetensors",
            "sae_metrics.csv",
            "sparse_probing.parquet",
            "sparse_probing_tags.csv",
            "sparse_probing.png",
        ],
    ),
    "hooks_in_your_code.py": (
        [],
        [
            "saliency_tokens.csv",
            "saliency_tokens.parquet",
            "saliency_sublayers.csv",
            "saliency_sublayers.parquet",
            "saliency.png",
        ],
    ),
}


def run_script(name: str, args: list[str], cwd: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DEPTHSCOPE_PROGRESS": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        **(env_extra or {}),
    }
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama with the tiny tokenizer, saved as a Hugging Face folder."""
    from conftest import make_tiny

    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama", vocab_size=len(tiny_tokenizer)).save_pretrained(d, safe_serialization=True)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def fast_runs(request, tmp_path_factory, tiny_folder):
    """The selected examples with an entry in FAST, started two at a time on the tiny model:
    {script: (future of its CompletedProcess, its --out folder)}."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example_runs_on_a_tiny_model"
    }
    base = tmp_path_factory.mktemp("examples")
    cache = base / "cache"  # the probes' activation stores go here, not to the user's cache
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for name in SCRIPTS:
        if name not in FAST or name not in selected:
            continue
        args, _ = FAST[name]
        out = base / Path(name).stem
        cmd = ["--model", str(tiny_folder), "--out", str(out), *args]
        runs[name] = (pool.submit(run_script, name, cmd, base, {"DEPTHSCOPE_CACHE": str(cache)}), out)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


def test_there_are_examples():
    assert len(SCRIPTS) >= 5, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_on_a_tiny_model(name, fast_runs):
    if name not in FAST:
        pytest.fail(f"examples/{name} has no entry in tests/test_examples.py FAST (its cheap arguments and outputs)")
    future, out = fast_runs[name]
    proc = future.result()
    assert proc.returncode == 0, f"examples/{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    missing = [f for f in FAST[name][1] if not (out / f).is_file()]
    assert not missing, f"examples/{name} did not write {missing}; it wrote {sorted(p.name for p in out.rglob('*'))}"
    assert proc.stdout.strip(), f"examples/{name} printed no summary"


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_is_documented(name):
    """A module docstring saying what it shows and how to run it; --model and --out options;
    a line in examples/README.md."""
    source = (EXAMPLES / name).read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source))
    assert doc and "\nRun\n" in doc, f"examples/{name}: no module docstring with a Run section"
    assert f"python examples/{name}" in doc, f"examples/{name}: its docstring does not say how to run it"
    assert '"--model"' in source and '"--out"' in source, f"examples/{name} lacks --model or --out"
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    assert f"python examples/{name}" in readme, f"examples/README.md does not list {name}"


@pytest.mark.slow
def test_steering_example_on_the_default_model(tmp_path):
    """As documented: no --model (SmolLM2-135M-Instruct); steering towards the positive set
    raises the next token's sentiment score and towards the negative set lowers it."""
    import pandas as pd

    out = tmp_path / "steer"
    args = ["--out", str(out), "--max-new-tokens", "8", "--max-prompts", "2", "--scales=-3,0,3"]
    proc = run_script("steering_generation.py", args, tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for f in FAST["steering_generation.py"][1]:
        assert (out / f).is_file(), f
    df = pd.read_csv(out / "steering.csv")
    assert set(df["site"]) == {"10.mlp"} and len(df) == 3 * 2
    score = df.groupby("scale")["sentiment_logprob_diff"].mean()
    assert score[-3.0] < score[0.0] < score[3.0], score
    assert df["continuation"].str.len().gt(0).all()
    assert "scale" in proc.stdout and "10.mlp" in proc.stdout
