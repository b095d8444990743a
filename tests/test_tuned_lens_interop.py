"""Tuned lenses in the ``tuned-lens`` package's format (:mod:`depthscope.analyses.lens.interop`).

Here, without the package: translator ``i`` sits at depthscope site ``2i`` because Hugging Face's
``hidden_states[i]`` (what the package's translator ``i`` reads) is the stream depthscope captures
there; export then import gives back the same translators; what cannot map is refused.

Against the package, in a virtual environment of its own (``make tunedlens-venv``, i.e.
``scripts/tunedlens_venv.sh``; the test skips, saying how to build it, while it is absent):
``tuned_lens.TunedLens.from_model_and_pretrained`` loads a folder that :func:`export_tuned_lens`
wrote, without its unembedding-mismatch warning, and its logits on the model's own hidden states
equal depthscope's lens logits at the same streams; a lens the package creates and saves
imports here with the same logits."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthscope.analyses import TunedLens, block_input_sites, export_tuned_lens, import_tuned_lens
from depthscope.analyses.lens.interop import unembed_hash
from depthscope.analyses.lens.lenses import LensMismatchError, model_info
from depthscope.common.errors import CheckpointError, InputError
from depthscope.hooks import load_model

VENV = Path(os.environ.get("DEPTHSCOPE_TUNEDLENS_VENV", Path.home() / ".cache" / "depthscope-tests" / "tunedlens-venv"))


def _random_lens(model, sites=None, scale: float = 0.05, seed: int = 0) -> TunedLens:
    """A lens with random translators at ``sites`` (default all) and the identity at the last."""
    lens = TunedLens.identity(model, sites)
    g = torch.Generator().manual_seed(seed)
    last = 2 * model.n_layers
    for i, s in enumerate(lens.sites):
        if s != last:
            lens.weight[i] = scale * torch.randn(model.d_model, model.d_model, generator=g)
            lens.bias[i] = scale * torch.randn(model.d_model, generator=g)
    return lens


def _ids(model, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


def _lens_logits(model, lens: TunedLens, ids: torch.Tensor, sites: list[int]) -> torch.Tensor:
    """depthscope's lens logits ``[len(sites), batch, pos, vocab]`` of the model's streams."""
    with torch.no_grad():
        rs = model.residual_stream(ids, sites=sites, return_logits=False)
        x = rs.resid.float()
        S, B, T, d = x.shape
        return lens.logits(model, x.reshape(S, B * T, d), sites).reshape(S, B, T, -1)


def test_block_inputs_are_the_sites_after_each_block(tiny_llama):
    """Hugging Face's ``hidden_states[i]`` (the input of block ``i``) is depthscope's site ``2i``."""
    ids = _ids(tiny_llama)
    sites = block_input_sites(tiny_llama.n_layers)
    assert sites == [0, 2, 4] and [tiny_llama.labels[s] for s in sites] == ["embed", "0.mlp", "1.mlp"]
    with torch.no_grad():
        hs = tiny_llama.hf_model(ids, output_hidden_states=True).hidden_states
        ours = tiny_llama.residual_stream(ids, sites=sites, return_logits=False).resid
    for i, s in enumerate(sites):
        assert torch.allclose(hs[i], ours[i], atol=1e-6), tiny_llama.labels[s]


def test_export_then_import_keeps_the_block_input_translators(tiny_llama, tmp_path):
    lens = _random_lens(tiny_llama, sites=[0, 2, 4, 6])
    folder = export_tuned_lens(lens, tmp_path / "lens", tiny_llama)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["d_model"] == tiny_llama.d_model and cfg["bias"] is True
    assert cfg["unembed_hash"] == unembed_hash(tiny_llama) and cfg["lens_type"] == "linear_tuned_lens"
    params = torch.load(folder / "params.pt", weights_only=True)
    assert torch.equal(params["1.weight"], lens.weight[1].T)  # nn.Linear's orientation: y = h @ W.T
    back = TunedLens.load(folder, tiny_llama)  # depthscope's own loader reads the package's folders
    assert back.sites == [0, 2, 4, 6]
    assert torch.equal(back.weight, lens.weight) and torch.equal(back.bias, lens.bias)
    ids = _ids(tiny_llama)
    assert torch.allclose(
        _lens_logits(tiny_llama, back, ids, back.sites), _lens_logits(tiny_llama, lens, ids, lens.sites)
    )


def test_what_cannot_map_is_refused(tiny_llama, tmp_path):
    full = _random_lens(tiny_llama)  # translators at the attention sites too
    with pytest.raises(InputError, match=r"no place for the translators at \['0.attn', '1.attn', '2.attn'\]"):
        export_tuned_lens(full, tmp_path / "a")
    out = export_tuned_lens(full, tmp_path / "a", drop_unmapped=True)
    assert torch.equal(import_tuned_lens(out, tiny_llama).weight[:3], full.weight[[0, 2, 4]])
    zero_attn = TunedLens.identity(tiny_llama)  # identity translators at the attention sites: nothing lost
    export_tuned_lens(zero_attn, tmp_path / "b")
    with pytest.raises(InputError, match=r"none at \['0.mlp'\]"):
        export_tuned_lens(_random_lens(tiny_llama, sites=[0, 4, 6]), tmp_path / "c")
    with pytest.raises(InputError, match="load it for a model"):
        TunedLens.load(out)


def test_a_lens_for_another_model_or_a_corrupt_one_is_refused(tiny_llama, tiny_factory, tmp_path):
    out = export_tuned_lens(_random_lens(tiny_llama, sites=[0, 2, 4]), tmp_path / "lens", tiny_llama)
    other = tiny_factory("llama", seed=1)  # same shapes, other weights: another unembedding
    with pytest.raises(LensMismatchError, match="another unembedding"):
        import_tuned_lens(out, other)
    assert import_tuned_lens(out, other, strict=False).n_layers == 3
    with pytest.raises(LensMismatchError, match="4 layers"):
        import_tuned_lens(out, tiny_factory("llama", n_layers=4))
    (out / "params.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        import_tuned_lens(out, tiny_llama)
    torch.save({"0.weight": torch.zeros(3, 3)}, out / "params.pt")
    with pytest.raises(CheckpointError, match="describes 3 translators"):
        import_tuned_lens(out, tiny_llama)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"lens_type": "tuned_lens_v2"}))
    with pytest.raises(CheckpointError, match="lens_type"):
        import_tuned_lens(out, tiny_llama)


SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from tuned_lens import TunedLens

    spec = json.load(open(sys.argv[1]))
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    ids = load_file(spec["ids"])["ids"]
    out = {}
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        ours = TunedLens.from_model_and_pretrained(model, spec["ours"])
        for i in range(len(ours)):
            out[f"ours.{i}"] = ours(hs[i], i).contiguous()
        theirs = TunedLens.from_model(model)
        g = torch.Generator().manual_seed(3)
        for p in theirs.layer_translators.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        theirs.save(spec["theirs"])
        for i in range(len(theirs)):
            out[f"theirs.{i}"] = theirs(hs[i], i).contiguous()
    save_file(out, spec["out"])
    json.dump({"warnings": warnings, "unembed_hash": theirs.config.unembed_hash}, open(spec["info"], "w"))
    """
)


def _venv_python() -> Path:
    py = VENV / "bin" / "python"
    if not (VENV / ".built").is_file() or not py.is_file():
        pytest.skip(
            f"no tuned-lens environment at {VENV}: build it with `make tunedlens-venv` (scripts/tunedlens_venv.sh), "
            f"or point DEPTHSCOPE_TUNEDLENS_VENV at one"
        )
    return py


def test_the_tuned_lens_package_reads_ours_and_we_read_its(tiny_llama_dir, tmp_path):
    py = _venv_python()
    model = load_model(str(tiny_llama_dir))
    lens = _random_lens(model, sites=block_input_sites(model.n_layers) + [2 * model.n_layers])
    ids = _ids(model)
    save_file({"ids": ids}, tmp_path / "ids.safetensors")
    spec = {
        "model": str(tiny_llama_dir),
        "ids": str(tmp_path / "ids.safetensors"),
        "ours": str(export_tuned_lens(lens, tmp_path / "ours", model)),
        "theirs": str(tmp_path / "theirs"),
        "out": str(tmp_path / "out.safetensors"),
        "info": str(tmp_path / "info.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "interop.py").write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    got = subprocess.run(
        [str(py), str(tmp_path / "interop.py"), str(tmp_path / "spec.json")], capture_output=True, text=True, env=env
    )
    assert got.returncode == 0, got.stderr[-2000:]
    theirs = load_file(tmp_path / "out.safetensors")
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["unembed_hash"] == unembed_hash(model)
    assert not [w for w in info["warnings"] if "hash" in w], info["warnings"]
    sites = block_input_sites(model.n_layers)
    ours = _lens_logits(model, lens, ids, sites)
    for i in range(model.n_layers):
        assert torch.allclose(ours[i], theirs[f"ours.{i}"], atol=1e-4), i
    back = TunedLens.load(spec["theirs"], model)
    assert back.sites == sites + [2 * model.n_layers] and back.model_info == model_info(model)
    mine = _lens_logits(model, back, ids, sites)
    for i in range(model.n_layers):
        assert torch.allclose(mine[i], theirs[f"theirs.{i}"], atol=1e-4), i
