"""Class 6 of issue 15: data are validated before the model loads, and dropped data are announced
on the console (spans no subword covers or past the context, labels unseen in training), not only
counted in a summary column."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from depthscope.analyses.cli import app
from depthscope.common.errors import InputError

UD = os.path.join(os.path.dirname(__file__), "fixtures", "ud")
EWT_TRAIN, EWT_TEST = os.path.join(UD, "ewt_tiny_train.conllu"), os.path.join(UD, "ewt_tiny_test.conllu")
FAST = dict(max_epochs=5, control=False, cumulative=False, progress=False)


@pytest.fixture
def no_model(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the data were checked")

    monkeypatch.setattr("depthscope.probes.store.extraction.resolve_model", boom)
    monkeypatch.setattr("depthscope.hooks.load_model", boom)


@pytest.mark.parametrize(
    "content,match",
    [
        ("1\tThe\tthe\tDET\n", "CoNLL-U|column|fields"),  # a token line with too few columns
        ("", "holds no CoNLL-U sentences"),
    ],
)
def test_bad_data_fail_before_the_model_loads(tmp_path, no_model, content, match):
    from depthscope.probes import run_probes

    bad = tmp_path / "bad.conllu"
    bad.write_text(content)
    with pytest.raises(InputError, match=match):
        run_probes("some-model-spec", "upos", str(bad), EWT_TEST, **FAST)


def test_a_task_the_data_lack_fails_before_the_model_loads(no_model):
    from depthscope.probes import run_probes

    with pytest.raises(InputError):
        run_probes("some-model-spec", "entity", EWT_TRAIN, EWT_TEST, **FAST)


def test_cli_missing_data_file_is_refused_before_the_model_loads(tmp_path, no_model):
    r = CliRunner().invoke(app, ["probe", "--train", str(tmp_path / "nope.conllu"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no such file" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_skipped_spans_and_unseen_labels_are_announced(tiny_factory, tmp_path, caplog):
    from depthscope.probes import run_probes

    m = tiny_factory("llama", n_layers=1, d_model=32)
    with caplog.at_level(logging.WARNING, logger="depthscope"):
        res = run_probes(
            m,
            "upos",
            EWT_TRAIN,
            EWT_TEST,
            max_train_sentences=3,
            max_test_sentences=20,
            max_tokens=12,
            store_dir=str(tmp_path),
            **FAST,
        )
    s = res.summary.iloc[0]
    assert s["n_skipped_train"] > 0 and s["n_test_unseen_labels"] > 0
    text = caplog.text
    assert f"{s['n_skipped_train']} of {s['n_skipped_train'] + s['n_train']} train" in text
    assert f"{s['n_skipped_test']} of" in text and "test spans skipped" in text and "12-token context" in text
    assert f"{s['n_test_unseen_labels']} test example(s) carry" in text and "unseen in train" in text


def test_nothing_is_announced_when_nothing_is_dropped():
    import numpy as np

    from depthscope.probes.run import dropped_note

    class TD:
        task, n_classes = "upos", 2
        skipped = {"train": 0, "test": 0}
        y = {"test": np.array([0, 1])}

    assert dropped_note(TD, 512) is None


def test_cli_prints_the_announcement(tiny_factory, tiny_tokenizer, tmp_path):
    m = tiny_factory("llama", n_layers=1, d_model=32)
    folder = tmp_path / "tiny"
    m.hf_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    args = ["probe", "--task", "upos", "--train", EWT_TRAIN, "--test", EWT_TEST, "--model", str(folder)]
    args += ["--max-train-sentences", "3", "--max-test-sentences", "20", "--max-epochs", "5", "--no-plots"]
    args += ["--store", str(tmp_path / "st"), "--out", str(tmp_path / "out")]
    code = "import sys; from depthscope.analyses.cli import main; sys.argv = sys.argv[1:]; main()"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEPTHSCOPE_PROGRESS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, "depthscope", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "unseen in train" in done.stderr and "task 'upos'" in done.stderr
