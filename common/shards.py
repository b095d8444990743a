"""The shard format every activation store of depthscope writes: arrays on disk, each recorded
with its size and sha256 in a manifest that carries a checksum of itself.

==============================  ================================================================
:class:`ShardedFeats`           several ``[n_i, ...]`` arrays (memmaps) as one ``[sum n_i, ...]``
                                array: integer, slice and index-array rows, read from the files
:func:`meta_digest`             sha256 of a manifest (canonical JSON) without its own checksum
:func:`file_record`             ``{"size", "sha256"}`` of a file, as a manifest records it
:func:`file_problem`            what is wrong with a file against its record (None: nothing)
:func:`save_array`              a ``.npy`` file written atomically; returns its record
:func:`load_array`              a ``.npy`` file checked against its record, memory-mapped
:func:`write_manifest`          a manifest (JSON) with its own checksum, written atomically
:func:`read_manifest`           a manifest read back; a changed or unreadable one is an error
==============================  ================================================================

Used by the probes' span store (:mod:`depthscope.probes.store.activations`, ``meta.json``;
:mod:`depthscope.probes.store.shards`, ``<key>.manifest.json``) and by the token activation
cache (:mod:`depthscope.hooks.activation_cache`). A manifest is plain JSON; its ``meta_sha256``
is the sha256 of the JSON of every other field (``json.dumps(body, sort_keys=True)``), so any
edit is seen. Files are hashed with :func:`~depthscope.common.stamps.file_digest` (once per
process per version of a file). Nothing here needs depthscope to read: ``.npy`` files open with
``np.load(path, mmap_mode="r")`` and checksums with ``sha256sum``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tokenize
from pathlib import Path

import numpy as np

from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text, atomic_write
from depthscope.common.stamps import file_digest, file_sha256

__all__ = [
    "ShardedFeats",
    "file_problem",
    "file_record",
    "load_array",
    "meta_digest",
    "read_manifest",
    "save_array",
    "write_manifest",
]


class ShardedFeats:
    """Rows of several ``[n_i, ...]`` arrays (same trailing shape and dtype) as one
    ``[sum n_i, ...]`` array. Indexing by an integer, a slice or an integer array reads only
    the rows asked for (memmaps through ``os.pread``: see :func:`_read_rows`); ``np.asarray``
    reads them all. ``parts`` are the arrays themselves."""

    def __init__(self, parts: list):
        if not parts:
            raise InputError("ShardedFeats needs at least one array")
        self.parts = parts
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.shape = (int(self.offsets[-1]), *parts[0].shape[1:])
        self.dtype = parts[0].dtype
        self.nbytes = int(sum(p.nbytes for p in parts))
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ShardedFeats(shape={self.shape}, dtype={self.dtype}, parts={len(self.parts)})"

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(p) for p in self.parts])
        return out if dtype is None else out.astype(dtype)

    def _rows(self, idx) -> np.ndarray:
        """``idx`` (an integer, a slice or integers) as row numbers, negative ones counted from the end."""
        if isinstance(idx, slice):
            return np.arange(*idx.indices(self.shape[0]), dtype=np.int64)
        idx = np.asarray(idx)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"rows are indexed by integers or slices, not {idx.dtype}")
        idx = idx.astype(np.int64)
        n = self.shape[0]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"row index out of range for {n} rows")
        return np.where(idx < 0, idx + n, idx)

    def __getitem__(self, idx):
        rest = ()
        if isinstance(idx, tuple):
            idx, rest = idx[0], idx[1:]
        idx = self._rows(idx)
        flat = idx.reshape(-1)
        which = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty((len(flat), *self.shape[1:]), dtype=self.dtype)
        for k in np.unique(which):
            sel = which == k
            rows, inverse = np.unique(flat[sel] - self.offsets[k], return_inverse=True)
            out[sel] = _read_rows(self.parts[k], rows)[inverse]
        out = out.reshape(*idx.shape, *self.shape[1:])
        return out[(slice(None),) * idx.ndim + rest] if rest else out


def _read_rows(part, rows: np.ndarray) -> np.ndarray:
    """``part[rows]`` (``rows`` sorted, unique). A memmap is read with ``os.pread``, runs of
    consecutive rows in one call, rather than through the mapping: the pages read stay in the
    OS page cache instead of this process's resident memory, which would otherwise grow with
    every row ever read (the store's whole size after one epoch)."""
    if not isinstance(part, np.memmap) or part.filename is None:
        return np.asarray(part[rows])
    row_shape = part.shape[1:]
    row_bytes = int(np.prod(row_shape)) * part.dtype.itemsize
    out = np.empty((len(rows), *row_shape), dtype=part.dtype)
    cut = np.nonzero(np.diff(rows) != 1)[0] + 1
    with open(part.filename, "rb") as f:
        for a, b in zip(np.concatenate([[0], cut]), np.concatenate([cut, [len(rows)]])):
            buf = os.pread(f.fileno(), int(b - a) * row_bytes, part.offset + int(rows[a]) * row_bytes)
            out[a:b] = np.frombuffer(buf, dtype=part.dtype).reshape(int(b - a), *row_shape)
    return out


def meta_digest(meta: dict) -> str:
    """sha256 of ``meta`` without its own ``meta_sha256`` (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def file_record(path, sha256: str | None = None) -> dict:
    """``{"size": bytes, "sha256": hex}`` of the file ``path`` (``sha256``: already known)."""
    path = Path(path)
    return {"size": path.stat().st_size, "sha256": sha256 or file_sha256(path)}


def file_problem(path, record, verify: bool = True) -> str | None:
    """What is wrong with the file ``path`` against its ``record`` (None: nothing): missing, of
    another size, or (``verify``) of other content than the sha256 recorded."""
    path = Path(path)
    if not isinstance(record, dict) or not isinstance(record.get("size"), int) or not record.get("sha256"):
        return f"{path} has no size and sha256 in the manifest"
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{path} has {size} bytes, not the {record['size']} recorded"
    if verify and file_digest(path) != record["sha256"]:
        return f"{path} does not match its checksum (corrupted or changed since it was written)"
    return None


def save_array(path, array: np.ndarray) -> dict:
    """``array`` as the ``.npy`` file ``path``, written atomically (a reader never sees a part);
    returns its :func:`file_record`."""
    array = np.ascontiguousarray(array)
    digest = []

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.lib.format.write_array(f, array, allow_pickle=False)
        digest.append(file_sha256(Path(tmp)))  # hashed before the rename: what was written

    atomic_write(path, write)
    return file_record(path, digest[0])


def load_array(path, record, verify: bool = True, shape: tuple | None = None, dtype=None) -> np.memmap:
    """The ``.npy`` file ``path`` memory-mapped (read-only) after :func:`file_problem`; ``shape``
    and ``dtype``: what it must hold. A failure is an :class:`~depthscope.common.errors.InputError`
    naming the file."""
    problem = file_problem(path, record, verify)
    if problem is None:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, SyntaxError, tokenize.TokenError) as e:  # a damaged header: numpy parses it
            problem = f"{path} is not a readable .npy file ({type(e).__name__}: {e})"
    if problem is None and shape is not None and tuple(arr.shape) != tuple(shape):
        problem = f"{path} holds an array of shape {tuple(arr.shape)}, not the {tuple(shape)} recorded"
    if problem is None and dtype is not None and arr.dtype != np.dtype(dtype):
        problem = f"{path} holds {arr.dtype}, not the {np.dtype(dtype)} recorded"
    if problem is not None:
        raise InputError(problem)
    return arr


def write_manifest(path, body: dict) -> dict:
    """``body`` with its ``meta_sha256`` as the JSON file ``path``, written atomically; returns it."""
    manifest = {**{k: v for k, v in body.items() if k != "meta_sha256"}}
    manifest["meta_sha256"] = meta_digest(manifest)
    atomic_text(path, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(path) -> dict:
    """The manifest ``path``; an unreadable one, or one whose ``meta_sha256`` does not match
    (edited or corrupted), is an :class:`~depthscope.common.errors.InputError` naming it."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("meta_sha256") != meta_digest(manifest):
        raise InputError(f"{path} does not match its own checksum (edited or corrupted)")
    return manifest
