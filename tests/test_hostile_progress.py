"""Class 4 of issue 15: long work shows progress (a bar with an ETA on a terminal, plain lines in logs
and CI: tests/test_progress_log.py, nothing with DEPTHSCOPE_PROGRESS=0) and inputs large in one
dimension are handled in linear time or refused with a stated bound."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest

from depthscope.common import progress


@pytest.mark.parametrize(
    "env,tty,shown",
    [
        ({}, False, False),
        ({}, True, True),
        ({"CI": "1"}, True, False),
        ({"DEPTHSCOPE_PROGRESS": "1", "CI": "1"}, False, True),
        ({"DEPTHSCOPE_PROGRESS": "0"}, True, False),
    ],
)
def test_bars_only_on_a_terminal(monkeypatch, env, tty, shown):
    for k in ("CI", "DEPTHSCOPE_PROGRESS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: tty, raising=False)
    assert progress.bars_enabled() is shown


LONG = " ".join(["The capital of France is Paris. The cat sat on the mat."] * 150)  # one long line


def test_lens_shows_a_bar_with_eta_on_a_terminal_and_nothing_when_off(tiny_factory, tmp_path, monkeypatch, capfd):
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.configs import LensConfig
    from depthscope.analyses.jobs.lens import lens_job

    m = tiny_factory("llama", n_layers=1, d_model=32)
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "0")
    lens_job(m, [LONG], LensConfig(progress=True), Output(None))
    assert capfd.readouterr().err == ""
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "1")
    res = lens_job(m, [LONG], LensConfig(progress=True), Output(None))
    err = capfd.readouterr().err
    n = res.summary["n_positions"]
    assert "logit lens" in err and f"/{n}" in err and "<" in err  # a total, and tqdm's [elapsed<eta]


def test_a_long_single_line_is_tokenized_once_per_stage_and_every_token_is_used(tiny_factory, monkeypatch):
    """The 54k-token line: tokenized a bounded number of times (not per window), each token
    decoded once; the windows cover it with no token dropped or repeated."""
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.configs import LensConfig, TextWindows
    from depthscope.analyses.jobs.lens import lens_job

    m = tiny_factory("llama", n_layers=1, d_model=32)
    calls = []
    tok = m.tokenizer
    real = type(tok).__call__

    def counting(self, text, *a, **k):
        calls.append(len(text) if isinstance(text, str) else sum(len(t) for t in text))
        return real(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", counting)
    res = lens_job(m, [LONG], LensConfig(text=TextWindows(window=64)), Output(None))
    n_tokens = len(real(tok, LONG)["input_ids"])
    assert res.summary["n_positions"] == n_tokens + -(-n_tokens // 63)  # a BOS and 63 tokens per window
    assert sum(c >= len(LONG) for c in calls) <= 2  # counting + windowing: not once per window
    assert "split into" in res.summary["split_note"]


def test_top_k_builds_its_columns_at_once_and_is_bounded_by_the_vocabulary(tiny_factory):
    from depthscope.analyses.lens.logit import logit_lens_tokens

    m = tiny_factory("llama", n_layers=1, d_model=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.PerformanceWarning)  # raised by column-at-a-time inserts
        df = logit_lens_tokens(m, "The capital of France is", k=m.vocab_size + 500)
    k = m.vocab_size
    assert f"top{k}_prob" in df.columns and f"top{k + 1}_prob" not in df.columns
    assert (df[[f"top{i}_prob" for i in (1, 2, k)]].diff(axis=1).iloc[:, 1:] <= 1e-12).all().all()
    assert df["top1_token"].iloc[0] == m.tokenizer.decode([int(df["top1_id"].iloc[0])])


def test_stages_use_the_one_progress_helper():
    """No module draws its own tqdm bar: one rule decides when bars appear."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    own = [
        str(p.relative_to(root))
        for d in ("hooks", "probes", "analyses")
        for p in (root / d).rglob("*.py")
        if "from tqdm" in p.read_text() and p.name != "progress.py"
    ]
    assert own == []
