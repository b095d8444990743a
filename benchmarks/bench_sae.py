"""SAEs: TopK training throughput and the cost of splicing an SAE into a forward pass (issue 38).

Training: :func:`depthscope.analyses.features.training.train_topk` (AuxK loss, dead-latent counters,
decoder renormalisation, rows read a block at a time from an ``[n, d]`` array, the log) against a
bare PyTorch TopK step written here (encode, top-k, decode, MSE, Adam, renormalise: the least a
trainer does), both on the same random rows of the default model's width (d 576, 4608 latents,
k 32, batches of 1024). Tokens per second of this process's CPU time, one thread, the arms
interleaved; goal: depthscope at >= 0.85 of the bare loop. sae_lens's own trainer needs
TransformerLens < 4 and a model it loads itself, so it is not run beside them here.

Splicing: ``model.run(texts, saes={"6.mlp": sae}, cache=["6.mlp.sae.features"])`` against a plain
``model.run(texts)`` on the default model (64 tokens per text, 4 texts): the added cost of
encoding, decoding and keeping the features (goal <= 1.15x).

    python -m benchmarks --only sae [--quick]
"""

from __future__ import annotations

from benchmarks._common import Row, Settings, float32_model, interleave, text_ids, timing_note

NAME = "sae"
D, LATENTS, K, BATCH = 576, 4608, 32, 1024


def _bare_trainer(x, steps: int):
    """The least a TopK trainer does per step, for ``steps`` batches of ``x``."""
    import torch

    g = torch.Generator().manual_seed(0)
    w_dec = torch.randn(LATENTS, D, generator=g)
    w_dec /= w_dec.norm(dim=-1, keepdim=True)
    p = [w_dec.T.clone().requires_grad_(), torch.zeros(LATENTS, requires_grad=True)]
    p += [w_dec.requires_grad_(), torch.zeros(D, requires_grad=True)]
    opt = torch.optim.Adam(p, lr=1e-3)

    def run():
        for s in range(steps):
            xb = x[s * BATCH : (s + 1) * BATCH]
            pre = (xb - p[3]) @ p[0] + p[1]
            val, idx = pre.topk(K, dim=-1)
            f = torch.zeros_like(pre).scatter(-1, idx, val.relu())
            loss = (xb - f @ p[2] - p[3]).pow(2).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                p[2] /= p[2].norm(dim=-1, keepdim=True)

    return run


def _training_row(settings: Settings) -> Row:
    import torch

    from depthscope.analyses.features.config import SaeTrainConfig
    from depthscope.analyses.features.training import train_topk

    steps = 4 if settings.quick else 12
    x = torch.randn(steps * BATCH, D, generator=torch.Generator().manual_seed(1))
    cfg = SaeTrainConfig(latents=LATENTS, k=K, epochs=1, batch_size=BATCH, lr=1e-3)
    arms = {"depthscope": lambda: train_topk(x, cfg), "bare": _bare_trainer(x, steps)}
    t = interleave(arms, settings)
    tokens = steps * BATCH
    ours, bare = tokens / t["depthscope"].median, tokens / t["bare"].median
    return Row(
        f"TopK SAE training tokens/s (d {D}, {LATENTS} latents, k {K}) / bare PyTorch loop",
        f"{ours:.0f} tok/s",
        f"{bare:.0f} tok/s",
        ours / bare,
        goal=">= 0.85",
        note=timing_note(t),
        bench=NAME,
    )


def _splice_row(settings: Settings) -> Row:
    import torch

    from depthscope.hooks import SAE

    model = float32_model()
    ids = text_ids(model, 4 * 64).reshape(4, 64)
    g = torch.Generator().manual_seed(0)
    d = model.d_model
    w_enc, w_dec = torch.randn(d, LATENTS, generator=g) / d**0.5, torch.randn(LATENTS, d, generator=g)
    sae = SAE(w_enc, torch.zeros(LATENTS), w_dec, torch.zeros(d), architecture="topk", k=K)
    arms = {
        "spliced": lambda: model.run(ids, saes={"6.mlp": sae}, cache=["6.mlp.sae.features"]),
        "plain": lambda: model.run(ids),
    }
    t = interleave(arms, settings)
    return Row(
        "run with an SAE spliced at 6.mlp (features cached) / plain run, 4x64 tokens",
        f"{t['spliced'].median:.3f} s",
        f"{t['plain'].median:.3f} s",
        t["spliced"].ratio_to(t["plain"]),
        goal="<= 1.15",
        note=timing_note(t),
        bench=NAME,
    )


def run(settings: Settings) -> list[Row]:
    return [_training_row(settings), _splice_row(settings)]
