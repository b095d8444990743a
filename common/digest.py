"""The one weight digest: a short hash that tells two sets of weights apart.

==========================  ==================================================================
:func:`digest_tensors`      hash of named tensors (name, shape and a strided sample of values)
:func:`model_digest`        a model's fingerprint plus every parameter (tuned-lens files, the
                            probe activation store key)
==========================  ==================================================================

``Unembed.digest()`` (:mod:`depthscope.hooks.unembed`) hashes its own tensors with the same
function. The sample is strided (at most ``SAMPLE`` values per tensor, always including the
first), so a digest costs one pass over a few thousand values per parameter, not over the
weights; two checkpoints of one architecture differ in it unless they agree on every sampled
value.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch

#: values sampled per tensor (a stride over its flattened values)
SAMPLE = 2048
#: names this algorithm in files that store a digest (another algorithm's digests never match)
ALGORITHM = "sha256-strided-2048"


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]], extra: dict | None = None) -> str:
    """sha256 (first 16 hex digits) of ``extra`` (JSON) and, per tensor, its name, shape and
    a strided float32 sample of its values."""
    h = hashlib.sha256()
    if extra is not None:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in named:
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // SAMPLE)
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(flat[::step].float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def model_digest(model) -> str:
    """Digest of a :class:`~depthscope.hooks.HookedModel`: its fingerprint (architecture and
    tokenizer) and every named parameter of the transformers model."""
    return digest_tensors(model.hf_model.named_parameters(), extra=model.fingerprint())
