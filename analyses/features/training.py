"""Training a TopK sparse autoencoder (or transcoder) on stored activations (Gao et al. 2024,
"Scaling and evaluating sparse autoencoders"), streaming rows from an activation store.

=========================  ==================================================================
offers                     what
=========================  ==================================================================
:class:`SaeTrainConfig`    (from :mod:`~depthscope.analyses.features.config`) latents, k, tokens, epochs...
:func:`train_topk`         rows (any ``[n, d]`` array that reads row blocks) -> trained
                           :class:`~depthscope.hooks.sae.SAE` and a per-step log; resumable
                           from a checkpoint file; with ``targets``, a TopK transcoder
:func:`input_scale`        the factor that brings the rows to mean squared norm ``d``
:func:`sae_metrics`        variance explained, L0, dead latents of an SAE (or a transcoder,
                           with its targets) on held-out rows
=========================  ==================================================================

The method, as in the paper: the rows are scaled by one factor ``s`` to mean squared norm ``d``
(folded back into the biases before the SAE is returned, so it runs on raw activations);
``W_dec`` starts as random unit rows, ``W_enc = W_dec.T``, ``b_dec`` the rows' mean, ``b_enc``
zero; the loss is the squared reconstruction error plus ``aux_coef`` times the AuxK loss (the
``k_aux`` largest pre-activations of latents that have not fired for ``dead_tokens`` tokens
reconstruct the residual error); Adam; decoder rows renormalised to unit norm after every step.
Rows are read a block at a time in a seeded random order (memory: one block), so a
memory-mapped store of any size trains in bounded memory.

A transcoder (``targets``: the rows it reconstructs, e.g. ``l.mlp_out`` for inputs ``l.mlp_in``)
is trained the same way with three differences: the targets get their own scale ``t`` (to mean
squared norm ``d_out``), the encoder reads the input as it is (``pre = x @ W_enc + b_enc``, no
``b_dec`` subtracted, as SAELens's transcoders) and starts as random columns of norm
:data:`TRANSCODER_ENC_NORM` (the features start small, the output near its mean), and ``b_dec``
starts at the targets' mean. Folding back: ``W_enc * s / t``, ``b_enc / t``, ``b_dec / t``, so
the ``topk_transcoder`` returned maps raw inputs to raw targets (its features divided by ``t``).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from depthscope.analyses.features.config import SaeTrainConfig
from depthscope.common.errors import InputError
from depthscope.common.files import atomic_write
from depthscope.hooks.sae import SAE

#: rows read from the store at once (shuffled within, blocks in random order)
BLOCK_ROWS = 32768
#: a transcoder's initial encoder column norm: its first reconstructions are near the targets'
#: mean (unit columns start at variance explained -3 on a toy MLP, -0.3 on SmolLM2's layer 5;
#: 0.1 ended 0.06 higher there after 8 epochs of 16k tokens, and higher on the toy)
TRANSCODER_ENC_NORM = 0.1


def input_scale(rows, *, sample: int = 16384, seed: int = 0) -> float:
    """``s`` such that ``s * x`` has mean squared norm ``d`` over (a sample of) the rows."""
    n = len(rows)
    idx = np.sort(np.random.default_rng(seed).choice(n, size=min(n, sample), replace=False))
    x = torch.as_tensor(np.asarray(rows[idx]), dtype=torch.float32)
    ms = float(x.pow(2).sum(-1).mean())
    if not math.isfinite(ms) or ms <= 0:
        raise InputError("the activations are all zero or not finite: nothing to train an SAE on")
    return math.sqrt(x.shape[-1] / ms)


def _blocks(n: int, rng: np.random.Generator):
    """Row numbers of one epoch: blocks of :data:`BLOCK_ROWS` in random order, shuffled within."""
    starts = rng.permutation(np.arange(0, n, BLOCK_ROWS))
    for s in starts:
        yield np.sort(np.arange(s, min(n, s + BLOCK_ROWS)))


class _State:
    """Parameters, optimiser and counters of one training run (what a checkpoint holds)."""

    def __init__(self, d_in: int, cfg: SaeTrainConfig, mean: torch.Tensor, *, transcoder: bool = False):
        g = torch.Generator().manual_seed(cfg.seed)
        w_dec = torch.randn(cfg.latents, mean.shape[-1], generator=g)
        w_dec /= w_dec.norm(dim=-1, keepdim=True)
        w_enc = w_dec.T.clone()
        if transcoder:  # the encoder reads another space than the decoder writes: small random columns
            w_enc = torch.randn(d_in, cfg.latents, generator=g)
            w_enc *= TRANSCODER_ENC_NORM / w_enc.norm(dim=0, keepdim=True)
        self.params = {
            "W_enc": w_enc.requires_grad_(),
            "b_enc": torch.zeros(cfg.latents, requires_grad=True),
            "W_dec": w_dec.requires_grad_(),
            "b_dec": mean.clone().requires_grad_(),
        }
        self.opt = torch.optim.Adam(self.params.values(), lr=cfg.lr)
        self.since_fired = torch.zeros(cfg.latents, dtype=torch.long)
        self.step = 0
        self.log: list[dict] = []

    def state_dict(self) -> dict:
        return {
            "params": {k: v.detach() for k, v in self.params.items()},
            "opt": self.opt.state_dict(),
            "since_fired": self.since_fired,
            "step": self.step,
            "log": self.log,
        }

    def load(self, saved: dict) -> None:
        with torch.no_grad():
            for k, v in saved["params"].items():
                self.params[k].copy_(v)
        self.opt.load_state_dict(saved["opt"])
        self.since_fired, self.step, self.log = saved["since_fired"], saved["step"], saved["log"]


def _loss(p: dict, x: torch.Tensor, y: torch.Tensor | None, cfg: SaeTrainConfig, since_fired: torch.Tensor):
    """Reconstruction loss + AuxK loss on one batch (``y``: a transcoder's targets; None: an
    SAE, which reconstructs ``x``), and the latents that fired."""
    pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"] if y is None else x @ p["W_enc"] + p["b_enc"]
    y = x if y is None else y
    val, idx = pre.topk(cfg.k, dim=-1)
    f = torch.zeros_like(pre).scatter(-1, idx, val.relu())
    recon = f @ p["W_dec"] + p["b_dec"]
    err = y - recon
    mse = err.pow(2).sum(-1).mean()
    dead = since_fired >= cfg.dead_tokens
    aux = torch.zeros(())
    k_aux = min(int(dead.sum()), y.shape[-1] // 2)
    if k_aux > 0:
        dead_pre = pre.masked_fill(~dead, float("-inf"))
        v, i = dead_pre.topk(k_aux, dim=-1)
        e_hat = torch.zeros_like(pre).scatter(-1, i, v.relu()) @ p["W_dec"]
        aux = (err.detach() - e_hat).pow(2).sum(-1).mean()
    fired = torch.zeros(pre.shape[-1], dtype=torch.bool).scatter(0, idx[val > 0].flatten(), True)
    total_var = (y - y.mean(0)).pow(2).sum(-1).mean()
    return mse + cfg.aux_coef * aux, mse, aux, fired, total_var


def _step(state: _State, x: torch.Tensor, y: torch.Tensor | None, cfg: SaeTrainConfig) -> None:
    loss, mse, aux, fired, total_var = _loss(state.params, x, y, cfg, state.since_fired)
    state.opt.zero_grad(set_to_none=True)
    loss.backward()
    state.opt.step()
    with torch.no_grad():
        w = state.params["W_dec"]
        w /= w.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    state.since_fired += x.shape[0]
    state.since_fired[fired] = 0
    state.step += 1
    if state.step % 10 == 0 or state.step == 1:
        state.log.append(
            {
                "step": state.step,
                "mse": float(mse.detach()),
                "variance_explained": 1 - float(mse.detach()) / max(float(total_var), 1e-12),
                "aux_loss": float(aux.detach()),
                "dead_fraction": float((state.since_fired >= cfg.dead_tokens).float().mean()),
            }
        )


def _fingerprint(cfg: SaeTrainConfig, n: int, d: int, d_out: int | None) -> dict:
    keep = asdict(cfg)
    keep.pop("progress")
    return {**keep, "rows": n, "d": d} | ({} if d_out is None else {"transcoder_d_out": d_out})


def _read(rows, idx, scale: float) -> torch.Tensor:
    return torch.as_tensor(np.asarray(rows[idx]), dtype=torch.float32) * scale


def train_topk(rows, cfg: SaeTrainConfig, *, targets=None, checkpoint: Path | None = None, bar=None, every: int = 50):
    """A TopK SAE trained on ``rows`` (``[n, d]``: a tensor, an array or a store's
    :class:`~depthscope.common.shards.ShardedFeats`) for ``cfg.epochs`` passes; with ``targets``
    (``[n, d_out]``, row ``i`` the target of input row ``i``), a TopK transcoder from ``rows`` to
    ``targets`` (module docstring). With ``checkpoint`` (a file), the state is saved atomically
    every ``every`` steps and a run with the same settings and rows resumes from it. ``bar``: a
    progress bar advanced per step. Returns ``(sae, log)``: the SAE (architecture ``topk``, or
    ``topk_transcoder``) folded to raw activations and the training log (rows every 10 steps)."""
    n, d = len(rows), rows.shape[-1]
    if n < cfg.batch_size:
        raise InputError(f"{n} training tokens are fewer than one batch of {cfg.batch_size}: lower --batch-size")
    if targets is not None and len(targets) != n:
        raise InputError(f"{n} input rows but {len(targets)} target rows: a transcoder needs one target per input")
    scale = input_scale(rows, seed=cfg.seed)
    out_rows, out_scale = (rows, scale) if targets is None else (targets, input_scale(targets, seed=cfg.seed))
    mean = _read(out_rows, np.arange(0, n, max(1, n // 16384)), out_scale).mean(0)
    state = _State(d, cfg, mean, transcoder=targets is not None)
    fp = _fingerprint(cfg, n, d, None if targets is None else targets.shape[-1])
    if checkpoint is not None and Path(checkpoint).is_file():
        saved = torch.load(checkpoint, weights_only=False)
        if saved.get("fingerprint") == fp:
            state.load(saved)
    per_epoch = n // cfg.batch_size
    total = per_epoch * cfg.epochs
    if bar is not None:
        bar.update(state.step)
    rng = np.random.default_rng(cfg.seed)
    for epoch in range(cfg.epochs):
        order = np.concatenate(list(_blocks(n, rng)))
        for b in range(per_epoch):
            if epoch * per_epoch + b < state.step:
                continue  # done before the checkpoint
            idx = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            idx = np.sort(idx)
            y = None if targets is None else _read(targets, idx, out_scale)
            _step(state, _read(rows, idx, scale), y, cfg)
            if bar is not None:
                bar.update(1)
            if checkpoint is not None and (state.step % every == 0 or state.step == total):
                saved = {**state.state_dict(), "fingerprint": fp}
                atomic_write(checkpoint, lambda tmp, s=saved: torch.save(s, tmp))
    if targets is None:
        return _folded(state.params, scale, scale, cfg.k), state.log
    return _folded(state.params, scale, out_scale, cfg.k, transcoder=True), state.log


def _folded(p: dict, s: float, t: float, k: int, *, transcoder: bool = False) -> SAE:
    """The SAE on raw activations: trained on ``s * x`` (and targets ``t * y``; ``t = s`` for an
    SAE), so ``W_enc`` is multiplied by ``s / t`` and ``b_enc``, ``b_dec`` divided by ``t`` (TopK
    and ReLU commute with a positive factor; the features come out divided by ``t``). An SAE's
    ``(x - b_dec) @ W_enc`` is unchanged by the same division, as ``s = t``."""
    w = {n: t_.detach().clone() for n, t_ in p.items()}
    arch = "topk_transcoder" if transcoder else "topk"
    w_enc = w["W_enc"] * (s / t) if transcoder else w["W_enc"]
    return SAE(
        w_enc, w["b_enc"] / t, w["W_dec"], w["b_dec"] / t, architecture=arch, k=k, apply_b_dec_to_input=not transcoder
    )


@torch.no_grad()
def sae_metrics(sae: SAE, rows, *, targets=None, batch: int = 4096) -> dict:
    """Fraction of variance explained ``1 - sum|y - y_hat|^2 / sum|y - mean|^2`` (``y``: the
    ``targets`` of a transcoder, else the ``rows``), mean L0 (active latents per token) and the
    fraction of latents that never fire, over ``rows``."""
    n = len(rows)
    if n == 0:
        raise InputError("no held-out tokens to evaluate the SAE on")
    err = tot = l0 = 0.0
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    y_rows = rows if targets is None else targets
    s1 = torch.zeros(y_rows.shape[-1], dtype=torch.float64)
    s2 = 0.0
    for a in range(0, n, batch):
        idx = np.arange(a, min(n, a + batch))
        x = _read(rows, idx, 1.0)
        y = x if targets is None else _read(targets, idx, 1.0)
        f = sae.encode(x)
        err += float((y - sae.decode(f, x)).double().pow(2).sum())
        s1 += y.double().sum(0)
        s2 += float(y.double().pow(2).sum())
        l0 += float((f > 0).sum())
        fired |= (f > 0).any(0)
    tot = s2 - float(s1.pow(2).sum()) / n
    return {
        "variance_explained": 1 - err / max(tot, 1e-30),
        "l0": l0 / n,
        "dead_fraction": float((~fired).float().mean()),
        "eval_tokens": n,
    }
