"""Training a tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers
with the Tuned Lens") at every residual site, sublayer sites included.

The lens object itself (:class:`~depthscope.analyses.lenses.TunedLens`: translate, save, load,
check) lives in :mod:`depthscope.analyses.lenses` beside the plain logit lens.

Each site ``s`` gets an affine translator ``h -> h + h A_s + b_s`` (identity at initialisation:
``A_s = 0``, ``b_s = 0``) applied to the stream before the model's own final norm and
unembedding. The translators are trained to minimise KL(final || lens) -- the model's own
next-token distribution against the translated lens -- on text. The last site (the model's
final stream) keeps the identity translator: its lens already is the model.

Training is sized for a CPU:

* the streams of ``cache_tokens`` tokens are captured once (one forward per batch, all sites),
* every step then trains all sites' translators together on ``tokens_per_step`` of those
  tokens: one batched ``[sites, d, d]`` matmul for the translators and one
  ``[tokens * sites, d] @ [d, vocab]`` unembedding (in bfloat16 where the CPU has native
  bfloat16 matmuls, ~3x faster than float32; evaluation with :func:`logit_lens` stays float32),
  with the softmax-KL gradient written out by hand so no ``[rows, vocab]`` autograd graph is kept,
* Adam with linear warm-up and decay over a bounded number of steps, a progress bar, and a
  checkpoint every ``checkpoint_every`` steps that ``resume=True`` continues from.

On SmolLM2-135M (61 sites) a step takes ~0.5 s on one CPU thread: the default 250 steps x 8
tokens train in ~3 minutes and cut the held-out KL(final || lens), averaged over sites, from
12.5 to 3.3 nats on UD English EWT text (embedding site: 102 -> 7 nats).

Bias parametrisation: ``b_s = rms_s * c_s`` with ``rms_s`` the stream's RMS at site ``s`` in the
training cache, so one learning rate suits every depth although stream norms grow ~10x from
the embedding to the last block. The saved ``bias`` is ``b_s`` itself.

Saved as a folder: ``tuned_lens.safetensors`` (``weight [sites, d, d]``, ``bias [sites, d]``)
and ``tuned_lens.json`` (sites, model fingerprint and weight digest, training record). Loading
it for a different model -- other architecture, tokenizer or weights -- is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from depthscope.analyses.lens import lens_batches
from depthscope.analyses.lenses import LensMismatchError, TunedLens, load_tensors, model_info, save_tensors, write_json
from depthscope.analyses.tuned_lens_config import TunedLensTraining
from depthscope.common.errors import CheckpointError, InputError
from depthscope.hooks.sites import parse_sites

__all__ = ["TunedLens", "TunedLensTraining", "train_tuned_lens", "LensMismatchError"]

CKPT_FILE = "checkpoint.safetensors"
CKPT_META = "checkpoint.json"


# ----------------------------------------------------------------------------- training
class _Buffers:
    """Reused ``[rows, vocab]`` work buffers: fresh 100-200 MB allocations every step cost page
    faults (a fifth of the step time on this CPU)."""

    def __init__(self):
        self._b: dict = {}

    def get(self, name: str, shape, dtype, device) -> torch.Tensor:
        t = self._b.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
            self._b[name] = None
            t = self._b[name] = torch.empty(shape, dtype=dtype, device=device)
        return t


class _KLUnembed(torch.autograd.Function):
    """KL(p || softmax(x W^T)) per row, with the gradient (q - p) W written out by hand.

    ``x``: [C*S, d] normed streams (token-major), ``W``: [V, d] (float32 or bfloat16), ``p``:
    [C, V] final distributions, ``neg_hp``: [C] sum p log p. Returns KL [C, S] in float32.
    ``bufs``: a :class:`_Buffers` (or None) whose float32 buffers hold q until the backward.
    """

    @staticmethod
    def forward(ctx, x, W, p, neg_hp, S: int, bufs=None):
        bufs = bufs or _Buffers()
        C, V = p.shape
        R, dev = C * S, x.device
        L = bufs.get("L", (R, V), torch.float32, dev)
        T = bufs.get("T", (R, V), torch.float32, dev)
        if W.dtype == torch.float32:
            torch.mm(x.float(), W.t(), out=T)
        else:
            Zb = bufs.get("Z", (R, V), W.dtype, dev)
            torch.mm(x.to(W.dtype), W.t(), out=Zb)
            T.copy_(Zb)
        torch.log_softmax(T, -1, out=L)
        torch.mul(L.view(C, S, V), p.unsqueeze(1), out=T.view(C, S, V))
        kl = neg_hp.unsqueeze(1) - T.sum(-1).view(C, S)
        ctx.q = L.exp_()  # a reused buffer: kept on ctx, untouched until the backward
        ctx.bufs = bufs
        ctx.S = S
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(p, W)
        return kl

    @staticmethod
    def backward(ctx, g):
        p, W = ctx.saved_tensors
        C, V = p.shape
        S = ctx.S
        gz = ctx.q.view(C, S, V).sub_(p.unsqueeze(1)).mul_(g.unsqueeze(2)).view(C * S, V)
        if W.dtype == torch.float32:
            gx = torch.mm(gz, W)
        else:
            Zb = ctx.bufs.get("Z", (C * S, V), W.dtype, gz.device)
            Zb.copy_(gz)
            gx = torch.mm(Zb, W)
        ctx.q = ctx.bufs = None
        return gx.to(ctx.x_dtype), None, None, None, None, None


def _kl_generic(model, x, p, neg_hp, S):
    """The same KL through ``model.unembed.project`` (biases, logit scales, soft-capping) with autograd."""
    C, V = p.shape
    lq = torch.log_softmax(model.unembed.project(x).float(), -1)
    return neg_hp.unsqueeze(1) - (lq.view(C, S, V) * p.unsqueeze(1)).sum(-1)


def _read_inputs(text, per_line: bool):
    from depthscope.analyses.text import read_documents

    if isinstance(text, (str, Path)):
        return read_documents(text, per_line=per_line)
    return text


def _cache_streams(model, inputs, train_sites, *, cache_tokens, window, batch_size, max_batch_tokens, progress):
    """Streams at ``train_sites`` and at the last site for the first ``cache_tokens`` real tokens."""
    last = model.n_sites - 1
    sites = sorted(set(train_sites) | {last})
    pos = [sites.index(s) for s in train_sites]
    X = torch.empty(len(train_sites), cache_tokens, model.d_model)  # filled in place: no concatenation copy
    Fin = torch.empty(cache_tokens, model.d_model)
    ids_seen = []
    n = 0
    bar = _bar(progress, total=cache_tokens, desc="capturing streams", unit="tok")
    with torch.inference_mode():
        for batch in lens_batches(
            model, inputs, batch_size=batch_size, window=window, max_batch_tokens=max_batch_tokens
        ):
            rs = model.residual_stream(batch.ids, mask=batch.mask, sites=sites, return_logits=False)
            m = rs.mask
            take = min(int(m.sum()), cache_tokens - n)
            x = rs.resid[:, m][:, :take]  # [S_all, take, d]
            X[:, n : n + take] = x[pos].cpu()
            Fin[n : n + take] = x[sites.index(last)].cpu()
            ids_seen.append(rs.input_ids[m][:take].cpu())
            n += take
            bar.update(take)
            if n >= cache_tokens:
                break
    bar.close()
    if n == 0:
        raise InputError("no tokens to train the tuned lens on")
    ids = torch.cat(ids_seen)
    digest = hashlib.sha1(ids.numpy().astype("int64").tobytes()).hexdigest()[:16]
    if n < cache_tokens:
        X, Fin = X[:, :n].clone(), Fin[:n].clone()
    return X, Fin, digest


def _bar(progress: bool, *, total=None, desc: str, unit: str = "it", **kw):
    from depthscope.common.progress import progress_bar

    return progress_bar(total, desc=desc, unit=unit, enabled=progress, **kw)


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    w = min(1.0, (step + 1) / max(1, warmup))
    decay = 1.0 - step / max(1, steps)
    return lr * w * max(decay, 0.0)


def train_tuned_lens(
    model,
    text,
    config: TunedLensTraining | None = None,
    *,
    out=None,
    per_line: bool = True,
    progress: bool = True,
    **overrides,
) -> TunedLens:
    """Train a tuned lens for ``model`` on ``text`` (a text file's path -- one document per line
    with ``per_line`` --, a list of documents or a LongTensor of token ids) and return it.

    ``config``: a :class:`TunedLensTraining` (its defaults when None); keyword ``overrides`` set
    single fields (``train_tuned_lens(model, docs, steps=40)``), unknown names are refused.
    ``out``: a folder where the lens and a training checkpoint (parameters, Adam state, step)
    are written every ``checkpoint_every`` steps and at the end; with ``resume`` a run whose
    checkpoint is there continues from it (the model, the cached tokens and the settings must
    match).

    The returned lens's ``training`` dict records the settings and, per step, the mean training
    KL over sites (``loss``) -- evaluate on held-out text with ``logit_lens(..., lens=lens)``.
    """
    known = {f.name for f in fields(TunedLensTraining)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(f"unknown tuned-lens setting(s) {unknown}; the settings are {sorted(known)}")
    cfg = replace(config or TunedLensTraining(), **overrides).validate()
    sites, steps, tokens_per_step, cache_tokens = cfg.sites, cfg.steps, cfg.tokens_per_step, cfg.cache_tokens
    lr, weight_lr, warmup, seed = cfg.lr, cfg.weight_lr, cfg.warmup, cfg.seed
    window, batch_size, max_batch_tokens = cfg.window, cfg.batch_size, cfg.max_batch_tokens
    checkpoint_every, resume, matmul_dtype = cfg.checkpoint_every, cfg.resume, cfg.matmul_dtype
    model.unembed.check()
    all_sites = parse_sites(sites, model.n_layers)
    last = model.n_sites - 1
    train_sites = [s for s in all_sites if s != last]
    d = model.d_model
    inputs = _read_inputs(text, per_line)

    matmul_dtype = _matmul_dtype(model, matmul_dtype)
    fast = model.unembed.is_plain_linear
    X, F, data_digest = _cache_streams(
        model,
        inputs,
        train_sites,
        cache_tokens=cache_tokens,
        window=window,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
    )
    N = F.shape[0]
    S = len(train_sites)
    scale = X.pow(2).mean(dim=(1, 2)).sqrt().clamp_min(1e-6) if S else torch.zeros(0)  # [S] stream RMS

    settings = {
        "sites": all_sites,
        "trained_sites": train_sites,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "cache_tokens": N,
        "lr": lr,
        "weight_lr": weight_lr,
        "warmup": warmup,
        "seed": seed,
        "matmul_dtype": matmul_dtype,
        "data_digest": data_digest,
        "window": window,
    }
    dev = model.device
    scale = scale.to(dev)
    A, c, state = _zero_translators(S, d, dev)
    start, history = 0, []
    out = Path(out) if out is not None else None
    info = model_info(model)
    if out is not None and resume and (out / CKPT_META).is_file():
        start, history = _resume(out, info, settings, A, c, state)

    Wm = model.unembed.matmul_weight(getattr(torch, matmul_dtype)) if fast else None

    def finish(step_done: int) -> TunedLens:
        return _save(model, out, all_sites, train_sites, A, c, scale, state, info, settings, history, step_done)

    if S == 0 or start >= steps:
        return finish(max(start, 0) if S else 0)

    order = _TokenOrder(N, tokens_per_step, seed)
    bufs = _Buffers()
    A.requires_grad_(True), c.requires_grad_(True)
    bar = _bar(progress, total=steps, initial=start, desc="training tuned lens", unit="step")
    t0 = time.perf_counter()
    for step in range(start, steps):
        idx = order(step)
        kl, gA, gc = _kl_and_grads(model, X[:, idx].to(dev), F[idx].to(dev), A, c, scale, Wm, bufs)
        t = step + 1
        with torch.no_grad():
            for P, G, m, v, base in (
                (A, gA, state["mA"], state["vA"], weight_lr),
                (c, gc, state["mc"], state["vc"], lr),
            ):
                _adam(P, G, m, v, _lr_at(step, steps, base, warmup), t)
        history.append(round(float(kl.detach().mean()), 5))
        bar.update(1)
        bar.set_postfix(kl=f"{history[-1]:.3f}")
        if (t % checkpoint_every == 0 or t == steps) and out is not None:
            finish(t)
    bar.close()
    settings["train_seconds"] = round(time.perf_counter() - t0, 1)
    A.requires_grad_(False), c.requires_grad_(False)
    return finish(steps)


def _zero_translators(S: int, d: int, dev):
    """Identity translators (``A = 0``, ``c = 0``) for ``S`` sites and zero Adam moments."""
    A = torch.zeros(S, d, d, device=dev)
    c = torch.zeros(S, d, device=dev)
    state = {"mA": torch.zeros_like(A), "vA": torch.zeros_like(A), "mc": torch.zeros_like(c), "vc": torch.zeros_like(c)}
    return A, c, state


def _matmul_dtype(model, matmul_dtype: str) -> str:
    """ "auto": bfloat16 where the CPU has native bfloat16 matmuls (a capability flag, not a
    timing), else float32."""
    if matmul_dtype == "auto":
        bf16_ok = model.device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        matmul_dtype = "bfloat16" if bf16_ok else "float32"
    if matmul_dtype not in ("bfloat16", "float32"):
        raise InputError(f"matmul_dtype must be 'auto', 'bfloat16' or 'float32', not {matmul_dtype!r}")
    return matmul_dtype


class _TokenOrder:
    """Token indices of each step: the cache drawn without replacement, one permutation per epoch."""

    def __init__(self, n: int, per_step: int, seed: int):
        self.n, self.per_step, self.seed = n, per_step, seed
        self.perms: dict[int, torch.Tensor] = {}

    def __call__(self, step: int) -> torch.Tensor:
        g = torch.arange(step * self.per_step, (step + 1) * self.per_step)
        epoch, off = g // self.n, g % self.n
        out_idx = torch.empty_like(g)
        for e in epoch.unique().tolist():
            if e not in self.perms:
                self.perms.clear()
                gen = torch.Generator().manual_seed(self.seed * 100003 + e)
                self.perms[e] = torch.randperm(self.n, generator=gen)
            sel = epoch == e
            out_idx[sel] = self.perms[e][off[sel]]
        return out_idx


def _kl_and_grads(model, xs, final, A, c, scale, Wm, bufs):
    """KL(final || lens) per (token, site) for streams ``xs`` [S, C, d] and final streams [C, d],
    and its mean's gradients with respect to the translators ``A`` and ``c``."""
    S, C, d = xs.shape
    with torch.no_grad():
        lp = torch.log_softmax(model.decode(final).float(), -1)  # the model's own final distribution
        p = lp.exp()
        neg_hp = (p * lp).sum(-1)
    with torch.enable_grad():
        h = torch.baddbmm(xs + (scale.unsqueeze(1) * c).unsqueeze(1), xs, A)  # [S, C, d]
        x = model.unembed.norm(h.transpose(0, 1).reshape(C * S, d))
        kl = _KLUnembed.apply(x, Wm, p, neg_hp, S, bufs) if Wm is not None else _kl_generic(model, x, p, neg_hp, S)
        gA, gc = torch.autograd.grad(kl.mean(), [A, c])
    return kl.detach(), gA, gc


def _adam(P, G, m, v, lr: float, t: int, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
    """One Adam update of ``P`` in place (moments ``m``, ``v``; ``t`` steps done, this one included)."""
    m.mul_(b1).add_(G, alpha=1 - b1)
    v.mul_(b2).addcmul_(G, G, value=1 - b2)
    step_lr = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    P.addcdiv_(m, v.sqrt().add_(eps), value=-step_lr)


def _save(model, out, all_sites, train_sites, A, c, scale, state, info, settings, history, step_done) -> TunedLens:
    """The lens after ``step_done`` steps; with ``out``, written there with a resumable checkpoint."""
    lens = _assemble(
        model, all_sites, train_sites, A, c, scale, info, {**settings, "steps_done": step_done, "loss": history}
    )
    if out is not None:
        lens.save(out)
        save_tensors(out / CKPT_FILE, {"A": A, "c": c, "scale": scale, **state})
        write_json(out / CKPT_META, {"step": step_done, "settings": settings, "model": info, "loss": history})
    return lens


def _assemble(model, all_sites, train_sites, A, c, scale, info, training) -> TunedLens:
    d = model.d_model
    weight = torch.zeros(len(all_sites), d, d)
    bias = torch.zeros(len(all_sites), d)
    with torch.no_grad():
        for i, s in enumerate(train_sites):
            j = all_sites.index(s)
            weight[j] = A[i]
            bias[j] = scale[i] * c[i]
    return TunedLens(all_sites, model.n_layers, weight, bias, info, training)


def _resume(out: Path, info: dict, settings: dict, A, c, state) -> tuple[int, list]:
    try:
        meta = json.loads((out / CKPT_META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{out / CKPT_META} is not valid JSON: {e}") from None
    old_model = meta.get("model", {})
    if {k: v for k, v in old_model.items() if k != "name"} != {k: v for k, v in info.items() if k != "name"}:
        raise LensMismatchError(
            f"the checkpoint in {out} was trained for {old_model.get('name')!r} (another model or "
            f"weights); use another output folder or start afresh (--no-resume; resume=False)"
        )
    old = meta.get("settings", {})
    keys = ["sites", "tokens_per_step", "cache_tokens", "seed", "data_digest", "lr", "weight_lr", "warmup", "window"]
    diff = [f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in keys if old.get(k) != settings.get(k)]
    if diff:
        raise InputError(
            f"cannot resume the checkpoint in {out}: settings or training text differ ({'; '.join(diff)}); "
            f"use the same settings, another output folder, or start afresh (--no-resume; resume=False)"
        )
    t = load_tensors(out / CKPT_FILE)
    with torch.no_grad():
        A.copy_(t["A"])
        c.copy_(t["c"])
        for k in state:
            state[k].copy_(t[k])
    return int(meta["step"]), list(meta.get("loss", []))
