"""Models that lie, and the GGUF cache. A config, tokenizer or GGUF
header that asks for impossible sizes, or that does not match the weights, is refused before
anything is allocated with a message naming the field, file or ids (the CLI exits 2, no
traceback); a cached conversion whose bytes changed behind unchanged metadata is never served."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny
from typer.testing import CliRunner

import depthscope.common.stamps as stamps
import depthscope.hooks.loading as loading
from depthscope.analyses.cli import app
from depthscope.common.errors import ModelSpecError
from depthscope.common.stamps import STAMPS
from depthscope.hooks.devices import ModelTooLarge
from depthscope.hooks.model_checks import MAX_LAYERS, gguf_config_sizes


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama folder (2 layers, width 32) whose config, tokenizer and weights agree."""
    folder = tmp_path_factory.mktemp("tiny") / "base"
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=2, d_model=32).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def _variant(base: Path, tmp_path: Path, **config) -> Path:
    """A copy of ``base`` with ``config`` written over its config.json."""
    folder = tmp_path / "m"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _refused(folder, *needles):
    """``depthscope info --model folder`` exits 2 with every needle in its message, no traceback."""
    r = CliRunner().invoke(app, ["info", "--model", str(folder)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.output.startswith("error: "), r.output
    for n in needles:
        assert n in r.output, (n, r.output)
    return r.output


@pytest.fixture
def nothing_built(monkeypatch):
    """Any model built (even on the meta device) or any weight read fails the test."""
    import transformers

    def boom(*a, **k):
        raise AssertionError("a model was built for a config that should have been refused")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel, transformers.LlamaForCausalLM):
        monkeypatch.setattr(cls, "from_config", boom, raising=False)
        monkeypatch.setattr(cls, "from_pretrained", boom, raising=False)


SIZES = [
    ("num_hidden_layers", 100_000, "past the most depthscope accepts (1,024)"),
    ("num_hidden_layers", 1_000_000_000, "past the most depthscope accepts (1,024)"),
    ("num_hidden_layers", -1, "must be at least 1, got -1"),
    ("num_hidden_layers", 0, "must be at least 1, got 0"),
    ("num_hidden_layers", 2.5, "must be a whole number from 1 to 1,024, got 2.5"),
    ("num_hidden_layers", "2", "must be a whole number from 1 to 1,024, got '2'"),
    ("num_hidden_layers", True, "must be a whole number"),
    ("hidden_size", 1_000_000_000, "hidden_size is 1,000,000,000, past the most"),
    ("intermediate_size", 10**15, "intermediate_size is"),
    ("vocab_size", -5, "vocab_size must be at least 1"),
    ("num_attention_heads", 0, "num_attention_heads must be at least 1"),
    ("max_position_embeddings", 1 << 40, "max_position_embeddings is"),
    ("n_layer", 10**9, "n_layer is 1,000,000,000"),  # GPT-2's name for the layer count
]


@pytest.mark.parametrize("field,value,message", SIZES, ids=[f"{f}={v!r}" for f, v, _ in SIZES])
def test_a_config_with_impossible_sizes_is_refused_before_anything_is_built(
    base, tmp_path, nothing_built, field, value, message
):
    folder = _variant(base, tmp_path, **{field: value})
    _refused(folder, str(folder / "config.json"), field, message)


def test_nested_config_fields_are_named_with_their_path(base, tmp_path, nothing_built):
    folder = _variant(base, tmp_path, text_config={"num_hidden_layers": 10**9})
    _refused(folder, "text_config.num_hidden_layers is 1,000,000,000")


def test_a_billion_layers_exits_2_in_bounded_memory_and_time(base, tmp_path):
    """The reported memory bomb, in a process of its own limited to 6 GiB of address space."""
    folder = _variant(base, tmp_path, num_hidden_layers=10**9)
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
        "from depthscope.analyses.cli import main; sys.argv = sys.argv[1:]; main()"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEPTHSCOPE_PROGRESS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, "depthscope", "info", "--model", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "num_hidden_layers is 1,000,000,000" in done.stderr


def test_sizes_within_the_bounds_but_past_this_machines_memory_are_refused_before_loading(base, tmp_path):
    """64 layers of width 65,536 are about 10^12 parameters: the count comes from a meta-device
    build and is checked against the free memory before transformers reads a weight."""
    folder = _variant(base, tmp_path, num_hidden_layers=64, hidden_size=1 << 16, intermediate_size=1 << 17)
    _refused(folder, "B parameters", "GiB free")
    with pytest.raises(ModelTooLarge):
        loading.load_model(folder)


def test_the_layer_bound_is_the_one_named(base, tmp_path, nothing_built):
    folder = _variant(base, tmp_path, num_hidden_layers=MAX_LAYERS + 1)
    _refused(folder, f"{MAX_LAYERS + 1:,}", f"({MAX_LAYERS:,})")


def _hub(tmp_path, monkeypatch, base, **config) -> str:
    """A hub id in a private local Hugging Face cache whose snapshot is ``base`` with ``config``."""
    import huggingface_hub.constants as hc

    hub = tmp_path / "hub"
    repo = hub / "models--someorg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    shutil.copytree(_variant(base, tmp_path, **config), repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub))
    return "someorg/tiny"


def test_a_cached_hub_id_gets_the_same_checks(base, tmp_path, monkeypatch):
    name = _hub(tmp_path / "lie", monkeypatch, base, num_hidden_layers=10**9)
    _refused(name, "config.json: num_hidden_layers is 1,000,000,000")
    name = _hub(tmp_path / "honest", monkeypatch, base)
    import transformers

    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(base)(ids).logits
        assert torch.equal(loading.load_model(name).hf_model(ids).logits, ref)


# ----------------------------------------------------------------------------- tokenizers
def test_truncated_tokenizer_json_names_the_file_and_line(base, tmp_path):
    folder = _variant(base, tmp_path)
    tj = folder / "tokenizer.json"
    tj.write_text(tj.read_text()[:5000])
    _refused(folder, f"{tj} is not valid JSON", "line ")


def test_tokenizer_json_that_is_not_an_object_is_refused(base, tmp_path):
    folder = _variant(base, tmp_path)
    (folder / "tokenizer.json").write_text("[]")
    _refused(folder, "tokenizer.json must hold a JSON object, got list")


def test_tokenizer_json_of_the_wrong_structure_is_refused(base, tmp_path):
    folder = _variant(base, tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    _refused(folder, f"cannot read the tokenizer in {folder}")


def test_a_folder_without_tokenizer_files_still_loads(base, tmp_path, caplog):
    folder = _variant(base, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        m = loading.load_model(folder)
    assert m.tokenizer is None and "no tokenizer loaded" in caplog.text


def test_a_vocabulary_larger_than_the_embedding_names_the_ids(base, tmp_path, tiny_tokenizer):
    folder = _variant(base, tmp_path)
    tok = type(tiny_tokenizer).from_pretrained(folder)
    tok.add_tokens([f"zzextra{i}" for i in range(5)])
    tok.save_pretrained(folder)
    n = len(tiny_tokenizer)
    _refused(folder, f"5 token(s) past the embedding's {n} rows (ids {n}..{n + 4}: 'zzextra0'")
    hf = make_tiny("llama", vocab_size=n, n_layers=1, d_model=32)  # in memory: the same check
    with pytest.raises(ModelSpecError, match=f"past the embedding's {n} rows"):
        loading.load_model(hf, tokenizer=tok)


def test_a_config_vocabulary_smaller_than_the_tokenizer_is_refused(base, tmp_path, tiny_tokenizer):
    folder = _variant(base, tmp_path, vocab_size=500)
    _refused(folder, f"{len(tiny_tokenizer) - 500} token(s) past the embedding's 500 rows (ids 500..")


def test_weights_of_other_shapes_than_the_config_builds_are_named(base, tmp_path, tiny_tokenizer):
    folder = _variant(base, tmp_path, vocab_size=len(tiny_tokenizer) + 100)
    _refused(folder, f"model.embed_tokens.weight is [{len(tiny_tokenizer)}, 32], the config builds [")
    folder = _variant(base, tmp_path / "w", hidden_size=64)
    _refused(folder, "do not match its config.json", "(and ")


def test_an_honest_folder_loads_and_matches_transformers(base):
    """The checks refuse nothing that is right: the folder's logits are transformers' own."""
    import transformers

    m = loading.load_model(base)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        assert torch.equal(m.hf_model(ids).logits, ref(ids).logits)


# ----------------------------------------------------------------------------- GGUF headers
def _gguf(path: Path, kv: dict) -> Path:
    """A GGUF header with string and uint32 metadata and no tensors."""
    out = [b"GGUF", struct.pack("<IQQ", 3, 0, len(kv))]
    for k, v in kv.items():
        out.append(struct.pack("<Q", len(k)) + k.encode())
        if isinstance(v, str):
            out.append(struct.pack("<IQ", 8, len(v)) + v.encode())
        elif isinstance(v, list):  # an array of strings
            out.append(struct.pack("<IIQ", 9, 8, len(v)) + b"".join(struct.pack("<Q", len(s)) + s.encode() for s in v))
        else:
            out.append(struct.pack("<II", 4, v))
    path.write_bytes(b"".join(out))
    return path


def test_a_gguf_whose_header_asks_for_a_billion_layers_is_refused_before_transformers_reads_it(
    tmp_path, monkeypatch, nothing_built
):
    import transformers

    def boom(*a, **k):
        raise AssertionError("transformers read a GGUF that should have been refused")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    f = _gguf(
        tmp_path / "lie.gguf",
        {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b"], "llama.block_count": 10**9},
    )
    assert gguf_config_sizes(f) == {"num_hidden_layers": 10**9}
    _refused(f, f"the metadata of {f}: num_hidden_layers is 1,000,000,000")


@pytest.mark.slow
def test_gguf_header_sizes_agree_with_transformers_reading_of_the_default_model():
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = loading.default_gguf_path()
    ref = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    got = gguf_config_sizes(path)
    assert got and got == {k: ref[k] for k in got}


# ----------------------------------------------------------------------------- the GGUF cache
@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_tokenizer):
    """A GGUF whose conversion is a tiny Llama (conversions counted), in a private cache."""
    import transformers

    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(256))
    tiny = make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=1, d_model=32)
    conversions = []
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def model_from(path, *a, gguf_file=None, **k):
        if gguf_file is None:
            return real_model(path, *a, **k)
        conversions.append(gguf_file)
        return make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=1, d_model=32)  # same seed: same weights

    def tok_from(path, *a, gguf_file=None, **k):
        return tiny_tokenizer if gguf_file is not None else real_tok(path, *a, **k)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_from)
    return gguf, conversions, tiny


def _cached(gguf: Path) -> Path:
    return loading.cache_dir() / "models" / loading._gguf_cache_key(gguf)


def _corrupt_behind_the_metadata(f: Path, at: int, n: int) -> None:
    """Zero ``n`` bytes of ``f`` at ``at`` in place (same inode, same size), then restore its times."""
    st = f.stat()
    with open(f, "r+b") as h:
        h.seek(at)
        h.write(b"\0" * n)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = f.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


IDS = torch.tensor([[1, 2, 3, 4, 5]])


def _logits(m):
    with torch.no_grad():
        return getattr(m, "hf_model", m)(IDS).logits


@pytest.mark.parametrize("new_process", [False, True], ids=["same-process", "new-process"])
def test_a_cache_corrupted_behind_unchanged_metadata_is_never_served(fake_gguf, caplog, new_process):
    gguf, conversions, tiny = fake_gguf
    loading.load_model(str(gguf))
    served = loading.load_model(str(gguf))
    assert len(conversions) == 1 and torch.equal(_logits(served), _logits(tiny))  # the good cache is served
    st = _cached(gguf) / "model.safetensors"
    _corrupt_behind_the_metadata(st, st.stat().st_size // 2, 4096)
    if new_process:  # a fresh process has verified nothing yet
        stamps.forget_digests()
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        m = loading.load_model(str(gguf))
    assert len(conversions) == 2
    line = next(r.getMessage() for r in caplog.records if "changed since it was written" in r.getMessage())
    assert "(model.safetensors)" in line and str(_cached(gguf)) in line and "\n" not in line
    assert torch.equal(_logits(m), _logits(tiny))
    again = loading.load_model(str(gguf))  # the rebuilt cache is served and right
    assert len(conversions) == 2 and torch.equal(_logits(again), _logits(tiny))


def test_a_cache_that_cannot_be_removed_is_still_not_served(fake_gguf, monkeypatch):
    gguf, conversions, tiny = fake_gguf
    loading.load_model(str(gguf))
    st = _cached(gguf) / "model.safetensors"
    _corrupt_behind_the_metadata(st, st.stat().st_size // 2, 4096)
    monkeypatch.setattr(loading.shutil, "rmtree", lambda *a, **k: None)  # e.g. a read-only cache
    m = loading.load_model(str(gguf))
    assert len(conversions) == 2 and torch.equal(_logits(m), _logits(tiny))


def test_an_unstamped_file_in_the_cache_rebuilds_it(fake_gguf, caplog):
    gguf, conversions, _ = fake_gguf
    loading.load_model(str(gguf))
    (_cached(gguf) / "model.safetensors.index.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        loading.load_model(str(gguf))
    assert len(conversions) == 2 and "(model.safetensors.index.json)" in caplog.text
    assert (_cached(gguf) / STAMPS).is_file() and not (_cached(gguf) / "model.safetensors.index.json").exists()


def test_the_cache_key_covers_the_whole_gguf(tmp_path):
    """Two GGUFs of one size and one first MiB (header and tensor index) get different caches."""
    head = b"GGUF" + os.urandom((1 << 20) + 100)
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for f, tail in ((a, b"\1" * 1000), (b, b"\2" * 1000)):
        f.parent.mkdir()
        f.write_bytes(head + tail)
    assert loading._gguf_cache_key(a) != loading._gguf_cache_key(b)
    shutil.copy(a, tmp_path / "m.gguf")
    assert loading._gguf_cache_key(tmp_path / "m.gguf") == loading._gguf_cache_key(a)


@pytest.mark.slow
def test_the_default_models_cache_corrupted_behind_its_metadata_is_converted_again(
    tmp_path, monkeypatch, default_model
):
    """The reported case: a zeroed block in the default model's conversion, size, mtime and inode
    kept, made it predict ' the' after 'The capital of France is'; now the served model is a fresh
    conversion's, and it predicts ' Paris'."""
    from conftest import copy_default_conversion

    copy_default_conversion(tmp_path)
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path))
    fresh = loading.load_model()
    ids = fresh.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():  # before the corruption: the served weights may map the file
        ref = fresh.hf_model(ids).logits[0, -1].clone()
    del fresh
    st = next((tmp_path / "models").iterdir()) / "model.safetensors"
    _corrupt_behind_the_metadata(st, st.stat().st_size // 3, 8 << 20)
    stamps.forget_digests()  # as in a new process
    m = loading.load_model()
    with torch.no_grad():
        logits = m.hf_model(ids).logits[0, -1]
    assert torch.equal(logits, ref)
    assert m.tokenizer.decode([int(logits.argmax())]) == " Paris"


# ----------------------------------------------------------------------------- config and weights that disagree
def _drop_tensor(folder: Path, name: str) -> None:
    """Rewrite ``folder``'s model.safetensors without the tensor ``name``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_config_with_more_layers_than_the_weights_is_refused(base, tmp_path):
    """transformers would initialise layer 2 at random and only print a load report."""
    folder = _variant(base, tmp_path, num_hidden_layers=3)
    _refused(folder, "not in the checkpoint: model.layers.2.", "num_hidden_layers (3)")


def test_a_config_with_fewer_layers_than_the_weights_is_refused(base, tmp_path):
    """transformers would drop layer 1's tensors as unexpected keys."""
    folder = _variant(base, tmp_path, num_hidden_layers=1)
    _refused(folder, "of layers it does not build: model.layers.1.", "num_hidden_layers (1)")


def test_a_tensor_missing_from_the_weights_is_named(base, tmp_path):
    folder = _variant(base, tmp_path)
    _drop_tensor(folder, "model.layers.1.self_attn.q_proj.weight")
    out = _refused(
        folder, "1 tensor(s) the config builds are not in the checkpoint: model.layers.1.self_attn.q_proj.weight"
    )
    assert "model.layers.0." not in out


def test_a_missing_tensor_in_a_sharded_checkpoint_is_named(base, tmp_path):
    """The names of every shard of the index are read, not only the first file's."""
    from safetensors.torch import load_file, save_file

    folder = _variant(base, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    halves = {"a.safetensors": {}, "b.safetensors": {}}
    for i, (k, t) in enumerate(sorted(tensors.items())):
        halves["b.safetensors" if i % 2 or k == "model.norm.weight" else "a.safetensors"][k] = t
    del halves["b.safetensors"]["model.norm.weight"]
    for f, ts in halves.items():
        save_file(ts, folder / f, metadata={"format": "pt"})
    weight_map = {k: f for f, ts in halves.items() for k in ts}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(folder, "not in the checkpoint: model.norm.weight")
    halves["b.safetensors"]["model.norm.weight"] = tensors["model.norm.weight"]  # complete again: it loads
    save_file(halves["b.safetensors"], folder / "b.safetensors", metadata={"format": "pt"})
    weight_map["model.norm.weight"] = "b.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_logits(loading.load_model(folder)), _logits(loading.load_model(base)))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "bert", "olmo2", "gemma2", "gemma3"])
def test_every_tiny_family_saved_by_transformers_passes_the_name_check(tmp_path, tiny_tokenizer, family):
    """Tied heads (llama, gpt2, bert) and unsaved buffers (rotary inv_freq) are not asked for; a
    dropped tensor of any family is named (the check is live for each, not skipped)."""
    from test_points import make_family

    made = make_family(family, len(tiny_tokenizer), n_layers=2, d_model=32)
    made.save_pretrained(tmp_path / "ok")
    tiny_tokenizer.save_pretrained(tmp_path / "ok")
    m = loading.load_model(tmp_path / "ok")
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        assert torch.equal(m.hf_model(ids).logits, made(ids).logits)
    shutil.copytree(tmp_path / "ok", tmp_path / "bad")
    name = next(n for n, _ in made.named_parameters() if ".1." in n)
    _drop_tensor(tmp_path / "bad", name)
    _refused(tmp_path / "bad", f"not in the checkpoint: {name}")


@pytest.mark.parametrize("field", ["rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -1e-5, 0, "1e-5", True])
def test_a_norm_epsilon_that_is_not_finite_and_positive_is_refused(base, tmp_path, nothing_built, field, value):
    folder = _variant(base, tmp_path, **{field: value})  # json writes inf as Infinity, nan as NaN
    _refused(folder, f"config.json: {field} must be a finite positive number", repr(value))


def test_a_nested_norm_epsilon_is_named_with_its_path(base, tmp_path, nothing_built):
    folder = _variant(base, tmp_path, text_config={"rms_norm_eps": float("inf")})
    _refused(folder, "text_config.rms_norm_eps must be a finite positive number", "got inf;")


@pytest.mark.parametrize("shard", ["../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors", ".."])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(base, tmp_path, shard):
    folder = _variant(base, tmp_path)
    weight_map = {"model.norm.weight": shard, "model.embed_tokens.weight": "model.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _refused(folder, f"names a shard outside {folder}: {shard!r}")
