"""Class 1 of issue 15: the output destination is checked before any compute, and a full or
read-only disk is a clear error naming the path, with no partial file left."""

from __future__ import annotations

import errno
import os

import pandas as pd
import pytest
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.common.errors import OutputError
from depthscope.common.files import atomic_write

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "lens", "ewt_sample.txt")
runner = CliRunner()


def _no_model(monkeypatch):
    """Loading a model fails loudly: the checks must come before it."""
    from depthscope.analyses.commands import common

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(common, "load", boom)
    monkeypatch.setattr("depthscope.hooks.load_model", boom)


COMMANDS = {
    "lens": ["lens", "--text", TEXT],
    "norms": ["norms", "--text", TEXT],
    "patch": ["patch"],
    "probe": ["probe"],
    "run": ["run"],
    "lens-train": ["lens-train", "--text", TEXT],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_out_naming_an_existing_file_is_refused_before_the_model_loads(command, tmp_path, monkeypatch):
    _no_model(monkeypatch)
    f = tmp_path / "a-file"
    f.write_text("keep me")
    r = runner.invoke(app, [*COMMANDS[command], "--out", str(f)])
    assert r.exit_code == 1, r.output
    assert "is an existing file" in r.output and str(f) in r.output
    assert "Traceback" not in r.output
    assert f.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unwritable_out_is_refused_before_the_model_loads(command, tmp_path, monkeypatch):
    _no_model(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = runner.invoke(app, [*COMMANDS[command], "--out", str(ro / "sub")])
        assert r.exit_code == 1, r.output
        assert "cannot write" in r.output and str(ro / "sub") in r.output
        assert not (ro / "sub").exists()
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_read_only_file_system_is_refused_before_the_model_loads(command, tmp_path, monkeypatch):
    """A read-only mount (as root, chmod does not stop writes: the probe file's creation is made to fail)."""
    import depthscope.common.files as files

    _no_model(monkeypatch)

    def ro(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(files.tempfile, "mkstemp", ro)
    r = runner.invoke(app, [*COMMANDS[command], "--out", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert f"cannot write {tmp_path / 'out'}: Read-only file system" in r.output
    assert "Traceback" not in r.output


def test_folder_of_another_run_is_refused_unless_forced(tmp_path, monkeypatch):
    from depthscope.analyses.jobs.base import prepare_output

    def claim(folder, *a, **k):  # a run that writes a table
        c = prepare_output(folder, *a, **k)
        (folder / f"{a[0]}.csv").write_text("x\n1\n")
        c.release()

    out = tmp_path / "out"
    claim(out, "lens", {"model": "a", "text": "t"})
    claim(out, "lens", {"model": "a", "text": "t"})  # the same run again: fine
    claim(out, "norms", {"model": "b", "text": "t"})  # another command's names: fine
    with pytest.raises(OutputError, match="another depthscope lens"):
        prepare_output(out, "lens", {"model": "b", "text": "t"})
    claim(out, "lens", {"model": "b", "text": "t"}, force=True)
    report = tmp_path / "report"
    claim(report, "run")
    with pytest.raises(OutputError, match="holds a depthscope run"):
        prepare_output(report, "lens", {"model": "a"})
    _no_model(monkeypatch)
    r = runner.invoke(app, ["lens", "--text", TEXT, "--out", str(report)])
    assert r.exit_code == 1 and "holds a depthscope run" in r.output and "--force" in r.output


def test_a_failed_run_leaves_no_folder_behind(tmp_path):
    from depthscope.analyses.jobs.base import prepare_output

    new = tmp_path / "new"
    prepare_output(new, "lens", {"model": "a"}).release()  # nothing written: tidied away
    assert not new.exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "mine.txt").write_text("keep")
    prepare_output(old, "lens", {"model": "a"}).release()
    assert sorted(p.name for p in old.iterdir()) == [".depthscope.json", ".depthscope.lock", "mine.txt"]


def _full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_names_the_path_and_leaves_no_partial_file(tmp_path, monkeypatch):
    old = tmp_path / "t.csv"
    old.write_text("a\n1\n")
    monkeypatch.setattr(pd.DataFrame, "to_csv", _full_disk)
    with pytest.raises(OutputError, match=r"cannot write .*t\.csv: No space left on device"):
        atomic_write(old, lambda t: pd.DataFrame({"a": [2]}).to_csv(t))
    assert old.read_text() == "a\n1\n"  # the table already written stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]  # no temporary left


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.EDQUOT])
def test_read_only_and_permission_errors_are_output_errors(tmp_path, err):
    def write(t):
        raise OSError(err, os.strerror(err))

    with pytest.raises(OutputError, match=str(tmp_path / "x.json")):
        atomic_write(tmp_path / "x.json", write)
    assert list(tmp_path.iterdir()) == []


def test_a_data_error_inside_the_writer_stays_what_it_is(tmp_path):
    with pytest.raises(ZeroDivisionError):
        atomic_write(tmp_path / "x", lambda t: 1 / 0)
    assert list(tmp_path.iterdir()) == []


def test_cli_disk_full_exits_1_without_traceback_and_earlier_tables_stay_whole(
    tiny_factory, tiny_tokenizer, tmp_path, monkeypatch
):
    """The norms command writes several tables; the disk fills up at the third file."""
    m = tiny_factory("llama", n_layers=1, d_model=32)
    folder = tmp_path / "tiny"
    m.hf_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    import depthscope.common.files as files

    real, calls = files.atomic_write, []

    def filling(path, write):
        calls.append(path)
        if len(calls) == 4:  # after norms_by_site.{parquet,csv} and one more file
            return real(path, _full_disk)
        return real(path, write)

    monkeypatch.setattr(files, "atomic_write", filling)
    monkeypatch.setattr("depthscope.analyses.tables.atomic_write", filling)
    r = runner.invoke(app, ["norms", "--text", TEXT, "--model", str(folder), "--max-tokens", "64", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert "No space left on device" in r.output and str(calls[3]) in r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    written = pd.read_csv(out / "norms_by_site.csv")  # whole, readable
    assert len(written) > 0
    assert not calls[3].exists()


def test_activation_store_on_a_full_disk_is_an_output_error_not_a_crash(tiny_factory, tmp_path, monkeypatch):
    """The store is a memmap: writing one on a full disk would die of SIGBUS. Its blocks are
    reserved first, so a full disk is an OutputError naming the store, and nothing is left."""
    import numpy as np

    from depthscope.probes.corpora.conllu import read_conllu
    from depthscope.probes.corpora.spans import SpanTable, build_passages, map_spans, tokenize_passages
    from depthscope.probes.store.activations import extract_spans

    m = tiny_factory("llama", n_layers=1, d_model=32)
    c = read_conllu(os.path.join(os.path.dirname(__file__), "fixtures", "ud", "ewt_tiny_test.conllu"), max_sentences=3)
    passages, _ = build_passages(c.sentences, "sentence")
    tok = tokenize_passages(m.tokenizer, [p.text for p in passages], max_tokens=64)
    rows = [(si, w.start, w.end) for si, s in enumerate(c.sentences) for w in s.words]
    table = map_spans(tok, SpanTable(*(np.array(v, dtype=np.int64) for v in zip(*rows))))
    monkeypatch.setattr(os, "posix_fallocate", _full_disk)
    with pytest.raises(
        OutputError,
        match=rf"cannot write {tmp_path}/\w+: No space left on device \(free some space or use another --store\)",
    ):
        extract_spans(m, tok, table, store_dir=tmp_path, progress=False)
    assert [p for p in tmp_path.iterdir() if p.suffix != ".lock"] == []
