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


# ------------------------------------------------------------------------------------- training


def mlp_rows(n=6000, d=16, h=32, seed=0):
    """Inputs and the outputs of a sparse ReLU MLP (about 2% of its neurons active per row)."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(d, h, generator=g) / d**0.5, torch.randn(h, d, generator=g) / h**0.5
    x = torch.randn(n, d, generator=g) * 3 + 1
    return x, (x @ w1 - 4.0).relu() @ w2 * 5 + 2


def linear_fit_ve(x, y, xe, ye) -> float:
    """Variance explained on (xe, ye) of the least-squares affine map fitted on (x, y)."""
    ones = torch.ones(len(x), 1)
    beta = torch.linalg.lstsq(torch.cat([x, ones], 1), y).solution
    r = ye - torch.cat([xe, torch.ones(len(xe), 1)], 1) @ beta
    return float(1 - r.pow(2).sum() / (ye - ye.mean(0)).pow(2).sum())


def test_transcoder_training_beats_baselines_and_folds_both_scales():
    from depthscope.analyses.features.config import SaeTrainConfig
    from depthscope.analyses.features.training import sae_metrics, train_topk

    x, y = mlp_rows()
    cfg = SaeTrainConfig(latents=128, k=8, batch_size=256, epochs=20, lr=3e-3, dead_tokens=2000)
    tc, log = train_topk(x[:5000], cfg, targets=y[:5000])
    assert tc.architecture == "topk_transcoder" and tc.is_transcoder and not tc.apply_b_dec_to_input
    assert (tc.d_in, tc.d_out, tc.k) == (16, 16, 8) and log[-1]["step"] > log[0]["step"]
    m = sae_metrics(tc, x[5000:], targets=y[5000:])
    # held-out: better than the mean (0) and than the best affine map of the inputs
    assert m["variance_explained"] > linear_fit_ve(x[:5000], y[:5000], x[5000:], y[5000:]) + 0.2
    assert m["l0"] <= 8
    # the input and target scales are folded into the weights: rescaled data, the same map rescaled
    tc2, _ = train_topk(x[:5000] * 10, cfg, targets=y[:5000] * 0.1)
    assert torch.allclose(tc2.reconstruct(x[5000:] * 10), tc.reconstruct(x[5000:]) * 0.1, rtol=1e-3, atol=1e-4)
    with pytest.raises(InputError, match="one target per input"):
        train_topk(x[:5000], cfg, targets=y[:4000])


def test_sae_training_unchanged_by_the_transcoder_path():
    """An SAE (no targets) still subtracts b_dec and returns a ``topk`` SAE."""
    from depthscope.analyses.features.config import SaeTrainConfig
    from depthscope.analyses.features.training import train_topk

    x, _ = mlp_rows(n=1024)
    sae, _ = train_topk(x, SaeTrainConfig(latents=32, k=4, batch_size=256, epochs=1))
    assert sae.architecture == "topk" and sae.apply_b_dec_to_input and sae.d_out == 16


def test_transcoders_command_writes_the_set_and_resumes(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    import pandas as pd

    from depthscope.common.resume import FOLDER
    from tests.conftest import run_cli

    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"The cat number {i} sat on the mat and looked at the dog." for i in range(300)))
    out = tmp_path / "out"
    args = ["transcoders", "train", "--model", tiny_llama_dir, "--text", text, "--out", out, "--latents", "64"]
    args += ["--k", "4", "--tokens", "2000", "--eval-tokens", "300", "--batch-size", "128", "--epochs", "2"]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    folder = out / "transcoders"
    n_layers = len([p for p in folder.iterdir() if p.is_dir()])
    assert n_layers >= 2 and (folder / "config.yaml").is_file()
    assert sorted(p.name for p in folder.glob("layer_*.safetensors")) == [
        f"layer_{i}.safetensors" for i in range(n_layers)
    ]
    table = pd.read_parquet(out / "transcoder_metrics.parquet")
    assert table["layer"].tolist() == list(range(n_layers))
    assert (table["point"] == [f"{i}.mlp_in" for i in range(n_layers)]).all()
    assert (table["label"] == [f"{i}.mlp" for i in range(n_layers)]).all() and table["depth"].notna().all()
    assert (table["l0"] <= 4).all() and (table["variance_explained"] > 0).all()  # beats the mean
    assert {"ce_loss_score", "loss_zero", "kl"} <= set(table.columns)
    assert (out / "transcoder_metrics.csv").is_file() and (out / "transcoder_metrics_by_layer.png").is_file()
    assert not (out / "activations").exists() and not list(out.glob("checkpoint_layer_*.pt"))
    sae_set, ct_set = (
        load_transcoder_set(folder, layout="saelens"),
        load_transcoder_set(folder, layout="circuit-tracer"),
    )
    x = torch.randn(3, sae_set[0].d_in)
    for i in range(n_layers):
        assert torch.equal(sae_set[i].reconstruct(x), ct_set[i].reconstruct(x))
    # a killed run: layer 0 finished (its record and folder stand), the rest lost
    weights = (folder / "layer_0" / "sae_weights.safetensors").read_bytes()
    for i in range(1, n_layers):
        shutil.rmtree(folder / f"layer_{i}")
    (folder / "config.yaml").unlink()
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    assert "(1 reused)" in err and (folder / "layer_0" / "sae_weights.safetensors").read_bytes() == weights
    assert sorted(load_transcoder_set(folder)) == list(range(n_layers)) and (folder / "config.yaml").is_file()
    assert (out / FOLDER).is_dir()
    again = pd.read_parquet(out / "transcoder_metrics.parquet")
    assert again.loc[0, "variance_explained"] == table.loc[0, "variance_explained"]
    # --layers picks layers: with other settings, the earlier layers' files go (another set)
    code, _, err = run_cli([*args, "--layers", "1", "--seed", "3"], monkeypatch, capsys)
    assert code == 0, err
    assert pd.read_parquet(out / "transcoder_metrics.parquet")["layer"].tolist() == [1]
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "layer_1", "layer_1.safetensors"]
    # ... with the same settings, a set builds up across runs
    code, _, err = run_cli([*args, "--layers", "0", "--seed", "3"], monkeypatch, capsys)
    assert code == 0, err
    assert "(1 reused)" in err
    assert pd.read_parquet(out / "transcoder_metrics.parquet")["layer"].tolist() == [0, 1]
    assert sorted(load_transcoder_set(folder, layout="circuit-tracer")) == [0, 1]
    # a bad spec is a usage error naming the flag
    code, _, err = run_cli([*args, "--layers", "0-x"], monkeypatch, capsys)
    assert code == 2 and "--layers" in err
    code, _, err = run_cli([*args, "--layers", "99", "--force"], monkeypatch, capsys)
    assert code != 0 and "out of range" in err and "Traceback" not in err
