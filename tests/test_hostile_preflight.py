"""Issue 36, classes 2, 7 and 8: every place written is checked before any compute (a file
there, a read-only place: a clear error naming the option or variable and the path, nothing
created); the tuned lens and its checkpoint are written together (a full disk leaves the
previous ones, or none); a Ray sweep asking for GPUs the cluster lacks is refused before any
task is submitted; the skipped-span note names the context the passages were cut at."""

from __future__ import annotations

import errno
import logging
import os
import types

import pytest

from depthscope.common.errors import OutputError

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
EWT_TRAIN, EWT_TEST = os.path.join(UD, "ewt_tiny_train.conllu"), os.path.join(UD, "ewt_tiny_test.conllu")
TEXTS = ["The cat sat on the mat and looked at the door.", "A dog ran in the park after the ball all day."]


def _read_only(monkeypatch):
    """A read-only mount (as root, chmod does not stop writes: creating the probe file fails)."""
    import depthscope.common.files as files

    def ro(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(files.tempfile, "mkstemp", ro)


# ----------------------------------------------------------------------------- class 2: places
@pytest.mark.parametrize("what", ["--store", "DEPTHSCOPE_CACHE", "--out"])
def test_a_file_where_a_folder_is_wanted_is_named(tmp_path, what):
    from depthscope.common.files import check_writable_dir

    f = tmp_path / "a-file"
    f.write_text("keep me")
    with pytest.raises(OutputError, match=f"{what} {f} is an existing file") as e:
        check_writable_dir(f, what)
    assert f"use another {what}" in str(e.value)
    with pytest.raises(OutputError, match="a part of its path is a file") as e:
        check_writable_dir(f / "sub" / "deeper", what)
    assert what in str(e.value) and str(f / "sub" / "deeper") in str(e.value)
    assert f.read_text() == "keep me"


def test_a_read_only_place_is_named_and_nothing_is_left(tmp_path, monkeypatch):
    from depthscope.common.files import check_writable_dir

    _read_only(monkeypatch)
    target = tmp_path / "new" / "store"
    with pytest.raises(OutputError, match="Read-only file system") as e:
        check_writable_dir(target, "--store")
    assert str(target) in str(e.value) and "use another --store" in str(e.value)
    assert not (tmp_path / "new").exists()  # the folders the check made are removed again


def test_the_store_check_names_store_or_the_cache_variable(tmp_path, monkeypatch):
    from depthscope.analyses.commands.common import prepare_store

    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(OutputError, match="--store"):
        prepare_store(f)
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(f))
    with pytest.raises(OutputError, match="a part of its path is a file; use another DEPTHSCOPE_CACHE") as e:
        prepare_store(None)
    assert str(f / "activations") in str(e.value)
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path / "cache"))
    assert prepare_store(None) == tmp_path / "cache" / "activations"
    assert prepare_store(tmp_path / "s") == tmp_path / "s" and (tmp_path / "s").is_dir()
    _read_only(monkeypatch)
    monkeypatch.setenv("DEPTHSCOPE_CACHE", str(tmp_path / "ro-cache"))
    with pytest.raises(OutputError, match="DEPTHSCOPE_CACHE") as e:
        prepare_store(None)
    assert "Read-only file system" in str(e.value) and not (tmp_path / "ro-cache").exists()


def _lens_files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_full_disk_during_a_lens_save_leaves_no_part(tiny_llama, tmp_path, monkeypatch):
    """A disk that fills while the second file of a save is written: a first save leaves nothing,
    a later one leaves the previous lens and checkpoint byte for byte; no staging folder remains."""
    import depthscope.analyses.lens.lenses as lenses
    from depthscope.analyses.lens.tuned import SAVED_FILES, train_tuned_lens

    out = tmp_path / "lens"
    kw = dict(steps=2, tokens_per_step=4, cache_tokens=32, checkpoint_every=1, progress=False, resume=False)
    real = lenses.save_file
    calls = {"n": 0}

    def fills_up(tensors, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path)

    monkeypatch.setattr(lenses, "save_file", fills_up)
    with pytest.raises(OutputError, match="No space left on device") as e:
        train_tuned_lens(tiny_llama, TEXTS, out=out, **kw)
    assert str(out) in str(e.value) and ".tuned-lens-staging" not in str(e.value)
    assert _lens_files(out) == []

    monkeypatch.setattr(lenses, "save_file", real)
    train_tuned_lens(tiny_llama, TEXTS, out=out, **kw)
    assert _lens_files(out) == sorted(SAVED_FILES)
    before = {n: (out / n).read_bytes() for n in SAVED_FILES}
    calls["n"] = 0
    monkeypatch.setattr(lenses, "save_file", fills_up)
    with pytest.raises(OutputError):
        train_tuned_lens(tiny_llama, TEXTS, out=out, **{**kw, "seed": 1})
    assert {n: (out / n).read_bytes() for n in SAVED_FILES} == before
    assert _lens_files(out) == sorted(SAVED_FILES)


def test_too_little_space_for_the_lens_is_refused_before_the_streams(tiny_llama, tmp_path, monkeypatch):
    import depthscope.analyses.lens.tuned as tl

    def no_compute(*a, **k):
        raise AssertionError("the streams were captured before the space was checked")

    need = tl.saved_bytes(tiny_llama.n_sites, tiny_llama.n_sites - 1, tiny_llama.d_model)
    assert need > 4 * tiny_llama.n_sites * tiny_llama.d_model**2  # the lens alone is smaller
    monkeypatch.setattr(tl, "_cache_streams", no_compute)
    monkeypatch.setattr(tl.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=need - 1))
    with pytest.raises(OutputError, match="MiB free") as e:
        tl.train_tuned_lens(tiny_llama, TEXTS, out=tmp_path / "lens", steps=2, progress=False)
    assert str(tmp_path / "lens") in str(e.value)
    assert not (tmp_path / "lens").exists()


# ----------------------------------------------------------------------------- class 7: Ray resources
@pytest.mark.parametrize(
    "cluster,gpus,match",
    [
        ({"CPU": 4.0}, 1.0, "has no GPU"),
        ({"CPU": 4.0, "GPU": 1.0}, 2.0, "has 1 GPU"),
        ({"GPU": 1.0}, 0.0, "no CPU"),
    ],
)
def test_resources_the_cluster_lacks_are_refused(cluster, gpus, match):
    from depthscope.analyses.sweeps.ray_engine import RayUnavailable, check_resources

    with pytest.raises(RayUnavailable, match=match):
        check_resources(cluster, gpus)


def test_resources_the_cluster_has_pass():
    from depthscope.analyses.sweeps.ray_engine import check_resources

    check_resources({"CPU": 1.0}, 0.0)
    check_resources({"CPU": 2.0, "GPU": 1.0}, 0.5)
    check_resources({"CPU": 2.0, "GPU": 2.0}, 2.0)


def test_a_gpu_sweep_on_a_cluster_without_gpus_submits_nothing(monkeypatch):
    """The check runs on the cluster's own resources, before a single task is submitted."""
    import depthscope.analyses.sweeps.ray_engine as sr

    def never(*a, **k):
        raise AssertionError("a task was submitted to a cluster that cannot run it")

    fake = types.SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {"CPU": 8.0}, remote=never)
    monkeypatch.setattr(sr, "require_ray", lambda: fake)
    engine = sr.RayEngine(gpus_per_task=1.0)
    with pytest.raises(sr.RayUnavailable, match="--gpus-per-task 1: .* has no GPU"):
        engine.run([types.SimpleNamespace(name="ck")], never, None, False, progress=False)


# ----------------------------------------------------------------------------- class 8: the note's context
def test_the_skipped_span_note_names_the_models_context(tiny_tokenizer, tmp_path, caplog):
    """A 16-token model with the default max_tokens (512): passages are cut at 16 tokens, and the
    note says so."""
    import transformers as tf

    from depthscope.hooks import load_model
    from depthscope.probes import run_probes

    cfg = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        vocab_size=len(tiny_tokenizer),
    )
    m = load_model(tf.LlamaForCausalLM(cfg).eval(), tokenizer=tiny_tokenizer)
    assert m.max_context == 16
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        res = run_probes(
            m,
            "upos",
            EWT_TRAIN,
            EWT_TEST,
            max_train_sentences=3,
            max_test_sentences=5,
            max_epochs=2,
            control=False,
            cumulative=False,
            progress=False,
            store_dir=str(tmp_path),
        )
    assert res.summary.iloc[0]["n_skipped_train"] > 0
    assert "16-token context" in caplog.text and "512-token context" not in caplog.text


def test_a_store_lock_that_cannot_be_taken_names_the_store_option(tmp_path):
    """A directory where the store's lock file goes: the message points at --store / DEPTHSCOPE_CACHE, not --out."""
    from depthscope.common.errors import OutputError
    from depthscope.probes.store.activations import _claim

    (tmp_path / ".k.lock").mkdir()
    with pytest.raises(OutputError, match=r"use another --store \(or DEPTHSCOPE_CACHE\)"):
        _claim(tmp_path, "k")
