"""The activation cache (depthscope.hooks.activation_cache, `depthscope cache`): what it stores is
what model.run computes, bit for bit, for every real token in document order; the layout reads
with numpy alone; damaged stores are refused; a killed run resumes, recomputing only what is missing."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import make_tiny, run_cli

from depthscope.common.errors import InputError, OutputError
from depthscope.common.shards import ShardedFeats, write_manifest
from depthscope.hooks import CacheSettings, load_model, open_activations, write_activations
from depthscope.hooks import activation_cache as ac

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [
    "The cat sat on the mat.",
    "Hello",
    "When Mary and John went to the store, John gave a drink to Mary",
    "A b c d e f",
    "Colorless green ideas sleep furiously, said the linguist to nobody in particular.",
    "x",
]
POINTS = ["embed", "0.attn", "1.mlp", "2.mlp", "0.z", "1.neurons", "2.q"]


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return load_model(make_tiny("llama", vocab_size=len(tiny_tokenizer)), tokenizer=tiny_tokenizer)


def settings(chunk_tokens: int = 4096, **kw) -> CacheSettings:
    return CacheSettings(chunk_tokens=chunk_tokens, progress=False, **kw)


def real_rows(run, name: str) -> torch.Tensor:
    """A point of a right-padded model.run at its real tokens, rows in document order."""
    return run[name][run.mask]


def test_one_chunk_is_exactly_model_run(model, tmp_path):
    acts = model.run(TEXTS, cache=POINTS, cache_to=tmp_path / "c")
    ref = model.run(TEXTS, cache=POINTS)
    assert list(acts) == ref.keys()  # forward order, canonical names
    for name in ref.keys():
        got = torch.from_numpy(np.asarray(acts[name]))
        assert torch.equal(got, real_rows(ref, name)), name
    # aliases read the same array; the shapes are [tokens, ...]
    assert acts["blocks.1.hook_resid_post"] is acts["1.mlp"] and acts["0.z"].shape == (acts.n_tokens, 4, 16)
    # the index: every token of every document, in order, with its id and position
    ids = model.tokenizer(TEXTS)["input_ids"]
    idx = acts.index
    assert list(idx.columns) == ["document", "position", "token"] and len(idx) == sum(map(len, ids))
    for d, toks in enumerate(ids):
        rows = idx.iloc[acts.document(d)]
        assert rows["document"].tolist() == [d] * len(toks)
        assert rows["position"].tolist() == list(range(len(toks))) and rows["token"].tolist() == toks
        alone = model.run([TEXTS[d]], cache="2.mlp")["2.mlp"][0]
        np.testing.assert_allclose(acts["2.mlp"][acts.document(d)], alone.numpy(), rtol=1e-5, atol=1e-5)


def test_chunks_are_model_run_of_their_documents(model, tmp_path):
    acts = write_activations(model, TEXTS, "resid", tmp_path / "c", settings=settings(chunk_tokens=24))
    chunks = acts.manifest["chunks"]
    assert len(chunks) >= 3 and [c["documents"][0] for c in chunks] == sorted({c["documents"][0] for c in chunks})
    for c in chunks:
        (a, b), (r0, r1) = c["documents"], c["rows"]
        ref = model.run(TEXTS[a:b], cache="resid")
        for name in ref.keys():
            assert torch.equal(torch.from_numpy(acts[name][r0:r1]), real_rows(ref, name)), (name, a, b)
    # against transformers' own hidden states of the whole batch (another padding: rounding only)
    enc = model.tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        hs = model.hf_model(**enc, output_hidden_states=True).hidden_states
    mask = enc["attention_mask"].bool()
    for layer in range(model.n_layers):  # the last hidden state is after the final norm: compare 0..L-1
        want = hs[layer][mask].numpy()
        got = np.asarray(acts["embed" if layer == 0 else f"{layer - 1}.mlp"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_model_is_stored_as_exact_float32(tiny_tokenizer, tmp_path):
    m = load_model(make_tiny("llama", vocab_size=len(tiny_tokenizer)).to(torch.bfloat16), tokenizer=tiny_tokenizer)
    acts = write_activations(m, TEXTS[:3], "0.mlp,2.attn", tmp_path / "c", settings=settings())
    ref = m.run(TEXTS[:3], cache=["0.mlp", "2.attn"])
    assert acts.manifest["model_dtype"] == "bfloat16" and acts["0.mlp"].dtype == np.float32
    for name in ref.keys():
        assert torch.equal(torch.from_numpy(np.asarray(acts[name])), real_rows(ref, name).float())


def test_layout_reads_with_numpy_alone(model, tmp_path):
    """docs/cache.md's layout: manifest.json, chunks/<k>/<point>.npy and index.npy, sha256 per file."""
    acts = write_activations(model, TEXTS, "resid", tmp_path / "c", settings=settings(chunk_tokens=24))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    body = {k: v for k, v in manifest.items() if k != "meta_sha256"}
    assert hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() == manifest["meta_sha256"]
    for c in manifest["chunks"]:
        for name, rec in c["files"].items():
            path = tmp_path / "c" / "chunks" / f"{c['chunk']:06d}" / name
            assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["sha256"] and path.stat().st_size == rec["size"]
    for name in manifest["points"]:
        parts = [
            np.load(tmp_path / "c" / "chunks" / f"{c['chunk']:06d}" / f"{name}.npy", mmap_mode="r")
            for c in manifest["chunks"]
        ]
        assert isinstance(parts[0], np.memmap)
        np.testing.assert_array_equal(np.concatenate(parts), np.asarray(acts[name]))
    index = np.concatenate(
        [np.load(tmp_path / "c" / "chunks" / f"{c['chunk']:06d}" / "index.npy") for c in manifest["chunks"]]
    )
    np.testing.assert_array_equal(index, acts.index.to_numpy())


def test_damaged_stores_are_refused(model, tmp_path):
    out = tmp_path / "c"
    write_activations(model, TEXTS, "0.mlp,1.attn", out, settings=settings(chunk_tokens=24))
    shard = out / "chunks" / "000001" / "1.attn.npy"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in the data, size unchanged
    shard.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"000001/1\.attn\.npy does not match its checksum"):
        open_activations(out)
    assert len(open_activations(out, verify=False)["1.attn"]) > 0  # opt-out of hashing: sizes still checked
    shard.write_bytes(bytes(raw[:-8]))
    with pytest.raises(InputError, match="has .* bytes, not the"):
        open_activations(out, verify=False)
    shard.unlink()
    with pytest.raises(InputError, match="is missing"):
        open_activations(out, verify=False)
    manifest = out / "manifest.json"
    edited = manifest.read_text().replace('"n_tokens": ', '"n_tokens": 1')
    manifest.write_text(edited)
    with pytest.raises(InputError, match="does not match its own checksum"):
        open_activations(out)
    with pytest.raises(InputError, match="not an activation cache"):
        open_activations(tmp_path)


def test_killed_run_resumes_with_only_the_missing_chunks(model, tmp_path, monkeypatch):
    whole = write_activations(model, TEXTS, "resid", tmp_path / "whole", settings=settings(chunk_tokens=24))
    n_chunks = len(whole.manifest["chunks"])
    real_write, calls = ac._write_chunk, []

    def dies_at_third(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while the third chunk is written
        calls.append(1)
        return real_write(*a, **k)

    monkeypatch.setattr(ac, "_write_chunk", dies_at_third)
    out = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        write_activations(model, TEXTS, "resid", out, settings=settings(chunk_tokens=24))
    monkeypatch.undo()
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and len(manifest["chunks"]) == 2
    with pytest.raises(InputError, match="unfinished"):
        open_activations(out)
    # a chunk whose shard was damaged after it was written is recomputed as well
    (out / "chunks" / "000000" / "0.mlp.npy").write_bytes(b"junk")
    real_capture, forwards = ac._capture, []
    monkeypatch.setattr(ac, "_capture", lambda *a: forwards.append(1) or real_capture(*a))
    acts = write_activations(model, TEXTS, "resid", out, settings=settings(chunk_tokens=24))
    assert len(forwards) == n_chunks - 1  # chunk 0 (damaged) and chunks 2.. ; chunk 1 kept
    for name in whole:
        np.testing.assert_array_equal(np.asarray(acts[name]), np.asarray(whole[name]))
    forwards.clear()
    write_activations(model, TEXTS, "resid", out, settings=settings(chunk_tokens=24))
    assert forwards == []  # a finished store: nothing to compute


def test_other_run_in_the_folder_is_refused_unless_overwritten(model, tmp_path):
    out = tmp_path / "c"
    write_activations(model, TEXTS, "0.mlp", out, settings=settings())
    with pytest.raises(OutputError, match="another run .*points"):
        write_activations(model, TEXTS, "1.mlp", out, settings=settings())
    with pytest.raises(OutputError, match="another run .*tokens_sha256"):
        write_activations(model, TEXTS[:2], "0.mlp", out, settings=settings())
    acts = write_activations(model, TEXTS[:2], "1.mlp", out, settings=settings(overwrite=True))
    assert list(acts) == ["1.mlp"] and acts.n_documents == 2


def test_bad_requests_are_clear_errors(model, tmp_path):
    with pytest.raises(InputError, match=r"\[batch, heads, pos"):
        model.run(TEXTS, cache="1.pattern", cache_to=tmp_path / "c")
    with pytest.raises(InputError, match="no gradient"):
        model.run(TEXTS, cache="resid", cache_to=tmp_path / "c", grad=True)
    with pytest.raises(InputError, match="as strings"):
        model.run(torch.tensor([[1, 2, 3]]), cache="resid", cache_to=tmp_path / "c")
    with pytest.raises(InputError, match="non-empty strings"):
        model.run(["a", ""], cache="resid", cache_to=tmp_path / "c")
    with pytest.raises(TypeError, match="cache_too"):
        model.run(TEXTS, cache="resid", cache_too=tmp_path / "c")
    with pytest.raises(InputError, match="chunk_tokens"):
        CacheSettings(chunk_tokens=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="existing file"):
        model.run(TEXTS, cache="resid", cache_to=tmp_path / "file")


def test_a_hook_changes_what_is_cached(model, tmp_path):
    acts = model.run(TEXTS[:2], cache=["0.mlp", "1.mlp"], cache_to=tmp_path / "c", hooks={"0.mlp": lambda t, c: t * 0})
    ref = model.run(TEXTS[:2], cache=["0.mlp", "1.mlp"], hooks={"0.mlp": lambda t, c: t * 0})
    assert not np.asarray(acts["0.mlp"]).any() and acts.manifest["hooks"] == ["0.mlp"]
    assert torch.equal(torch.from_numpy(np.asarray(acts["1.mlp"])), real_rows(ref, "1.mlp"))


def test_sharded_rows_index_like_one_array():
    parts = [np.arange(i, i + n * 6, dtype=np.float32).reshape(n, 2, 3) for i, n in ((0, 4), (100, 1), (200, 3))]
    whole, f = np.concatenate(parts), ShardedFeats(parts)
    for idx in (5, -1, slice(2, 6), slice(None, None, -3), np.array([[7, 0], [4, -8]]), (slice(1, 7), 1), (3, 0, 2)):
        np.testing.assert_array_equal(f[idx], whole[idx])
    with pytest.raises(IndexError):
        f[8]


def test_manifest_checksum_is_the_probes_store_one(tmp_path):
    """One shard format: the probes' store digests its meta.json with the same function."""
    from depthscope.probes.store import activations

    m = write_manifest(tmp_path / "m.json", {"a": 1, "b": [2, 3]})
    assert activations._meta_digest(m) == m["meta_sha256"]


def test_cli_writes_and_resumes(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(TEXTS) + "\n\n")
    args = ["cache", "-t", text, "-m", tiny_llama_dir, "--out", tmp_path / "o", "--chunk-tokens", "24"]
    code, out, err = run_cli(args + ["--points", "0.mlp,2.z"], monkeypatch, capsys)
    assert code == 0, err
    acts = open_activations(tmp_path / "o")
    assert list(acts) == ["0.mlp", "2.z"] and acts.n_documents == len(TEXTS) and "6 / " in out
    code, _, err = run_cli(args + ["--points", "1.mlp"], monkeypatch, capsys)
    assert code != 0 and "another depthscope cache" in err and "Traceback" not in err
    code, _, err = run_cli([*args[:-4], "--out", tmp_path / "q", "--points", "1.scores"], monkeypatch, capsys)
    assert code != 0 and "cannot be cached per token" in err and "Traceback" not in err
    code, _, err = run_cli(["cache", "-t", tmp_path / "none.txt", "--out", tmp_path / "p"], monkeypatch, capsys)
    assert code != 0 and "no such text file" in err and "Traceback" not in err
