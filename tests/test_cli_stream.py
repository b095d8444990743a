"""``--stream`` on the commands whose work is forward-only: the option reaches the model loader (the
model is streamed), and ``depthscope lens --stream`` writes the same lens table as the run without it."""

from __future__ import annotations

import os

import pandas as pd
import pytest
from conftest import run_cli

SAMPLE = os.path.join(os.path.dirname(__file__), "fixtures", "lens", "ewt_sample.txt")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lens_stream_gives_the_same_table(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from depthscope.analyses.commands import common

    load, streamed = common.load, []

    def spy(*a, **k):
        m = load(*a, **k)
        streamed.append(m.streamed)
        return m

    monkeypatch.setattr(common, "load", spy)
    tables = {}
    for flag in ("--no-stream", "--stream"):
        out = tmp_path / flag.strip("-")
        args = ["lens", "--text", SAMPLE, "--model", tiny_llama_dir, "--out", out, "--max-tokens", "40", flag]
        code, stdout, err = run_cli(args, monkeypatch, capsys)
        assert code == 0, err
        assert f"wrote {out / 'lens_by_site.parquet'}" in stdout
        tables[flag] = pd.read_parquet(out / "lens_by_site.parquet")
    assert streamed == [False, True]  # the flag reached the loader: the second model read its blocks from disk
    assert len(tables["--stream"]) > 0
    assert tables["--stream"].equals(tables["--no-stream"])


def test_stream_is_offered_where_the_work_is_forward_only():
    import typer

    from depthscope.analyses.cli import app

    group = typer.main.get_command(app)
    forward = {"lens", "norms", "cache", "probe", "run", "causal", "layers", "patch", "info"}
    offered = {name for name, c in group.commands.items() if any(p.name == "stream" for p in c.params)}
    assert offered == forward  # not lens-train, localize, circuit, sae train: they need gradients
