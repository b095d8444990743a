"""SAELens interop, in a virtual environment of its own: sae-lens 6 requires transformer-lens < 4
(it imports ``HookedTransformer``), which cannot be installed beside depthscope. The test builds
that environment once (same torch version, sae-lens from the package index) under
``~/.cache/depthscope-tests/saelens-venv`` and skips, saying why, when it cannot be built.

Checked both ways: folders that :func:`~depthscope.hooks.save_sae` writes load in
``sae_lens.SAE.load_from_disk`` and encode/decode the same activations to 1e-5 (standard, TopK,
JumpReLU, transcoder), and an SAE that sae_lens creates and saves loads in
:func:`~depthscope.hooks.load_sae` with the same features."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthscope.hooks import load_sae, save_sae
from tests.test_sae import random_sae

pytestmark = pytest.mark.slow

VENV = Path.home() / ".cache" / "depthscope-tests" / "saelens-venv"
SAELENS = "sae-lens>=6,<7"

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from safetensors.torch import load_file, save_file
    from sae_lens import SAE, TopKSAE, TopKSAEConfig

    spec = json.load(open(sys.argv[1]))
    x = load_file(spec["x"])["x"]
    out = {}
    for name, folder in spec["folders"].items():
        sae = SAE.load_from_disk(folder)
        f = sae.encode(x)
        out[name + ".features"] = f.contiguous()
        out[name + ".decoded"] = sae.decode(f).contiguous()
    torch.manual_seed(0)
    cfg = TopKSAEConfig(d_in=x.shape[-1], d_sae=24, k=5, dtype="float32", device="cpu")
    own = TopKSAE(cfg)
    with torch.no_grad():
        own.b_enc.normal_()
        own.b_dec.normal_()
    own.save_model(spec["saelens_folder"])
    out["saelens.features"] = own.encode(x).contiguous()
    save_file(out, spec["out"])
    """
)


def _venv_python() -> Path:
    """The interop environment's python, built on first use (a lock keeps two runs from building it
    at once); skips the test with pip's own words when the environment cannot be built."""
    py = VENV / "bin" / "python"
    stamp = VENV / ".built"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / "saelens-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file():
            return py
        torch_pin = "torch==" + torch.__version__.split("+")[0]
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(VENV)],
            [str(py), "-m", "pip", "install", "-q", torch_pin],
        ]
        steps.append([str(py), "-m", "pip", "install", "-q", SAELENS])
        for cmd in steps:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            if got.returncode != 0:
                pytest.skip(f"cannot build the sae-lens environment ({' '.join(cmd[-2:])}): {got.stderr[-400:]}")
        stamp.write_text(f"{torch_pin} {SAELENS}\n")
    return py


def test_saelens_loads_ours_and_we_load_saelens(tmp_path):
    py = _venv_python()
    d = 16
    saes = {
        "standard": random_sae(d, 40, "standard", hook_name="blocks.1.hook_resid_post"),
        "topk": random_sae(d, 40, "topk", k=6, hook_name="blocks.1.hook_resid_post"),
        "jumprelu": random_sae(d, 40, "jumprelu", hook_name="blocks.1.hook_resid_post"),
        "transcoder": random_sae(d, 40, "transcoder", d_out=d, hook_name="blocks.1.ln2.hook_normalized"),
    }
    folders = {name: str(save_sae(sae, tmp_path / name, model_name="tiny")) for name, sae in saes.items()}
    x = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(1))
    save_file({"x": x}, tmp_path / "x.safetensors")
    spec = {"x": str(tmp_path / "x.safetensors"), "folders": folders, "out": str(tmp_path / "out.safetensors")}
    spec["saelens_folder"] = str(tmp_path / "from_saelens")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "interop.py").write_text(SCRIPT)
    got = subprocess.run(
        [str(py), str(tmp_path / "interop.py"), str(tmp_path / "spec.json")], capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-2000:]
    theirs = load_file(tmp_path / "out.safetensors")
    for name in saes:
        ours = load_sae(folders[name])
        assert torch.allclose(ours.encode(x), theirs[name + ".features"], atol=1e-5), name
        assert torch.allclose(ours.decode(ours.encode(x), x), theirs[name + ".decoded"], atol=1e-5), name
    back = load_sae(spec["saelens_folder"])
    assert back.architecture == "topk" and back.k == 5
    assert torch.allclose(back.encode(x), theirs["saelens.features"], atol=1e-5)
