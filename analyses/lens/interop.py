"""Tuned lenses in the format of the ``tuned-lens`` package (Belrose et al. 2023), without it.

=================================  ==============================================================
offers                             what
=================================  ==============================================================
:func:`import_tuned_lens`          a ``tuned-lens`` folder -> :class:`TunedLens` for ``model``
                                   (``TunedLens.load`` reads such folders through it too)
:func:`export_tuned_lens`          :class:`TunedLens` -> a folder that ``tuned_lens``'s
                                   ``TunedLens.from_model_and_pretrained(model, folder)`` loads
:func:`is_tuned_lens_folder`       whether a folder holds the package's two files
:func:`missing_file`               which of the two a folder holding only one lacks
:func:`block_input_sites`          the sites its translators sit at: ``[0, 2, ..., 2L - 2]``
:func:`unembed_hash`               the package's hash of a model's unembedding matrix
=================================  ==============================================================

The format (``tuned-lens`` 0.2, ``tuned_lens/nn/lenses.py``): a folder with ``config.json``
(``base_model_name_or_path``, ``d_model``, ``num_hidden_layers``, ``bias``,
``base_model_revision``, ``unembed_hash``, ``lens_type = "linear_tuned_lens"``) and
``params.pt`` (``torch.save`` of the translators' state dict: ``"{i}.weight"`` ``[d, d]`` as an
``nn.Linear`` holds it, output by input, and ``"{i}.bias"`` ``[d]`` when ``bias``, for ``i`` in
``0 .. L-1``). Translator ``i`` maps ``h -> h + h @ W_i.T + b_i``, then the model's final norm and
unembedding decode it.

Where the translators sit. The package indexes them by *block input*: translator ``i`` reads
``hidden_states[i]`` of a Hugging Face forward, the input of block ``i`` (``i = 0``: the
embeddings), and the final stream is decoded untranslated. depthscope's sites are after each
sublayer (``2L + 1``, :mod:`depthscope.hooks.sites`); the input of block ``i`` is the stream
after block ``i - 1``, so

==========================  =====================================================
tuned-lens translator ``i``  depthscope site ``2i``: ``embed``, ``0.mlp``, ``1.mlp``, ...,
                             ``(L-2).mlp`` (``blocks.i.hook_resid_pre``)
(untranslated final)         site ``2L``, ``(L-1).mlp``: identity (depthscope's trained lens
                             keeps the identity there too)
(none)                       the attention sites ``l.attn`` (``resid_mid``): the package has
                             no translator between a block's two sublayers
==========================  =====================================================

with ``weight[site 2i] = W_i.T`` and ``bias[site 2i] = b_i`` (zeros when ``bias`` is false).
Importing gives a lens over the ``L`` block inputs and the final site (identity). Exporting
needs a translator at every block input (a lens trained on some sites only is refused, naming
the missing ones); a non-zero translator at an attention site or at the final site has no place
in the format and is refused unless ``drop_unmapped=True`` leaves it out (zero ones, the identity,
are left out silently: they change no logit). ``unembed_hash`` is the package's own fingerprint
of the model's unembedding matrix (the SHA-256 of the matrix printed at one decimal): an export
with ``model=`` records it, so the package loads the lens without its mismatch warning, and an
import refuses a lens whose recorded hash is another model's (``strict=False``: a warning).
Decoding stays depthscope's (the model's own post-processing, e.g. Gemma-2's logit soft-capping,
which the package's ``Unembed`` leaves out).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from depthscope.analyses.lens.lenses import LensMismatchError, TunedLens, model_info, write_json
from depthscope.common.errors import CheckpointError, InputError
from depthscope.common.files import atomic_write
from depthscope.hooks.sites import site_labels

__all__ = ["import_tuned_lens", "export_tuned_lens", "is_tuned_lens_folder", "block_input_sites", "unembed_hash"]

CONFIG_FILE = "config.json"
PARAMS_FILE = "params.pt"
LENS_TYPE = "linear_tuned_lens"
log = logging.getLogger(__name__)


def block_input_sites(n_layers: int) -> list[int]:
    """The depthscope sites of the package's ``n_layers`` translators: block ``i``'s input is site
    ``2i`` (``embed``, ``0.mlp``, ..., ``(n_layers-2).mlp``)."""
    return [2 * i for i in range(n_layers)]


def is_tuned_lens_folder(path) -> bool:
    """Whether ``path`` is a folder with the package's ``config.json`` and ``params.pt``."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_FILE).is_file()


def unembed_hash(model) -> str:
    """The package's fingerprint of ``model``'s unembedding matrix ``[vocab, d]`` (its
    ``Unembed.unembedding_hash``): the SHA-256 of the float32 matrix as numpy prints it at one
    decimal, with numpy's default print options (a summary of its corners)."""
    W = model.unembed.W_U.T.detach().cpu().float().numpy()
    with np.printoptions(threshold=1000, edgeitems=3, linewidth=75, suppress=False, floatmode="maxprec", sign="-"):
        text = np.array_str(W, precision=1)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path / CONFIG_FILE} is not a tuned-lens config (a JSON object)")
    kind = cfg.get("lens_type", LENS_TYPE)
    if kind != LENS_TYPE:
        raise CheckpointError(f"{path}: lens_type {kind!r} is not supported (only {LENS_TYPE!r}, affine translators)")
    for key in ("d_model", "num_hidden_layers"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
            raise CheckpointError(f"{path / CONFIG_FILE}: {key} must be a positive integer, got {cfg.get(key)!r}")
    return cfg


def _read_params(path: Path, n: int, d: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [n, d, d], bias [n, d])`` in depthscope's orientation (``h @ weight``) from
    ``params.pt``, read as plain tensors (``weights_only``: no code runs)."""
    try:
        state = torch.load(path / PARAMS_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or pickled objects other than tensors
        raise CheckpointError(f"cannot read {path / PARAMS_FILE}: {e}") from None
    _check_keys(path / PARAMS_FILE, state, n, bias)
    weight = torch.zeros(n, d, d)
    b = torch.zeros(n, d)
    for i in range(n):
        for key, shape in [(f"{i}.weight", (d, d))] + ([(f"{i}.bias", (d,))] if bias else []):
            t = state[key]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_floating_point():
                got = f"a {list(t.shape)} {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(
                    f"{path / PARAMS_FILE}: {key!r} must be a {list(shape)} float tensor (translator {i}), got {got}"
                )
        W = state[f"{i}.weight"]
        weight[i] = W.float().T  # nn.Linear: y = h @ W.T
        if bias:
            b[i] = state[f"{i}.bias"].float()
    if not (torch.isfinite(weight).all() and torch.isfinite(b).all()):
        raise CheckpointError(f"{path / PARAMS_FILE} holds NaN or inf weights")
    return weight, b


def _check_keys(file: Path, state, n: int, bias: bool) -> None:
    """Refuse a ``params.pt`` that is no dict of the ``n`` translators' keys, naming the keys at
    fault: any not a string, any extra, any missing."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a state dict of translators")
    odd = [k for k in state if not isinstance(k, str)]
    if odd:
        raise CheckpointError(f"{file}: key {odd[0]!r} ({type(odd[0]).__name__}) is not a string parameter name")
    want = [f"{i}.weight" for i in range(n)] + ([f"{i}.bias" for i in range(n)] if bias else [])
    extra, missing = sorted(set(state) - set(want)), [k for k in want if k not in state]
    if extra or missing:
        parts = ([f"extra keys {extra[:6]}"] if extra else []) + ([f"missing {missing[:6]}"] if missing else [])
        raise CheckpointError(
            f"{file}: {'; '.join(parts)}: {CONFIG_FILE} describes {n} translators "
            f"('0.weight'{', 0.bias' if bias else ''} ... '{n - 1}.weight')"
        )


def missing_file(path) -> str | None:
    """The file a folder holding one of the package's two files lacks (None: both, or neither)."""
    path = Path(path)
    there = [(path / f).is_file() for f in (CONFIG_FILE, PARAMS_FILE)]
    return None if all(there) or not any(there) else (CONFIG_FILE, PARAMS_FILE)[there.index(False)]


def import_tuned_lens(path, model, *, strict: bool = True) -> TunedLens:
    """The lens in the ``tuned-lens`` folder ``path`` as a :class:`TunedLens` for ``model``: its
    translators at the block inputs (:func:`block_input_sites`) and the identity at the final
    site. A lens for another width or depth, or (``strict``) whose recorded ``unembed_hash`` is
    not ``model``'s, is refused (:class:`LensMismatchError`)."""
    path = Path(path)
    if not is_tuned_lens_folder(path):
        lacking = missing_file(path) or f"{CONFIG_FILE} and {PARAMS_FILE}"
        raise CheckpointError(f"no tuned-lens lens at {path}: it lacks {lacking}")
    model.unembed.check()
    cfg = _read_config(path)
    n, d = cfg["num_hidden_layers"], cfg["d_model"]
    name = cfg.get("base_model_name_or_path")
    if (n, d) != (model.n_layers, model.d_model):
        raise LensMismatchError(
            f"the tuned-lens lens at {path} is for {name!r} ({n} layers, d_model {d}), not for {model.name!r} "
            f"({model.n_layers} layers, d_model {model.d_model})"
        )
    recorded = cfg.get("unembed_hash")
    if recorded is not None and recorded != unembed_hash(model):
        msg = (
            f"the tuned-lens lens at {path} was trained with another unembedding ({name!r}; its unembed_hash "
            f"differs from {model.name!r}'s)"
        )
        if strict:
            raise LensMismatchError(msg + "; pass strict=False to use it anyway")
        log.warning(msg)
    weight, bias = _read_params(path, n, d, bool(cfg.get("bias", True)))
    sites = block_input_sites(n) + [2 * n]
    weight = torch.cat([weight, torch.zeros(1, d, d)])
    bias = torch.cat([bias, torch.zeros(1, d)])
    source = {"format": "tuned-lens", "path": str(path), "config": cfg}
    return TunedLens(sites, n, weight, bias, model_info(model), {"imported_from": source})


def _mapped(lens: TunedLens, drop_unmapped: bool) -> list[int]:
    """The lens's positions of the block inputs, in order; refuses a missing block input and
    (unless ``drop_unmapped``) a non-zero translator that the format cannot hold."""
    n = lens.n_layers
    labels = site_labels(n)
    pos = {s: i for i, s in enumerate(lens.sites)}
    missing = [labels[s] for s in block_input_sites(n) if s not in pos]
    if missing:
        raise InputError(
            f"the tuned-lens format holds a translator for every block input (embed, 0.mlp, ..., {n - 2}.mlp); "
            f"this lens has none at {missing} (train it at those sites)"
        )
    inputs = set(block_input_sites(n))
    other = [s for s in lens.sites if s not in inputs]
    live = [labels[s] for s in other if bool(lens.weight[pos[s]].any() or lens.bias[pos[s]].any())]
    if live and not drop_unmapped:
        raise InputError(
            f"the tuned-lens format has no place for the translators at {live} (attention sites sit between a "
            f"block's sublayers; the final stream is decoded untranslated); pass drop_unmapped=True to save "
            f"the block inputs' translators without them"
        )
    return [pos[s] for s in block_input_sites(n)]


def export_tuned_lens(lens: TunedLens, path, model=None, *, drop_unmapped: bool = False) -> Path:
    """Write ``lens`` as a ``tuned-lens`` folder (``config.json``, ``params.pt``) at ``path``;
    returns the folder. With ``model`` (checked against the lens) the config records its
    ``unembed_hash``. See the module docstring for what maps and what is refused."""
    if not isinstance(lens, TunedLens):
        raise InputError(f"expected a TunedLens, got {type(lens).__name__}")
    rows = _mapped(lens, drop_unmapped)
    if model is not None:
        lens.check(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for i, r in enumerate(rows):
        state[f"{i}.weight"] = lens.weight[r].T.contiguous().clone()
        state[f"{i}.bias"] = lens.bias[r].contiguous().clone()
    atomic_write(path / PARAMS_FILE, lambda tmp: torch.save(state, tmp))
    config = {
        "base_model_name_or_path": lens.model_info.get("name"),
        "d_model": lens.d_model,
        "num_hidden_layers": lens.n_layers,
        "bias": True,
        "base_model_revision": None,
        "unembed_hash": unembed_hash(model) if model is not None else None,
        "lens_type": LENS_TYPE,
    }
    write_json(path / CONFIG_FILE, config)
    return path
