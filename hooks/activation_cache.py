"""Activations of every token of a corpus on disk: written in chunks, read back memory-mapped.

>>> write_activations(model, texts, "resid", "acts/")      # or model.run(texts, cache="resid", cache_to="acts/")
>>> acts = open_activations("acts/")
>>> acts["12.attn"].shape, acts.index.columns.tolist()      # [n_tokens, d_model], document position token

==============================  ================================================================
:func:`write_activations`       documents through the model one chunk at a time, each chunk's
                                points written as ``.npy`` shards with their sha256 in the
                                manifest (rewritten after every chunk); a re-run resumes
:func:`open_activations`        the store as :class:`Activations` (checksums verified unless
                                ``verify=False``)
:class:`Activations`            point name -> ``[n_tokens, ...]`` array over the memory-mapped
                                shards (rows: every real token of every document, in document
                                order), ``.index`` (document, position, token), ``.document(i)``
:class:`CacheSettings`          tokens per chunk, progress bar, overwrite a store of another run
==============================  ================================================================

Layout of a store ``DIR`` (readable with numpy alone, see ``docs/cache.md``)::

    DIR/manifest.json                      what the store holds, one record per finished chunk
    DIR/chunks/000000/index.npy            int64 [n, 3]: document, position, token id
    DIR/chunks/000000/<point>.npy          float32 [n, ...]: e.g. 12.attn.npy [n, d_model]

Chunk ``k`` holds the documents ``chunks[k]["documents"]`` (a half-open range) and the rows
``chunks[k]["rows"]`` of every point. Documents are texts (tokenized as the tokenizer does) or
token-id sequences (``depthscope cache`` passes the windows of
:func:`depthscope.analyses.text.text_rows`, each a document of the store); ``first`` (one per
document) leaves its leading positions out of the store: context the model reads, stored for no
one (the overlap of a window with the one before). Activations are stored as float32 whatever the model's
dtype (float32, float16 and bfloat16 values convert exactly; numpy has no bfloat16). The
manifest records each file's size and sha256 and a sha256 of itself
(:mod:`depthscope.common.shards`, the format of the probes' activation store too). Each file is
written atomically and the manifest names a chunk only once all its files are written, so a run
killed at any moment leaves a store that the same call resumes: finished chunks whose files pass
their checks are kept, the others are computed again. Memory holds one forward pass of a chunk
(at most ``chunk_tokens`` padded tokens): each point's rows are written as soon as the forward
reaches it, so no chunk of activations piles up. Points are any hook points whose
tensor is ``[batch, pos, ...]`` (every point but ``l.rot_q``, ``l.rot_k``, ``l.scores`` and
``l.pattern``); each row is the point as the model used it, after ``hooks``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from depthscope.common.errors import ContextLengthError, InputError, OutputError
from depthscope.common.files import FolderLock, check_writable_dir
from depthscope.common.progress import progress_bar
from depthscope.common.shards import ShardedFeats, file_problem, load_array, read_manifest, save_array, write_manifest
from depthscope.hooks.attention import ATTENTION_KINDS
from depthscope.hooks.engine import Engine, Hooks, State, normalise_hooks
from depthscope.hooks.points import Point, parse_point, parse_points
from depthscope.hooks.stream_identity import store_digest
from depthscope.hooks.stream_pass import attention_free, layer_major

__all__ = ["Activations", "CacheSettings", "cache_points", "open_activations", "write_activations"]

FORMAT = "depthscope-activations"
VERSION = 1
MANIFEST = "manifest.json"
CHUNKS = "chunks"
INDEX = "index.npy"
INDEX_COLUMNS = ("document", "position", "token")
STORED_DTYPE = "float32"
LOCK = ".depthscope-cache.lock"
#: the fields of the manifest that must match for a re-run to resume a store
IDENTITY = ("model", "model_digest", "points", "hooks", "tokens_sha256", "n_documents", "n_tokens", "chunk_tokens")
log = logging.getLogger("depthscope")


@dataclass(frozen=True)
class CacheSettings:
    """How :func:`write_activations` writes: ``chunk_tokens`` padded tokens per chunk (one forward
    pass; a longer document is a chunk of its own), a progress bar, and ``overwrite`` a store of
    another run (other model, texts, points) in the same folder instead of refusing."""

    chunk_tokens: int = 1024
    progress: bool = True
    overwrite: bool = False
    desc: str = "activation cache"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise InputError(f"chunk_tokens must be a positive integer, got {self.chunk_tokens!r}")


@dataclass
class Activations(Mapping):
    """A store opened by :func:`open_activations`: ``acts[name]`` (any alias of a point stored)
    is a ``[n_tokens, ...]`` :class:`~depthscope.common.shards.ShardedFeats` over the chunks'
    memmaps (``np.asarray`` reads it whole; indexing reads only the rows asked for);
    ``index`` the table (document, position, token) of its rows."""

    path: Path
    manifest: dict
    arrays: dict[str, ShardedFeats]
    index_parts: list = field(repr=False)

    def __repr__(self) -> str:
        return (
            f"Activations({str(self.path)!r}, {self.n_documents} documents, {self.n_tokens} tokens, "
            f"{len(self.arrays)} points {_short(list(self.arrays))})"
        )

    def _key(self, name) -> str:
        if isinstance(name, str) and name in self.arrays:
            return name
        key = parse_point(name, self.manifest["n_layers"]).name
        if key not in self.arrays:
            raise KeyError(f"hook point {name!r} ({key}) is not in {self.path}; stored: {list(self.arrays)}")
        return key

    def __getitem__(self, name) -> ShardedFeats:
        return self.arrays[self._key(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    @property
    def n_documents(self) -> int:
        return int(self.manifest["n_documents"])

    @property
    def index(self):
        """The rows as a table: ``document``, ``position`` (within the document), ``token`` (id)."""
        import pandas as pd  # lazy: only this table needs pandas

        return pd.DataFrame(self.index_array(), columns=list(INDEX_COLUMNS))

    def index_array(self) -> np.ndarray:
        """The index as one int64 ``[n_tokens, 3]`` array (document, position, token)."""
        return np.concatenate([np.asarray(p) for p in self.index_parts])

    def document(self, i: int) -> slice:
        """The rows of document ``i``: ``acts[name][acts.document(i)]`` is its ``[len, ...]`` activations."""
        starts = self.manifest["document_starts"]
        if not 0 <= i < self.n_documents:
            raise IndexError(f"document {i} out of range 0..{self.n_documents - 1}")
        return slice(starts[i], starts[i + 1])


def _short(names: list[str]) -> str:
    """``names`` for a repr: all of a few, else the first two and the last."""
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"


# ---------------------------------------------------------------------------- planning
def _cacheable(points: list[Point]) -> list[Point]:
    """``points``, refusing none and those whose tensor is not ``[batch, pos, ...]``."""
    if not points:
        raise InputError("no hook points to cache: name some (e.g. 'resid' or '0.mlp,5.attn')")
    bad = [p.name for p in points if p.kind in ATTENTION_KINDS]
    if bad:
        raise InputError(
            f"{bad} cannot be cached per token: they are [batch, heads, pos, ...] tensors; cache other points "
            f"(e.g. 'resid', 'l.z', 'l.q') or read them with model.run"
        )
    return points


def _tokens(model, texts) -> list[np.ndarray]:
    """Each document's token ids: strings as ``model.tokenize`` makes them (without padding),
    token-id sequences as they are (checked against the vocabulary)."""
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts) if isinstance(texts, (list, tuple)) else None
    if texts and all(not isinstance(t, str) for t in texts):
        docs = [_ids(t, i, model.vocab_size) for i, t in enumerate(texts)]
    else:
        if not texts or any(not isinstance(t, str) or not t for t in texts):
            raise InputError("cache_to needs documents: a non-empty list of non-empty strings (or of token-id lists)")
        if model.tokenizer is None:
            raise InputError("this model has no tokenizer: load_model(..., tokenizer=...) to cache text")
        ids = model.tokenizer(texts, add_special_tokens=True)["input_ids"]
        docs = [np.asarray(d, dtype=np.int64) for d in ids]
    ctx = model.max_context
    for i, d in enumerate(docs):
        if len(d) == 0:
            raise InputError(f"document {i} tokenizes to no tokens")
        if ctx is not None and len(d) > ctx:
            raise ContextLengthError(
                f"document {i} has {len(d)} tokens but {model.name} has a context of {ctx}; split it into "
                f"windows (depthscope.analyses.text.text_rows) or shorter lines"
            )
    return docs


def _ids(seq, i: int, vocab: int) -> np.ndarray:
    """One document given as token ids, as int64, each id in the vocabulary."""
    try:
        arr = np.asarray(seq)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InputError(f"document {i} is neither a string nor a list of token ids: {type(seq).__name__}")
    bad = arr[(arr < 0) | (arr >= vocab)]
    if bad.size:
        raise InputError(f"document {i} holds token id {int(bad[0])}, outside the vocabulary 0..{vocab - 1}")
    return arr.astype(np.int64)


def _firsts(first, docs: list[np.ndarray]) -> np.ndarray:
    """The first stored position of each document (None: 0), each leaving at least one row."""
    if first is None:
        return np.zeros(len(docs), dtype=np.int64)
    f = np.asarray(first, dtype=np.int64).reshape(-1)
    if len(f) != len(docs):
        raise InputError(f"first gives {len(f)} positions for {len(docs)} documents")
    bad = [i for i, (k, d) in enumerate(zip(f, docs)) if not 0 <= k < len(d)]
    if bad:
        raise InputError(f"first[{bad[0]}] = {int(f[bad[0]])} leaves document {bad[0]} of {len(docs[bad[0]])} no row")
    return f


def _plan(lengths: Sequence[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive documents ``[a, b)`` per chunk: as many as fit in ``chunk_tokens`` padded
    tokens (``count * longest``), at least one."""
    out, a, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > a and (i - a + 1) * max(longest, n) > chunk_tokens:
            out.append((a, i))
            a, longest = i, 0
        longest = max(longest, int(n))
    out.append((a, len(lengths)))
    return out


def _identity(model, docs: list[np.ndarray], first: np.ndarray, points: list[Point], user: dict, chunk_tokens: int):
    """What a store is of: the model (name and weight digest: a streamed model's from its files'
    headers and versions, :func:`~depthscope.hooks.stream_identity.store_digest`), the points, the
    hooks' points, the token ids (and the first stored position of each document) and the
    chunking; a re-run resumes only a store of the same."""
    h = hashlib.sha256()
    for d, f in zip(docs, first):
        h.update(np.int64(len(d)).tobytes())
        h.update(d.tobytes())
        if f:  # a store of whole documents keeps the digest it always had
            h.update(b"first" + np.int64(f).tobytes())
    return {
        "model": str(model.name),
        "model_digest": store_digest(model),
        "points": [p.name for p in points],
        "hooks": sorted(p.name for p in user),
        "tokens_sha256": h.hexdigest(),
        "n_documents": len(docs),
        "n_tokens": int(sum(len(d) for d in docs) - int(first.sum())),
        "chunk_tokens": int(chunk_tokens),
    }


# ---------------------------------------------------------------------------- writing
def _capture(model, points: list[Point], user: dict, docs: tuple, keep: Callable) -> None:
    """One forward of ``docs`` (``(ids, first)``: right-padded) handing each point's rows at the
    real tokens from each document's first stored position on, in document order, as float32
    numpy to ``keep(name, rows)`` as soon as the forward reaches it (gathered inside the hook;
    only one point's rows are held at a time; the forward stops after the last point)."""
    docs, first = docs
    width = max(len(d) for d in docs)
    pad = getattr(model.tokenizer, "pad_token_id", None) if model.tokenizer is not None else None
    ids = torch.full((len(docs), width), 0 if pad is None else int(pad), dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.bool)
    stored = torch.zeros((len(docs), width), dtype=torch.bool)
    for k, d in enumerate(docs):
        ids[k, : len(d)] = torch.from_numpy(d)
        mask[k, : len(d)] = True
        stored[k, int(first[k]) : len(d)] = True
    ids, mask = ids.to(model.device), mask.to(model.device)
    flat = stored.reshape(-1).nonzero().reshape(-1).to(model.device)

    def sink(point: Point, t: torch.Tensor) -> torch.Tensor:
        rows = t.reshape(-1, *t.shape[2:]).index_select(0, flat)
        keep(point.name, rows.detach().to(device="cpu", dtype=torch.float32).numpy())
        return rows.new_empty((0, *rows.shape[1:]))  # the engine keeps nothing (not a view: it would hold the rows)

    state = State(mask=mask, positions=torch.arange(width, device=ids.device).expand(ids.shape), step=None)
    with torch.no_grad(), Engine(model, points, user, state=state, sink=sink, stop=True):
        model.hf_model(input_ids=ids, attention_mask=mask.long(), use_cache=False)


def _index(docs: list[np.ndarray], first: np.ndarray, start: int) -> np.ndarray:
    """int64 ``[n, 3]``: document (numbered from ``start``), position, token id of each row (the
    positions of each document from its ``first`` on)."""
    doc = np.repeat(np.arange(start, start + len(docs), dtype=np.int64), [len(d) - f for d, f in zip(docs, first)])
    pos = np.concatenate([np.arange(f, len(d), dtype=np.int64) for d, f in zip(docs, first)])
    return np.stack([doc, pos, np.concatenate([d[f:] for d, f in zip(docs, first)])], axis=1)


def _write_chunk(out: Path, k: int, job: tuple, span: tuple[int, int], rows: tuple[int, int]) -> dict:
    """Chunk ``k`` (documents ``span``, rows ``rows``) computed and written: one ``.npy`` per point
    as the forward reaches it, then the index, each atomically. ``job``: (model, points, user
    hooks, every document's ids, every document's first stored position). Returns its manifest
    record (with ``shapes``: each point's)."""
    model, points, user, docs, first = job
    folder = out / CHUNKS / f"{k:06d}"
    files, shapes = {}, {}

    def keep(name: str, arr: np.ndarray) -> None:
        files[f"{name}.npy"] = save_array(folder / f"{name}.npy", arr)
        shapes[name] = list(arr.shape[1:])

    part, part_first = docs[span[0] : span[1]], first[span[0] : span[1]]
    _capture(model, points, user, (part, part_first), keep)
    files[INDEX] = save_array(folder / INDEX, _index(part, part_first, span[0]))
    return {"chunk": k, "documents": list(span), "rows": list(rows), "files": files, "shapes": shapes}


def _chunk_ok(out: Path, record: dict) -> bool:
    """Whether a finished chunk's files are all there and match their sha256."""
    folder = out / CHUNKS / f"{record['chunk']:06d}"
    problems = [file_problem(folder / n, r) for n, r in record.get("files", {}).items()]
    bad = [p for p in problems if p]
    if bad:
        log.warning("activation cache: %s; computing that chunk again", bad[0])
    return not bad and bool(problems)


def _start(out: Path, identity: dict, overwrite: bool) -> dict:
    """The manifest to continue: the one in ``out`` when it is of the same run (its finished
    chunks), else a new one (``overwrite``: the other run's files removed)."""
    old = None
    if (out / MANIFEST).is_file():
        try:
            old = read_manifest(out / MANIFEST)
        except InputError as e:
            log.warning("activation cache: %s; starting again", e)
    if old is not None and old.get("format") == FORMAT and all(old.get(k) == identity[k] for k in IDENTITY):
        done = [c for c in old.get("chunks", []) if _chunk_ok(out, c)]
        return {**old, "complete": False, "chunks": done}
    if old is not None and not overwrite:
        differ = [k for k in IDENTITY if old.get(k) != identity[k]]
        raise OutputError(
            f"{out} holds the activations of another run (its {', '.join(differ) or 'format'} differ); "
            f"use another folder, or overwrite it (--force; in Python CacheSettings(overwrite=True))"
        )
    shutil.rmtree(out / CHUNKS, ignore_errors=True)
    return {"format": FORMAT, "version": VERSION, "complete": False, **identity, "chunks": []}


def cache_points(points, n_layers: int) -> list[Point]:
    """The points a cache is asked for: names, a comma list, or a list, where the group words
    ``resid`` (the 2L+1 residual sites) and ``all`` mix with point names (``"resid,1.z"``)."""
    if isinstance(points, str):
        points = [p.strip() for p in points.split(",") if p.strip()]
    if isinstance(points, (list, tuple)):
        groups = [p for p in points if isinstance(p, str) and p in ("all", "resid")]
        named = [p for p in points if not (isinstance(p, str) and p in ("all", "resid"))]
        found = [q for g in groups for q in parse_points(g, n_layers)] + parse_points(named, n_layers)
        return sorted(set(found), key=lambda p: p.order)
    return parse_points(points, n_layers)


def write_activations(
    model,
    texts,
    points="resid",
    out=".",
    *,
    hooks: Hooks = None,
    settings: CacheSettings | None = None,
    first=None,
    meta: dict | None = None,
) -> Activations:
    """The activations at ``points`` (names, ``"resid"``, a comma list) of every token of ``texts``
    (documents: strings, or token-id sequences) written to the store ``out`` chunk by chunk (see
    the module docstring), resuming a store of the same run there; ``hooks`` ({name: fn}) run as
    in ``model.run``; ``first``: each document's first stored position (None: 0); ``meta``: what
    the caller records about the documents (the manifest's ``meta``). Returns the store opened
    (:func:`open_activations`, files not hashed again)."""
    settings = settings or CacheSettings()
    points = _cacheable(cache_points(points, model.n_layers))
    user = normalise_hooks(hooks, model.n_layers)
    docs = _tokens(model, texts)
    firsts = _firsts(first, docs)
    out = check_writable_dir(out, "the activation cache folder (--out)")
    identity = _identity(model, docs, firsts, points, user, settings.chunk_tokens)
    with FolderLock(out / LOCK, f"the activation cache {out}", "--out"):
        manifest = _start(out, identity, settings.overwrite)
        manifest.update({"meta": meta} if meta else {})
        _fill(model, (docs, firsts), points, user, out, manifest, settings)
    return open_activations(out, verify=False)


def _fill(model, docs: tuple, points, user, out: Path, manifest: dict, settings: CacheSettings) -> None:
    """Compute and write every chunk the manifest does not name, rewriting it after each; then
    mark it complete. ``docs``: ``(ids, first)`` of every document."""
    docs, first = docs
    lengths = [len(d) for d in docs]
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths) - first)]).astype(int)
    manifest.update(
        n_layers=model.n_layers,
        model_dtype=str(model.dtype).removeprefix("torch."),
        dtype=STORED_DTYPE,
        index_columns=list(INDEX_COLUMNS),
        document_starts=starts.tolist(),
    )
    done = {c["chunk"] for c in manifest["chunks"]}
    plan = _plan(lengths, settings.chunk_tokens)
    left = sum(int(starts[b] - starts[a]) for k, (a, b) in enumerate(plan) if k not in done)
    bar = progress_bar(left, desc=settings.desc, unit="tok", enabled=settings.progress)
    job = (model, points, user, docs, first)
    todo = [(k, a, b) for k, (a, b) in enumerate(plan) if k not in done]

    def chunk(item: tuple) -> tuple:
        k, a, b = item
        return item, _write_chunk(out, k, job, (a, b), (int(starts[a]), int(starts[b])))

    def held(item: tuple) -> int:  # a chunk's padded stream (its points' rows go to disk as reached)
        _, a, b = item
        return (b - a) * max(lengths[a:b]) * 4 * model.d_model

    # streamed: the chunks as layer-major passes, the weights read once per pass
    safe = attention_free([*points, *user])
    try:
        for (_, a, b), record in layer_major(model, todo, chunk, held=held, enabled=safe, progress=settings.progress):
            manifest.setdefault("shapes", record.pop("shapes"))
            manifest["chunks"] = sorted([*manifest["chunks"], record], key=lambda c: c["chunk"])
            write_manifest(out / MANIFEST, manifest)
            bar.update(int(starts[b] - starts[a]))
    finally:
        bar.close()
    manifest["complete"] = True
    write_manifest(out / MANIFEST, manifest)


# ---------------------------------------------------------------------------- reading
def _checked_manifest(path: Path) -> dict:
    """The store's manifest, refused unless complete and its chunks cover every row in order."""
    if not (path / MANIFEST).is_file():
        raise InputError(f"{path} is not an activation cache (no {MANIFEST}); write one with depthscope cache")
    m = read_manifest(path / MANIFEST)
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise InputError(f"{path / MANIFEST} is not a depthscope activation cache of version {VERSION}")
    chunks = m.get("chunks", [])
    if not m.get("complete"):
        raise InputError(
            f"{path} is unfinished ({len(chunks)} chunks written): run the same depthscope cache command "
            f"(or model.run(..., cache_to=)) again to finish it"
        )
    docs = [d for c in chunks for d in c["documents"]]
    rows = [r for c in chunks for r in c["rows"]]
    ends_ok = docs[:1] == [0] == rows[:1] and docs[-1:] == [m["n_documents"]] and rows[-1:] == [m["n_tokens"]]
    if not (ends_ok and docs[1:-1:2] == docs[2::2] and rows[1:-1:2] == rows[2::2]):
        raise InputError(f"{path / MANIFEST} lists chunks that do not cover its documents in order")
    return m


def open_activations(path, *, verify: bool = True) -> Activations:
    """The store ``path`` (written by :func:`write_activations`) as :class:`Activations`.

    Every file is checked against the manifest: present, of its recorded size, shape and dtype,
    and (``verify=True``, the default) of its recorded sha256, which reads each file once per
    process (about 1 GB/s); ``verify=False`` skips the hashing. A missing, truncated or corrupted
    shard, an edited manifest or an unfinished store is an
    :class:`~depthscope.common.errors.InputError` naming the file."""
    path = Path(path)
    m = _checked_manifest(path)
    parts: dict[str, list] = {name: [] for name in m["points"]}
    index = []
    for c in m["chunks"]:
        folder, n = path / CHUNKS / f"{c['chunk']:06d}", c["rows"][1] - c["rows"][0]
        files = c["files"]
        index.append(load_array(folder / INDEX, files.get(INDEX), verify, (n, 3), np.int64))
        for name in m["points"]:
            f = f"{name}.npy"
            parts[name].append(load_array(folder / f, files.get(f), verify, (n, *m["shapes"][name]), STORED_DTYPE))
    return Activations(path, m, {name: ShardedFeats(p) for name, p in parts.items()}, index)
