"""Hostile input around the held-out text (issue 57): each ends in a clear error naming its cause
(exit code 2 on the command line), or in the work asked for, never in a raw torch, numpy or
tokenizer error or a misleading number.

- token caps apply within a document: a one-document text capped at N tokens reads N tokens;
- ``sae train`` on a one-document text splits it by tokens, and a text too short for the counts
  asked says how many tokens it holds;
- ``cache --points resid,1.z`` mixes the group word with a point name;
- ``open_activations(verify=False)`` on a damaged ``.npy`` header names the file.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from depthscope.analyses import LensConfig, TextWindows, contribution_norms, logit_lens
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.lens import lens_job
from depthscope.common.errors import InputError
from depthscope.hooks import open_activations, write_activations
from depthscope.hooks.points import parse_points
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCE = "The cat number {i} sat on the mat and looked at the dog."


@pytest.fixture(scope="module")
def one_document():
    """One long document: a whole text on one line."""
    return " ".join(SENTENCE.format(i=i) for i in range(120))


def test_token_caps_apply_within_a_document(tiny_llama, one_document, tmp_path):
    n = len(tiny_llama.tokenizer(one_document)["input_ids"])
    assert n > 1000
    lens = logit_lens(tiny_llama, [one_document], max_tokens=200, sites=["embed", "2.mlp"])
    assert (lens["n_positions"] == 200).all()  # not the whole document
    norms = contribution_norms(tiny_llama, [one_document], max_tokens=200)
    assert norms.groupby("positions")["n_tokens"].first().sum() == 200
    res = lens_job(tiny_llama, [one_document], LensConfig(text=TextWindows(max_tokens=200)), Output(tmp_path / "o"))
    assert res.summary["n_positions"] == 200


def test_sae_train_on_one_document(tiny_llama_dir, tiny_tokenizer, one_document, tmp_path, monkeypatch, capsys):
    text = tmp_path / "one.txt"
    text.write_text(one_document + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = ["sae", "train", "--model", tiny_llama_dir, "--site", "1.mlp", "--text", text, "--out", out]
    args += ["--latents", "32", "--k", "4", "--batch-size", "64", "--epochs", "1"]
    code, _, err = run_cli(args + ["--tokens", "600", "--eval-tokens", "200"], monkeypatch, capsys)
    assert code == 0, err  # one document, split by tokens: the first 600 train, the next 200 evaluate
    row = pd.read_parquet(out / "sae_metrics.parquet").iloc[0]
    assert row["train_tokens"] == 600 and row["eval_tokens"] == 200 and row["n_docs"] == 1
    have = len(tiny_tokenizer(one_document)["input_ids"])  # each token predicted once, after a BOS
    code, _, err = run_cli(
        args + ["--tokens", "5000", "--eval-tokens", "200", "--out", tmp_path / "o2"], monkeypatch, capsys
    )
    assert code == 2 and "Traceback" not in err
    assert f"the text has {have} tokens to train and evaluate on (1 document(s)" in err
    assert "need 5200" in err


def test_cache_points_mix_group_words_with_names(tiny_llama, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    resid = [p.name for p in parse_points("resid", tiny_llama.n_layers)]
    acts = write_activations(tiny_llama, ["Hello world"], "resid,1.z", tmp_path / "a", settings=None)
    assert set(acts) == {*resid, "1.z"}
    text = tmp_path / "t.txt"
    text.write_text("Hello world\nThe cat sat on the mat.\n", encoding="utf-8")
    args = ["cache", "-t", text, "-m", tiny_llama_dir, "--out", tmp_path / "c"]
    code, _, err = run_cli(args + ["--points", "resid,1.z"], monkeypatch, capsys)
    assert code == 0, err
    assert set(open_activations(tmp_path / "c")) == {*resid, "1.z"}
    code, _, err = run_cli(args[:-1] + [tmp_path / "d", "--points", "resid,9.nope"], monkeypatch, capsys)
    assert code == 2 and "9.nope" in err and "Traceback" not in err


def test_cache_windows_are_documents_of_the_store(
    tiny_llama, tiny_llama_dir, one_document, tmp_path, monkeypatch, capsys
):
    text = tmp_path / "t.txt"
    text.write_text(one_document + "\nHello world\n", encoding="utf-8")
    out = tmp_path / "c"
    code, _, err = run_cli(
        [
            "cache",
            "-t",
            text,
            "-m",
            tiny_llama_dir,
            "--out",
            out,
            "--points",
            "0.mlp",
            "--window",
            "64",
            "--stride",
            "48",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    acts = open_activations(out)
    meta = acts.manifest["meta"]
    assert meta["text_document"][0] == 0 and meta["text_document"][-1] == 1 and meta["bos"] is True
    n = len(tiny_llama.tokenizer(one_document)["input_ids"]) + len(tiny_llama.tokenizer("Hello world")["input_ids"])
    assert (
        acts.n_tokens == n + 2
    )  # every token once (the overlap of a window with the one before is not stored), and a BOS per document
    idx = acts.index_array()
    later = idx[idx[:, 0] == 1]  # the second window: its BOS and 15 tokens of context are not stored
    assert later[0, 1] == 64 - 48


def test_a_damaged_npy_header_names_the_file(tiny_llama, tmp_path):
    out = tmp_path / "c"
    write_activations(tiny_llama, ["Hello world", "The cat sat."], "0.mlp", out)
    shard = out / "chunks" / "000000" / "0.mlp.npy"
    raw = bytearray(shard.read_bytes())
    start = raw.index(b"{")
    raw[start + 10] = ord("(")  # the header dict no longer parses; the size is unchanged
    shard.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"000000/0\.mlp\.npy is not a readable \.npy file"):
        open_activations(out, verify=False)
    with pytest.raises(InputError, match="does not match its checksum"):
        open_activations(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and np.isfinite(manifest["n_tokens"])
