"""``depthscope attribute`` end to end on a tiny Llama with a random transcoder set: the files it
writes hold the graph the Python API computes (same adjacency, scores, completeness on reload),
and bad input is a clear error with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_cli

from depthscope.analyses.circuits.features import attribution_graph, graph_scores, prune_graph, read_graph
from depthscope.hooks import SAE, load_model, save_transcoder_set

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "the cat sat on the mat and the dog"


def random_set(d_model: int, n_layers: int, d_sae: int = 24) -> dict[int, SAE]:
    out = {}
    for layer in range(n_layers):
        g = torch.Generator().manual_seed(layer)
        out[layer] = SAE(
            W_enc=torch.randn(d_model, d_sae, generator=g) / d_model**0.5,
            b_enc=torch.randn(d_sae, generator=g) * 0.1,
            W_dec=torch.randn(d_sae, d_model, generator=g) / d_sae**0.5,
            b_dec=torch.randn(d_model, generator=g) * 0.01,
            architecture="topk_transcoder",
            k=4,
            apply_b_dec_to_input=False,
            hook_name=f"blocks.{layer}.ln2.hook_normalized",
            hook_name_out=f"blocks.{layer}.hook_mlp_out",
        )
    return out


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    model = load_model(str(tiny_llama_dir))
    tcs = random_set(model.d_model, model.n_layers)
    folder = tmp_path_factory.mktemp("tcs") / "set"
    save_transcoder_set(tcs, folder)
    return model, tcs, folder


def test_the_command_writes_the_graph_the_api_computes(setup, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    model, tcs, folder = setup
    out = tmp_path / "out"
    args = ["attribute", "--model", tiny_llama_dir, "--transcoders", folder, "--prompt", PROMPT, "--out", out]
    code, stdout, stderr = run_cli([*args, "--max-feature-nodes", 30, "--top-tokens", 3], monkeypatch, capsys)
    assert code == 0, stderr
    for name in ("nodes.parquet", "adjacency.npz", "attribution_summary.json", "graph.json", "attribution.html"):
        assert (out / name).is_file(), name
    assert (out / "attribution_graph.png").is_file() and (out / "attribution_graph.svg").is_file()
    assert "completeness_score" in stdout

    api = attribution_graph(model, tcs, PROMPT, max_feature_nodes=30)
    back = read_graph(out)
    np.testing.assert_allclose(back.dense(), api.dense(), rtol=1e-5, atol=1e-6)
    assert back.logit_tokens == api.logit_tokens
    summary = json.loads((out / "attribution_summary.json").read_text())
    scores = graph_scores(api, prune_graph(api))
    for k, v in scores.items():
        assert summary[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    # completeness on the reloaded files: every target's input is its edges plus its bias
    targets = ~np.isnan(back.inputs)
    assert targets.sum() > back.n_logits  # feature rows too
    sums = back.dense().sum(1) + back.bias
    np.testing.assert_allclose(sums[targets], back.inputs[targets], rtol=1e-4, atol=1e-4)
    # the most influential kept feature's top tokens (its decoder row through the unembedding) are in the page
    html = (out / "attribution.html").read_text()
    table = pd.read_parquet(out / "nodes.parquet")
    kept = table[(table.kind == "feature") & table.in_pruned_graph].sort_values("influence", ascending=False)
    assert len(kept)
    row = kept.iloc[0]
    scores = tcs[int(row.layer)].W_dec[int(row.feature)] @ model.unembed.W_U.detach()
    for i in torch.topk(scores, 3).indices.tolist():
        assert json.dumps(model.tokenizer.decode([i]))[1:-1] in html


def test_named_targets_are_the_graphs_logits(setup, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    model, _, folder = setup
    ids = model.tokenizer.encode(" cat dog", add_special_tokens=False)
    names = ",".join(model.tokenizer.decode([i]) for i in ids)
    args = ["attribute", "--model", tiny_llama_dir, "--transcoders", folder, "--prompt", PROMPT]
    code, _, stderr = run_cli(
        [*args, "--out", tmp_path / "o", "--targets", names, "--max-feature-nodes", 5], monkeypatch, capsys
    )
    assert code == 0, stderr
    assert read_graph(tmp_path / "o").logit_tokens == list(ids)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt", PROMPT, "--node-threshold", "1.5"], "node-threshold"),
        (["--prompt", PROMPT, "--targets", "the cat sat on"], "not one token"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(
    setup, tiny_llama_dir, tmp_path, monkeypatch, capsys, extra, message
):
    _, _, folder = setup
    out = tmp_path / "out"
    args = ["attribute", "--model", tiny_llama_dir, "--transcoders", folder, "--out", out, *extra]
    code, _, stderr = run_cli(args, monkeypatch, capsys)
    assert code == 2
    assert message in stderr.replace("\n", " ") and "Traceback" not in stderr
    assert not (out / "nodes.parquet").exists()


def test_a_missing_transcoder_set_is_named(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    args = ["attribute", "--model", tiny_llama_dir, "--transcoders", tmp_path / "nope", "--prompt", PROMPT]
    code, _, stderr = run_cli([*args, "--out", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and "nope" in stderr and "Traceback" not in stderr
