"""Activation stores written as shards (one per corpus slice, by parallel workers), read as one.

==============================  ================================================================
:func:`extract_sharded`         split the spans into ``n_shards`` contiguous slices, extract each
                                slice as its own store (:func:`~.activations.extract_spans`), in
                                this process or as Ray tasks; a re-run skips finished shards
:class:`ShardedFeats`           the shards' memmaps as one ``[n_rows, n_sites, d]`` array for
                                row indexing (reads only the rows asked for: streaming); the
                                shard format's core, :mod:`depthscope.common.shards`
:func:`slice_spans`             the passages and spans of one slice, passage indices re-based
==============================  ================================================================

Layout: each shard is an ordinary store ``store_dir/<shard key>/`` (``feats.bin`` memmap,
``rows.npy``, ``meta.json`` written last, with both files' sha256: a shard that fails its checks
is extracted again, see :mod:`~.activations`), keyed like any store by the model digest, the
slice's token ids and spans, sites, pooling and dtype; ``store_dir/<key>.manifest.json`` lists
the shards in span order and is written last, atomically. The returned
:class:`~.activations.SpanStore` has the same rows, in the same order, as the unsharded store
of the same data (``gather`` is equal), and its memory does not grow with the corpus: the probe
reads each batch's rows from the memmaps.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from depthscope.common.errors import InputError
from depthscope.common.shards import ShardedFeats, _read_rows, write_manifest  # noqa: F401  (public here too)
from depthscope.hooks.stream_identity import store_digest
from depthscope.probes.corpora.spans import SpanTable, Tokenized
from depthscope.probes.store.activations import SpanStore, _open, _store_key, extract_spans


def slice_spans(tok: Tokenized, table: SpanTable, lo: int, hi: int) -> tuple[Tokenized, SpanTable]:
    """Spans ``lo:hi`` of ``table`` and the passages they use (re-indexed from 0)."""
    passage = table.passage[lo:hi]
    used = np.unique(passage[passage >= 0])
    sub_tok = Tokenized(
        ids=[tok.ids[p] for p in used], starts=[tok.starts[p] for p in used], ends=[tok.ends[p] for p in used]
    )
    sub = SpanTable(
        passage=np.where(passage >= 0, np.searchsorted(used, passage), passage),
        cs=table.cs[lo:hi],
        ce=table.ce[lo:hi],
        first=table.first[lo:hi],
        last=table.last[lo:hi],
    )
    return sub_tok, sub


def _span_bounds(n_spans: int, n_shards: int) -> np.ndarray:
    """Where the spans are cut into contiguous slices: ``n_shards`` (at most one per span, at
    least one) nearly equal slices."""
    return np.linspace(0, n_spans, min(n_shards, max(n_spans, 1)) + 1).astype(int)


def _with_sites(model, extract_kw: dict) -> dict:
    """``extract_kw`` with the sites resolved (all by default) and no progress bar per shard."""
    extract_kw = {"progress": False, **extract_kw}
    sites = extract_kw.get("sites")
    extract_kw["sites"] = list(range(model.n_sites)) if sites is None else [int(s) for s in sites]
    return extract_kw


def _write_missing(model, slices: list, missing: list, store_dir: Path, engine, load, extract_kw: dict) -> dict:
    """Extract the shards ``missing``: here with ``model`` (no ``engine``; returns ``{i: store}``,
    each checked as it was written), or as Ray tasks that load the model with ``load`` (returns
    ``{}``: the caller opens, and so verifies, what the workers wrote)."""
    if not missing:
        return {}
    if engine is None:
        return {i: extract_spans(model, *slices[i], store_dir=store_dir, **extract_kw) for i in missing}
    if load is None:
        raise InputError("extract_sharded on Ray needs load=, a picklable loader of the model")
    _run_on_ray(engine, load, [slices[i] for i in missing], store_dir, extract_kw)
    return {}


def _write_manifest(store_dir: Path, keys: list, bounds: np.ndarray, missing: list) -> dict:
    """``<key>.manifest.json``, written atomically with its own checksum
    (:func:`~depthscope.common.shards.write_manifest`): the shards in span order (key and span
    range) and which were reused; returns it."""
    key = hashlib.sha256("|".join(keys).encode()).hexdigest()[:24]
    manifest = {
        "complete": True,
        "key": key,
        "shards": [{"key": k, "spans": [int(a), int(b)]} for k, a, b in zip(keys, bounds[:-1], bounds[1:])],
        "reused": [i for i in range(len(keys)) if i not in missing],
    }
    return write_manifest(store_dir / f"{key}.manifest.json", manifest)


def _joined(store_dir: Path, shards: list, manifest: dict, reused: bool) -> SpanStore:
    """The shards as one :class:`SpanStore`: rows re-based onto the concatenated memmaps."""
    offsets = np.concatenate([[0], np.cumsum([s.feats.shape[0] for s in shards])])
    row_start = np.concatenate([s.row_start + off for s, off in zip(shards, offsets[:-1])])
    n_rows = np.concatenate([s.n_rows for s in shards])
    meta = {
        **shards[0].meta,
        "shards": manifest["shards"],
        "key": manifest["key"],
        "shape": [int(offsets[-1]), *shards[0].meta["shape"][1:]],
    }
    feats = ShardedFeats([s.feats for s in shards])
    return SpanStore(store_dir, feats, row_start, n_rows, shards[0].sites, shards[0].pooling, meta, reused=reused)


def extract_sharded(
    model,
    tok: Tokenized,
    table: SpanTable,
    *,
    n_shards: int,
    store_dir,
    engine=None,
    load: Callable | None = None,
    **extract_kw,
) -> SpanStore:
    """The store of ``table`` written as ``n_shards`` shards (see the module docstring).

    ``engine``: None runs the missing shards here with ``model``; a
    :class:`~depthscope.analyses.sweeps.ray_engine.RayEngine`-like object with ``workers`` runs one Ray
    task per missing shard, each loading the model with ``load()`` (a picklable loader such as
    ``functools.partial(load_model, spec, dtype=...)``). ``extract_kw``: ``sites``, ``pooling``,
    ``dtype``, ``batch_tokens``, ``max_tokens`` as for :func:`~.activations.extract_spans`."""
    if n_shards < 1:
        raise InputError(f"n_shards must be at least 1, got {n_shards}")
    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    extract_kw = _with_sites(model, extract_kw)
    bounds = _span_bounds(len(table), n_shards)
    slices = [slice_spans(tok, table, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    keys = _shard_keys(model, slices, extract_kw)
    found = [_open(store_dir / k) for k in keys]
    missing = [i for i, s in enumerate(found) if s is None]
    written = _write_missing(model, slices, missing, store_dir, engine, load, extract_kw)
    shards = [found[i] or written.get(i) or _open(store_dir / k) for i, k in enumerate(keys)]
    lost = [keys[i] for i, s in enumerate(shards) if s is None]
    if lost:
        raise InputError(f"shards {lost} were not written intact in {store_dir}")
    manifest = _write_manifest(store_dir, keys, bounds, missing)
    return _joined(store_dir, shards, manifest, reused=not missing)


def _shard_keys(model, slices: list, extract_kw: dict) -> list[str]:
    """The store key of each slice: what :func:`~.activations.extract_spans` names its store."""
    digest = store_digest(model)
    pooling, max_tokens = extract_kw.get("pooling", "last"), extract_kw.get("max_tokens", 512)
    dtype = np.dtype(extract_kw.get("dtype", "float16"))
    return [_store_key(digest, t, s, extract_kw["sites"], pooling, dtype, max_tokens) for t, s in slices]


def _shard_task(load: Callable, tok: Tokenized, table: SpanTable, store_dir: str, extract_kw: dict) -> str:
    """One Ray task: load the model and write one shard (atomically, by extract_spans)."""
    model = load()
    return str(extract_spans(model, tok, table, store_dir=store_dir, **extract_kw).path)


def _init_ray(ray, engine) -> bool:
    """Start Ray (the imported module ``ray``) unless it runs: on the cluster at
    ``engine.address``, else a local one with ``engine.workers`` CPUs whose workers import
    depthscope from this process's ``sys.path``. True when this call started it (and so shuts
    it down)."""
    if ray.is_initialized():
        return False
    address = getattr(engine, "address", None)
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        path = os.pathsep.join(p for p in sys.path if p)
        ray.init(
            address="local",
            num_cpus=getattr(engine, "workers", 2),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    return True


def _run_on_ray(engine, load: Callable, slices: list, store_dir: Path, extract_kw: dict) -> None:
    """One Ray task per shard; ``engine`` gives ``address``, ``workers``, ``gpus_per_task``, ``max_retries``."""
    try:
        import ray  # lazy: Ray is an optional dependency (depthscope[ray])
    except ImportError:
        raise InputError("sharded extraction on Ray needs Ray: run `pip install 'depthscope[ray]'`") from None
    started = _init_ray(ray, engine)
    try:
        opts = dict(num_cpus=1, num_gpus=getattr(engine, "gpus_per_task", 0.0))
        remote = ray.remote(max_retries=getattr(engine, "max_retries", 1), **opts)(_shard_task)
        shared = ray.put(load)
        ray.get([remote.remote(shared, t, s, str(store_dir.resolve()), extract_kw) for t, s in slices])
    finally:
        if started:
            ray.shutdown()
