"""Memory before the work (issue 68, item 6): patching and circuits estimate what a pair needs and
refuse, before any forward, what the memory free cannot hold, naming the estimate, the memory
free and what helps; the token budget counts a row's cached prefix; a long pair's progress bar
has its total before its first patched forward; the estimate is within a factor of a measured
peak."""

from __future__ import annotations

import json

import pytest
import torch

from depthscope.analyses.circuits import memory
from depthscope.analyses.circuits.patching import results, runs
from depthscope.analyses.circuits.patching.activation import activation_patching
from depthscope.hooks import devices
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def _weights(folder) -> int:
    from depthscope.hooks import load_model

    m = load_model(str(folder))
    return sum(p.numel() * p.element_size() for p in m.hf_model.parameters())


def _free(monkeypatch, nbytes: int) -> None:
    """Make every preflight (the model's load, the pair's check) see ``nbytes`` free."""
    monkeypatch.setattr(devices, "free_bytes", lambda device: int(nbytes))


def test_patch_refuses_a_pair_that_does_not_fit_before_any_forward(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    free = 2 * _weights(tiny_llama_dir)  # the weights load; the patching does not fit beside them
    _free(monkeypatch, free)
    forwards = []
    monkeypatch.setattr(runs, "capture", lambda *a, **k: forwards.append(1))
    out = tmp_path / "out"
    args = ["patch", "--clean", CLEAN, "--corrupted", CORRUPTED, "--target", " Mary", "--foil", " John"]
    code, _, err = run_cli([*args, "--model", tiny_llama_dir, "--out", out, "--threads", "1"], monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err and "error:" in err
    assert "patching of the pair" in err and "of memory" in err and f"{memory._gib(free)} free" in err
    assert "--positions last" in err and "--batch-tokens" in err and "nothing was run" in err
    assert not forwards and not (out / "patching_by_site.parquet").exists()


def test_a_pair_that_fits_runs_and_the_estimate_is_what_was_compared(tiny_llama, monkeypatch):
    need = {}
    real = memory.check_room

    def spy(terms, device, what, knobs, **kw):
        need["bytes"] = real(terms, device, what, knobs, **kw)
        return need["bytes"]

    monkeypatch.setattr(memory, "check_room", spy)
    _free(monkeypatch, 64 * 2**30)
    df = activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="resid")
    assert len(df) == 2 * tiny_llama.n_layers + 1 and need["bytes"] > 0
    _free(monkeypatch, need["bytes"] // 2)
    with pytest.raises(memory.WorkTooLarge, match="activation patching of the pair"):
        activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="resid")
    _free(monkeypatch, need["bytes"] * 2)  # the same pair with room to spare
    activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="resid")


def test_circuit_refuses_a_batch_that_does_not_fit(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    pairs = tmp_path / "pairs.jsonl"
    tail = " the cat sat on the mat" * 20  # about 140 tokens: EAP needs megabytes, the weights fit in one
    rows = [
        {"clean": "the cat" + tail, "corrupted": "the dog" + tail, "target": " mat", "foil": " cat"},
        {"clean": "the dog" + tail, "corrupted": "the cat" + tail, "target": " mat", "foil": " cat"},
    ]
    pairs.write_text("\n".join(json.dumps(r) for r in rows))
    _free(monkeypatch, 2 * _weights(tiny_llama_dir))
    args = ["circuit", "--pairs", pairs, "--model", tiny_llama_dir, "--in-sample", "--out", tmp_path / "out"]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err and "of memory" in err and "free" in err and "shorter pairs" in err
    assert not (tmp_path / "out" / "edges.parquet").exists()


def test_the_token_budget_counts_a_rows_cached_prefix():
    # three patches at position 9 of 10: one computed position a row, nine held as a prefix
    assert [len(r) for r, _ in runs.plan([9, 9, 9], 10, 8)] == [3]  # prefix free: one chunk
    assert [len(r) for r, _ in runs.plan([9, 9, 9], 10, 8, weight=1.0)] == [1, 1, 1]  # 2 rows x 10 > 8
    assert [len(r) for r, _ in runs.plan([9, 9, 9], 10, 40, weight=1.0)] == [3]  # 4 rows x 10 <= 40


class _Bar:
    """A progress bar that records its total at each update."""

    def __init__(self, total=None, **_):
        self.total, self.seen = total, []

    def update(self, n):
        self.seen.append((n, self.total))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_pairs_bar_has_its_total_before_its_first_patched_forward(tiny_llama, monkeypatch):
    bars = []
    monkeypatch.setattr(results, "progress_bar", lambda *a, **k: bars.append(_Bar(*a, **k)) or bars[-1])
    activation_patching(tiny_llama, CLEAN, CORRUPTED, (" Mary", " John"), sites="resid", batch_tokens=64)
    (bar,) = bars
    n_patches = 2 * tiny_llama.n_layers + 1
    moving = [(n, total) for n, total in bar.seen if n > 0]
    assert len(moving) > 1 and all(total == n_patches for _, total in moving)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_the_estimate_is_within_a_factor_of_the_measured_peak(tiny_tokenizer):
    """A long pair on a tiny model with a real vocabulary (the logits dominate, as on the default
    model): the estimate against the rise of the process's peak resident memory."""
    import transformers as tf

    from depthscope.common.runtime import peak_memory, reset_peak_memory
    from depthscope.hooks import load_model

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        vocab_size=49152,
    )
    model = load_model(tf.LlamaForCausalLM(cfg).eval(), tokenizer=tiny_tokenizer)
    words = " ".join(f"the cat number {i} sat on the mat" for i in range(120))
    clean, corrupted = words + " and John gave a drink to", words + " and Mary gave a drink to"
    n = len(model.tokenize([clean])[0][0])
    assert n > 1000
    terms = memory.patch_bytes(model, ["resid"] * 5, n, n, method="activation", batch_tokens=2048, last_only=True)
    if not reset_peak_memory():
        pytest.skip("no resettable peak memory here")
    before = _status("VmRSS:")
    activation_patching(model, clean, corrupted, (" Mary", " John"), sites="resid")
    measured = peak_memory() - before
    estimate = sum(terms.values())
    assert measured > 0
    assert 0.5 <= estimate / measured <= 4, (estimate / 2**20, measured / 2**20)


def test_edge_attribution_bar_moves_within_a_pair(tiny_llama, monkeypatch):
    from depthscope.analyses.circuits.edges import eap

    bars = []
    monkeypatch.setattr(eap, "progress_bar", lambda *a, **k: bars.append(_Bar(*a, **k)) or bars[-1])
    pair = {"clean": "the cat sat on the mat", "corrupted": "the dog sat on the mat", "target": " mat", "foil": " cat"}
    eap.score_edges(tiny_llama, [pair], "eap-ig", steps=3)
    (bar,) = bars
    assert bar.total == 3 and bar.seen == [(1, 3)] * 3  # one pair: three steps, each counted
