"""Issue 57, item 7: ``--sites`` naming no residual site is a clear error (SiteError, an InputError:
exit code 2 on the command line, no traceback) naming the site and what is allowed; a name no
model has is refused before the model loads, a layer past the model's right after it loads,
before any extraction."""

from __future__ import annotations

import pytest
from conftest import run_cli

from depthscope.common.errors import InputError, SiteError
from depthscope.hooks.sites import check_site_names, parse_site, parse_sites
from depthscope.probes.config import ExtractionConfig


@pytest.mark.parametrize(
    "name, match",
    [
        ("0.q", "'0.q' is a hook point inside a block, not a residual site"),
        ("1.attn_out", "is a hook point inside a block"),
        ("blocks.1.attn.hook_z", "is a hook point inside a block"),
        ("attn", "unknown site 'attn'"),
        ("-1", "site index -1 out of range 0..6"),
        ("7.mlp", r"site '7.mlp': layer 7 out of range 0..2 \(3 layers\)"),
        ("blocks.3.hook_resid_pre", "layer 3 out of range 0..2"),
        ("7", r"site index 7 out of range 0..6 \(the model has 3 layers\)"),
        (7, "site index 7 out of range 0..6"),
    ],
)
def test_a_name_that_is_no_residual_site_is_a_site_error(name, match):
    with pytest.raises(SiteError, match=match) as e:
        parse_sites([name], 3)
    assert isinstance(e.value, InputError) and isinstance(e.value, KeyError) and isinstance(e.value, IndexError)
    assert "'embed'" in str(e.value) or "out of range" in str(e.value)  # what is allowed
    assert not str(e.value).startswith(("'", '"'))  # the message, not KeyError's quoted repr


def test_valid_names_pass_and_names_no_model_has_fail_before_a_model():
    assert parse_sites(["embed", "0.attn", "blocks.2.hook_resid_pre", "2.mlp", 3, "4"], 3) == [0, 1, 3, 4, 6]
    assert parse_site("blocks.0.hook_resid_pre", 3) == 0
    check_site_names(["embed", "99.mlp", "blocks.40.hook_resid_mid", 120])  # the range needs the model
    for bad in (["0.q"], ["-3"], "0.k", [None], [True]):
        with pytest.raises(SiteError):
            check_site_names(bad)
    with pytest.raises(SiteError, match="hook point inside a block"):
        ExtractionConfig(sites=["embed", "2.mlp_out"]).validate()


@pytest.fixture
def no_model(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the sites were checked")

    monkeypatch.setattr("depthscope.probes.store.extraction.resolve_model", boom)
    monkeypatch.setattr("depthscope.hooks.load_model", boom)


def _data_args() -> list:
    from depthscope.probes import sample_data

    data = sample_data()
    return ["--train", data["ewt_train"], "--test", data["ewt_test"], "--max-train-sentences", "10"]


def _exits_2(args, monkeypatch, capsys, match: str) -> None:
    code, stdout, stderr = run_cli(args, monkeypatch, capsys)
    text = stdout + stderr
    assert code == 2, text
    assert match in text and "Traceback" not in text


@pytest.mark.parametrize("command", ["causal", "probe"])
@pytest.mark.parametrize("sites, match", [("embed,0.q", "'0.q' is a hook point inside a block"), ("x", "unknown site")])
def test_commands_refuse_a_point_that_is_no_site_before_loading(
    no_model, tmp_path, monkeypatch, capsys, command, sites, match
):
    _exits_2([command, *_data_args(), "--sites", sites, "--out", tmp_path / "o"], monkeypatch, capsys, match)


@pytest.mark.parametrize("command", ["causal", "probe"])
@pytest.mark.parametrize("sites, match", [("7.mlp", "layer 7 out of range 0..2"), ("99", "site index 99 out of range")])
def test_commands_refuse_a_layer_the_model_lacks(tiny_llama_dir, tmp_path, monkeypatch, capsys, command, sites, match):
    args = [command, "--model", tiny_llama_dir, *_data_args(), "--sites", sites, "--out", tmp_path / "o"]
    _exits_2(args, monkeypatch, capsys, match)
