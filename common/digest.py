"""Content digests: what tells two sets of weights, or two versions of a file, apart.

==========================  ==================================================================
:func:`digest_tensors`      sha256 of named tensors: every name, dtype, shape and every byte
:func:`model_digest`        a model's fingerprint plus every parameter (tuned-lens files, the
                            probe activation store key, a sweep's ``duplicate_of``)
:func:`file_digest`         sha256 of a file's bytes, streamed; hashed once per process per
                            version of the file (see below)
:func:`forget_digests`      forget what :func:`file_digest` remembers
==========================  ==================================================================

Weights are hashed in full: a digest over a sample of the values would give two models that
agree on the sample (one edited neuron, a fine-tune of a few rows) the same key, and so one
model another's cached activations. The digest is of the tensors in memory, the ones that
produce the activations, not of the files they were loaded from: a model edited in memory
(ablated, patched, cast) differs from its files, and an edit through ``.data`` leaves no trace
a metadata check could see. It costs one pass over the weights at the speed of sha256
(0.3 to 0.5 s for the 538 MB of the 135M-parameter default model in float32, on one CPU core).
``Unembed.digest()`` (:mod:`depthscope.hooks.unembed`) hashes its own tensors with
:func:`digest_tensors`.

:func:`file_digest` remembers, for this process only, the digest of each version of a file: a
version is its device, inode, size, mtime and ctime. Every write to a file moves its ctime,
which no user call can set back (``os.utime`` restores mtime but moves ctime), and a copy is a
new inode, so a file rewritten in place with its size and mtime restored, or a copy with the
same metadata, is hashed again. Timestamps are coarse (a clock tick, a second on some file
systems), so two writes close together can share a ctime: a version is remembered only once its
ctime is ``SETTLED_NS`` older than the start of the read, after which any write gets a later
ctime. A new process hashes every file it verifies once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

#: names this algorithm in files that store a digest (another algorithm's digests never match)
ALGORITHM = "sha256-full-v1"
#: hex digits kept of a weight digest (128 bits: no collision by chance or by search)
HEX = 32
#: file versions whose digest this process remembers (oldest forgotten first)
MEMO_SIZE = 4096
#: how much older than a read a file's ctime must be for its digest to be remembered (ns)
SETTLED_NS = 2_000_000_000
_memo: dict[tuple, str] = {}
_now = time.time_ns


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
    tokenizer) and every named parameter of the transformers model, in full."""
    return digest_tensors(model.hf_model.named_parameters(), extra=model.fingerprint())


def _version(path: Path) -> tuple:
    """What identifies one version of a file: device, inode, size, mtime and ctime (ns)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hash_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _keep(version: tuple, digest: str) -> None:
    if len(_memo) >= MEMO_SIZE:
        _memo.pop(next(iter(_memo)))
    _memo[version] = digest


def file_digest(path) -> str:
    """sha256 (hex) of the bytes of ``path``, streamed; a settled version of the file this process
    has already hashed (same device, inode, size, mtime and ctime) is not read again."""
    path = Path(path)
    before = _version(path)
    if before in _memo:
        return _memo[before]
    start = _now()
    digest = _hash_file(path)
    if _version(path) == before and before[4] < start - SETTLED_NS:  # unchanged while read, and settled
        _keep(before, digest)
    return digest


def forget_digests() -> None:
    """Forget every remembered file digest (the next :func:`file_digest` of each file reads it)."""
    _memo.clear()
