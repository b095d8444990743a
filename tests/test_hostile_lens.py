"""The tuned lens under hostile conditions: a corrupted checkpoint is never resumed, a non-finite
training loss stops training, a corrupted or NaN lens file is refused at load (exit 2 from the
CLI), and a disk that fills while the lens is saved is a clear OutputError (exit 1) with nothing
partial left."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import run_cli
from safetensors import SafetensorError

from depthscope.analyses import TunedLens, train_tuned_lens
from depthscope.analyses.lens import lenses as L
from depthscope.analyses.lens import tuned as T
from depthscope.common.errors import CheckpointError, NonFiniteActivationError, OutputError
from depthscope.common.files import is_place_error, output_error

SAMPLE = os.path.join(os.path.dirname(__file__), "fixtures", "lens", "ewt_sample.txt")
TEXTS = ["The capital of France is Paris.", "Hello world, this is a longer second sentence with more words."]
KW = dict(tokens_per_step=5, progress=False, matmul_dtype="float32")
DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"

pytestmark = pytest.mark.usefixtures("one_thread")


def _train_args(model_dir, out, steps):
    return ["lens-train", "--text", SAMPLE, "--model", model_dir, "--out", out, "--steps", steps]


def _corrupt(path, start=100_000, stop=150_000):
    """Overwrite bytes ``start..stop`` of ``path`` with random bytes: same size, same mtime."""
    st = os.stat(path)
    assert st.st_size > stop
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(
            torch.randint(0, 256, (stop - start,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
            .numpy()
            .tobytes()
        )
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ----------------------------------------------------------------------------- F1: checkpoints
def test_corrupt_checkpoint_is_not_resumed(tiny_llama, tmp_path, caplog):
    out = tmp_path / "run"
    train_tuned_lens(tiny_llama, TEXTS, steps=3, out=out, **KW)
    ckpt = out / T.CKPT_FILE
    meta = json.loads((out / T.CKPT_META).read_text())
    from depthscope.common.stamps import file_sha256

    assert meta["checkpoint_sha256"] == file_sha256(ckpt)
    _corrupt(ckpt)
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        got = train_tuned_lens(tiny_llama, TEXTS, steps=6, out=out, **KW)
    assert str(ckpt) in caplog.text and "afresh" in caplog.text
    fresh = train_tuned_lens(tiny_llama, TEXTS, steps=6, **KW)  # what starting afresh gives
    assert torch.isfinite(got.weight).all() and torch.isfinite(got.bias).all()
    torch.testing.assert_close(got.weight, fresh.weight, rtol=1e-5, atol=1e-7)
    assert got.training["loss"] == pytest.approx(fresh.training["loss"], rel=1e-5)
    assert len(got.training["loss"]) == 6


def test_old_checkpoint_with_nan_is_not_resumed(tiny_llama, tmp_path, caplog):
    """A checkpoint with no recorded digest (an older version's) is still checked for NaN/inf."""
    out = tmp_path / "run"
    train_tuned_lens(tiny_llama, TEXTS, steps=2, out=out, **KW)
    t = L.load_tensors(out / T.CKPT_FILE)
    t["A"][0, 0, 0] = float("nan")
    L.save_tensors(out / T.CKPT_FILE, t)
    meta = json.loads((out / T.CKPT_META).read_text())
    del meta["checkpoint_sha256"]
    L.write_json(out / T.CKPT_META, meta)
    with caplog.at_level(logging.WARNING, logger=T.__name__):
        got = train_tuned_lens(tiny_llama, TEXTS, steps=3, out=out, **KW)
    assert "NaN or inf" in caplog.text and len(got.training["loss"]) == 3
    assert torch.isfinite(got.weight).all()


def test_non_finite_loss_stops_training(tiny_llama, tmp_path, monkeypatch):
    real = T._kl_and_grads
    calls = []

    def nan_at_third(*a):
        kl, gA, gc = real(*a)
        calls.append(1)
        return (kl * float("nan"), gA, gc) if len(calls) == 3 else (kl, gA, gc)

    monkeypatch.setattr(T, "_kl_and_grads", nan_at_third)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteActivationError, match="loss is NaN or inf at step 3"):
        train_tuned_lens(tiny_llama, TEXTS, steps=5, checkpoint_every=1, out=out, **KW)
    assert json.loads((out / T.CKPT_META).read_text())["step"] == 2  # the last good checkpoint
    back = TunedLens.load(out, tiny_llama)
    assert torch.isfinite(back.weight).all() and back.training["steps_done"] == 2


def test_cli_resume_from_corrupt_checkpoint(tiny_llama_dir, tmp_path, monkeypatch, capsys, caplog):
    out = tmp_path / "tl"
    code, _, se = run_cli(_train_args(tiny_llama_dir, out, 3), monkeypatch, capsys)
    assert code == 0, se
    _corrupt(out / T.CKPT_FILE)
    code, so, se = run_cli(_train_args(tiny_llama_dir, out, 5), monkeypatch, capsys)
    assert code == 0, se
    assert str(out / T.CKPT_FILE) in caplog.text and "afresh" in caplog.text  # the CLI logs to stderr
    assert "nan" not in so.lower() and "tuned lens 0.000" not in so
    lens = TunedLens.load(out)
    assert torch.isfinite(lens.weight).all() and lens.training["steps_done"] == 5
    assert len(lens.training["loss"]) == 5


# ----------------------------------------------------------------------------- F2: lens files
def test_corrupt_or_nan_lens_is_refused(tiny_llama, tmp_path):
    d = tmp_path / "lens"
    lens = train_tuned_lens(tiny_llama, TEXTS, steps=2, out=d, **KW)
    params = d / L.PARAMS_FILE
    st = os.stat(params)
    _corrupt(params, 1000, 2000)
    with pytest.raises(CheckpointError, match="does not match the digest") as e:
        TunedLens.load(d, tiny_llama)
    assert str(params) in str(e.value)
    # a lens of an older version records no digest: still loadable
    lens.save(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / L.META_FILE).read_text())
    del meta["params_sha256"]
    L.write_json(tmp_path / "old" / L.META_FILE, meta)
    torch.testing.assert_close(TunedLens.load(tmp_path / "old", tiny_llama).weight, lens.weight)
    # NaN or inf weights are refused, digest or none
    bad = TunedLens.identity(tiny_llama)
    bad.bias[1, 3] = float("inf")
    bad.save(tmp_path / "inf")
    with pytest.raises(CheckpointError, match="NaN or inf"):
        TunedLens.load(tmp_path / "inf", tiny_llama)
    assert st.st_size == os.stat(params).st_size


def test_cli_lens_refuses_corrupt_tuned_lens(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    lens_dir = tmp_path / "tl"
    code, _, se = run_cli(_train_args(tiny_llama_dir, lens_dir, 2), monkeypatch, capsys)
    assert code == 0, se
    _corrupt(lens_dir / L.PARAMS_FILE, 1000, 2000)
    args = ["lens", "--text", SAMPLE, "--model", tiny_llama_dir, "--out", tmp_path / "o", "--tuned", lens_dir]
    code, _, se = run_cli([*args, "--max-tokens", "20"], monkeypatch, capsys)
    assert code == 2 and str(lens_dir / L.PARAMS_FILE) in se and "Traceback" not in se


# ----------------------------------------------------------------------------- F3: a full disk
def test_safetensors_io_error_is_a_place_error(tmp_path):
    e = SafetensorError(DISK_FULL)
    assert is_place_error(e)
    msg = str(output_error(tmp_path / "x", e))
    assert "No space left on device" in msg and "free some space or use another --out" in msg
    assert not is_place_error(SafetensorError("Error while deserializing header: HeaderTooLarge"))


def _full_disk(tensors, filename, *a, **k):
    """safetensors' save_file as on a full disk: a partial write, then its I/O error."""
    with open(filename, "wb") as f:
        f.write(b"partial")
    raise SafetensorError(DISK_FULL)


def test_save_tensors_on_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "save_file", _full_disk)
    with pytest.raises(OutputError, match="free some space or use another --out") as e:
        L.save_tensors(tmp_path / "t.safetensors", {"x": torch.zeros(2)})
    assert str(tmp_path / "t.safetensors") in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_cli_disk_full_while_saving(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(L, "save_file", _full_disk)
    out = tmp_path / "tl"
    code, _, se = run_cli(_train_args(tiny_llama_dir, out, 2), monkeypatch, capsys)
    assert code == 1, se
    assert "Traceback" not in se and "SafetensorError" not in se
    assert f"cannot write {out}" in se and "free some space or use another --out" in se
    left = [p.name for p in out.rglob("*")] if out.exists() else []
    assert not [n for n in left if "tuned_lens" in n or "checkpoint" in n or n.endswith(".tmp")], left
