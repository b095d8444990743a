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
tokenizer and a digest of its weights), the token ids of every passage, every span's token
range, the sites, the pooling and the dtype; a re-run with the same model, data and sites
finds the complete store (``meta.json`` is written last) and reuses it without a forward pass.
One process extracts a key at a time (a ``flock`` on ``store_dir/.<key>.lock``): a second one
waits, says so, and then reuses what the first wrote. Temporary folders of killed runs (their
process is gone) are removed by the next extraction into the same folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from depthscope.common.digest import model_digest
from depthscope.common.errors import InputError, NonFiniteActivationError
from depthscope.probes.config import POOLINGS
from depthscope.probes.corpora.spans import SpanTable, Tokenized

ATTN_MAX_TOKENS = 16
STORE_VERSION = 1
log = logging.getLogger("depthscope")


def _claim(store_dir: Path, key: str):
    """Hold the extraction lock of ``key`` (waiting, with a message, while another process holds
    it) and remove temporary folders left by killed extractions; returns the lock."""
    from depthscope.common.files import FolderLock

    lock = FolderLock(store_dir / f".{key}.lock", f"the activation store {store_dir / key}")

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
        """Hold the rows in memory (as a torch tensor) when they fit in ``max_bytes``."""
        if isinstance(self.feats, np.memmap) and self.feats.nbytes <= max_bytes:
            self.feats = np.array(self.feats)

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


def _open(path: Path) -> SpanStore | None:
    meta_p = path / "meta.json"
    if not meta_p.is_file():
        return None
    try:
        meta = json.loads(meta_p.read_text())
        rows = np.load(path / "rows.npy")
        feats = np.memmap(path / "feats.bin", dtype=meta["dtype"], mode="r", shape=tuple(meta["shape"]))
    except (OSError, ValueError, KeyError):
        return None
    if not meta.get("complete"):
        return None
    return SpanStore(
        path, feats, rows[:, 0].copy(), rows[:, 1].copy(), meta["sites"], meta["pooling"], meta, reused=True
    )


def _batches(lengths: np.ndarray, batch_tokens: int, overhead: int = 64) -> list:
    """Passages in length-sorted batches of at most ``batch_tokens`` padded tokens, cut where
    they cost least: dynamic programming over the sorted lengths minimising padded tokens
    plus ``overhead`` token-equivalents per batch (a greedy fill pads short passages up to
    the batch's longest; on UD sentences it ran ~30% padding, this ~5%)."""
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


def extract_spans(
    model,
    tok: Tokenized,
    table: SpanTable,
    *,
    sites: Sequence[int] | None = None,
    pooling: str = "last",
    store_dir=None,
    dtype: str = "float16",
    batch_tokens: int = 2048,
    max_tokens: int = 512,
    progress: bool = True,
    desc: str = "activations",
) -> SpanStore:
    """Pooled span activations at ``sites`` (default all), from the store if already there."""
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    dtype = np.dtype(dtype)
    if dtype not in (np.float16, np.float32):
        raise InputError(f"store dtype must be float16 or float32, got {dtype}")
    sites = list(range(model.n_sites)) if sites is None else [int(s) for s in sites]
    if store_dir is None:
        from depthscope.hooks.loading import cache_dir

        store_dir = cache_dir() / "activations"
    store_dir = Path(store_dir)
    key = _store_key(model_digest(model), tok, table, sites, pooling, dtype, max_tokens)
    path = store_dir / key
    found = _open(path)
    if found is not None:
        return found

    n = len(table)
    ok = table.first >= 0
    ntok = np.where(ok, table.last - table.first + 1, 0)
    per_span = np.where(ok, np.minimum(ntok, ATTN_MAX_TOKENS) if pooling == "attn" else 1, 0)
    np.array([len(x) for x in tok.ids], dtype=np.int64)
    # spans of each passage, and row assignment in batch order
    has_span = np.zeros(len(tok.ids), dtype=bool)
    has_span[table.passage[ok]] = True
    # only run a passage up to its last needed token
    last_needed = np.zeros(len(tok.ids), dtype=np.int64)
    np.maximum.at(last_needed, table.passage[ok], table.last[ok] + 1)
    run_len = np.where(has_span, last_needed, 0)
    batches = [b for b in _batches(run_len, batch_tokens) if run_len[b[0]] > 0]
    # spans in batch order (batch, row of the batch, then table order): their rows are
    # contiguous per batch, so each batch writes one slice of the store
    bat = np.full(len(tok.ids), -1, dtype=np.int64)
    slot = np.zeros(len(tok.ids), dtype=np.int64)
    for j, b in enumerate(batches):
        bat[b] = j
        slot[b] = np.arange(len(b))
    sp = np.nonzero(ok & (bat[np.maximum(table.passage, 0)] >= 0))[0]
    sp = sp[np.lexsort((sp, slot[table.passage[sp]], bat[table.passage[sp]]))]
    row_start = np.zeros(n, dtype=np.int64)
    row_start[sp] = np.cumsum(per_span[sp]) - per_span[sp]
    bounds = np.searchsorted(bat[table.passage[sp]], np.arange(len(batches) + 1))
    r = int(per_span[sp].sum())
    n_rows_total = r
    D, S = model.d_model, len(sites)

    store_dir.mkdir(parents=True, exist_ok=True)
    lock = _claim(store_dir, key)
    found = _open(path)  # another process may have written it while we waited
    if found is not None:
        lock.release()
        return found
    tmp = store_dir / f".{key}.tmp{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        from depthscope.common.files import preallocate

        shape = (max(n_rows_total, 1), S, D)
        preallocate(tmp / "feats.bin", int(np.prod(shape)) * dtype.itemsize)  # a full disk fails here, not SIGBUS
        feats = np.memmap(tmp / "feats.bin", dtype=dtype, mode="r+", shape=shape)
        pad = getattr(model.tokenizer, "pad_token_id", None)
        pad = 0 if pad is None else int(pad)
        t0, n_tokens = time.perf_counter(), 0
        bar = None
        if progress:
            from depthscope.common.progress import progress_bar

            bar = progress_bar(int(run_len.sum()), desc=desc, unit="tok")
        for j, b in enumerate(batches):
            width = int(run_len[b].max())
            ids = torch.full((len(b), width), pad, dtype=torch.long)
            mask = torch.zeros((len(b), width), dtype=torch.bool)
            for k, p in enumerate(b):
                L = int(run_len[p])
                ids[k, :L] = torch.from_numpy(tok.ids[p][:L])
                mask[k, :L] = True
            here = sp[bounds[j] : bounds[j + 1]]
            if not len(here):
                continue
            base = slot[table.passage[here]] * width
            f, l = table.first[here], table.last[here]
            if pooling == "last":
                tok_idx = base + l
            elif pooling == "first":
                tok_idx = base + f
            else:  # attn: the last ATTN_MAX_TOKENS subwords; mean: all of them
                a = np.maximum(f, l - ATTN_MAX_TOKENS + 1) if pooling == "attn" else f
                cnt = l - a + 1
                seg = np.repeat(np.arange(len(here)), cnt)
                tok_idx = base[seg] + a[seg] + (np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt))
            # only the positions spans need are kept, gathered inside each site's hook: [S, n, D]
            ti = torch.from_numpy(np.ascontiguousarray(tok_idx, dtype=np.int64))
            out = model.residual_stream(ids, mask=mask, sites=sites, return_logits=False, positions=ti).resid
            if pooling == "mean":  # summed in float32 on the model's device, whatever the model's dtype
                sg = torch.from_numpy(seg).to(out.device)
                summed = torch.zeros(S, len(here), D, dtype=torch.float32, device=out.device)
                summed.index_add_(1, sg, out.float())
                cnt = torch.bincount(sg, minlength=len(here)).to(torch.float32)
                out = summed / cnt[None, :, None]
            arr = out.permute(1, 0, 2).to(torch.float16 if dtype == np.float16 else torch.float32).cpu().numpy()
            if dtype == np.float16 and not np.isfinite(arr).all():
                raise NonFiniteActivationError(
                    "activations overflow float16 (|x| > 65504) at some site: store them as float32 "
                    "(--float32; in Python store_dtype='float32')"
                )
            r0 = int(row_start[here[0]])
            feats[r0 : r0 + len(arr)] = arr
            n_tokens += int(mask.sum())
            if bar is not None:
                bar.update(int(mask.sum()))
        if bar is not None:
            bar.close()
        feats.flush()
        seconds = time.perf_counter() - t0
        del feats
        rows = np.stack([row_start, per_span], 1)
        np.save(tmp / "rows.npy", rows)
        meta = {
            "complete": True,
            "version": STORE_VERSION,
            "key": key,
            "model": getattr(model, "name", "?"),
            "sites": sites,
            "pooling": pooling,
            "dtype": dtype.name,
            "shape": [max(n_rows_total, 1), S, D],
            "n_spans": int(n),
            "n_skipped": int((~ok).sum()),
            "n_passages": int(len(tok.ids)),
            "n_tokens_run": int(n_tokens),
            "n_truncated_passages": int(tok.n_truncated),
            "seconds": seconds,
            "tokens_per_second": n_tokens / seconds if seconds > 0 else None,
            "max_tokens": int(max_tokens),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        from depthscope.common.files import is_place_error, output_error

        if is_place_error(e):
            raise output_error(path, e, "--store") from e
        raise
    finally:
        lock.release()
    store = _open(path)
    store.reused = False
    return store
