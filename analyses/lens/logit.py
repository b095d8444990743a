"""The logit lens at every residual site, streamed over whole datasets.

Each site's stream (embedding, after every attention sublayer, after every MLP sublayer) is
decoded the way the model decodes its last stream: the model's own final norm, recomputed on
that site's stream, then the unembedding (with any bias, logit scale or soft-capping the
architecture has). The last site therefore reproduces the model's own logits, so its KL to the
final distribution is 0 and its cross-entropy is the model's own.

>>> from depthscope.analyses import logit_lens, logit_lens_tokens
>>> df = logit_lens(model, ["The cat sat on the mat.", "Another document."])
>>> df[["label", "depth", "kl_to_final", "cross_entropy", "top1_agreement"]]
>>> tok = logit_lens_tokens(model, "The capital of France is")   # per position x site, top-k

Metrics (natural-log units) for a site ``s`` at a position with final distribution ``p`` (the
model's own next-token distribution) and lens distribution ``q_s``:

* ``kl_to_final`` = KL(p || q_s) = sum_v p_v (log p_v - log q_s,v)
* ``cross_entropy`` = -log q_s(next token), at positions that have a next token in their window
* ``entropy`` = -sum_v q_s,v log q_s,v
* ``top1_agreement`` = [argmax q_s == argmax p] (tie-aware: the final top-1 token holds the
  lens's largest logit)
* ``top1_accuracy`` = [no logit is strictly greater than the next token's] (``target_rank == 0``)
* ``target_rank`` = number of vocabulary items whose lens logit is strictly greater than the
  next token's (0 = the lens's top prediction); ``target_log_rank`` = mean log10(1 + rank), a
  summary less dominated by a few very large ranks.

Streaming: documents are read as every free-text analysis reads them
(:func:`depthscope.analyses.text.iter_rows` under a
:class:`~depthscope.analyses.text_settings.TextWindows`, ``text=``: the BOS token prepended to
every window when the tokenizer adds none, documents longer than the window split into windows,
each a fresh context, and at most ``max_tokens`` positions read, cut inside a document); the
last position of a window has no next-token target. Token ids are taken as they are, and the
per-token view of a prompt (:func:`logit_lens_tokens`) reads it as the tokenizer does. Each
forward captures all sites at once; positions are then decoded in chunks of ``token_chunk`` tokens x all sites as one
``[chunk * sites, d] @ [d, vocab]`` matmul into reused buffers, and reduced at once to per-site
sums (float64). Memory is bounded by ``max_batch_tokens`` (activations and logits of one forward)
and ``token_chunk`` (two ``[chunk * sites, vocab]`` float32 buffers, 400 MB by default, 4 GB on a
GPU), never by the corpus length.

Precision: a bfloat16 (or float16) model is run and decoded in its own dtype (streams, final
norm, unembedding matmul), a 16 MB block of logits at a time copied into the float32 buffers
(:meth:`~depthscope.hooks.unembed.Unembed.project_into`); every statistic is reduced in float32
there and summed per site in float64.

Uncertainty: every mean comes with a 95% interval that treats each document as one cluster
(tokens of a text are correlated, so a per-token standard error would be too narrow); the
clusters' sums come from the same per-position metrics, no extra pass
(:mod:`depthscope.analyses.intervals`).

Position 0 of every window: included by default (``first_position=True``), because the issue's
metrics are over all real positions. With the BOS token prepended it is the BOS, whose
prediction is the first word's, unconditional; without one (``TextWindows(bos=False)`` and a
tokenizer that adds none, as SmolLM2's) it is the first word; either way its stream is the
attention sink with outsized norms. Pass ``first_position=False`` to exclude it everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.intervals import ClusterSums, add_notes, cluster_provenance, interval_columns, pick_clusters
from depthscope.analyses.lens.lenses import Lens, LogitLens
from depthscope.analyses.text import TokenBatch, token_batches, with_window
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.sites import site_frame

if TYPE_CHECKING:  # annotations only
    from depthscope.hooks.model import ResidualStream

__all__ = ["logit_lens", "logit_lens_tokens", "Streaming", "lens_batches", "DEFAULT_BUFFER_MB", "LOGIT_LENS"]

#: the default lens of every analysis (stateless, shared)
LOGIT_LENS = LogitLens()

#: memory for the two reused float32 ``[rows, vocab]`` decode buffers when ``token_chunk`` is not
#: given: rows = 400 MB / (2 x 4 B x vocab), i.e. ~1000 rows (16 tokens x 61 sites) for SmolLM2's
#: 49k vocabulary. Larger chunks keep the unembedding matmul nearer its peak speed; the bound keeps
#: the buffers' memory fixed whatever the vocabulary.
DEFAULT_BUFFER_MB = 400
#: the same budget when the model is on a GPU, at most a quarter of the card's free memory: a
#: chunk there is ~25 small kernels whatever its size, so ~10x larger chunks cut the launches
#: the host issues (the lens was bound by them on an H200: docs/benchmarks.md)
GPU_BUFFER_MB = 4096

METRICS = [
    "kl_to_final",
    "cross_entropy",
    "entropy",
    "top1_agreement",
    "top1_accuracy",
    "target_rank",
    "target_log_rank",
]
_ALL_POSITIONS = {"kl_to_final", "entropy", "top1_agreement"}  # the others need a next token
#: the range of each metric's mean (its 95% interval is cut to it)
_BOUNDS = {
    "kl_to_final": (0.0, None),
    "cross_entropy": (0.0, None),
    "entropy": (0.0, None),
    "top1_agreement": (0.0, 1.0),
    "top1_accuracy": (0.0, 1.0),
    "target_rank": (0.0, None),
    "target_log_rank": (0.0, None),
}


# ----------------------------------------------------------------------------- batching
@dataclass
class _Batch:
    """Padded windows of one forward: token ids, real-token mask, and each row's document and
    window number."""

    ids: torch.Tensor
    mask: torch.Tensor
    doc_index: list
    window_index: list
    first: list | None = None  # each row's first counted position (None: all count)

    def rows(self, start: int, stop: int, width: int | None = None) -> _Batch:
        """Rows ``start:stop``, cut to the first ``width`` positions (None: all)."""
        cols = slice(None) if width is None else slice(None, width)
        return _Batch(
            self.ids[start:stop, cols],
            self.mask[start:stop, cols],
            self.doc_index[start:stop],
            self.window_index[start:stop],
            None if self.first is None else self.first[start:stop],
        )


def lens_batches(
    model,
    inputs,
    *,
    mask: torch.Tensor | None = None,
    batch_size: int = 8,
    window: int | None = None,
    max_batch_tokens: int = 1024,
    text: TextWindows | None = None,
    skip: int = 0,
) -> Iterator[_Batch]:
    """``token_batches`` further split so that no forward holds more than ``max_batch_tokens``
    padded tokens (rows x width), whatever the document lengths. Padding is trimmed per split.
    Documents are read under ``text`` (``skip``: 1 leaves each window's first position uncounted)
    when it is given, else as the tokenizer tokenizes them."""
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    if text is not None and not isinstance(inputs, torch.Tensor):
        stream = token_batches(model, inputs, batch_size=batch_size, window=window, text=text, skip=skip)
    else:
        stream = _grouped_token_batches(model, inputs, batch_size=batch_size, window=window, mask=mask)
    for tb in stream:
        batch = _Batch(tb.ids, tb.mask, tb.doc_index, tb.window_index, tb.first)
        for start, stop, width in _row_splits(tb.mask.sum(1), max_batch_tokens):
            yield batch.rows(start, stop, width)


def _row_splits(lengths: torch.Tensor, max_batch_tokens: int) -> Iterator[tuple[int, int, int]]:
    """Consecutive row ranges ``(start, stop, width)`` of a batch whose rows have ``lengths`` real
    tokens: each range as long as its padded size (rows x widest row) stays within
    ``max_batch_tokens``, and at least one row."""
    n = len(lengths)
    start = 0
    while start < n:
        stop = start + 1
        width = int(lengths[start])
        while stop < n:
            wider = max(width, int(lengths[stop]))
            if (stop - start + 1) * wider > max_batch_tokens:
                break
            width = wider
            stop += 1
        yield start, stop, width
        start = stop


#: documents tokenized at a time: token_batches tokenizes everything it is given up front, so
#: long document lists are fed to it in groups to keep token-id lists bounded too.
DOC_GROUP = 1024


def _grouped_token_batches(model, inputs, *, batch_size, window, mask) -> Iterator[TokenBatch]:
    """:func:`token_batches` over ``inputs``, ``DOC_GROUP`` documents at a time, with document
    numbers counted over the whole list (empty strings dropped, as token_batches does)."""
    if isinstance(inputs, (str, torch.Tensor)) or len(inputs) <= DOC_GROUP:
        yield from token_batches(model, inputs, batch_size=batch_size, window=window, mask=mask)
        return
    docs = list(inputs)
    if not any(docs):
        raise InputError("empty input: no texts given")
    before, yielded = 0, False
    for start in range(0, len(docs), DOC_GROUP):
        group = [d for d in docs[start : start + DOC_GROUP] if d]
        for tb in _group_batches(model, group, batch_size=batch_size, window=window):
            yielded = True
            yield TokenBatch(tb.ids, tb.mask, [before + i for i in tb.doc_index], tb.window_index)
        before += len(group)
    if not yielded:
        raise InputError("empty input: the texts tokenize to no tokens")


def _group_batches(model, group: list[str], *, batch_size: int, window: int | None) -> Iterator[TokenBatch]:
    """The token batches of one group of documents; none when the group is empty or all its
    documents tokenize to nothing (a later group may still hold tokens)."""
    if not group:
        return
    try:
        yield from token_batches(model, group, batch_size=batch_size, window=window)
    except InputError as e:
        if "tokenize to no tokens" not in str(e):
            raise


# ----------------------------------------------------------------------------- decoding
def _exp_shifted(Z: torch.Tensor, B: torch.Tensor, zmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``B = Z - zmax`` (log q up to the normaliser) and ``Z = exp(B)``; returns the
    normaliser ``s`` per row and ``log s``. The sum is torch's cascade (pairwise) sum, ~1e-7
    relative in float32; softmax / log_softmax kernels sum it sequentially on the CPU, ~3e-5 at a
    49k vocabulary. Neither buffer is normalised: the metrics take ``s`` out of their sums."""
    torch.sub(Z, zmax, out=B)
    torch.exp(B, out=Z)
    s = Z.sum(-1, keepdim=True)
    return s, s.log()


class _Decoder:
    """Decodes chunks of ``[tokens, sites, d]`` streams into per-row metrics through the model's
    :class:`~depthscope.hooks.unembed.Unembed`, reusing two float32 ``[rows, vocab]`` buffers for
    every chunk (float32 always: the last site must reproduce the model's own numbers)."""

    def __init__(self, model, max_rows: int):
        self.model = model
        self.V = model.vocab_size
        self.max_rows = max_rows
        self.Z = self.B = torch.empty(0, self.V)

    def _ensure(self, rows: int) -> None:
        """Grow the buffers to ``rows`` (at most ``max_rows``); small inputs keep small buffers."""
        if rows > self.Z.shape[0]:
            cap = min(self.max_rows, max(rows, 2 * self.Z.shape[0]))
            dev = self.model.device
            self.Z = self.B = None
            self.Z = torch.empty(cap, self.V, dtype=torch.float32, device=dev)
            self.B = torch.empty(cap, self.V, dtype=torch.float32, device=dev)

    def final(self, logits: torch.Tensor):
        """Per-token reference: probs, sum p log p, argmax of the model's own logits. ``sum p log
        p`` is formed as :meth:`run` forms ``sum p log q`` (``sum p B - log s sum p``, the same
        operations), so a site whose logits are the model's has a KL of exactly 0."""
        logits = logits.float()
        top = logits.argmax(-1)
        p, B = logits.clone(), torch.empty_like(logits)
        s, log_s = _exp_shifted(p, B, logits.amax(-1, keepdim=True))
        p.div_(s)
        neg_h = (B * p).sum(-1) - log_s[:, 0] * p.sum(-1)  # sum_v p log p
        return p, neg_h, top

    def run(
        self,
        xs: torch.Tensor,
        p: torch.Tensor,
        neg_hp: torch.Tensor,
        final_top: torch.Tensor,
        targets: torch.Tensor,
        *,
        topk: int = 0,
    ) -> dict:
        """``xs``: [C, S, d] streams (translated if a tuned lens is used); returns [C, S] tensors."""
        model = self.model
        C, S, d = xs.shape
        R, V = C * S, self.V
        self._ensure(R)
        Z, B = self.Z[:R], self.B[:R]
        unembed = model.unembed
        unembed.project_into(unembed.norm(xs.reshape(R, d)), Z)
        tgt = targets.repeat_interleave(S).unsqueeze(1)  # [R, 1]
        out = {}
        # agreement: the final top-1 token holds the lens's largest logit (amax is a cheap
        # vectorised pass; argmax is not, and the aggregate needs no lens token id)
        z_final_top = Z.gather(1, final_top.repeat_interleave(S).unsqueeze(1)).view(C, S)
        zmax = Z.amax(-1, keepdim=True)
        out["top1_agreement"] = z_final_top >= zmax.view(C, S)
        zt = Z.gather(1, tgt)
        torch.gt(Z, zt, out=B)  # as floats: a bool tensor's sum is ~30x slower on the CPU
        out["target_rank"] = B.sum(-1).view(C, S)  # exact in float32 (< 2^24)
        s, log_s = _exp_shifted(Z, B, zmax)  # q = Z / s, log q = B - log s (both [R, 1])
        out["target_logprob"] = (B.gather(1, tgt) - log_s).view(C, S)
        if topk:
            vals, ids = B.topk(topk, dim=-1)
            out["topk_logprob"] = (vals - log_s).view(C, S, topk)
            out["topk_id"] = ids.view(C, S, topk)
            out["top1_id"] = out["topk_id"][..., 0]
        # row-wise dot products as multiply + sum: torch's sum is a cascade (pairwise) reduction,
        # accurate to ~1e-7 relative; bmm/mm dots over 49k terms err by up to 1e-4 relative.
        # entropy = -sum q log q = log s - sum(e^B B) / s: two non-negative terms, no cancellation
        torch.mul(Z, B, out=Z)
        out["entropy"] = (log_s - Z.sum(-1, keepdim=True) / s).view(C, S)
        # sum_v p log q = sum_v p B - log s sum_v p
        torch.mul(B.view(C, S, V), p.unsqueeze(1), out=B.view(C, S, V))
        p_logq = B.sum(-1).view(C, S) - log_s.view(C, S) * p.sum(-1, keepdim=True)
        out["kl_to_final"] = neg_hp.unsqueeze(1) - p_logq
        return out


def _token_chunk(token_chunk: int | None, n_sites: int, vocab: int, device: torch.device | None = None) -> int:
    """Positions decoded at once: ``token_chunk``, or as many as the buffers' budget holds
    (:data:`DEFAULT_BUFFER_MB`; :data:`GPU_BUFFER_MB` on a GPU, within a quarter of its free
    memory)."""
    if token_chunk is None:
        budget = DEFAULT_BUFFER_MB * 2**20
        if device is not None and device.type == "cuda":
            budget = min(GPU_BUFFER_MB * 2**20, torch.cuda.mem_get_info(device)[0] // 4)
        rows = budget // (2 * 4 * vocab)
        return max(1, rows // n_sites)
    if token_chunk < 1:
        raise InputError("token_chunk must be at least 1")
    return int(token_chunk)


def _positions(ids: torch.Tensor, mask: torch.Tensor, first_position: bool, first: list | None = None):
    """Flat (row, pos) of the positions used (from each row's ``first`` on, when given), and their
    next-token targets (-1 if none)."""
    sel = mask.clone()
    if first is not None:
        pos = torch.arange(mask.shape[1], device=mask.device)
        sel &= pos[None] >= torch.tensor(first, device=mask.device)[:, None]
    if not first_position:
        sel[:, 0] = False
    b_idx, t_idx = sel.nonzero(as_tuple=True)
    T = ids.shape[1]
    nxt = (t_idx + 1).clamp(max=T - 1)
    has_next = (t_idx + 1 < T) & mask[b_idx, nxt]
    targets = torch.where(has_next, ids[b_idx, nxt], torch.full_like(t_idx, -1))
    return b_idx, t_idx, targets


# ----------------------------------------------------------------------------- streaming
@dataclass(frozen=True)
class Streaming:
    """How :func:`logit_lens` and :func:`logit_lens_tokens` stream their inputs: ``batch_size``
    windows of at most ``window`` tokens per forward (None: min(context, 512); longer documents
    are split), at most ``max_batch_tokens`` padded tokens per forward, ``token_chunk`` positions
    (x all sites) decoded at once (None: a 400 MB buffer budget, 4 GB on a GPU),
    ``first_position=False`` skips position 0 of every window (the attention sink),
    ``max_tokens`` stops after that many positions (in input order, cut inside a document).
    Either function takes ``streaming=Streaming(...)`` or any of these fields by keyword; for
    documents, ``window`` and ``max_tokens`` are those of the text settings (``text=``)."""

    batch_size: int = 8
    window: int | None = None
    max_batch_tokens: int = 1024
    token_chunk: int | None = None
    first_position: bool = True
    max_tokens: int | None = None


@dataclass(frozen=True, kw_only=True)
class _LensSettings(Streaming):
    """What one lens pass decodes and how it streams: the settings :func:`logit_lens` and
    :func:`logit_lens_tokens` share, bundled once so every helper takes one object.

    The :class:`Streaming` fields, and ``lens``; ``sites``: resolved site indices; ``mask``: the
    inputs' mask (token-id inputs); ``topk``: how many top tokens per (position, site) to keep
    (0: none, the dataset-level table needs no token ids); ``text``: how documents are read
    (None: as the tokenizer tokenizes them)."""

    lens: Lens
    sites: list[int]
    mask: torch.Tensor | None = None
    topk: int = 0
    text: TextWindows | None = None
    progress: bool = False  # a bar over each streamed pass's blocks


@dataclass
class _Chunk:
    """Up to ``token_chunk`` positions of one forward, decoded at every site.

    ``rows``/``positions``: each position's batch row and index in its window; ``targets``: its
    next token id (-1 where the window has none); ``chosen``: the token whose log-prob and rank
    ``metrics`` hold; ``metrics``: :meth:`_Decoder.run`'s ``[c, S]`` tensors plus
    ``final_top1_id`` ``[c]`` (the model's own top-1)."""

    batch: _Batch
    rs: ResidualStream
    rows: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    chosen: torch.Tensor
    metrics: dict


class _Budget:
    """The positions ``max_tokens`` still allows (None: no limit), spent in input order."""

    def __init__(self, max_tokens: int | None):
        if max_tokens is not None and max_tokens < 1:
            raise InputError("max_tokens must be at least 1")
        self.left = max_tokens

    def exhausted(self) -> bool:
        return self.left is not None and self.left <= 0

    def trim(self, batch: _Batch, first_position: bool) -> _Batch:
        """The windows of ``batch`` that can still contribute: a forward of the rest is wasted."""
        if self.left is None:
            return batch
        per_row = batch.mask.sum(1) - (0 if first_position else 1)
        keep = int((per_row.cumsum(0) < self.left).sum()) + 1
        return batch.rows(0, keep)

    def take(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-position tensors cut to the positions still allowed, which they then use up."""
        if self.left is None:
            return flat
        flat = tuple(v[: self.left] for v in flat)
        self.left -= len(flat[0])
        return flat


class _Clock:
    """Seconds spent per phase (``forward_s``: forward passes; ``decode_s``: decoding and
    metrics), added into a caller's ``timings`` dict at the end."""

    def __init__(self):
        self.spent = {"forward_s": 0.0, "decode_s": 0.0}
        self.mark = time.perf_counter()

    def start(self) -> None:
        self.mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last mark to ``phase`` and set a new mark."""
        now = time.perf_counter()
        self.spent[phase] += now - self.mark
        self.mark = now

    def add_to(self, timings: dict | None) -> None:
        if timings is not None:
            for phase, seconds in self.spent.items():
                timings[phase] = timings.get(phase, 0.0) + seconds


def _forwards(model, inputs, settings: _LensSettings, clock: _Clock) -> Iterator[tuple]:
    """One forward per :func:`lens_batches` batch (all sites at once): ``(batch, rs, (rows,
    positions, targets))`` with the flat positions it contributes within ``max_tokens``. On a
    streamed model the batches run as layer-major passes (:func:`~depthscope.hooks.stream_pass.layer_major`:
    the weights read once per pass), each batch's captures held until its pass ends."""
    from depthscope.hooks.stream_pass import layer_major

    per_token = 4 * (len(settings.sites) * model.d_model + model.vocab_size)  # the captures and the logits

    def planned() -> Iterator[tuple]:
        budget = _Budget(settings.max_tokens)
        batches = lens_batches(
            model,
            inputs,
            mask=settings.mask,
            batch_size=settings.batch_size,
            window=settings.window,
            max_batch_tokens=settings.max_batch_tokens,
            text=settings.text,
            skip=0 if settings.first_position else 1,
        )
        for batch in batches:
            if budget.exhausted():
                break
            batch = budget.trim(batch, settings.first_position)
            yield batch, budget.take(*_positions(batch.ids, batch.mask.bool(), settings.first_position, batch.first))

    def forward(job: tuple) -> tuple:
        return job, model.residual_stream(job[0].ids, mask=job[0].mask, sites=settings.sites)

    clock.start()
    held = lambda job: job[0].ids.numel() * per_token  # noqa: E731
    for (batch, flat), rs in layer_major(model, planned(), forward, held=held, progress=settings.progress):
        clock.lap("forward_s")
        yield batch, rs, tuple(t.to(rs.input_ids.device) for t in flat)
        clock.start()


def _iter_chunks(model, inputs, settings: _LensSettings, *, target_fn=None, timings=None) -> Iterator[_Chunk]:
    """Every position of ``inputs`` decoded at every site, ``token_chunk`` positions at a time
    (the decode buffers are sized once for a chunk). ``target_fn(targets, final_top)`` picks the
    token measured at each position (default: the next token)."""
    n_sites = len(settings.sites)
    chunk = _token_chunk(settings.token_chunk, n_sites, model.vocab_size, model.device)
    dec = _Decoder(model, chunk * n_sites)
    clock = _Clock()
    with torch.inference_mode():
        for batch, rs, (b_all, t_all, tg_all) in _forwards(model, inputs, settings, clock):
            for start in range(0, len(b_all), chunk):
                part = slice(start, start + chunk)
                flat = (b_all[part], t_all[part], tg_all[part])
                yield _decode_chunk(dec, settings, batch, rs, flat, target_fn)
            clock.lap("decode_s")
    clock.add_to(timings)


def _decode_chunk(dec: _Decoder, settings: _LensSettings, batch: _Batch, rs, flat, target_fn) -> _Chunk:
    """Decode positions ``flat = (rows, positions, targets)`` of the forward ``rs`` at every
    site: the model's own logits there are the reference, each site's stream (translated by
    the lens) is decoded against them."""
    bi, ti, targets = flat
    p, neg_hp, final_top = dec.final(rs.logits[bi, ti])
    chosen = targets if target_fn is None else target_fn(targets, final_top)
    xs = rs.resid[:, bi, ti]  # [S, c, d]
    xs = settings.lens.translate(xs, settings.sites).transpose(0, 1).contiguous()  # [c, S, d]
    met = dec.run(xs, p, neg_hp, final_top, chosen.clamp(min=0), topk=settings.topk)
    met["final_top1_id"] = final_top
    return _Chunk(batch, rs, bi, ti, targets, chosen, met)


# ----------------------------------------------------------------------------- dataset level
@dataclass
class _Sums:
    """Per-site running sums (and sums of squares) of every metric over positions, and per
    window (each a cluster: :mod:`depthscope.analyses.intervals`) its sums and counts, which
    give the documents' sums too."""

    n_sites: int
    s: dict = field(default_factory=dict)
    ss: dict = field(default_factory=dict)
    n_all: int = 0
    n_next: int = 0
    docs: ClusterSums = field(default_factory=ClusterSums)
    windows: ClusterSums = field(default_factory=ClusterSums)

    def add_chunk(self, batch: _Batch, bi: torch.Tensor, values: dict[str, tuple[torch.Tensor, torch.Tensor | None]]):
        """One chunk's per-position metrics ``values[name] = (v [c, S], valid [c] or None)``;
        ``bi``: the batch row of each position. Every sum is formed where the metrics are (on
        the model's device) into fixed shapes and comes back in one transfer."""
        names = list(values)
        M, S, B = len(names), self.n_sites, batch.ids.shape[0]
        v0 = values[names[0]][0]
        dev, f64 = v0.device, torch.float64
        ones = torch.ones(len(bi), dtype=f64, device=dev)
        vs, ws = [], []
        for name in names:
            v, valid = values[name]
            v = v.to(f64)
            if valid is not None:  # positions without a next token count in no sum
                v = torch.where(valid[:, None], v, torch.zeros((), dtype=f64, device=dev))
            vs.append(v)
            ws.append(ones if valid is None else valid.to(f64))
        V, W = torch.stack(vs), torch.stack(ws + [ones])  # [M, c, S], [M + 1, c] (the last: positions)
        idx = bi.to(dev)
        rows_v = torch.zeros(M, B, S, dtype=f64, device=dev).index_add_(1, idx, V)
        rows_w = torch.zeros(M + 1, B, dtype=f64, device=dev).index_add_(1, idx, W)
        packed = torch.cat([V.sum(1).flatten(), (V * V).sum(1).flatten(), rows_v.flatten(), rows_w.flatten()]).cpu()
        s, ss, rv, rw = packed.split([M * S, M * S, M * B * S, (M + 1) * B])
        s, ss = s.view(M, S), ss.view(M, S)
        rv, rw = rv.view(M, B, S).numpy(), rw.view(M + 1, B).numpy()
        present = np.flatnonzero(rw[-1] > 0)  # batch rows with positions in this chunk
        per_row = {}
        for i, name in enumerate(names):
            if name not in self.s:
                self.s[name] = torch.zeros(S, dtype=f64)
                self.ss[name] = torch.zeros(S, dtype=f64)
            self.s[name] += s[i]
            self.ss[name] += ss[i]
            per_row[name] = (rv[i, present], np.repeat(rw[i, present, None], S, 1))
        self.windows.add([(batch.doc_index[r], batch.window_index[r]) for r in present], per_row)
        self.docs.add([batch.doc_index[r] for r in present], per_row)

    def mean_std(self, name: str, n: int):
        if n == 0:
            nan = np.full(self.n_sites, np.nan)
            return nan, nan
        mean = (self.s[name] / n).numpy()
        var = (self.ss[name] / n).numpy() - mean**2
        return mean, np.sqrt(np.clip(var, 0.0, None))


def logit_lens(
    model,
    inputs: torch.Tensor | Sequence[str] | str,
    *,
    lens: Lens = LOGIT_LENS,
    sites=None,
    mask: torch.Tensor | None = None,
    streaming: Streaming | None = None,
    timings: dict | None = None,
    progress: bool = False,
    total: int | None = None,
    text: TextWindows | None = None,
    **overrides,
) -> pd.DataFrame:
    """Dataset-level logit lens: one row per site with the means of every metric.

    ``inputs``: a LongTensor ``[batch, pos]`` (optional boolean ``mask``), a list of documents,
    or one string. ``lens``: a :class:`~depthscope.analyses.lens.lenses.Lens` (default: the plain
    :class:`~depthscope.analyses.lens.lenses.LogitLens`; a ``TunedLens`` translates each site's
    stream before decoding; its ``kind`` fills the ``lens`` column). ``sites``: indices,
    labels or TransformerLens names (default: all 2L+1, or the tuned lens's sites).
    ``streaming``: a :class:`Streaming` (batch size, window, tokens per forward, positions
    decoded at once, ``first_position``, ``max_tokens``), or any of its fields by keyword
    (``overrides``), e.g. ``logit_lens(model, docs, window=256, max_tokens=10_000)``.
    ``text``: how documents are read (:class:`~depthscope.analyses.text_settings.TextWindows`;
    None: the defaults, with the ``window`` and ``max_tokens`` given here).

    Returns columns ``site, label, layer, sublayer, depth, lens``, then for each metric in
    ``kl_to_final, cross_entropy, entropy, top1_agreement, top1_accuracy, target_rank,
    target_log_rank`` its mean over positions and ``<metric>_std`` (population std), then
    ``n_positions`` (positions used by kl/entropy/agreement) and ``n_next`` (positions with a
    next token, used by cross_entropy/accuracy/rank), ``n_docs`` and ``n_windows`` (documents
    and windows holding at least one position: the intervals' clusters are the documents, or
    the windows when there is a single document), and for each metric ``<metric>_se`` (its
    mean's standard error, clustered by document) and ``<metric>_lo``/``<metric>_hi`` (the 95%
    interval, Student t over the clusters, cut to the metric's range; NaN below 10 clusters,
    ``df.attrs["notes"]`` says why; :mod:`depthscope.analyses.intervals`), and ``ci_n``,
    ``ci_unit``, ``ci_method``: the clusters and the method of every metric's interval.
    ``timings`` (a dict) receives the seconds spent in forward passes (``forward_s``) and in
    decoding + metrics (``decode_s``).
    ``progress``: a bar over positions (:mod:`depthscope.common.progress`), with an ETA when
    ``total`` (the number of positions, e.g. the documents' token count) is given.
    """
    lens.check(model)
    stream, text = _text_streaming(inputs, replace(streaming or Streaming(), **overrides), text)
    settings = _LensSettings(
        lens=lens, sites=lens.resolve_sites(model, sites), mask=mask, text=text, progress=progress, **asdict(stream)
    )
    if text is not None and text.max_tokens is not None and total is not None:
        total = min(total, text.max_tokens)
    bar = _position_bar(settings, total, enabled=progress)
    acc = _accumulate(model, inputs, settings, bar=bar, timings=timings)
    return _dataset_table(model, settings, acc)


def _text_streaming(inputs, stream: Streaming, text: TextWindows | None) -> tuple[Streaming, TextWindows | None]:
    """Where the window and the position cap live: documents are read under ``text`` (None: the
    defaults) holding the streaming's ``window`` and ``max_tokens``; token ids take the text
    settings' window and cap as streaming ones."""
    if isinstance(inputs, torch.Tensor):
        if text is None:
            return stream, None
        window, cap = stream.window or text.window, stream.max_tokens or text.max_tokens
        return replace(stream, window=window, max_tokens=cap), None
    text = with_window(text or TextWindows(), stream.window, stream.max_tokens)
    return replace(stream, window=None, max_tokens=None), text


def _position_bar(settings: _LensSettings, total: int | None, *, enabled: bool):
    """A progress bar over positions; its ``total`` (if known) capped by ``max_tokens``."""
    if settings.max_tokens is not None and total is not None:
        total = min(total, settings.max_tokens)
    return progress_bar(total, desc=f"{settings.lens.kind} lens", unit="tok", enabled=enabled)


def _position_metrics(chunk: _Chunk) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every dataset metric's per-(position, site) values in a chunk, each with the positions it
    is defined at (None: all; else those with a next token), as :meth:`_Sums.add_chunk` takes them."""
    met, valid = chunk.metrics, chunk.targets >= 0
    rank = met["target_rank"]
    return {
        "kl_to_final": (met["kl_to_final"], None),
        "cross_entropy": (-met["target_logprob"], valid),
        "entropy": (met["entropy"], None),
        "top1_agreement": (met["top1_agreement"], None),
        "top1_accuracy": (rank == 0, valid),
        "target_rank": (rank, valid),
        "target_log_rank": (torch.log10(1.0 + rank.double()), valid),
    }


def _accumulate(model, inputs, settings: _LensSettings, *, bar, timings: dict | None) -> _Sums:
    """Stream ``inputs`` through the lens into per-site sums, advancing ``bar`` by positions."""
    acc = _Sums(len(settings.sites))
    for chunk in _iter_chunks(model, inputs, settings, timings=timings):
        acc.n_all += len(chunk.targets)
        acc.n_next += int((chunk.targets >= 0).sum())
        acc.add_chunk(chunk.batch, chunk.rows, _position_metrics(chunk))
        bar.update(len(chunk.targets))
    bar.close()
    if acc.n_all == 0:
        raise InputError("no positions to decode (every window has a single token and first_position=False?)")
    return acc


def _dataset_table(model, settings: _LensSettings, acc: _Sums) -> pd.DataFrame:
    """The table of :func:`logit_lens` from the sums: site columns, each metric's mean and std,
    the counts, and each mean's standard error and 95% interval."""
    df = site_frame(settings.sites, model.n_layers)
    df["lens"] = settings.lens.kind
    for name in METRICS:
        n = acc.n_all if name in _ALL_POSITIONS else acc.n_next
        mean, std = acc.mean_std(name, n)
        df[name] = mean
        df[name + "_std"] = std
    df["n_positions"] = acc.n_all
    df["n_next"] = acc.n_next
    clusters = pick_clusters(acc.docs, acc.windows)  # closes the open clusters: count after it
    df["n_docs"] = acc.docs.n_clusters
    df["n_windows"] = acc.windows.n_clusters
    ci, notes = cluster_provenance(acc.docs, acc.windows, "the intervals of the means (<metric>_lo, <metric>_hi)")
    out = pd.concat([df, _interval_frame(df, clusters), pd.DataFrame(ci, index=df.index)], axis=1)
    add_notes(out, notes)
    return out


def _interval_frame(df: pd.DataFrame, clusters: ClusterSums) -> pd.DataFrame:
    """``<metric>_se``, ``_lo`` and ``_hi`` of every metric's mean in ``df`` over ``clusters``
    (documents, or the windows of a single document), as columns added at once."""
    extra = {}
    for name in METRICS:
        se, g = clusters.se(name)
        for suffix, col in interval_columns(df[name], se, g, _BOUNDS[name]).items():
            extra[f"{name}_{suffix}"] = col
    return pd.DataFrame(extra, index=df.index)


# ----------------------------------------------------------------------------- per token
def _decode_token(tok, i: int) -> str:
    """Token id ``i`` as text (its id as a string when the model has no tokenizer)."""
    if tok is None:
        return str(i)
    return tok.decode([int(i)])


@dataclass(frozen=True)
class _TargetChoice:
    """The token whose log-prob and rank :func:`logit_lens_tokens` reports at each position: a
    ``fixed`` id everywhere, or (None) the next token, the model's own top-1 where there is none."""

    fixed: int | None

    def __call__(self, targets: torch.Tensor, final_top: torch.Tensor) -> torch.Tensor:
        if self.fixed is not None:
            return torch.full_like(targets, self.fixed)
        return torch.where(targets >= 0, targets, final_top)

    def kinds(self, targets: torch.Tensor) -> list[str]:
        """Which rule chose each position's target: ``fixed``, ``next`` or ``model_top1``."""
        if self.fixed is not None:
            return ["fixed"] * len(targets)
        return ["next" if t >= 0 else "model_top1" for t in targets.tolist()]


def logit_lens_tokens(
    model,
    inputs: torch.Tensor | Sequence[str] | str,
    *,
    lens: Lens = LOGIT_LENS,
    sites=None,
    k: int = 5,
    target=None,
    mask: torch.Tensor | None = None,
    streaming: Streaming | None = None,
    **overrides,
) -> pd.DataFrame:
    """Per position and site: the lens's top-``k`` tokens and a target token's log-prob and rank.

    ``target``: None (default) follows the actual next token, and at a window's last position
    (no next token) the model's own top-1 prediction (``target_kind`` says which); a string (one
    token, e.g. ``" Paris"``) or a token id fixes one target at every position. ``streaming``
    and ``overrides``: as in :func:`logit_lens`.

    One row per (document window, position, site); columns: the shared site columns, ``lens``,
    ``doc``, ``window``, ``position``, ``token_id``, ``token``, ``next_id``/``next_token`` (-1 /
    "" when none), ``final_top1_id``/``final_top1_token`` (the model's own prediction),
    ``target_kind``, ``target_id``, ``target_token``, ``target_logprob``, ``target_prob``,
    ``target_rank``, ``kl_to_final``, ``entropy``, ``top1_agreement``, and ``top{i}_id``,
    ``top{i}_token``, ``top{i}_prob`` for i = 1..k. Rows grow with the input: meant for prompts
    and short texts (use :func:`logit_lens` for corpora).
    """
    lens.check(model)
    if k < 1:
        raise InputError("k must be at least 1")
    settings = _LensSettings(
        lens=lens,
        sites=lens.resolve_sites(model, sites),
        mask=mask,
        **asdict(replace(streaming or Streaming(), **overrides)),
        topk=min(int(k), model.vocab_size),
    )
    choice = _TargetChoice(None if target is None else model.token_id(target, "target"))
    sf = site_frame(settings.sites, model.n_layers)
    chunks = _iter_chunks(model, inputs, settings, target_fn=choice)
    frames = [_token_rows(model.tokenizer, settings, sf, choice, chunk) for chunk in chunks]
    if not frames:
        raise InputError("no positions to decode")
    return pd.concat(frames, ignore_index=True)


def _token_rows(tok, settings: _LensSettings, sf: pd.DataFrame, choice: _TargetChoice, chunk: _Chunk) -> pd.DataFrame:
    """One chunk's rows of :func:`logit_lens_tokens`: (position, site) pairs, position-major."""
    part = _position_columns(tok, sf, settings.lens.kind, choice, chunk)
    for name, col in _site_metric_columns(chunk.metrics).items():
        part[name] = col
    top = _topk_columns(tok, chunk.metrics, settings.topk)
    return pd.concat([part, pd.DataFrame(top, index=part.index)], axis=1)


def _position_columns(tok, sf: pd.DataFrame, kind: str, choice: _TargetChoice, chunk: _Chunk) -> pd.DataFrame:
    """The site columns, the lens ``kind``, and what each position reads, is followed by, and is
    measured against, repeated over its sites."""
    S, c = len(sf), len(chunk.rows)
    rep = lambda v: np.repeat(np.asarray(v), S)  # noqa: E731  per position -> per (position, site)
    bi, targets, chosen = chunk.rows, chunk.targets, chunk.chosen
    ids = chunk.rs.input_ids[bi, chunk.positions].cpu()
    final_top = chunk.metrics["final_top1_id"].cpu()
    part = pd.DataFrame({col: np.tile(sf[col].to_numpy(), c) for col in sf.columns})
    part["lens"] = kind
    part["doc"] = rep([chunk.batch.doc_index[int(b)] for b in bi])
    part["window"] = rep([chunk.batch.window_index[int(b)] for b in bi])
    part["position"] = rep(chunk.positions.cpu().numpy())
    part["token_id"] = rep(ids.numpy())
    part["token"] = rep([_decode_token(tok, i) for i in ids.tolist()])
    part["next_id"] = rep(targets.cpu().numpy())
    part["next_token"] = rep([_decode_token(tok, i) if i >= 0 else "" for i in targets.tolist()])
    part["final_top1_id"] = rep(final_top.numpy())
    part["final_top1_token"] = rep([_decode_token(tok, i) for i in final_top.tolist()])
    part["target_kind"] = rep(choice.kinds(targets))
    part["target_id"] = rep(chosen.cpu().numpy())
    part["target_token"] = rep([_decode_token(tok, i) for i in chosen.tolist()])
    return part


def _site_metric_columns(met: dict) -> dict[str, np.ndarray]:
    """The per-(position, site) metrics of a chunk as flat columns (position-major)."""
    lp = met["target_logprob"].reshape(-1).double().cpu().numpy()
    return {
        "target_logprob": lp,
        "target_prob": np.exp(lp),
        "target_rank": met["target_rank"].reshape(-1).cpu().numpy().astype(np.int64),
        "kl_to_final": met["kl_to_final"].reshape(-1).double().cpu().numpy(),
        "entropy": met["entropy"].reshape(-1).double().cpu().numpy(),
        "top1_agreement": met["top1_agreement"].reshape(-1).cpu().numpy(),
    }


def _topk_columns(tok, met: dict, k: int) -> dict[str, np.ndarray]:
    """``top{i}_id``, ``top{i}_token`` and ``top{i}_prob`` for i = 1..k, built together so the
    frame gets them in one concat (not 3k column insertions)."""
    top_ids = met["topk_id"].reshape(-1, k).cpu().numpy()
    top_p = met["topk_logprob"].reshape(-1, k).double().exp().cpu().numpy()
    uniq, inverse = np.unique(top_ids, return_inverse=True)  # decode each distinct token once
    words = np.array([_decode_token(tok, int(t)) for t in uniq], dtype=object)[inverse.reshape(top_ids.shape)]
    cols = {}
    for i in range(k):
        cols[f"top{i + 1}_id"] = top_ids[:, i].astype(np.int64)
        cols[f"top{i + 1}_token"] = words[:, i]
        cols[f"top{i + 1}_prob"] = top_p[:, i]
    return cols
