"""The identity of a streamed model's weights without a read of its blocks: what a store is keyed by.

>>> store_digest(model)   # a streamed model: the files' headers and versions; in memory: model_digest

==========================  ===================================================================
:func:`store_digest`        the weight digest an activation store records: :func:`streamed_digest`
                            for a streamed model, :func:`~depthscope.common.digest.model_digest`
                            (every weight hashed) for a model in memory
:func:`streamed_digest`     a streamed model's digest: its fingerprint and dtype, every resident
                            tensor in full, and for its block tensors where each lies (file, name
                            in the file) and each file's header (names, dtypes, shapes, offsets)
                            and version (inode, size, mtime, ctime)
:data:`ALGORITHM`           names this digest (never equal to a full digest: another algorithm)
==========================  ===================================================================

Why. Hashing every weight of a streamed model is one more full read of the checkpoint (56-63 s on
a 26 GB model, as long as a pass that reads it). A streamed model's block weights cannot be edited
in memory: every forward reads them from the files again, so they are whatever the files hold.
What tells two of them apart is then the files: which tensors (the headers: names, dtypes, shapes,
offsets) and which bytes, for which :func:`streamed_digest` takes each file's version as
:mod:`depthscope.common.stamps` defines it. Every write to a file moves its ctime, which no user
call can set back (``os.utime`` restores the mtime and moves the ctime), and a copy is a new inode:
so checkpoint files rewritten with other weights of the same shapes (a fine-tune saved over the
old one, an edited tensor, even with the size and mtime restored) give another digest, and a store
of the old weights is never taken for the new ones (``tests/test_stream_identity.py``). What this
does not see, where the full digest would: a file changed while the system clock was set back to
its old ctime, or within the same clock tick as the digest was taken. The resident tensors
(embeddings, final norm, unembedding, the blocks' vectors) are in memory and may be edited there,
so they are hashed in full, as :func:`~depthscope.common.digest.model_digest` hashes them. A
checkpoint moved to another folder keeps its digest (its files keep their inodes and ctimes); a
copy does not (a store is then computed again: never served wrongly). The digest differs from the
same weights' digest in memory (:func:`~depthscope.common.digest.model_digest`): a store written
by the model in memory is not resumed by it streamed. Every weight digest of depthscope takes it:
the activation cache, the probes' activation store, ``depthscope run``'s and the transcoders'
resumed stages, a tuned lens's record of its model (a lens of the model in memory is still
checked in full against it streamed), a sweep's record of each checkpoint (whose duplicates are
then the same files, not copies of the same weights) (``tests/test_stream_digests.py``).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from depthscope.common.digest import HEX, model_digest

__all__ = ["store_digest", "streamed_digest", "ALGORITHM"]

#: names this algorithm in what it is recorded with (a full digest never equals one of these)
ALGORITHM = "sha256-files-v1"


def store_digest(model) -> str:
    """:func:`streamed_digest` of a streamed model, :func:`~depthscope.common.digest.model_digest`
    of any other."""
    return streamed_digest(model) if getattr(model, "streamer", None) is not None else model_digest(model)


def _file_identity(path) -> dict:
    """A safetensors file's header (sha256 of its bytes, ``__metadata__`` included) and version."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = hashlib.sha256(f.read(n)).hexdigest()
    st = os.stat(path)
    return {"header": header, "version": [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]}


def streamed_digest(model) -> str:
    """sha256 (first :data:`~depthscope.common.digest.HEX` hex digits) of a streamed model's
    fingerprint and dtype; per parameter in ``named_parameters`` order, its name and either (resident)
    its dtype, shape and every byte or (streamed) its file and name there; and each file's header
    and version (module docstring). Reads no block weight."""
    streamer = model.streamer
    h = hashlib.sha256()
    h.update(json.dumps({"algorithm": ALGORITHM, "model": model.fingerprint(), "dtype": str(streamer.dtype)}).encode())
    files = set()
    with torch.no_grad():
        for full, layer, ref in streamer.order:
            if layer is None:
                module, attr, _ = ref
                t = module._parameters[attr].detach().reshape(-1).cpu().contiguous()
                h.update(json.dumps([full, str(t.dtype), list(module._parameters[attr].shape)]).encode() + b"\0")
                h.update(memoryview(t.view(torch.uint8).numpy()))
                continue
            path, key = streamer.index[streamer.names[layer][ref][2]]
            files.add(path)
            h.update(json.dumps([full, path.name, key]).encode() + b"\0")
    for path in sorted(files):
        h.update(json.dumps([path.name, _file_identity(path)]).encode())
    return h.hexdigest()[:HEX]
