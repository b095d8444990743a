"""Training a tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers
with the Tuned Lens") at every residual site, sublayer sites included.

The lens object itself (:class:`~depthscope.analyses.lens.lenses.TunedLens`: translate, save, load,
check) lives in :mod:`depthscope.analyses.lens.lenses` beside the plain logit lens.

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
  bfloat16 matmuls; evaluation with :func:`logit_lens` stays float32), with the softmax-KL
  gradient written out by hand so no ``[rows, vocab]`` autograd graph is kept,
* Adam with linear warm-up and decay over a bounded number of steps, a progress bar, and a
  checkpoint every ``checkpoint_every`` steps that ``resume=True`` continues from.

Bias parametrisation: ``b_s = rms_s * c_s`` with ``rms_s`` the stream's RMS at site ``s`` in the
training cache, so one learning rate suits every depth although stream norms grow by an order
of magnitude from the embedding to the last block. The saved ``bias`` is ``b_s`` itself.

Saved as a folder: ``tuned_lens.safetensors`` (``weight [sites, d, d]``, ``bias [sites, d]``)
and ``tuned_lens.json`` (sites, model fingerprint and weight digest, training record). Loading
it for a different model -- other architecture, tokenizer or weights -- is refused. The lens and
its checkpoint are written together (a staging folder, then renames that need no space): a full
disk leaves the previous lens and checkpoint, or none, never a part; the space they need is
checked before the streams are captured. ``checkpoint.json`` records the sha256 of
``checkpoint.safetensors``: a checkpoint that no longer matches it (or holds NaN/inf) is not
resumed -- a warning names it and training starts afresh. A step whose loss or gradients are
not finite stops training (:class:`~depthscope.common.errors.NonFiniteActivationError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from depthscope.analyses.lens.config import TunedLensTraining, check_memory
from depthscope.analyses.lens.lenses import (
    META_FILE,
    PARAMS_FILE,
    LensMismatchError,
    TunedLens,
    load_tensors,
    model_info,
    save_tensors,
    write_json,
)
from depthscope.analyses.lens.logit import lens_batches
from depthscope.analyses.text import read_documents
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import CheckpointError, InputError, NonFiniteActivationError, OutputError
from depthscope.common.files import is_place_error, output_error
from depthscope.common.progress import progress_bar
from depthscope.common.stamps import file_sha256
from depthscope.hooks.sites import parse_sites

__all__ = ["TunedLens", "TunedLensTraining", "train_tuned_lens", "LensMismatchError"]

CKPT_FILE = "checkpoint.safetensors"
CKPT_META = "checkpoint.json"
log = logging.getLogger(__name__)

#: the settings a resumed run must share with its checkpoint (the rest may change, e.g. ``steps``)
RESUME_KEYS = ["sites", "tokens_per_step", "cache_tokens", "seed", "data_digest", "lr", "weight_lr", "warmup", "window"]


# ----------------------------------------------------------------------------- the loss
class _Buffers:
    """Reused ``[rows, vocab]`` work buffers: a fresh allocation of that size every step would
    cost page faults on each first touch."""

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
        """KL per (token, site); keeps q (in a reused buffer) for the backward."""
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
        """The gradient with respect to ``x`` only: ``((q - p) * g) W``."""
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


def _kl_and_grads(model, xs, final, tr: _Translators, Wm, bufs: _Buffers):
    """KL(final || lens) per (token, site) for streams ``xs`` [S, C, d] and final streams [C, d],
    and its mean's gradients with respect to the translators ``tr.A`` and ``tr.c``. ``Wm``: the
    unembedding in the matmul dtype (plain linear unembeddings), else None (generic path)."""
    S, C, d = xs.shape
    with torch.no_grad():
        lp = torch.log_softmax(model.decode(final).float(), -1)  # the model's own final distribution
        p = lp.exp()
        neg_hp = (p * lp).sum(-1)
    with torch.enable_grad():
        h = torch.baddbmm(xs + (tr.scale.unsqueeze(1) * tr.c).unsqueeze(1), xs, tr.A)  # [S, C, d]
        x = model.unembed.norm(h.transpose(0, 1).reshape(C * S, d))
        kl = _KLUnembed.apply(x, Wm, p, neg_hp, S, bufs) if Wm is not None else _kl_generic(model, x, p, neg_hp, S)
        gA, gc = torch.autograd.grad(kl.mean(), [tr.A, tr.c])
    return kl.detach(), gA, gc


# ----------------------------------------------------------------------------- the data
def _read_inputs(text, per_line: bool):
    """Documents of a text file's path; lists of documents and token-id tensors as given."""
    if isinstance(text, (str, Path)):
        return read_documents(text, per_line=per_line)
    return text


def _cache_streams(model, inputs, train_sites: list[int], cfg: TunedLensTraining, progress: bool):
    """Streams ``X`` [S, n, d] at ``train_sites`` and ``Fin`` [n, d] at the last site for the
    first ``n = cfg.cache_tokens`` real tokens (fewer if the text is shorter), and a digest of
    those tokens (a resumed run must train on the same ones)."""
    last = model.n_sites - 1
    sites = sorted(set(train_sites) | {last})
    pos = [sites.index(s) for s in train_sites]
    X = torch.empty(len(train_sites), cfg.cache_tokens, model.d_model)  # filled in place: no concatenation copy
    Fin = torch.empty(cfg.cache_tokens, model.d_model)
    ids_seen = []
    n = 0
    bar = _bar(progress, total=cfg.cache_tokens, desc="capturing streams", unit="tok")
    text = TextWindows(window=cfg.window)  # the text read as the logit lens reads it (the BOS rule, windows)
    batches = lens_batches(model, inputs, batch_size=cfg.batch_size, max_batch_tokens=cfg.max_batch_tokens, text=text)
    with bar, torch.inference_mode():  # the bar is closed on error too
        for batch in batches:
            rs = model.residual_stream(batch.ids, mask=batch.mask, sites=sites, return_logits=False)
            m = rs.mask
            take = min(int(m.sum()), cfg.cache_tokens - n)
            x = rs.resid[:, m][:, :take]  # [S_all, take, d]
            X[:, n : n + take] = x[pos].cpu()
            Fin[n : n + take] = x[sites.index(last)].cpu()
            ids_seen.append(rs.input_ids[m][:take].cpu())
            n += take
            bar.update(take)
            if n >= cfg.cache_tokens:
                break
    if n == 0:
        raise InputError("no tokens to train the tuned lens on")
    if n < cfg.cache_tokens:
        X, Fin = X[:, :n].clone(), Fin[:n].clone()
    return X, Fin, _token_digest(torch.cat(ids_seen))


def _token_digest(ids: torch.Tensor) -> str:
    """A short digest of the cached token ids: what identifies the training text."""
    return hashlib.sha1(ids.numpy().astype("int64").tobytes()).hexdigest()[:16]


def _stream_rms(X: torch.Tensor) -> torch.Tensor:
    """[S] the RMS of each site's cached streams (the bias scale), kept away from 0."""
    if X.shape[0] == 0:
        return torch.zeros(0)
    return X.pow(2).mean(dim=(1, 2)).sqrt().clamp_min(1e-6)


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


def _bar(progress: bool, *, total=None, desc: str, unit: str = "it", **kw):
    """A progress bar (:mod:`depthscope.common.progress`), silent unless ``progress``."""
    return progress_bar(total, desc=desc, unit=unit, enabled=progress, **kw)


# ----------------------------------------------------------------------------- the optimiser
def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """The learning rate of step ``step`` (0-based): linear warm-up over ``warmup`` steps, then
    linear decay to 0 at ``steps``."""
    w = min(1.0, (step + 1) / max(1, warmup))
    decay = 1.0 - step / max(1, steps)
    return lr * w * max(decay, 0.0)


@dataclass(frozen=True)
class _Adam:
    """Adam's constants; :meth:`step` updates one parameter in place."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def step(self, P, G, m, v, lr: float, t: int) -> None:
        """One update of ``P`` by gradient ``G`` (moments ``m``, ``v``; ``t`` steps done, this one included)."""
        m.mul_(self.b1).add_(G, alpha=1 - self.b1)
        v.mul_(self.b2).addcmul_(G, G, value=1 - self.b2)
        step_lr = lr * math.sqrt(1 - self.b2**t) / (1 - self.b1**t)
        P.addcdiv_(m, v.sqrt().add_(self.eps), value=-step_lr)


ADAM = _Adam()


@dataclass
class _Translators:
    """What training updates, for ``S`` trained sites: the matrices ``A`` [S, d, d] and bias
    coefficients ``c`` [S, d] (the bias is ``scale * c``, ``scale`` [S] the streams' RMS), and
    Adam's moments of both (``mA``, ``vA``, ``mc``, ``vc``)."""

    A: torch.Tensor
    c: torch.Tensor
    scale: torch.Tensor
    moments: dict

    @classmethod
    def identity(cls, scale: torch.Tensor, d: int, device) -> _Translators:
        """Identity translators (``A = 0``, ``c = 0``) and zero moments."""
        S = len(scale)
        A = torch.zeros(S, d, d, device=device)
        c = torch.zeros(S, d, device=device)
        moments = {
            "mA": torch.zeros_like(A),
            "vA": torch.zeros_like(A),
            "mc": torch.zeros_like(c),
            "vc": torch.zeros_like(c),
        }
        return cls(A, c, scale.to(device), moments)

    def trainable(self, on: bool) -> None:
        self.A.requires_grad_(on)
        self.c.requires_grad_(on)

    def update(self, gA, gc, *, step: int, cfg: TunedLensTraining) -> None:
        """One Adam step of ``A`` (at ``weight_lr``) and ``c`` (at ``lr``), both on the schedule."""
        t = step + 1
        with torch.no_grad():
            for P, G, m, v, base in (
                (self.A, gA, self.moments["mA"], self.moments["vA"], cfg.weight_lr),
                (self.c, gc, self.moments["mc"], self.moments["vc"], cfg.lr),
            ):
                ADAM.step(P, G, m, v, _lr_at(step, cfg.steps, base, cfg.warmup), t)

    def tensors(self) -> dict:
        """Everything a checkpoint holds, by name."""
        return {"A": self.A, "c": self.c, "scale": self.scale, **self.moments}

    def restore(self, t: dict) -> None:
        """Copy a checkpoint's translators and moments in place."""
        with torch.no_grad():
            self.A.copy_(t["A"])
            self.c.copy_(t["c"])
            for k, m in self.moments.items():
                m.copy_(t[k])


# ----------------------------------------------------------------------------- training
@dataclass
class _Run:
    """The fixed context of one training run: the model, the sites (all, and those trained:
    all but the last), the model's identity, the settings record (what the lens's ``training``
    dict and the checkpoint hold) and the output folder (None: nothing written)."""

    model: object
    all_sites: list[int]
    train_sites: list[int]
    info: dict
    settings: dict
    out: Path | None


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
    cfg = _config(config, overrides)
    model.unembed.check()
    all_sites = parse_sites(cfg.sites, model.n_layers)
    train_sites = [s for s in all_sites if s != model.n_sites - 1]
    inputs = _read_inputs(text, per_line)
    if out is not None:
        _check_space(Path(out), len(all_sites), len(train_sites), model.d_model)
    check_memory(cfg, sites=len(train_sites) + 1, d_model=model.d_model, vocab=model.vocab_size)
    matmul_dtype = _matmul_dtype(model, cfg.matmul_dtype)
    X, F, data_digest = _cache_streams(model, inputs, train_sites, cfg, progress)
    settings = _settings_record(cfg, all_sites, train_sites, F.shape[0], matmul_dtype, data_digest)
    run = _Run(model, all_sites, train_sites, model_info(model), settings, None if out is None else Path(out))
    tr = _Translators.identity(_stream_rms(X), model.d_model, model.device)
    start, history = 0, []
    if run.out is not None and cfg.resume and (run.out / CKPT_META).is_file():
        start, history = _resume(run, tr)
    if not train_sites or start >= cfg.steps:
        return _save(run, tr, history, max(start, 0) if train_sites else 0)
    return _train(run, tr, (X, F), cfg, start=start, history=history, progress=progress)


def _config(config: TunedLensTraining | None, overrides: dict) -> TunedLensTraining:
    """``config`` (default: the defaults) with single fields overridden, validated; unknown
    field names are refused."""
    known = {f.name for f in fields(TunedLensTraining)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(f"unknown tuned-lens setting(s) {unknown}; the settings are {sorted(known)}")
    return replace(config or TunedLensTraining(), **overrides).validate()


def _settings_record(cfg, all_sites, train_sites, n_cached: int, matmul_dtype: str, data_digest: str) -> dict:
    """What the lens's ``training`` dict and the checkpoint record of the settings (a resumed
    run must match the :data:`RESUME_KEYS` of it)."""
    return {
        "sites": all_sites,
        "trained_sites": train_sites,
        "steps": cfg.steps,
        "tokens_per_step": cfg.tokens_per_step,
        "cache_tokens": n_cached,
        "lr": cfg.lr,
        "weight_lr": cfg.weight_lr,
        "warmup": cfg.warmup,
        "seed": cfg.seed,
        "matmul_dtype": matmul_dtype,
        "data_digest": data_digest,
        "window": cfg.window,
    }


def _matmul_dtype(model, matmul_dtype: str) -> str:
    """ "auto": bfloat16 where the CPU has native bfloat16 matmuls (a capability flag, not a
    timing), else float32."""
    if matmul_dtype == "auto":
        bf16_ok = model.device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        matmul_dtype = "bfloat16" if bf16_ok else "float32"
    if matmul_dtype not in ("bfloat16", "float32"):
        raise InputError(f"matmul_dtype must be 'auto', 'bfloat16' or 'float32', not {matmul_dtype!r}")
    return matmul_dtype


def _train(run: _Run, tr: _Translators, cache, cfg: TunedLensTraining, *, start: int, history: list, progress: bool):
    """Steps ``start..cfg.steps`` on the cached streams ``cache = (X, F)``, a checkpoint every
    ``checkpoint_every`` steps (with an output folder); returns the trained lens."""
    model, (X, F) = run.model, cache
    dev = model.device
    fast = model.unembed.is_plain_linear  # the hand-written KL gradient; else autograd through project
    Wm = model.unembed.matmul_weight(getattr(torch, run.settings["matmul_dtype"])) if fast else None
    order = _TokenOrder(F.shape[0], cfg.tokens_per_step, cfg.seed)
    bufs = _Buffers()
    tr.trainable(True)
    bar = _bar(progress, total=cfg.steps, initial=start, desc="training tuned lens", unit="step")
    t0 = time.perf_counter()
    with bar:  # closed on error too (a non-finite step, a full disk)
        for step in range(start, cfg.steps):
            idx = order(step)
            kl, gA, gc = _kl_and_grads(model, X[:, idx].to(dev), F[idx].to(dev), tr, Wm, bufs)
            _check_finite(kl, gA, gc, step=step + 1)
            tr.update(gA, gc, step=step, cfg=cfg)
            history.append(round(float(kl.detach().mean()), 5))
            bar.update(1)
            bar.set_postfix(kl=f"{history[-1]:.3f}")
            t = step + 1
            if (t % cfg.checkpoint_every == 0 or t == cfg.steps) and run.out is not None:
                _save(run, tr, history, t)
    run.settings["train_seconds"] = round(time.perf_counter() - t0, 1)
    tr.trainable(False)
    return _save(run, tr, history, cfg.steps)


def _save(run: _Run, tr: _Translators, history: list, step_done: int) -> TunedLens:
    """The lens after ``step_done`` steps; with an output folder, written there with a
    resumable checkpoint, all four files together (:func:`_write_together`)."""
    lens = _assemble(run, tr, {**run.settings, "steps_done": step_done, "loss": history})
    if run.out is not None:
        meta = {"step": step_done, "settings": run.settings, "model": run.info, "loss": history}

        def write(folder: Path) -> None:
            lens.save(folder)
            save_tensors(folder / CKPT_FILE, tr.tensors())
            write_json(folder / CKPT_META, {**meta, "checkpoint_sha256": file_sha256(folder / CKPT_FILE)})

        _write_together(run.out, write)
    return lens


#: the files of a saved lens and its checkpoint, in the order they are renamed into place
SAVED_FILES = (CKPT_FILE, CKPT_META, PARAMS_FILE, META_FILE)


def _write_together(out: Path, write) -> None:
    """``write(folder)`` into a staging folder inside ``out``, then each file renamed into ``out``
    (a rename needs no space). A failure -- a full disk, a read-only place -- removes the staging
    folder: ``out`` keeps the previous lens and checkpoint (or none), never a part of a new one;
    the place's errors are an :class:`~depthscope.common.errors.OutputError` naming ``out``."""
    stage = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".tuned-lens-staging.", dir=out))
        write(stage)
        for name in SAVED_FILES:
            if (stage / name).exists():
                os.replace(stage / name, out / name)
    except OutputError as e:  # raised for a file in the staging folder: name the output folder
        cause = e.__cause__
        raise (output_error(out, cause) if is_place_error(cause) else e) from cause
    except OSError as e:
        if is_place_error(e):
            raise output_error(out, e) from e
        raise
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


def saved_bytes(n_sites: int, n_trained: int, d_model: int) -> int:
    """Bytes of a saved lens (``weight``, ``bias`` of every site) and its checkpoint (``A``, ``c``
    and Adam's two moments of each, ``scale``, of the trained sites), float32, plus the JSON files."""
    per_site = d_model * d_model + d_model
    return 4 * (n_sites * per_site + n_trained * (3 * per_site + 1)) + (1 << 20)


def _check_space(out: Path, n_sites: int, n_trained: int, d_model: int) -> None:
    """Refuse, before any compute, an output folder whose disk cannot take the lens and its
    checkpoint (a staging copy is written beside the previous one)."""
    need = saved_bytes(n_sites, n_trained, d_model)
    place = next((p for p in [out, *out.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(place).free
    if free < need:
        raise OutputError(
            f"cannot write the tuned lens to {out}: it and its checkpoint need {need / 2**20:.1f} MiB and the disk "
            f"has {free / 2**20:.1f} MiB free (free some space or use another --out)"
        )


def _assemble(run: _Run, tr: _Translators, training: dict) -> TunedLens:
    """A :class:`TunedLens` over all sites: the trained translators, identity at the rest."""
    d = run.model.d_model
    weight = torch.zeros(len(run.all_sites), d, d)
    bias = torch.zeros(len(run.all_sites), d)
    with torch.no_grad():
        for i, s in enumerate(run.train_sites):
            j = run.all_sites.index(s)
            weight[j] = tr.A[i]
            bias[j] = tr.scale[i] * tr.c[i]
    return TunedLens(run.all_sites, run.model.n_layers, weight, bias, run.info, training)


def _resume(run: _Run, tr: _Translators) -> tuple[int, list]:
    """Load the checkpoint in ``run.out`` into ``tr``; returns the steps done and the loss
    history. Refused for another model or other settings or training text."""
    out = run.out
    try:
        meta = json.loads((out / CKPT_META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{out / CKPT_META} is not valid JSON: {e}") from None
    old_model = meta.get("model", {})
    if {k: v for k, v in old_model.items() if k != "name"} != {k: v for k, v in run.info.items() if k != "name"}:
        raise LensMismatchError(
            f"the checkpoint in {out} was trained for {old_model.get('name')!r} (another model or "
            f"weights); use another output folder or start afresh (--no-resume; resume=False)"
        )
    old, new = meta.get("settings", {}), run.settings
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in RESUME_KEYS if old.get(k) != new.get(k)]
    if diff:
        raise InputError(
            f"cannot resume the checkpoint in {out}: settings or training text differ ({'; '.join(diff)}); "
            f"use the same settings, another output folder, or start afresh (--no-resume; resume=False)"
        )
    problem = _checkpoint_problem(out / CKPT_FILE, meta.get("checkpoint_sha256"))
    tensors = load_tensors(out / CKPT_FILE) if problem is None else {}
    if problem is None and not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        problem = "it holds NaN or inf values"
    if problem is not None:
        log.warning("not resuming from %s: %s; training starts afresh", out / CKPT_FILE, problem)
        return 0, []
    tr.restore(tensors)
    return int(meta["step"]), list(meta.get("loss", []))


def _checkpoint_problem(path: Path, recorded: str | None) -> str | None:
    """Why the checkpoint tensors at ``path`` cannot be trusted -- their sha256 differs from the
    one its JSON ``recorded`` (a corrupt or replaced file) -- or None. Checkpoints of older
    versions record no digest: nothing to compare."""
    if recorded is not None and file_sha256(path) != recorded:
        return f"it does not match the sha256 recorded in {path.parent / CKPT_META} (corrupt or replaced)"
    return None


def _check_finite(kl: torch.Tensor, gA: torch.Tensor, gc: torch.Tensor, *, step: int) -> None:
    """Stop training at the first step whose loss or gradients are NaN or inf, before the
    translators are updated or saved (the last checkpoint stays the last good one)."""
    if not all(bool(torch.isfinite(t).all()) for t in (kl, gA, gc)):
        bad = "loss" if not bool(torch.isfinite(kl).all()) else "gradient"
        raise NonFiniteActivationError(
            f"the tuned-lens training {bad} is NaN or inf at step {step}: the model's streams or the "
            f"translators are not finite; nothing of this step was saved (check the model, or lower --lr)"
        )
