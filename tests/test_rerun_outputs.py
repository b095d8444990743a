"""A rerun into the same output folder without the option that made an optional output: that
output (table and figure) goes, so no figure or table outlives the run it came from (issue 68,
item 2: ``norms`` without ``--heads``, ``lens`` without ``--tuned``; ``layers`` writes the same
files whatever its settings)."""

from __future__ import annotations

import pytest

from depthscope.analyses import LensConfig, TextWindows, TunedLens
from depthscope.analyses.jobs import Output
from depthscope.analyses.jobs.configs import LayersConfig, NormsConfig
from depthscope.analyses.jobs.layers import layers_job
from depthscope.analyses.jobs.lens import lens_job
from depthscope.analyses.jobs.norms import norms_job

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = ["The cat sat on the mat and looked at the dog.", "When Mary and John went to the store, John gave"]


def _names(folder) -> set[str]:
    return {p.name for p in folder.iterdir() if not p.name.startswith(".")}


def test_norms_without_heads_removes_the_head_writes_of_an_earlier_run(tiny_llama, tmp_path):
    out = tmp_path / "norms"
    text = TextWindows(max_tokens=40)
    norms_job(tiny_llama, DOCS, NormsConfig(heads=True, text=text), Output(out))
    heads = {"head_writes.parquet", "head_writes.csv", "norms_head_writes.png", "norms_head_writes.svg"}
    assert heads <= _names(out)
    res = norms_job(tiny_llama, DOCS, NormsConfig(heads=False, text=text), Output(out))
    assert not heads & _names(out)
    assert "dla.parquet" in _names(out) and "norms_dla.png" in _names(out)  # what this run wrote stays
    assert {p.name for p in res.files} <= _names(out)


def test_lens_without_tuned_removes_the_tuned_lens_figures_of_an_earlier_run(tiny_llama, tmp_path):
    lens = TunedLens.identity(tiny_llama)
    lens.save(tmp_path / "lens")
    out = tmp_path / "lens_out"
    text = TextWindows(max_tokens=40)
    lens_job(tiny_llama, DOCS, LensConfig(tuned=tmp_path / "lens", text=text), Output(out))
    tuned = {f"{n}_tuned.{x}" for n in ("lens_top1_heatmap", "lens_rank_trajectory") for x in ("png", "svg")}
    assert tuned <= _names(out)
    lens_job(tiny_llama, DOCS, LensConfig(text=text), Output(out))
    assert not tuned & _names(out)
    assert "lens_top1_heatmap.png" in _names(out)


def test_layers_writes_the_same_files_whatever_its_settings(tiny_llama, tmp_path):
    out = tmp_path / "layers"
    first = layers_job(tiny_llama, DOCS, LayersConfig(text=TextWindows(max_tokens=40)), Output(out))
    names = _names(out)
    second = layers_job(tiny_llama, DOCS[:1], LayersConfig(batch_size=1, text=TextWindows(max_tokens=20)), Output(out))
    assert {p.name for p in first.files} == {p.name for p in second.files} and _names(out) == names
