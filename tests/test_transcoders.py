"""Transcoder sets: both layouts written and read back exactly, circuit-tracer's layout checked by
a reader written here from circuit-tracer's conventions, clear errors for broken sets."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from depthscope.common.errors import InputError
from depthscope.hooks import SAE, load_transcoder_set, save_transcoder_set


def random_tc(d_in: int, d_sae: int, arch: str = "topk_transcoder", *, layer: int = 0, seed: int = 0, **kw) -> SAE:
    g = torch.Generator().manual_seed(seed)
    w = dict(
        W_enc=torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        b_enc=torch.randn(d_sae, generator=g) * 0.1 + 2.0,  # pre-activations mostly positive
        W_dec=torch.randn(d_sae, d_in, generator=g) / d_sae**0.5,
        b_dec=torch.randn(d_in, generator=g) * 0.1,
    )
    if "jumprelu" in arch:
        kw["threshold"] = torch.rand(d_sae, generator=g) + 1.5
    if arch == "skip_transcoder":
        kw["W_skip"] = torch.randn(d_in, d_in, generator=g) * 0.1
    kw.setdefault("k", 4 if arch == "topk_transcoder" else None)
    hooks = dict(hook_name=f"blocks.{layer}.ln2.hook_normalized", hook_name_out=f"blocks.{layer}.hook_mlp_out")
    return SAE(**w, architecture=arch, apply_b_dec_to_input=False, **hooks, **kw)


def a_set(arch="topk_transcoder", layers=(0, 1, 2), d=6, d_sae=16) -> dict[int, SAE]:
    return {i: random_tc(d, d_sae, arch, layer=i, seed=i) for i in layers}


def circuit_tracer_reader(folder):
    """circuit-tracer's loading, written from its source (single_layer_transcoder.py: W_enc
    [d_sae, d_model] used through F.linear, W_dec [d_sae, d_model], JumpReLU threshold under
    ``activation_function.threshold``, TopK keeping the k largest as they are; caching.py:
    config.yaml + layer_<i>.safetensors): ``{layer: fn(x) -> reconstruction}`` and the config."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    out = {}
    for f in sorted(folder.glob("layer_*.safetensors")):
        p = load_file(str(f))

        def run(x, p=p):
            pre = F.linear(x, p["W_enc"], p["b_enc"])
            if config.get("activation") == "topk":
                idx = pre.topk(config["k"], dim=-1).indices
                acts = pre * torch.zeros_like(pre).scatter(-1, idx, 1.0)
            elif "activation_function.threshold" in p:
                acts = pre * (pre > p["activation_function.threshold"])
            else:
                acts = F.relu(pre)
            y = acts @ p["W_dec"] + p["b_dec"]
            return y + x @ p["W_skip"].T if "W_skip" in p else y

        out[int(f.stem.split("_")[1])] = run
    return out, config


@pytest.mark.parametrize("arch", ["topk_transcoder", "transcoder", "jumprelu_transcoder", "skip_transcoder"])
def test_both_layouts_round_trip(tmp_path, arch):
    tcs = a_set(arch)
    save_transcoder_set(tcs, tmp_path / "set", model_name="org/tiny")
    names = sorted(p.name for p in (tmp_path / "set").iterdir())
    assert names == sorted(
        ["config.yaml", *[f"layer_{i}" for i in range(3)], *[f"layer_{i}.safetensors" for i in range(3)]]
    )
    x = torch.randn(5, 7, 6)
    for layout in ("saelens", "circuit-tracer"):
        back = load_transcoder_set(tmp_path / "set", layout=layout)
        assert sorted(back) == [0, 1, 2]
        for i, tc in tcs.items():
            b = back[i]
            assert (b.architecture, b.k, b.hook_name, b.hook_name_out) == (
                arch,
                tc.k,
                f"blocks.{i}.ln2.hook_normalized",
                f"blocks.{i}.hook_mlp_out",
            )
            assert torch.equal(b.encode(x), tc.encode(x)) and torch.equal(b.reconstruct(x), tc.reconstruct(x))


@pytest.mark.parametrize("arch", ["topk_transcoder", "transcoder", "jumprelu_transcoder", "skip_transcoder"])
def test_circuit_tracer_reader_agrees(tmp_path, arch):
    tcs = a_set(arch)
    save_transcoder_set(tcs, tmp_path / "set", model_name="org/tiny", layout="circuit-tracer")
    assert not (tmp_path / "set" / "layer_0").exists()
    readers, config = circuit_tracer_reader(tmp_path / "set")
    assert config["model_kind"] == "transcoder_set" and config["model_name"] == "org/tiny"
    assert (config["feature_input_hook"], config["feature_output_hook"]) == ("mlp.hook_in", "hook_mlp_out")
    assert "transcoders" not in config  # circuit-tracer lists layer_*.safetensors itself
    x = torch.randn(9, 6)
    for i, tc in tcs.items():
        ref = readers[i](x)
        assert torch.allclose(tc.reconstruct(x), ref, atol=1e-5)
        # the loaded set ignores the SAE fields: a plain linear check of the decoder
        got = load_transcoder_set(tmp_path / "set")[i]
        assert torch.allclose(got.reconstruct(x), ref, atol=1e-5)


def test_reads_circuit_tracer_variants(tmp_path):
    """Older configs: a ``transcoders`` list of ``{layer, filepath}``, ``mlp.hook_out``, ``threshold``."""
    tcs = a_set("jumprelu_transcoder", layers=(0, 1))
    save_transcoder_set(tcs, tmp_path / "s", layout="circuit-tracer")
    for i in (0, 1):
        p = load_file(str(tmp_path / "s" / f"layer_{i}.safetensors"))
        p["threshold"] = p.pop("activation_function.threshold")
        (tmp_path / "s" / f"layer_{i}.safetensors").unlink()
        from safetensors.torch import save_file

        save_file(p, str(tmp_path / "s" / f"tc{i}.safetensors"))
    cfg = {
        "model_name": "m",
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out",
        "transcoders": [{"id": f"t{i}", "layer": i, "filepath": f"tc{i}.safetensors"} for i in (1, 0)],
    }
    (tmp_path / "s" / "config.yaml").write_text(yaml.safe_dump(cfg))
    back = load_transcoder_set(tmp_path / "s", dtype="float64")
    x = torch.randn(3, 6, dtype=torch.float64)
    assert back[1].hook_name_out == "blocks.1.hook_mlp_out" and back[1].dtype == torch.float64
    assert torch.allclose(back[1].reconstruct(x), tcs[1].reconstruct(x.float()).double(), atol=1e-5)


def test_bad_sets_are_clear_errors(tmp_path):
    save_transcoder_set(a_set(), tmp_path / "s")
    (tmp_path / "s" / "layer_1.safetensors").unlink()
    with pytest.raises(InputError, match=r"layers \[1\] whose layer_<i>.safetensors is missing"):
        load_transcoder_set(tmp_path / "s", layout="circuit-tracer")
    shutil.rmtree(tmp_path / "s" / "layer_2")
    assert sorted(load_transcoder_set(tmp_path / "s")) == [0, 1]  # SAELens's folders: what is there
    with pytest.raises(InputError, match="not a transcoder set"):
        load_transcoder_set(tmp_path)
    with pytest.raises(InputError, match="no transcoder-set folder"):
        load_transcoder_set(tmp_path / "nowhere")
    mixed = {0: random_tc(6, 16), 1: random_tc(8, 16, layer=1)}
    with pytest.raises(InputError, match="widths differ"):
        save_transcoder_set(mixed, tmp_path / "m")
    # widths that differ between files on disk
    save_transcoder_set({0: random_tc(6, 16)}, tmp_path / "w", layout="circuit-tracer")
    save_transcoder_set({1: random_tc(8, 16, layer=1)}, tmp_path / "w8", layout="circuit-tracer")
    shutil.copy(tmp_path / "w8" / "layer_1.safetensors", tmp_path / "w" / "layer_1.safetensors")
    with pytest.raises(InputError, match="widths differ"):
        load_transcoder_set(tmp_path / "w")
    with pytest.raises(InputError, match="not a transcoder"):
        save_transcoder_set({0: SAE(torch.eye(3), torch.zeros(3), torch.eye(3), torch.zeros(3))}, tmp_path / "x")
    with pytest.raises(InputError, match="one activation"):
        save_transcoder_set({0: random_tc(6, 16), 1: random_tc(6, 16, "transcoder", layer=1)}, tmp_path / "y")
    with pytest.raises(InputError, match="not in block 1"):
        save_transcoder_set({1: random_tc(6, 16, layer=0)}, tmp_path / "z", layout="circuit-tracer")
    (tmp_path / "w" / "config.yaml").write_text("model_kind: cross_layer_transcoder\n")
    with pytest.raises(InputError, match="cross_layer_transcoder"):
        load_transcoder_set(tmp_path / "w")
