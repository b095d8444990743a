"""Span activations at every site, extracted once and streamed to an on-disk store.

:func:`extract_spans` runs passages through ``model.residual_stream(..., return_logits=False)``
in length-sorted batches of at most ``batch_tokens`` (padded) tokens, keeps only the subword
positions spans need, pools them, and writes the rows of each batch straight into a numpy
memmap ``[n_rows, n_sites, d_model]`` (float16 by default, float32 on request), so a corpus
larger than memory streams through in bounded memory.

Pooling (``pooling=``): ``last`` (the span's last subword; the default for causal decoders,
which has seen the whole span), ``first``, ``mean`` (over the span's subwords) -> one row per
span; ``attn`` (trainable self-attentive pooling, done by the probe) -> the span's subword
rows are stored (at most ``ATTN_MAX_TOKENS``, the last ones), one row each.

The store lives in ``store_dir/<key>/`` where the key hashes the model (architecture,
tokenizer and a digest of its weights: :func:`~depthscope.hooks.stream_identity.store_digest`,
every weight of a model in memory, a streamed model's files' headers and versions without a read
of its blocks),
the token ids of every passage, every span's token range, the sites, the pooling and the
dtype; a re-run with the same model, data and sites finds the complete store (``meta.json`` is
written last) and reuses it without a forward pass.

Integrity: ``meta.json`` records the sha256 and size of ``feats.bin`` (hashed while its rows are
written, no second pass) and of ``rows.npy``, and a sha256 of itself. A store is used only when
its meta digest, both files' sizes and contents, its shape and every span's rows agree
(:func:`_verify`); the contents are hashed on the first open in each process and again whenever
a file's version changes (:func:`~depthscope.common.stamps.file_digest`: a rewrite in place with
size and mtime restored still moves its ctime). A store that fails is named in a warning and
extracted again: a zeroed or random ``feats.bin`` or bad row offsets are never read.
One process extracts a key at a time (a ``flock`` on ``store_dir/.<key>.lock``): a second one
waits, says so, and then reuses what the first wrote. Temporary folders of killed runs (their
process is gone) are removed by the next extraction into the same folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from depthscope.common.errors import InputError, NonFiniteActivationError
from depthscope.common.files import FolderLock, check_writable_dir, is_place_error, output_error, preallocate
from depthscope.common.progress import progress_bar
from depthscope.common.shards import meta_digest
from depthscope.common.stamps import file_digest
from depthscope.hooks import cache_dir
from depthscope.hooks.stream_identity import store_digest
from depthscope.hooks.stream_pass import layer_major
from depthscope.probes.config import POOLINGS
from depthscope.probes.corpora.spans import SpanTable, Tokenized

ATTN_MAX_TOKENS = 16
STORE_VERSION = 2
#: the files of a store whose size and sha256 ``meta.json`` records
FILES = ("feats.bin", "rows.npy")
log = logging.getLogger("depthscope")


def _claim(store_dir: Path, key: str):
    """Hold the extraction lock of ``key`` (waiting, with a message, while another process holds
    it) and remove temporary folders left by killed extractions; returns the lock."""
    lock = FolderLock(
        store_dir / f".{key}.lock", f"the activation store {store_dir / key}", "--store (or DEPTHSCOPE_CACHE)"
    )

    def waiting():
        log.warning("another process is extracting the same activations into %s; waiting for it", store_dir / key)

    lock.acquire(wait=True, on_wait=waiting)
    for tmp in store_dir.glob(".*.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        mine = tmp.name.startswith(f".{key}.tmp")  # we hold this key's lock: nobody else writes it
        if tmp.is_dir() and (mine or (pid.isdigit() and not _alive(int(pid)))):
            shutil.rmtree(tmp, ignore_errors=True)
    return lock


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class SpanStore:
    """Pooled span rows ``feats[row_start[i] : row_start[i] + n_rows[i]]`` for span ``i``
    (``n_rows == 0``: skipped span), at sites ``sites``."""

    path: Path
    feats: np.ndarray  # memmap [n_rows, n_sites, d]
    row_start: np.ndarray
    n_rows: np.ndarray
    sites: list
    pooling: str
    meta: dict
    reused: bool = False

    @property
    def n_sites(self) -> int:
        return self.feats.shape[1]

    @property
    def d_model(self) -> int:
        return self.feats.shape[2]

    @property
    def skipped(self) -> np.ndarray:
        return self.n_rows == 0

    def load(self, max_bytes: float = 6e9) -> None:
        """Hold the rows in memory (an in-memory array instead of the memmap) when they fit in
        ``max_bytes``."""
        if isinstance(self.feats, np.memmap) and self.feats.nbytes <= max_bytes:
            self.feats = np.array(self.feats)

    def release(self) -> None:
        """Drop this process's resident pages of the memmap (they stay in the OS page cache, and
        a later read maps them back): once features are copied into memory the store's pages
        would otherwise count twice in the process' memory. A no-op for in-memory rows."""
        mm = getattr(self.feats, "_mmap", None)  # numpy's memmap keeps its mmap.mmap here
        if isinstance(mm, mmap.mmap) and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # a closed map, or a platform without it: nothing to drop
                pass

    def gather(self, span_ids: np.ndarray, max_len: int = 1):
        """Rows of spans: ``x [B, L, S, D]`` (float32 tensor) and ``mask [B, L]``.

        With one row per span ``L = 1``; with token rows (attn pooling) ``L`` is the longest
        span of the batch (rows left-aligned, padding masked).
        """
        span_ids = np.asarray(span_ids, dtype=np.int64)
        starts, counts = self.row_start[span_ids], self.n_rows[span_ids]
        L = max(1, int(min(counts.max(initial=1), max_len)))
        if L == 1:
            x = torch.from_numpy(np.asarray(self.feats[starts]))
            return x.float()[:, None], torch.ones(len(starts), 1, dtype=torch.bool)
        # last min(count, L) rows of each span
        take = np.minimum(counts, L)
        first = starts + counts - take
        idx = first[:, None] + np.arange(L)[None, :]
        mask = np.arange(L)[None, :] < take[:, None]
        idx = np.where(mask, idx, first[:, None])
        flat = np.asarray(self.feats[idx.reshape(-1)])
        x = torch.from_numpy(flat).float().reshape(len(span_ids), L, self.n_sites, self.d_model)
        return x, torch.from_numpy(mask)


def _store_key(model_id: str, tok: Tokenized, table: SpanTable, sites, pooling, dtype, max_tokens) -> str:
    """The store's folder name: a hash of the model id, the settings, every passage's token ids
    and every span's passage and token range."""
    h = hashlib.sha256()
    h.update(
        f"v{STORE_VERSION}|{model_id}|{list(sites)}|{pooling}|{np.dtype(dtype).name}|{max_tokens}|{ATTN_MAX_TOKENS}".encode()
    )
    for ids in tok.ids:
        h.update(np.int64(len(ids)).tobytes())
        h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    for arr in (table.passage, table.first, table.last):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.hexdigest()[:24]


def _meta_digest(meta: dict) -> str:
    """sha256 of ``meta`` without its own ``meta_sha256``: the shard format's
    (:func:`depthscope.common.shards.meta_digest`)."""
    return meta_digest(meta)


def _meta_problem(meta, path: Path) -> str | None:
    """What is wrong with a store's ``meta.json`` (None: nothing): its own digest, version,
    completeness, key, dtype, shape, sites and pooling."""
    where = path / "meta.json"
    if not isinstance(meta, dict):
        return f"{where} is not a JSON object"
    if meta.get("version") != STORE_VERSION:
        return f"{where} is of store version {meta.get('version')!r}, not {STORE_VERSION}"
    if meta.get("meta_sha256") != _meta_digest(meta):
        return f"{where} does not match its own checksum (edited or corrupted)"
    shape = meta.get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v >= 1 for v in shape)):
        return f"{where} records a bad shape {shape!r}"
    if not meta.get("complete") or meta.get("key") != path.name or meta.get("dtype") not in ("float16", "float32"):
        return f"{where} is incomplete or belongs to another store"
    if not isinstance(meta.get("sites"), list) or len(meta["sites"]) != shape[1] or meta.get("pooling") not in POOLINGS:
        return f"{where} records sites or pooling that do not match its shape"
    return None


def _files_problem(path: Path, meta: dict, trusted: str | None) -> str | None:
    """The first of the store's files that is missing, of the wrong size or whose content does
    not match the sha256 ``meta.json`` records (None: all match). ``trusted``: the sha256 of
    ``feats.bin`` its writer computed while writing it (then it is not read again)."""
    n_bytes = int(np.prod(meta["shape"])) * np.dtype(meta["dtype"]).itemsize
    for name in FILES:
        f, rec = path / name, meta["files"][name]
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != rec["size"] or (name == "feats.bin" and size != n_bytes):
            return f"{f} has {size} bytes, not the {rec['size']} recorded for shape {meta['shape']}"
        if not (name == "feats.bin" and trusted is not None and trusted == rec["sha256"]):
            if file_digest(f) != rec["sha256"]:
                return f"{f} does not match its checksum (corrupted or changed since it was written)"
    return None


def _rows_problem(rows: np.ndarray, meta: dict) -> str | None:
    """What is wrong with the span rows ``[n_spans, 2]`` (start, count) (None: nothing): their
    shape and type, and every span's rows inside the store."""
    if rows.dtype.kind not in "iu" or rows.shape != (meta.get("n_spans"), 2):
        return f"holds {rows.dtype} {rows.shape}, not [n_spans={meta.get('n_spans')}, 2] integers"
    start, count = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    if len(rows) and ((start < 0).any() or (count < 0).any() or (start + count > meta["shape"][0]).any()):
        return f"holds row offsets outside the store's {meta['shape'][0]} rows"
    return None


def _verify(path: Path, trusted: str | None = None) -> tuple[SpanStore | None, str | None]:
    """``(store, problem)``: the complete store in ``path`` (marked reused) when every check
    passes (see the module docstring); else None and what is wrong, naming the file (problem
    None: no store there yet)."""
    if not (path / "meta.json").is_file():
        return None, None
    try:
        meta = json.loads((path / "meta.json").read_text())
        problem = _meta_problem(meta, path) or _files_problem(path, meta, trusted)
        if problem:
            return None, problem
        rows = np.load(path / "rows.npy", allow_pickle=False)
        problem = _rows_problem(rows, meta)
        if problem:
            return None, f"{path / 'rows.npy'} {problem}"
        feats = np.memmap(path / "feats.bin", dtype=meta["dtype"], mode="r", shape=tuple(meta["shape"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{path} cannot be read ({type(e).__name__}: {e})"
    rows = rows.astype(np.int64)
    start, count = rows[:, 0].copy(), rows[:, 1].copy()
    return SpanStore(path, feats, start, count, meta["sites"], meta["pooling"], meta, reused=True), None


def _open(path: Path) -> SpanStore | None:
    """The complete, intact store in ``path`` (marked reused), or None when it is absent,
    unfinished or fails a check (:func:`_verify`)."""
    return _verify(path)[0]


def _batches(lengths: np.ndarray, batch_tokens: int, overhead: int = 64) -> list:
    """Passages in length-sorted batches of at most ``batch_tokens`` padded tokens, cut where
    they cost least: dynamic programming over the sorted lengths minimising padded tokens
    plus ``overhead`` token-equivalents per batch (a greedy fill would pad every short passage
    up to the longest of its batch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    L = lengths[order]
    n = len(L)
    best = np.zeros(n + 1)
    nxt = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        w = max(int(L[i]), 1)
        k = max(1, min(n - i, batch_tokens // w))
        js = np.arange(i + 1, i + k + 1)
        cost = (js - i) * w + overhead + best[js]
        m = int(np.argmin(cost))
        best[i], nxt[i] = cost[m], js[m]
    out, i = [], 0
    while i < n:
        out.append([int(p) for p in order[i : nxt[i]]])
        i = int(nxt[i])
    return out


@dataclass(frozen=True)
class _Job:
    """One extraction: the model, the passages and spans, and the store's settings."""

    model: object
    tok: Tokenized
    table: SpanTable
    sites: list
    pooling: str
    dtype: np.dtype
    max_tokens: int
    progress: bool
    desc: str


@dataclass
class _Plan:
    """Where each span's rows go and which passages run together.

    ``per_span`` rows per span (0: skipped); ``row_start`` each span's first row; ``run_len``
    the tokens each passage runs (up to its last needed token, 0 when no span needs it);
    ``batches`` passage indices per forward pass and ``slot`` each passage's row in its batch;
    ``spans`` the span ids in batch order (batch, row of the batch, then table order), so the
    rows of one batch are one contiguous slice of the store: ``spans[bounds[j]:bounds[j + 1]]``
    are batch ``j``'s."""

    per_span: np.ndarray
    row_start: np.ndarray
    run_len: np.ndarray
    batches: list
    slot: np.ndarray
    spans: np.ndarray
    bounds: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(self.per_span[self.spans].sum())

    def spans_of(self, j: int) -> np.ndarray:
        """The spans whose rows batch ``j`` writes."""
        return self.spans[self.bounds[j] : self.bounds[j + 1]]


def _run_lengths(table: SpanTable, ok: np.ndarray, n_passages: int) -> np.ndarray:
    """Tokens each passage runs: up to the last token a span needs, 0 for a passage no usable
    span lies in."""
    has_span = np.zeros(n_passages, dtype=bool)
    has_span[table.passage[ok]] = True
    last_needed = np.zeros(n_passages, dtype=np.int64)
    np.maximum.at(last_needed, table.passage[ok], table.last[ok] + 1)
    return np.where(has_span, last_needed, 0)


def _plan(tok: Tokenized, table: SpanTable, pooling: str, batch_tokens: int) -> _Plan:
    """Batches of passages and the store row of every span (see :class:`_Plan`)."""
    n_passages = len(tok.ids)
    ok = table.first >= 0
    ntok = np.where(ok, table.last - table.first + 1, 0)
    per_span = np.where(ok, np.minimum(ntok, ATTN_MAX_TOKENS) if pooling == "attn" else 1, 0)
    run_len = _run_lengths(table, ok, n_passages)
    batches = [b for b in _batches(run_len, batch_tokens) if run_len[b[0]] > 0]
    bat = np.full(n_passages, -1, dtype=np.int64)
    slot = np.zeros(n_passages, dtype=np.int64)
    for j, b in enumerate(batches):
        bat[b] = j
        slot[b] = np.arange(len(b))
    sp = np.nonzero(ok & (bat[np.maximum(table.passage, 0)] >= 0))[0]
    sp = sp[np.lexsort((sp, slot[table.passage[sp]], bat[table.passage[sp]]))]
    row_start = np.zeros(len(table), dtype=np.int64)
    row_start[sp] = np.cumsum(per_span[sp]) - per_span[sp]
    bounds = np.searchsorted(bat[table.passage[sp]], np.arange(len(batches) + 1))
    return _Plan(per_span, row_start, run_len, batches, slot, sp, bounds)


def _batch_inputs(tok: Tokenized, batch: list, run_len: np.ndarray, pad: int) -> tuple:
    """Token ids ``[B, width]`` (right-padded with ``pad``) and their mask for one batch, each
    passage cut at its run length."""
    width = int(run_len[batch].max())
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for k, p in enumerate(batch):
        L = int(run_len[p])
        ids[k, :L] = torch.from_numpy(tok.ids[p][:L])
        mask[k, :L] = True
    return ids, mask


def _positions(table: SpanTable, plan: _Plan, here: np.ndarray, width: int, pooling: str) -> tuple:
    """Flat positions (``row * width + token``) of the tokens the spans ``here`` need, and for
    ``mean``/``attn`` the span each position belongs to (None otherwise): ``last``/``first`` one
    token per span, ``mean`` all of a span's tokens, ``attn`` its last ``ATTN_MAX_TOKENS``."""
    base = plan.slot[table.passage[here]] * width
    f, l = table.first[here], table.last[here]
    if pooling == "last":
        return base + l, None
    if pooling == "first":
        return base + f, None
    a = np.maximum(f, l - ATTN_MAX_TOKENS + 1) if pooling == "attn" else f
    cnt = l - a + 1
    seg = np.repeat(np.arange(len(here)), cnt)
    return base[seg] + a[seg] + (np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)), seg


def _span_means(out: torch.Tensor, seg: np.ndarray, n_spans: int) -> torch.Tensor:
    """Token rows ``[S, n_tokens, D]`` averaged per span ``[S, n_spans, D]``, summed in float32
    on the model's device whatever the model's dtype."""
    sg = torch.from_numpy(seg).to(out.device)
    summed = torch.zeros(out.shape[0], n_spans, out.shape[2], dtype=torch.float32, device=out.device)
    summed.index_add_(1, sg, out.float())
    cnt = torch.bincount(sg, minlength=n_spans).to(torch.float32)
    return summed / cnt[None, :, None]


def _pooled_rows(job: _Job, ids, mask, positions: np.ndarray, seg, n_spans: int) -> np.ndarray:
    """One forward pass keeping only ``positions`` (gathered inside each site's hook), pooled:
    store rows ``[rows, S, D]`` in the store's dtype. Refuses rows that overflow float16."""
    ti = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
    out = job.model.residual_stream(ids, mask=mask, sites=job.sites, return_logits=False, positions=ti).resid
    if job.pooling == "mean":
        out = _span_means(out, seg, n_spans)
    arr = out.permute(1, 0, 2).to(torch.float16 if job.dtype == np.float16 else torch.float32).cpu().numpy()
    if job.dtype == np.float16 and not np.isfinite(arr).all():
        raise NonFiniteActivationError(
            "activations overflow float16 (|x| > 65504) at some site: store them as float32 "
            "(--float32; in Python store_dtype='float32')"
        )
    return arr


class _RowSink:
    """The store's rows written into the memmap ``feats``, hashed (sha256) as they are written
    while they arrive in file order, so the checksum needs no second pass over the file."""

    def __init__(self, feats: np.ndarray):
        self.feats, self.hash, self.next_row, self.in_order = feats, hashlib.sha256(), 0, True

    def write(self, r0: int, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.feats.dtype)
        self.feats[r0 : r0 + len(rows)] = rows
        if r0 != self.next_row:
            self.in_order = False
        elif self.in_order:
            self.hash.update(rows)
            self.next_row += len(rows)

    def digest(self) -> str | None:
        """sha256 of the whole file, or None when the rows written did not cover it in order."""
        return self.hash.hexdigest() if self.in_order and self.next_row == len(self.feats) else None


def _fill(job: _Job, plan: _Plan, feats: _RowSink) -> int:
    """Run every batch and write its rows into ``feats``; returns the tokens run."""
    pad = getattr(job.model.tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    bar = progress_bar(int(plan.run_len.sum()), desc=job.desc, unit="tok") if job.progress else None
    n_tokens = 0

    def batches():
        for j, batch in enumerate(plan.batches):
            here = plan.spans_of(j)
            if len(here):
                ids, mask = _batch_inputs(job.tok, batch, plan.run_len, pad)
                yield (here, ids, mask, *_positions(job.table, plan, here, ids.shape[1], job.pooling))

    def held(item: tuple) -> int:  # the batch's stream and the positions kept at every site (float32)
        return 4 * job.model.d_model * (item[1].numel() + len(item[3]) * len(job.sites))

    def pooled(item: tuple) -> tuple:
        here, ids, mask, positions, seg = item
        return here, mask, _pooled_rows(job, ids, mask, positions, seg, len(here))

    # a streamed model runs the batches as layer-major passes: the weights read once per pass
    for here, mask, rows in layer_major(job.model, batches(), pooled, held=held, progress=job.progress):
        r0 = int(plan.row_start[here[0]])
        feats.write(r0, rows)
        n_tokens += int(mask.sum())
        if bar is not None:
            bar.update(int(mask.sum()))
    if bar is not None:
        bar.close()
    return n_tokens


def _meta(job: _Job, plan: _Plan, key: str, n_tokens: int, seconds: float) -> dict:
    """``meta.json``: what the store holds, how it was made, and ``complete`` (written last)."""
    return {
        "complete": True,
        "version": STORE_VERSION,
        "key": key,
        "model": getattr(job.model, "name", "?"),
        "sites": job.sites,
        "pooling": job.pooling,
        "dtype": job.dtype.name,
        "shape": [max(plan.n_rows, 1), len(job.sites), job.model.d_model],
        "n_spans": int(len(job.table)),
        "n_skipped": int((job.table.first < 0).sum()),
        "n_passages": int(len(job.tok.ids)),
        "n_tokens_run": int(n_tokens),
        "n_truncated_passages": int(job.tok.n_truncated),
        "seconds": seconds,
        "tokens_per_second": n_tokens / seconds if seconds > 0 else None,
        "max_tokens": int(job.max_tokens),
    }


def _write(job: _Job, plan: _Plan, tmp: Path, key: str) -> str:
    """The store's files in ``tmp``: the rows (``feats.bin``, allocated in full first so a full
    disk fails here rather than as a SIGBUS mid-write), ``rows.npy``, then ``meta.json`` with
    both files' size and sha256 and its own sha256. Returns the sha256 of ``feats.bin``."""
    shape = (max(plan.n_rows, 1), len(job.sites), job.model.d_model)
    preallocate(tmp / "feats.bin", int(np.prod(shape)) * job.dtype.itemsize)
    feats = np.memmap(tmp / "feats.bin", dtype=job.dtype, mode="r+", shape=shape)
    sink = _RowSink(feats)
    t0 = time.perf_counter()
    n_tokens = _fill(job, plan, sink)
    feats.flush()
    seconds = time.perf_counter() - t0
    streamed = sink.digest()
    del feats, sink
    np.save(tmp / "rows.npy", np.stack([plan.row_start, plan.per_span], 1).astype(np.int64))
    sums = {"feats.bin": streamed or file_digest(tmp / "feats.bin"), "rows.npy": file_digest(tmp / "rows.npy")}
    meta = _meta(job, plan, key, n_tokens, seconds)
    meta["files"] = {name: {"size": (tmp / name).stat().st_size, "sha256": sums[name]} for name in FILES}
    meta["meta_sha256"] = _meta_digest(meta)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return sums["feats.bin"]


def _remove(path: Path) -> None:
    """Remove what stands at ``path`` (a store folder, or a file or link put in its place)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _extract_locked(job: _Job, plan: _Plan, store_dir: Path, key: str) -> SpanStore:
    """Write the store ``store_dir/key`` under its lock: into a temporary folder renamed into
    place when complete, or reuse what another process wrote while this one waited."""
    path = store_dir / key
    store_dir.mkdir(parents=True, exist_ok=True)
    lock = _claim(store_dir, key)
    found, problem = _verify(path)
    if found is not None:
        lock.release()
        return found
    if problem:
        log.warning("the activation store is not used: %s; extracting it again", problem)
    tmp = store_dir / f".{key}.tmp{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        written = _write(job, plan, tmp, key)
        _remove(path)
        os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_place_error(e):
            raise output_error(path, e, "--store") from e
        raise
    finally:
        lock.release()
    store, problem = _verify(path, trusted=written)
    if store is None:
        raise InputError(f"the activation store just written does not read back intact: {problem}")
    store.reused = False
    return store


@dataclass(frozen=True)
class SpanExtraction:
    """How :func:`extract_spans` pools and stores span activations: at ``sites`` (indices; None:
    all), ``pooling`` (one of ``POOLINGS``), into ``store_dir`` (None: the cache's
    ``activations/``) as ``dtype`` (float16 or float32), ``batch_tokens`` padded tokens per
    forward, passages cut at ``max_tokens`` tokens."""

    sites: Sequence[int] | None = None
    pooling: str = "last"
    store_dir: str | Path | None = None
    dtype: str = "float16"
    batch_tokens: int = 2048
    max_tokens: int = 512


def extract_spans(
    model,
    tok: Tokenized,
    table: SpanTable,
    settings: SpanExtraction | None = None,
    *,
    progress: bool = True,
    desc: str = "activations",
    **overrides,
) -> SpanStore:
    """Pooled span activations, from the store if already there. ``settings``: a
    :class:`SpanExtraction` (sites, pooling, store folder and dtype, tokens per forward, context
    cap), or any of its fields by keyword (``overrides``), e.g. ``sites=[0, 5], pooling="mean"``."""
    cfg = replace(settings or SpanExtraction(), **overrides)
    sites, pooling, store_dir, dtype = cfg.sites, cfg.pooling, cfg.store_dir, cfg.dtype
    batch_tokens, max_tokens = cfg.batch_tokens, cfg.max_tokens
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    dtype = np.dtype(dtype)
    if dtype not in (np.float16, np.float32):
        raise InputError(f"store dtype must be float16 or float32, got {dtype}")
    sites = list(range(model.n_sites)) if sites is None else [int(s) for s in sites]
    where = "--store" if store_dir is not None else "DEPTHSCOPE_CACHE"
    store_dir = check_writable_dir(Path(cache_dir() / "activations" if store_dir is None else store_dir), where)
    key = _store_key(store_digest(model), tok, table, sites, pooling, dtype, max_tokens)
    found = _open(store_dir / key)
    if found is not None:
        return found
    job = _Job(model, tok, table, sites, pooling, dtype, max_tokens, progress, desc)
    return _extract_locked(job, _plan(tok, table, pooling, batch_tokens), store_dir, key)
