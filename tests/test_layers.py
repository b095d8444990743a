"""Layer interventions (analyses/causal/erasure/layers.py, hooks/block_order.py): the model with one block skipped
or two neighbouring blocks swapped, scored by next-token cross-entropy and top-1 agreement, against
the same intervention built by hand on the plain transformers model (a new ``nn.ModuleList`` of
its blocks: the skipped block left out, the swapped pair exchanged), one line at a time without
padding; the ``none`` row against transformers' own loss; the block order restored on error; the
command's table and its errors for bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from depthscope.analyses.causal.erasure.layers import layer_interventions
from depthscope.common.errors import InputError
from depthscope.hooks.block_order import block_order, skip, swap
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [
    "The capital of France is Paris.",
    "The cat sat on the mat. The dog sat on the log.",
    "Hello world",
    "A bird flew over the house and sang.",
    "The capital of Italy is Rome. Hello world, this is a longer second sentence with more words.",
]
#: where each family keeps its block list: (parent attribute path, list name)
BLOCKS = {"llama": ("model", "layers"), "gpt2": ("transformer", "h"), "gpt_neox": ("gpt_neox", "layers")}


def _reference(hf, tok, family: str, order) -> tuple[float, list[torch.Tensor]]:
    """Token-weighted next-token cross-entropy of ``hf`` with its blocks replaced by ``order`` (block
    indices; None: unmodified), one line at a time (no padding; the BOS token prepended, as the
    tiny tokenizer adds none), and each line's argmax."""
    parent_path, name = BLOCKS[family]
    parent = getattr(hf, parent_path)
    original = getattr(parent, name)
    if order is not None:
        setattr(parent, name, nn.ModuleList([original[i] for i in order]))
    try:
        total, n, tops = 0.0, 0, []
        for text in TEXTS:
            ids = torch.tensor([[tok.bos_token_id, *tok(text)["input_ids"]]])
            with torch.no_grad():
                out = hf(input_ids=ids, labels=ids, use_cache=False)
            total += float(out.loss) * (ids.shape[1] - 1)
            n += ids.shape[1] - 1
            tops.append(out.logits[0, :-1].argmax(-1))
        return total / n, tops
    finally:
        setattr(parent, name, original)


def _agreement(tops, base) -> float:
    return float(sum(int((a == b).sum()) for a, b in zip(tops, base)) / sum(len(b) for b in base))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_interventions_match_plain_transformers(tiny_factory, tiny_tokenizer, family):
    model = tiny_factory(family, n_layers=4)
    df = layer_interventions(model, TEXTS, batch_size=3)  # padded batches of lines of unequal length
    hf, L = model.hf_model, model.n_layers
    assert len(df) == 1 + L + (L - 1)
    base_ce, base_top = _reference(hf, tiny_tokenizer, family, None)
    row = df[df["intervention"] == "none"].iloc[0]
    assert row["cross_entropy"] == pytest.approx(base_ce, abs=1e-5)
    assert row["top1_agreement"] == 1.0
    for layer in range(L):
        ce, tops = _reference(hf, tiny_tokenizer, family, [i for i in range(L) if i != layer])
        got = df[(df["intervention"] == "skip") & (df["layer"] == layer)].iloc[0]
        assert got["cross_entropy"] == pytest.approx(ce, abs=1e-5), (family, "skip", layer)
        assert got["top1_agreement"] == pytest.approx(_agreement(tops, base_top), abs=1e-9)
        assert got["depth"] == layer + 1 and got["label"] == f"{layer}.mlp" and got["site"] == 2 * layer + 2
    for layer in range(L - 1):
        order = list(range(L))
        order[layer], order[layer + 1] = layer + 1, layer
        ce, tops = _reference(hf, tiny_tokenizer, family, order)
        got = df[(df["intervention"] == "swap") & (df["layer"] == layer)].iloc[0]
        assert got["cross_entropy"] == pytest.approx(ce, abs=1e-5), (family, "swap", layer)
        assert got["top1_agreement"] == pytest.approx(_agreement(tops, base_top), abs=1e-9)
    # the interventions change the model: a skipped block moves the loss
    assert (df[df["intervention"] == "skip"]["cross_entropy"] - base_ce).abs().max() > 1e-3


def test_block_order_is_restored_on_error(tiny_factory):
    model = tiny_factory("llama", n_layers=3)
    blocks = list(model.arch.blocks)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    before = model.run(ids).logits
    with pytest.raises(RuntimeError, match="boom"):
        with block_order(model, swap(3, 0)):
            assert model.arch.blocks[0] is blocks[1]
            raise RuntimeError("boom")
    assert list(model.arch.blocks) == blocks
    torch.testing.assert_close(model.run(ids).logits, before, rtol=0, atol=0)
    with block_order(model, skip(3, 2)):
        assert not torch.allclose(model.run(ids).logits, before)
    assert list(model.arch.blocks) == blocks


def test_bad_orders_and_models_are_input_errors(tiny_factory):
    model = tiny_factory("llama", n_layers=3)
    for order in ([0, 1], [0, 1, 3], [0, 1, "2"], [0, 1, True]):
        with pytest.raises(InputError, match="block order"):
            with block_order(model, order):
                pass
    with pytest.raises(InputError, match="next block"):
        swap(3, 2)
    with pytest.raises(InputError, match="out of range"):
        layer_interventions(model, TEXTS, layers=[5])
    with pytest.raises(InputError, match="not a decoder"):
        layer_interventions(tiny_factory("bert", n_layers=2), TEXTS)


def test_layers_command(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    text = tmp_path / "text.txt"
    text.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        ["layers", "--text", text, "--model", tiny_llama_dir, "--out", out], monkeypatch, capsys
    )
    assert code == 0, err
    df = pd.read_parquet(out / "layers.parquet")
    assert sorted(df["intervention"].unique()) == ["none", "skip", "swap"]
    assert (df["intervention"] == "none").sum() == 1
    assert {"layer", "depth", "cross_entropy", "top1_agreement"} <= set(df.columns)
    assert np.isfinite(df["cross_entropy"]).all()
    assert (out / "layers.csv").is_file() and (out / "layers_curves.png").is_file()
    code, _, err = run_cli(
        ["layers", "--text", tmp_path / "missing.txt", "--model", tiny_llama_dir, "--out", tmp_path / "o2"],
        monkeypatch,
        capsys,
    )
    assert code != 0 and "no such text file" in err and "Traceback" not in err
    code, _, err = run_cli(
        ["layers", "--text", text, "--model", tiny_llama_dir, "--batch-size", "0", "--out", tmp_path / "o3"],
        monkeypatch,
        capsys,
    )
    assert code != 0 and "Traceback" not in err
