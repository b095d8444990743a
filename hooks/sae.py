"""Sparse autoencoders and transcoders in SAELens's on-disk layout, without sae-lens.

A folder holds ``cfg.json`` and ``sae_weights.safetensors`` (``W_enc [d_in, d_sae]``,
``b_enc [d_sae]``, ``W_dec [d_sae, d_out]``, ``b_dec [d_out]``, and ``threshold [d_sae]`` for
JumpReLU, ``W_skip [d_out, d_in]`` for skip transcoders). The config is SAELens 6's (``metadata``
holds ``hook_name``) or an older one (``hook_name``/``hook_point`` at the top level).

=======================  ==================================================================
offers                   what
=======================  ==================================================================
:class:`SAE`             the weights and settings; ``encode``, ``decode``, ``reconstruct``
:func:`load_sae`         a folder -> :class:`SAE` (clear errors for what it cannot run)
:func:`save_sae`         :class:`SAE` -> a folder that ``sae_lens.SAE.load_from_disk`` loads
:func:`sae_point`        the depthscope hook point an SAE reads (and a transcoder writes)
``ARCHITECTURES``        the architectures encoded here
=======================  ==================================================================

``encode`` follows SAELens (``sae_lens/saes/*_sae.py``): the input is cast to the SAE's dtype,
normalised if the config asks (``constant_norm_rescale``, ``layer_norm``), ``b_dec`` is
subtracted when ``apply_b_dec_to_input``, then ``pre = x @ W_enc + b_enc`` and

- ``standard``, ``transcoder``: ``relu(pre)``;
- ``topk``, ``topk_transcoder``: the ``k`` largest entries of ``pre`` (times the decoder norms
  when ``rescale_acts_by_decoder_norm``), ReLU'd, the rest zero;
- ``jumprelu``, ``jumprelu_transcoder``: ``relu(pre)`` where ``pre > threshold``, else zero.

``decode`` is ``f @ W_dec + b_dec`` (TopK with decoder-norm rescaling divides ``f`` by the norms
first), undoing the input normalisation; skip transcoders add ``x @ W_skip.T``. Transcoders read
one point (the MLP's input) and write another (the MLP's output); an SAE writes where it reads.

``topk_transcoder`` is depthscope's name for a TopK transcoder (what ``depthscope transcoders
train`` writes): SAELens 6 has TopK SAEs and ReLU/JumpReLU/skip transcoders but no TopK
transcoder class, so ``sae_lens.SAE.load_from_disk`` refuses that one architecture; its folder
is otherwise SAELens's (``k`` in ``cfg.json``, ``d_out``, ``metadata.hook_name_out``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text, atomic_write
from depthscope.hooks.points import Point, parse_point

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = (
    "standard",
    "topk",
    "jumprelu",
    "transcoder",
    "skip_transcoder",
    "jumprelu_transcoder",
    "topk_transcoder",
)
TRANSCODERS = ("transcoder", "skip_transcoder", "jumprelu_transcoder", "topk_transcoder")
#: the architectures that keep the ``k`` largest pre-activations
TOPK = ("topk", "topk_transcoder")
NORMALISATIONS = ("none", "constant_norm_rescale", "layer_norm")
#: the SAELens version written into saved configs (6.x reads ``metadata``)
SAELENS_FORMAT = "6.0.0"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: TransformerLens names of a transcoder's output when the config names none: the MLP's write
_MLP_OUT = "hook_mlp_out"


@dataclass
class SAE:
    """A sparse autoencoder (or transcoder): weights as tensors plus the settings ``encode`` needs.

    ``hook_name`` is the TransformerLens-style name it was trained at (resolved against a model
    by :func:`sae_point`), ``hook_name_out`` a transcoder's output point. ``cfg`` keeps the
    whole config read from disk so a save writes back what it does not interpret; ``source``
    the folder it was loaded from (its messages name it)."""

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    architecture: str = "standard"
    hook_name: str | None = None
    hook_name_out: str | None = None
    k: int | None = None
    threshold: torch.Tensor | None = None
    W_skip: torch.Tensor | None = None
    apply_b_dec_to_input: bool = True
    rescale_acts_by_decoder_norm: bool = False
    normalize_activations: str = "none"
    reshape_hook_z: bool = False
    cfg: dict = field(default_factory=dict)
    source: str | None = None

    def __repr__(self) -> str:
        k = f", k={self.k}" if self.k else ""
        out = f" -> {self.hook_name_out!r}" if self.hook_name_out else ""
        where = f", from {self.source!r}" if self.source else ""
        return (
            f"SAE({self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}{k}, hook={self.hook_name!r}{out}, "
            f"dtype={str(self.dtype).removeprefix('torch.')}{where})"
        )

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def is_transcoder(self) -> bool:
        return self.architecture in TRANSCODERS

    def to(self, device=None, dtype=None) -> SAE:
        """A copy with every weight on ``device`` / in ``dtype``."""
        move = {n: getattr(self, n) for n in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")}
        return replace(self, **{n: None if t is None else t.to(device=device, dtype=dtype) for n, t in move.items()})

    def _norm_in(self, x: torch.Tensor):
        """The input normalised as the config asks, and how to undo it on the output."""
        if self.normalize_activations == "constant_norm_rescale":
            coeff = math.sqrt(self.d_in) / x.norm(dim=-1, keepdim=True)
            return x * coeff, lambda y: y / coeff
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            std = (x - mu).std(dim=-1, keepdim=True)
            return (x - mu) / (std + 1e-5), lambda y: y * std + mu
        return x, lambda y: y

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(-2) if self.reshape_hook_z else x

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - b_dec) @ W_enc + b_enc`` on the normalised input (before the activation)."""
        x, _ = self._norm_in(self._flat(x).to(self.dtype))
        if self.apply_b_dec_to_input and not self.is_transcoder:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` of activations ``x [..., d_in]`` (in the SAE's dtype)."""
        pre = self.pre_activations(x)
        if self.architecture in TOPK:
            if self.rescale_acts_by_decoder_norm:
                pre = pre * self.W_dec.norm(dim=-1)
            values, index = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter(-1, index, values.relu())
        acts = pre.relu()
        if self.threshold is not None:
            acts = acts * (pre > self.threshold).to(acts.dtype)
        return acts

    def decode(self, features: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction ``features @ W_dec + b_dec`` (undoing the input normalisation of ``x``,
        which a normalising SAE and a skip transcoder need)."""
        if self.architecture in TOPK and self.rescale_acts_by_decoder_norm:
            features = features / self.W_dec.norm(dim=-1)
        out = features @ self.W_dec + self.b_dec
        if x is not None:
            xf = self._flat(x).to(self.dtype)
            if not self.is_transcoder:
                out = self._norm_in(xf)[1](out)
            if self.W_skip is not None:
                out = out + xf @ self.W_skip.T
        elif self.normalize_activations != "none" or self.W_skip is not None:
            raise InputError(f"decoding this SAE ({self.architecture}, {self.normalize_activations}) needs its input x")
        return out.unflatten(-1, x.shape[-2:]) if self.reshape_hook_z and x is not None else out

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x), x)``, in the SAE's dtype."""
        return self.decode(self.encode(x), x)


def sae_point(sae: SAE, n_layers: int, *, out: bool = False) -> Point:
    """The hook point an SAE reads (``out=True``: the point a transcoder writes), from its hook
    name (a TransformerLens name such as ``blocks.6.hook_resid_post`` or a depthscope name)."""
    name = sae.hook_name_out if out else sae.hook_name
    if out and name is None:
        name = _default_out(sae.hook_name)
    if name is None:
        raise InputError("this SAE names no hook point (cfg.json metadata.hook_name): attach it by point name")
    try:
        return parse_point(name, n_layers)
    except InputError as e:
        raise InputError(f"the SAE's hook {name!r} is no hook point of this model: {e}") from None


def _default_out(hook_in: str | None) -> str | None:
    """A transcoder's output when the config names none: the MLP write of the same block."""
    if hook_in is None:
        return None
    parts = hook_in.split(".")
    if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit():
        return f"blocks.{parts[1]}.{_MLP_OUT}"
    if parts[0].isdigit():
        return f"{parts[0]}.mlp_out"
    return None


def _read_cfg(folder: Path) -> dict:
    path = folder / CFG_FILE
    if not path.is_file():
        raise InputError(f"{folder} is not an SAE folder: no {CFG_FILE} (SAELens layout: {CFG_FILE} + {WEIGHTS_FILE})")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: the config is not a JSON object")
    return cfg


def _settings(cfg: dict, path: Path) -> dict:
    """The fields :class:`SAE` takes, from a SAELens 6 or older config; refuses what it cannot run."""
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    arch = cfg.get("architecture", "standard")
    if cfg.get("activation_fn") == "topk" or cfg.get("activation_fn_str") == "topk":
        arch, cfg = "topk", {**cfg, "k": (cfg.get("activation_fn_kwargs") or {}).get("k", cfg.get("k"))}
    if arch not in ARCHITECTURES:
        raise InputError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    norm = cfg.get("normalize_activations") or "none"
    norm = "none" if norm is False else norm
    if norm not in NORMALISATIONS:
        raise InputError(
            f"{path}: normalize_activations={norm!r} needs a dataset-wide scaling factor that the folder does not "
            f"hold (supported: {', '.join(NORMALISATIONS)}); fold it into the weights first"
        )
    k = cfg.get("k")
    if arch in TOPK and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise InputError(f"{path}: a {arch} SAE needs an integer k >= 1, got {k!r}")
    hook = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    return {
        "architecture": arch,
        "hook_name": hook,
        "hook_name_out": meta.get("hook_name_out") or cfg.get("hook_name_out"),
        "k": k if arch in TOPK else None,
        "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", arch not in TRANSCODERS)),
        "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        "normalize_activations": norm,
        "reshape_hook_z": cfg.get("reshape_activations") == "hook_z",
    }


def _read_weights(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InputError(f"{path.parent} is not an SAE folder: no {WEIGHTS_FILE}")
    try:
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    if "log_threshold" in state:  # older JumpReLU checkpoints
        state["threshold"] = state.pop("log_threshold").exp()
    scale = state.pop("scaling_factor", None)
    if scale is not None and not torch.all(scale == 1):
        raise InputError(f"{path}: a finetuning scaling factor is not supported; fold it into W_dec first")
    return {k: v.to(dtype) if dtype is not None else v for k, v in state.items()}


def _check_shapes(state: dict, arch: str, path: Path) -> None:
    need = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if "jumprelu" in arch else [])
    need += ["W_skip"] if arch == "skip_transcoder" else []
    missing = [n for n in need if n not in state]
    if missing:
        raise InputError(f"{path}: missing weights {missing} for a {arch} SAE (found {sorted(state)})")
    d_in, d_sae = state["W_enc"].shape if state["W_enc"].ndim == 2 else (None, None)
    d_out = state["b_dec"].shape[0] if state["b_dec"].ndim == 1 else None
    want = {"b_enc": (d_sae,), "W_dec": (d_sae, d_out), "threshold": (d_sae,), "W_skip": (d_out, d_in)}
    bad = [
        f"{n} {tuple(state[n].shape)} (expected {want[n]})"
        for n in want
        if n in state and tuple(state[n].shape) != want[n]
    ]
    if d_in is None or d_out is None or bad:
        raise InputError(
            f"{path}: weight shapes do not fit together: W_enc {tuple(state['W_enc'].shape)}, " + ", ".join(bad)
        )
    if arch not in TRANSCODERS and d_out != d_in:
        raise InputError(f"{path}: an SAE decodes into its input space, but d_in={d_in} and d_out={d_out}")
    for n in need:
        if not torch.isfinite(state[n].float()).all():
            raise InputError(f"{path}: {n} holds NaN or infinite values")


def load_sae(path, *, dtype: torch.dtype | str | None = None, device=None) -> SAE:
    """Read an SAE or transcoder from a folder in SAELens's layout (``cfg.json`` +
    ``sae_weights.safetensors``). ``dtype``: None keeps the stored one (SAELens converts to the
    config's ``dtype``; pass it to match). Unsupported settings are an :class:`InputError` that
    names them, never a silently different SAE."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"no SAE folder at {folder}")
    cfg = _read_cfg(folder)
    settings = _settings(cfg, folder / CFG_FILE)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InputError(f"unknown dtype {dtype!r}; one of {list(_DTYPES)}")
        dtype = _DTYPES[dtype]
    state = _read_weights(folder / WEIGHTS_FILE, dtype)
    _check_shapes(state, settings["architecture"], folder / WEIGHTS_FILE)
    k = settings["k"]
    if k is not None and k > state["W_enc"].shape[1]:
        raise InputError(f"{folder / CFG_FILE}: k={k} exceeds the number of latents {state['W_enc'].shape[1]}")
    weights = {n: state.get(n) for n in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")}
    sae = SAE(**weights, **settings, cfg=cfg, source=str(folder))
    return sae.to(device=device) if device is not None else sae


def save_sae(sae: SAE, path, *, model_name: str | None = None, extra_metadata: dict | None = None) -> Path:
    """Write ``sae`` to a folder in SAELens 6's layout (``sae_lens.SAE.load_from_disk`` loads it).
    Each file is written atomically; the folder is created if needed."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    state.update({n: t for n, t in (("threshold", sae.threshold), ("W_skip", sae.W_skip)) if t is not None})
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(state, tmp))
    dtype = next(n for n, d in _DTYPES.items() if d == sae.dtype)
    meta = {**(sae.cfg.get("metadata") or {}), "sae_lens_version": SAELENS_FORMAT, "hook_name": sae.hook_name}
    meta.update({"model_name": model_name} if model_name else {})
    meta.update({"hook_name_out": sae.hook_name_out} if sae.hook_name_out else {})
    meta.update(extra_metadata or {})
    cfg = {
        "architecture": sae.architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": dtype,
        "device": "cpu",
        "apply_b_dec_to_input": sae.apply_b_dec_to_input,
        "normalize_activations": sae.normalize_activations,
        "reshape_activations": "hook_z" if sae.reshape_hook_z else "none",
        "metadata": meta,
    }
    cfg.update({"k": sae.k, "rescale_acts_by_decoder_norm": sae.rescale_acts_by_decoder_norm} if sae.k else {})
    cfg.update({"d_out": sae.d_out} if sae.is_transcoder else {})
    atomic_text(folder / CFG_FILE, json.dumps(cfg, indent=2))
    return folder
