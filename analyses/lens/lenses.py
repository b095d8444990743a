"""Lenses: interchangeable ways to read a site's stream through the model's own decoding.

A lens turns the stream at a site into next-token logits: it may first *translate* the stream
(a tuned lens's affine map per site), then decodes it with the model's
:class:`~depthscope.hooks.unembed.Unembed` (final norm + unembedding). Analyses
(:func:`~depthscope.analyses.lens.logit.logit_lens`, :func:`~depthscope.analyses.lens.logit.logit_lens_tokens`)
take any lens object; the default is the plain :class:`LogitLens`.

====================  ===========================================================================
:class:`Lens`         the interface: ``kind``, ``check(model)``, ``resolve_sites(model, sites)``,
                      ``translate(xs, sites)``, ``logits(model, xs, sites)``
:class:`LogitLens`    no translation (nostalgebraist 2020)
:class:`TunedLens`    an affine translator per site, saved as a folder (Belrose et al. 2023);
                      trained by :func:`depthscope.analyses.lens.tuned.train_tuned_lens`;
                      ``load`` also reads the ``tuned-lens`` package's folders
                      (:mod:`depthscope.analyses.lens.interop`, which also writes them)
:func:`model_info`    what identifies the model a lens belongs to (fingerprint, name, digest:
                      :func:`~depthscope.hooks.stream_identity.store_digest`, which reads no
                      block of a streamed model)
====================  ===========================================================================
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from depthscope.common.digest import ALGORITHM, model_digest
from depthscope.common.errors import CheckpointError, InputError
from depthscope.common.files import atomic_text, atomic_write, json_text
from depthscope.common.stamps import file_sha256
from depthscope.hooks.sites import parse_sites, site_labels
from depthscope.hooks.stream_identity import ALGORITHM as STREAMED
from depthscope.hooks.stream_identity import store_digest, streamed_digest

__all__ = ["Lens", "LogitLens", "TunedLens", "LensMismatchError", "model_info"]

FORMAT = "depthscope-tuned-lens"
VERSION = 1
PARAMS_FILE = "tuned_lens.safetensors"
META_FILE = "tuned_lens.json"


class LensMismatchError(InputError):
    """A tuned lens used with a model it was not trained for."""


def _identity(model) -> dict:
    """The model's fingerprint and name."""
    info = dict(model.fingerprint())
    info["name"] = model.name
    return info


def model_info(model) -> dict:
    """The model a lens belongs to: its fingerprint, name and weight digest
    (:func:`~depthscope.hooks.stream_identity.store_digest`: every weight of a model in memory; a
    streamed model's files' headers and versions, without a read of its blocks) and its algorithm."""
    info = _identity(model)
    info["digest"] = store_digest(model)
    info["digest_algorithm"] = STREAMED if getattr(model, "streamer", None) is not None else ALGORITHM
    return info


def _weights_differ(mine: dict, model) -> list[str]:
    """Why ``model``'s weights are not those a lens recorded (``mine``), computed as it recorded them:
    the full digest for a lens of a model in memory (of a streamed model too: every weight read),
    the files' identity for a lens of a streamed model (a model in memory has none to compare)."""
    streamed = getattr(model, "streamer", None) is not None
    if mine.get("digest_algorithm") == ALGORITHM:
        theirs = model_digest(model)
    elif mine.get("digest_algorithm") == STREAMED and streamed:
        theirs = streamed_digest(model)
    elif mine.get("digest_algorithm") == STREAMED:
        return [
            "weights: the lens records a streamed checkpoint's files, which a model in memory cannot be "
            "compared with; load the model with stream=True, or the lens with strict=False if it is this model's"
        ]
    else:
        return [
            "weights: the lens records a weight digest of an older depthscope, which cannot be "
            "compared; load it with strict=False if it is this model's"
        ]
    return [] if theirs == mine.get("digest") else [f"weights: lens digest {mine.get('digest')} vs model {theirs}"]


def _parse(sites, model) -> list[int]:
    try:
        return parse_sites(sites, model.n_layers)
    except (KeyError, IndexError) as e:
        raise InputError(str(e).strip("'\"")) from None


class Lens:
    """The lens interface. ``kind`` names it in tables (the ``lens`` column)."""

    kind = "lens"

    def check(self, model) -> None:
        """Refuse a model this lens cannot read (raises a DepthscopeError)."""
        raise NotImplementedError

    def resolve_sites(self, model, sites=None) -> list[int]:
        """Site indices for ``sites`` (indices, labels, TransformerLens names; None: the default)."""
        raise NotImplementedError

    def translate(self, xs: torch.Tensor, sites: Sequence[int]) -> torch.Tensor:
        """Streams ``[len(sites), n, d]`` as this lens reads them before decoding."""
        raise NotImplementedError

    def logits(self, model, xs: torch.Tensor, sites: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(sites), n, vocab]`` of streams ``xs`` ``[len(sites), n, d]``: translated,
        then decoded by ``model.unembed`` (the same for every lens)."""
        return model.unembed(self.translate(xs, sites))


class LogitLens(Lens):
    """The plain logit lens: every site's stream decoded as the model decodes its last one."""

    kind = "logit"

    def __repr__(self) -> str:
        return "LogitLens()"

    def check(self, model) -> None:
        model.unembed.check()

    def resolve_sites(self, model, sites=None) -> list[int]:
        return _parse(sites, model)

    def translate(self, xs: torch.Tensor, sites: Sequence[int]) -> torch.Tensor:
        return xs


class TunedLens(Lens):
    """Affine translators ``h -> h + h @ weight[i] + bias[i]`` for the sites in ``sites``.

    ``weight``: ``[n_sites, d, d]``, ``bias``: ``[n_sites, d]`` (zeros = the plain logit lens).
    Use with ``logit_lens(model, inputs, lens=tuned)``; ``translate`` applies it to streams.
    Trained by :func:`depthscope.analyses.lens.tuned.train_tuned_lens`.
    """

    kind = "tuned"

    def __init__(
        self,
        sites: Sequence[int],
        n_layers: int,
        weight: torch.Tensor,
        bias: torch.Tensor,
        model_info: dict,
        training: dict | None = None,
    ):
        self.sites = [int(s) for s in sites]
        self.n_layers = int(n_layers)
        if weight.shape != (len(self.sites), weight.shape[-1], weight.shape[-1]) or bias.shape != weight.shape[:2]:
            raise CheckpointError(
                f"tuned lens tensors have shapes {tuple(weight.shape)}, {tuple(bias.shape)} for {len(self.sites)} sites"
            )
        self.weight = weight.float()
        self.bias = bias.float()
        self.d_model = int(weight.shape[-1])
        self.model_info = dict(model_info)
        self.training = dict(training or {})
        self._pos = {s: i for i, s in enumerate(self.sites)}

    # ------------------------------------------------------------------ construction
    @classmethod
    def identity(cls, model, sites=None) -> TunedLens:
        """Zero translators (the plain logit lens) for ``sites`` (default: all) of ``model``."""
        sites = parse_sites(sites, model.n_layers)
        d = model.d_model
        return cls(sites, model.n_layers, torch.zeros(len(sites), d, d), torch.zeros(len(sites), d), model_info(model))

    @property
    def site_labels(self) -> list[str]:
        labels = site_labels(self.n_layers)
        return [labels[s] for s in self.sites]

    def __repr__(self) -> str:
        steps = self.training.get("steps_done")
        return (
            f"TunedLens({self.model_info.get('name')!r}, {len(self.sites)} sites, d_model={self.d_model}"
            + (f", trained {steps} steps" if steps is not None else "")
            + ")"
        )

    # ------------------------------------------------------------------ use
    def translate(self, xs: torch.Tensor, sites: Sequence[int]) -> torch.Tensor:
        """Apply the translators of ``sites`` to streams ``xs`` ``[len(sites), n, d]``."""
        try:
            idx = torch.tensor([self._pos[int(s)] for s in sites], dtype=torch.long)
        except KeyError as e:
            raise InputError(
                f"the tuned lens has no translator for site {e.args[0]}; it covers {self.site_labels}"
            ) from None
        A = self.weight[idx].to(device=xs.device, dtype=xs.dtype)
        b = self.bias[idx].to(device=xs.device, dtype=xs.dtype)
        return torch.baddbmm(xs + b.unsqueeze(1), xs, A)

    def resolve_sites(self, model, sites=None) -> list[int]:
        """``sites`` (default: every site this lens translates), refused where it has no translator."""
        if sites is None:
            return list(self.sites)
        wanted = _parse(sites, model)
        missing = [model.labels[s] for s in wanted if s not in self._pos]
        if missing:
            raise InputError(f"the tuned lens has no translator for sites {missing}; it covers {self.site_labels}")
        return wanted

    def check(self, model, *, strict: bool = True) -> None:
        """Refuse ``model`` unless it decodes and is the model this lens was trained for
        (architecture, tokenizer and -- with ``strict`` -- weights)."""
        model.unembed.check()
        mine, theirs = self.model_info, _identity(model)
        keys = ["family", "model_type", "n_layers", "d_model", "vocab_size", "tokenizer", "tokenizer_vocab"]
        diff = [f"{k}: lens {mine.get(k)!r} vs model {theirs.get(k)!r}" for k in keys if mine.get(k) != theirs.get(k)]
        if strict and not diff:
            diff += _weights_differ(mine, model)
        if diff:
            raise LensMismatchError(
                f"this tuned lens was trained for {mine.get('name')!r}, not for {theirs.get('name')!r} "
                f"({'; '.join(diff)}); train one for this model (depthscope lens-train)"
            )

    # ------------------------------------------------------------------ disk
    def save(self, path) -> Path:
        """Write ``path/tuned_lens.safetensors`` and ``path/tuned_lens.json`` (which records the
        tensors file's sha256, verified at load); returns the folder."""
        path = Path(path)
        if path.suffix in (".json", ".safetensors"):
            path = path.parent
        path.mkdir(parents=True, exist_ok=True)
        save_tensors(path / PARAMS_FILE, {"weight": self.weight, "bias": self.bias})
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "params_sha256": file_sha256(path / PARAMS_FILE),
            "sites": self.sites,
            "labels": self.site_labels,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "translator": "h -> h + h @ weight[i] + bias[i], then the model's final norm and unembedding",
            "model": self.model_info,
            "training": self.training,
        }
        write_json(path / META_FILE, meta)
        return path

    @classmethod
    def load(cls, path, model=None, *, strict: bool = True) -> TunedLens:
        """Read a saved lens (its folder, or either file in it); with ``model``, check it fits. A
        tensors file whose sha256 differs from the recorded one, or with NaN/inf weights, is refused
        (:class:`~depthscope.common.errors.CheckpointError`). A folder in the ``tuned-lens``
        package's format (``config.json``, ``params.pt``) is read for ``model`` by
        :func:`~depthscope.analyses.lens.interop.import_tuned_lens`."""
        path = Path(path)
        if path.suffix in (".json", ".safetensors", ".pt"):
            path = path.parent
        meta_p, params_p = path / META_FILE, path / PARAMS_FILE
        if not meta_p.is_file():
            # interop imports this module: imported here, where a folder is not depthscope's own
            from depthscope.analyses.lens.interop import import_tuned_lens, is_tuned_lens_folder, missing_file

            if is_tuned_lens_folder(path):
                if model is None:
                    raise InputError(
                        f"{path} is a tuned-lens package lens: load it for a model, TunedLens.load(path, model)"
                    )
                return import_tuned_lens(path, model, strict=strict)
            lacking = missing_file(path)
            if lacking is not None and not params_p.is_file():
                raise CheckpointError(f"{path} holds a tuned-lens package lens without its {lacking}")
        if not meta_p.is_file() or not params_p.is_file():
            raise CheckpointError(f"no tuned lens at {path} (expected {META_FILE} and {PARAMS_FILE})")
        try:
            meta = json.loads(meta_p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{meta_p} is not valid JSON: {e}") from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_p} is not a depthscope tuned lens (format {meta.get('format')!r})")
        t = load_tensors(params_p)
        recorded = meta.get("params_sha256")  # lenses of older versions record none: nothing to verify
        if recorded is not None and file_sha256(params_p) != recorded:
            raise CheckpointError(
                f"{params_p} does not match the digest recorded in {meta_p}: the file is corrupt or was "
                f"replaced; train the lens again (depthscope lens-train)"
            )
        if "weight" not in t or "bias" not in t:
            raise CheckpointError(f"{params_p} lacks 'weight'/'bias' tensors")
        if not all(bool(torch.isfinite(t[k]).all()) for k in ("weight", "bias")):
            raise CheckpointError(f"{params_p} holds NaN or inf weights; train the lens again (depthscope lens-train)")
        lens = cls(meta["sites"], meta["n_layers"], t["weight"], t["bias"], meta.get("model", {}), meta.get("training"))
        if model is not None:
            lens.check(model, strict=strict)
        return lens


def save_tensors(path: Path, tensors: dict) -> None:
    """Write ``tensors`` as safetensors atomically (CPU, contiguous)."""
    atomic_write(path, lambda t: save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(t)))


def load_tensors(path: Path) -> dict:
    """The tensors of a safetensors file; a corrupt or truncated one is a CheckpointError."""
    try:
        return load_file(str(path))
    except Exception as e:  # corrupt or truncated file
        raise CheckpointError(f"cannot read {path}: {e}") from None


def write_json(path: Path, obj) -> None:
    atomic_text(path, json_text(obj, indent=1))
