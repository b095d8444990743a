"""Content digests of weights: what tells two sets of weights apart.

==========================  ==================================================================
:func:`digest_tensors`      sha256 of named tensors: every name, dtype, shape and every byte
:func:`model_digest`        a model's fingerprint plus every parameter (tuned-lens files, the
                            probe activation store key, a sweep's ``duplicate_of``)
==========================  ==================================================================

Weights are hashed in full: a digest over a sample of the values would give two models that
agree on the sample (one edited neuron, a fine-tune of a few rows) the same key, and so one
model another's cached activations. The digest is of the tensors in memory, the ones that
produce the activations, not of the files they were loaded from: a model edited in memory
(ablated, patched, cast) differs from its files, and an edit through ``.data`` leaves no trace
a metadata check could see. It costs one pass over the weights at the speed of sha256
(0.3 to 0.5 s for the 538 MB of the 135M-parameter default model in float32, on one CPU core).
``Unembed.digest()`` (:mod:`depthscope.hooks.unembed`) hashes its own tensors with
:func:`digest_tensors`. Digests of files are :mod:`depthscope.common.stamps`'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch

#: names this algorithm in files that store a digest (another algorithm's digests never match)
ALGORITHM = "sha256-full-v1"
#: hex digits kept of a weight digest (128 bits: no collision by chance or by search)
HEX = 32


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (any dtype, any device), C-contiguous, as one buffer."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]], extra: dict | None = None) -> str:
    """sha256 (first ``HEX`` hex digits) of ``extra`` (JSON) and, per tensor in the given order,
    its name, dtype, shape and every byte of its values."""
    h = hashlib.sha256()
    if extra is not None:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in named:
            head = json.dumps([name, str(t.dtype), list(t.shape), t.numel() * t.element_size()])
            h.update(head.encode() + b"\0")
            h.update(_tensor_bytes(t))
    return h.hexdigest()[:HEX]


def model_digest(model) -> str:
    """Digest of a :class:`~depthscope.hooks.HookedModel`: its fingerprint (architecture and
    tokenizer) and every named parameter of the transformers model, in full (a streamed model's as
    read from its files: the same digest as the model in memory)."""
    named = model.named_weights() if hasattr(model, "named_weights") else model.hf_model.named_parameters()
    return digest_tensors(named, extra=model.fingerprint())
