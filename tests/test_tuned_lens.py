"""Tuned lens: identity at initialisation, lower held-out KL after a short training run on the
real model, an exact hand-written gradient, save/load, resumable training, refusal of a lens
trained for another model, and the CLI."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_cli

from depthscope.analyses import TunedLens, logit_lens, train_tuned_lens
from depthscope.analyses.lens import tuned as T
from depthscope.analyses.text import read_documents
from depthscope.hooks import CheckpointError, InputError

SAMPLE = os.path.join(os.path.dirname(__file__), "fixtures", "lens", "ewt_sample.txt")  # UD EWT, CC BY-SA 4.0
TEXTS = ["The capital of France is Paris.", "Hello world, this is a longer second sentence with more words."]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def test_identity_lens_is_the_logit_lens(tiny_llama):
    ident = TunedLens.identity(tiny_llama)
    a = logit_lens(tiny_llama, TEXTS)
    b = logit_lens(tiny_llama, TEXTS, lens=ident)
    assert (b["lens"] == "tuned").all() and (a["lens"] == "logit").all()
    cols = [c for c in a.columns if c not in ("label", "sublayer", "lens", "ci_unit", "ci_method")]
    np.testing.assert_array_equal(a[cols].to_numpy(float), b[cols].to_numpy(float))


def test_translate_is_affine(tiny_llama):
    lens = TunedLens.identity(tiny_llama, sites=["embed", "1.mlp"])
    torch.manual_seed(0)
    lens.weight.normal_(std=0.1)
    lens.bias.normal_()
    h = torch.randn(2, 5, tiny_llama.d_model)
    got = lens.translate(h, [0, 4])
    want = torch.stack([h[i] + h[i] @ lens.weight[i] + lens.bias[i] for i in range(2)])
    torch.testing.assert_close(got, want)
    with pytest.raises(InputError, match="no translator"):
        logit_lens(tiny_llama, TEXTS, lens=lens, sites=["0.attn"])


def test_hand_written_gradient_matches_autograd(tiny_llama):
    """_KLUnembed's forward and backward (float32) equal the plain autograd computation."""
    torch.manual_seed(1)
    m = tiny_llama
    C, S = 3, 4
    x = torch.randn(C * S, m.d_model, requires_grad=True)
    lp = torch.log_softmax(torch.randn(C, m.vocab_size) * 3, -1)
    p = lp.exp()
    neg_hp = (p * lp).sum(-1)
    W = m.arch.unembed.weight.detach()
    w = torch.rand(C, S)
    kl = T._KLUnembed.apply(x, W, p, neg_hp, S)
    (g,) = torch.autograd.grad((kl * w).sum(), [x])
    x2 = x.detach().clone().requires_grad_(True)
    lq = torch.log_softmax(x2 @ W.t(), -1).view(C, S, -1)
    kl2 = (p.unsqueeze(1) * (lp.unsqueeze(1) - lq)).sum(-1)
    (g2,) = torch.autograd.grad((kl2 * w).sum(), [x2])
    torch.testing.assert_close(kl, kl2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, g2, rtol=1e-4, atol=1e-6)
    # the bfloat16 unembedding used for training on CPUs with native bf16: close, not equal
    bufs = T._Buffers()
    for _ in range(2):  # reused buffers give the same answer
        kl3 = T._KLUnembed.apply(x, W.bfloat16(), p, neg_hp, S, bufs)
        (g3,) = torch.autograd.grad((kl3 * w).sum(), [x])
        assert (kl3 - kl2).abs().max() < 0.05 * kl2.abs().max()
        assert torch.nn.functional.cosine_similarity(g3.flatten(), g2.flatten(), dim=0) > 0.99


def test_training_lowers_heldout_kl_on_the_real_model(default_model):
    """A short run (3 sites, 40 steps) on four EWT sentences beats the logit lens on two others."""
    docs = read_documents(SAMPLE)
    train, held = docs[:4], docs[4:]
    sites = ["embed", "6.mlp", "18.mlp", "29.mlp"]
    tl = train_tuned_lens(default_model, train, sites=sites, steps=40, tokens_per_step=8, warmup=5, progress=False)
    assert tl.training["steps_done"] == 40 and len(tl.training["loss"]) == 40
    assert np.mean(tl.training["loss"][-5:]) < 0.5 * np.mean(tl.training["loss"][:3])
    plain = logit_lens(default_model, held, sites=sites)
    tuned = logit_lens(default_model, held, lens=tl)
    assert tuned["label"].tolist() == sites
    for a, b in zip(plain.itertuples(), tuned.itertuples()):
        if a.label == "29.mlp":  # the last site keeps the identity: still the model itself
            assert abs(b.kl_to_final) < 1e-6 and b.cross_entropy == pytest.approx(a.cross_entropy, rel=1e-6)
            assert torch.count_nonzero(tl.weight[-1]) == 0 and torch.count_nonzero(tl.bias[-1]) == 0
        else:
            assert b.kl_to_final < 0.8 * a.kl_to_final, a.label
    assert tuned["kl_to_final"].iloc[0] < 0.5 * plain["kl_to_final"].iloc[0]  # the embedding gains most


def test_save_load_and_refuse_other_models(tiny_factory, tiny_llama, tmp_path):
    tl = train_tuned_lens(tiny_llama, TEXTS, steps=3, tokens_per_step=4, out=tmp_path / "lens", progress=False)
    assert (tmp_path / "lens" / "tuned_lens.safetensors").is_file()
    meta = json.loads((tmp_path / "lens" / "tuned_lens.json").read_text())
    assert meta["model"]["n_layers"] == 3 and meta["labels"][0] == "embed" and meta["training"]["steps_done"] == 3
    back = TunedLens.load(tmp_path / "lens", tiny_llama)
    torch.testing.assert_close(back.weight, tl.weight)
    torch.testing.assert_close(back.bias, tl.bias)
    assert back.weight.abs().sum() > 0  # it did train
    a = logit_lens(tiny_llama, TEXTS, lens=tl)
    b = logit_lens(tiny_llama, TEXTS, lens=back)
    pd.testing.assert_frame_equal(a, b)
    # same architecture, other weights: refused unless strict=False
    other = tiny_factory("llama", seed=1)
    with pytest.raises(T.LensMismatchError, match="weights"):
        TunedLens.load(tmp_path / "lens", other)
    with pytest.raises(T.LensMismatchError, match="trained for"):
        logit_lens(other, TEXTS, lens=back)
    TunedLens.load(tmp_path / "lens", other, strict=False)
    # another architecture: refused even without strict
    with pytest.raises(T.LensMismatchError, match="family"):
        TunedLens.load(tmp_path / "lens", tiny_factory("gpt2"), strict=False)


def test_bad_lens_files(tmp_path, tiny_llama):
    with pytest.raises(CheckpointError, match="no tuned lens"):
        TunedLens.load(tmp_path / "nothing", tiny_llama)
    d = tmp_path / "broken"
    TunedLens.identity(tiny_llama).save(d)
    (d / "tuned_lens.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        TunedLens.load(d, tiny_llama)
    (d / "tuned_lens.json").write_text('{"format": "something else"}')
    with pytest.raises(CheckpointError, match="not a depthscope tuned lens"):
        TunedLens.load(d, tiny_llama)


def test_training_resumes_exactly(tiny_llama, tmp_path, monkeypatch):
    kw = dict(steps=8, tokens_per_step=5, checkpoint_every=3, progress=False, matmul_dtype="float32")
    straight = train_tuned_lens(tiny_llama, TEXTS, **kw)
    real_lr = T._lr_at

    def crash_at_7(step, *a):
        if step == 7:
            raise KeyboardInterrupt
        return real_lr(step, *a)

    monkeypatch.setattr(T, "_lr_at", crash_at_7)
    with pytest.raises(KeyboardInterrupt):
        train_tuned_lens(tiny_llama, TEXTS, out=tmp_path / "run", **kw)
    assert json.loads((tmp_path / "run" / "checkpoint.json").read_text())["step"] == 6
    monkeypatch.setattr(T, "_lr_at", real_lr)
    resumed = train_tuned_lens(tiny_llama, TEXTS, out=tmp_path / "run", **kw)
    assert resumed.training["steps_done"] == 8
    torch.testing.assert_close(resumed.weight, straight.weight, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(resumed.bias, straight.bias, rtol=1e-5, atol=1e-7)
    assert resumed.training["loss"] == pytest.approx(straight.training["loss"], rel=1e-5)
    with pytest.raises(InputError, match="cannot resume"):
        train_tuned_lens(tiny_llama, TEXTS, out=tmp_path / "run", **{**kw, "tokens_per_step": 4})
    with pytest.raises(InputError, match="cannot resume"):
        train_tuned_lens(tiny_llama, TEXTS[:1], out=tmp_path / "run", **kw)  # other text


def test_generic_unembedding_path(tiny_factory):
    """Models whose unembedding has a bias/scale/soft-cap train through model.unembed.project."""
    m = tiny_factory("llama")
    m.arch.logit_scale = 0.9
    assert not m.unembed.is_plain_linear
    tl = train_tuned_lens(m, TEXTS, steps=2, tokens_per_step=4, progress=False)
    assert tl.weight.abs().sum() > 0


def test_bad_training_input(tiny_llama, tiny_factory, tmp_path):
    from depthscope.hooks import UnsupportedArchitecture

    with pytest.raises(InputError, match="holds no text"):
        (tmp_path / "e.txt").write_text("\n\n")
        train_tuned_lens(tiny_llama, tmp_path / "e.txt")
    with pytest.raises(InputError):
        train_tuned_lens(tiny_llama, TEXTS, tokens_per_step=0)
    with pytest.raises(UnsupportedArchitecture, match="not final norm -> unembedding"):
        train_tuned_lens(tiny_factory("bert"), TEXTS)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer):
    from conftest import make_tiny

    dirs = []
    for seed in (0, 1):
        d = tmp_path_factory.mktemp(f"tiny_llama_{seed}")
        make_tiny("llama", vocab_size=len(tokenizer), seed=seed).save_pretrained(d)
        tokenizer.save_pretrained(d)
        dirs.append(d)
    return dirs


def test_cli_train_then_lens_with_tuned(tiny_dirs, tmp_path, monkeypatch, capsys):
    lens_dir = tmp_path / "tl"
    code, so, se = run_cli(
        [
            "lens-train",
            "--text",
            SAMPLE,
            "--model",
            tiny_dirs[0],
            "--out",
            lens_dir,
            "--steps",
            "4",
            "--tokens-per-step",
            "4",
            "--cache-tokens",
            "64",
            "--eval-tokens",
            "16",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, se
    assert "held-out mean KL" in so and (lens_dir / "tuned_lens.json").is_file()
    ev = pd.read_csv(lens_dir / "tuned_lens_eval.csv")
    assert set(ev["lens"]) == {"logit", "tuned"}
    out = tmp_path / "out"
    code, so, se = run_cli(
        ["lens", "--text", SAMPLE, "--model", tiny_dirs[0], "--out", out, "--tuned", lens_dir, "--max-tokens", "30"],
        monkeypatch,
        capsys,
    )
    assert code == 0, se
    df = pd.read_csv(out / "lens_by_site.csv")
    assert df.groupby("lens").size().to_dict() == {"logit": 7, "tuned": 7}
    assert (df["n_positions"] == 30).all()
    assert (out / "lens_top1_heatmap_tuned.png").is_file() and (out / "lens_rank_trajectory_tuned.png").is_file()
    # a lens trained for another model is refused with a clear message
    code, so, se = run_cli(
        ["lens", "--text", SAMPLE, "--model", tiny_dirs[1], "--out", tmp_path / "o2", "--tuned", lens_dir],
        monkeypatch,
        capsys,
    )
    assert code == 2 and "trained for" in se
