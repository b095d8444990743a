"""Class 5 of issue 15: killed runs leave nothing that hurts. Temporary folders of a killed
extraction are removed by the next one; two processes writing one --out do not both work (the
second is refused with a message naming the first), and two extracting one activation store
wait for each other (the second reuses the first's store). Locks are ``flock``s: a killed
process never leaves one behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.common.errors import OutputError
from depthscope.common.files import FolderLock

TEXT = os.path.join(os.path.dirname(__file__), "fixtures", "lens", "ewt_sample.txt")
EWT_TEST = os.path.join(os.path.dirname(__file__), "fixtures", "ud", "ewt_tiny_test.conllu")

HOLD = """
import sys, time
from depthscope.common.files import FolderLock
FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder():
    """holder(path): a child process holding the lock file ``path`` until killed."""
    procs = []

    def start(path):
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_second_writer_of_one_out_is_refused_and_a_killed_one_leaves_no_lock(holder, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    p = holder(out / ".depthscope.lock")

    def boom(*a, **k):
        raise AssertionError("the model was loaded while another process writes --out")

    monkeypatch.setattr("depthscope.analyses.commands.common.load", boom)
    r = CliRunner().invoke(app, ["lens", "--text", TEXT, "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert f"another depthscope process (pid {p.pid}) is writing into {out}" in r.output
    assert "Traceback" not in r.output
    assert sorted(x.name for x in out.iterdir()) == [".depthscope.lock"]  # nothing written
    p.send_signal(signal.SIGKILL)
    p.wait()
    FolderLock(out / ".depthscope.lock").acquire().release()  # the kernel dropped it


def _word_table(model):
    from depthscope.probes.corpora.conllu import read_conllu
    from depthscope.probes.corpora.spans import SpanTable, build_passages, map_spans, tokenize_passages

    c = read_conllu(EWT_TEST, max_sentences=4)
    passages, _ = build_passages(c.sentences, "sentence")
    tok = tokenize_passages(model.tokenizer, [p.text for p in passages], max_tokens=64)
    rows = [(si, w.start, w.end) for si, s in enumerate(c.sentences) for w in s.words]
    p, cs, ce = (np.array(v, dtype=np.int64) for v in zip(*rows))
    return tok, map_spans(tok, SpanTable(p, cs, ce))


def test_killed_extraction_temporaries_are_removed(tiny_factory, tmp_path):
    from depthscope.probes.store.activations import extract_spans

    m = tiny_factory("llama", n_layers=1, d_model=32)
    tok, table = _word_table(m)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    stale = tmp_path / f".0123456789abcdef.tmp{dead.pid}"
    (stale / "feats.bin").parent.mkdir()
    (stale / "feats.bin").write_bytes(b"\0" * 1000)
    live = tmp_path / f".fedcba9876543210.tmp{os.getpid()}"  # a live process's: kept
    live.mkdir()
    store = extract_spans(m, tok, table, store_dir=tmp_path, progress=False)
    assert not stale.exists() and live.exists()
    assert not store.reused and [p.name for p in tmp_path.glob(".*.tmp*")] == [live.name]


def test_two_extractions_of_one_store_wait_and_reuse(tiny_factory, tmp_path, monkeypatch, caplog):
    """A process holds the key's lock; our extraction waits (saying so), and when the holder
    'finishes' (its complete store appears, then it dies) ours reuses the store, no forward pass."""
    import depthscope.probes.store.activations as act

    m = tiny_factory("llama", n_layers=1, d_model=32)
    tok, table = _word_table(m)
    first = act.extract_spans(m, tok, table, store_dir=tmp_path / "a", progress=False)
    key = first.path.name
    store = tmp_path / "b"
    store.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(store / f".{key}.lock")], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"

    def finish():
        time.sleep(1.0)
        import shutil

        shutil.copytree(first.path, store / key)
        p.kill()

    t = threading.Thread(target=finish)
    t.start()
    forwards = []
    monkeypatch.setattr(type(m), "residual_stream", lambda *a, **k: forwards.append(1))
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        got = act.extract_spans(m, tok, table, store_dir=store, progress=False)
    t.join()
    p.wait()
    assert "another process is extracting the same activations" in caplog.text
    assert got.reused and forwards == []
    assert np.array_equal(np.asarray(got.feats), np.asarray(first.feats))


def test_lock_refuses_then_frees(tmp_path):
    lock = FolderLock(tmp_path / ".depthscope.lock", "into the folder").acquire()
    with pytest.raises(OutputError, match=rf"pid {os.getpid()}\) is writing into the folder"):
        FolderLock(tmp_path / ".depthscope.lock", "into the folder").acquire()
    lock.release()
    FolderLock(tmp_path / ".depthscope.lock").acquire().release()
