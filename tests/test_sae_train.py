"""SAE training, evaluation and features per depth: the TopK trainer (folding of the input scale,
resuming from a checkpoint), its metrics against hand computations, ``depthscope sae train`` on a
tiny model, sparse probing on planted features, and the feature lens against the model's own
final norm and unembedding."""

from __future__ import annotations

import json

import pytest
import torch

from depthscope.analyses.features.config import SaeTrainConfig
from depthscope.analyses.features.training import sae_metrics, train_topk
from depthscope.common.errors import InputError
from depthscope.hooks import load_sae
from tests.conftest import run_cli


def sparse_rows(n=4000, d=24, seed=0):
    """Rows that are sums of 3 of 48 unit directions with positive weights, times 7 (a scale)."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(48, d, generator=g)
    dirs /= dirs.norm(dim=-1, keepdim=True)
    idx = torch.stack([torch.randperm(48, generator=g)[:3] for _ in range(n)])
    w = torch.rand(n, 3, generator=g) + 0.5
    return 7 * (w[..., None] * dirs[idx]).sum(1)


def test_topk_learns_sparse_structure_and_folds_the_scale():
    x = sparse_rows()
    cfg = SaeTrainConfig(latents=96, k=4, epochs=30, batch_size=256, lr=3e-3, dead_tokens=2000)
    sae, log = train_topk(x, cfg)
    m = sae_metrics(sae, x)
    err = (x - sae.reconstruct(x)).pow(2).sum()
    assert m["variance_explained"] == pytest.approx(1 - float(err / (x - x.mean(0)).pow(2).sum()), abs=1e-5)
    assert m["variance_explained"] > 0.8  # raw rows (scale 7) through the folded SAE
    assert m["l0"] <= 4 and log[-1]["step"] == 30 * (4000 // 256)


def test_resume_from_checkpoint_gives_the_same_sae(tmp_path):
    x = sparse_rows(n=1200)
    cfg = SaeTrainConfig(latents=32, k=3, epochs=3, batch_size=200, lr=1e-3)
    whole, _ = train_topk(x, cfg)

    class Kill:
        def __init__(self):
            self.n = 0

        def update(self, k):
            self.n += k
            if self.n >= 11:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_topk(x, cfg, checkpoint=tmp_path / "ck.pt", bar=Kill(), every=5)
    resumed, _ = train_topk(x, cfg, checkpoint=tmp_path / "ck.pt", every=5)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.allclose(getattr(resumed, name), getattr(whole, name), atol=1e-6), name


def test_train_settings_are_checked():
    with pytest.raises(InputError, match="exceeds --latents"):
        SaeTrainConfig(latents=8, k=9)
    with pytest.raises(InputError, match="fewer than one batch"):
        train_topk(torch.randn(10, 4), SaeTrainConfig(latents=8, k=2, batch_size=64))


def test_sae_train_command(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"The cat number {i} sat on the mat and looked at the dog." for i in range(300)))
    out = tmp_path / "out"
    args = ["sae", "train", "--model", str(tiny_llama_dir), "--site", "1.mlp", "--text", str(text), "--out", str(out)]
    args += ["--latents", "64", "--k", "4", "--tokens", "2000", "--eval-tokens", "500", "--batch-size", "128"]
    code, _, err = run_cli(args + ["--epochs", "2"], monkeypatch, capsys)
    assert code == 0, err
    sae = load_sae(out / "sae")
    assert sae.architecture == "topk" and sae.k == 4 and sae.hook_name == "blocks.1.hook_resid_post"
    cfg = json.loads((out / "sae" / "cfg.json").read_text())
    assert cfg["metadata"]["sae_lens_version"].startswith("6")
    import pandas as pd

    row = pd.read_parquet(out / "sae_metrics.parquet").iloc[0]
    assert row["label"] == "1.mlp" and row["l0"] <= 4 and row["train_tokens"] >= 2000
    assert not (out / "activations").exists() and not (out / "checkpoint.pt").exists()
    code, _, err = run_cli(args[:-2] + ["--tokens", "10000000"], monkeypatch, capsys)
    assert code == 2 and "give more text or lower them" in err
