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

Streaming: inputs go through :func:`depthscope.analyses.text.token_batches` (documents longer
than the window are split into windows; each window starts a fresh context, and the last
position of a window has no next-token target). Each forward captures all sites at once;
positions are then decoded in chunks of ``token_chunk`` tokens x all sites as one
``[chunk * sites, d] @ [d, vocab]`` matmul into reused buffers, and reduced at once to per-site
sums (float64). Memory is bounded by ``max_batch_tokens`` (activations and logits of one forward)
and ``token_chunk`` (two ``[chunk * sites, vocab]`` float32 buffers, 400 MB by default), never by
the corpus length.

Uncertainty: every mean comes with a 95% interval that treats each document as one cluster
(tokens of a text are correlated, so a per-token standard error would be too narrow); the
clusters' sums come from the same per-position metrics, no extra pass
(:mod:`depthscope.analyses.intervals`).

Position 0 of every window: included by default (``first_position=True``), because the issue's
metrics are over all real positions. Without a BOS token (SmolLM2's tokenizer adds none) position
0 is the first word and its prediction is nearly unconditional; its stream is also the
attention sink with outsized norms. Pass ``first_position=False`` to exclude it everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.intervals import ClusterSums, interval_columns, pick_clusters
from depthscope.analyses.lenses import Lens, LogitLens
from depthscope.common.errors import InputError
from depthscope.hooks.sites import site_frame

__all__ = ["logit_lens", "logit_lens_tokens", "lens_batches", "DEFAULT_BUFFER_MB", "LOGIT_LENS"]

#: the default lens of every analysis (stateless, shared)
LOGIT_LENS = LogitLens()

#: memory for the two reused float32 ``[rows, vocab]`` decode buffers when ``token_chunk`` is not
#: given: rows = 400 MB / (2 x 4 B x vocab), i.e. ~1000 rows (16 tokens x 61 sites) for SmolLM2's
#: 49k vocabulary. Larger chunks keep the unembedding matmul nearer its peak speed; the bound keeps
#: the buffers' memory fixed whatever the vocabulary.
DEFAULT_BUFFER_MB = 400

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
    ids: torch.Tensor
    mask: torch.Tensor
    doc_index: list
    window_index: list


def lens_batches(
    model,
    inputs,
    *,
    mask: torch.Tensor | None = None,
    batch_size: int = 8,
    window: int | None = None,
    max_batch_tokens: int = 1024,
) -> Iterator[_Batch]:
    """``token_batches`` further split so that no forward holds more than ``max_batch_tokens``
    padded tokens (rows x width), whatever the document lengths. Padding is trimmed per split."""
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    for tb in _grouped_token_batches(model, inputs, batch_size=batch_size, window=window, mask=mask):
        n = tb.ids.shape[0]
        lengths = tb.mask.sum(1)
        start = 0
        while start < n:
            stop = start + 1
            width = int(lengths[start])
            while stop < n:
                w2 = max(width, int(lengths[stop]))
                if (stop - start + 1) * w2 > max_batch_tokens:
                    break
                width = w2
                stop += 1
            yield _Batch(
                tb.ids[start:stop, :width],
                tb.mask[start:stop, :width],
                tb.doc_index[start:stop],
                tb.window_index[start:stop],
            )
            start = stop


#: documents tokenized at a time: token_batches tokenizes everything it is given up front, so
#: long document lists are fed to it in groups to keep token-id lists bounded too.
DOC_GROUP = 1024


def _grouped_token_batches(model, inputs, *, batch_size, window, mask):
    from depthscope.analyses.text import TokenBatch, token_batches

    if isinstance(inputs, (str, torch.Tensor)) or len(inputs) <= DOC_GROUP:
        yield from token_batches(model, inputs, batch_size=batch_size, window=window, mask=mask)
        return
    docs = list(inputs)
    if not any(docs):
        raise InputError("empty input: no texts given")
    before, yielded = 0, False  # documents are numbered after dropping empty strings, as token_batches does
    for start in range(0, len(docs), DOC_GROUP):
        group = [d for d in docs[start : start + DOC_GROUP] if d]
        if not group:
            continue
        try:
            for tb in token_batches(model, group, batch_size=batch_size, window=window):
                yielded = True
                yield TokenBatch(tb.ids, tb.mask, [before + i for i in tb.doc_index], tb.window_index)
        except InputError as e:
            if "tokenize to no tokens" not in str(e):
                raise
        before += len(group)
    if not yielded:
        raise InputError("empty input: the texts tokenize to no tokens")


# ----------------------------------------------------------------------------- decoding
def _normalise(Z: torch.Tensor, B: torch.Tensor, zmax: torch.Tensor) -> None:
    """Logits ``Z`` -> probabilities in ``Z`` and log-probabilities in ``B`` (both in place).

    The normaliser is summed with torch's pairwise (cascade) sum, accurate to ~1e-7 relative
    in float32; softmax / log_softmax kernels accumulate it sequentially on the CPU, which over a
    49k vocabulary errs by ~3e-5 (probabilities summing to 1 +- 3e-5, entropies off by 1e-5
    relative). One exp pass serves both outputs."""
    torch.sub(Z, zmax, out=B)
    torch.exp(B, out=Z)
    s = Z.sum(-1, keepdim=True)
    B.sub_(s.log())
    Z.div_(s)


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
        """Per-token reference: log-probs, probs, sum p log p, argmax of the model's own logits."""
        logits = logits.float()
        top = logits.argmax(-1)
        p, lp = logits.clone(), torch.empty_like(logits)
        _normalise(p, lp, logits.amax(-1, keepdim=True))  # as the lens's own rows (errors cancel in KL)
        neg_h = (p * lp).sum(-1)  # sum_v p log p
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
        torch.gt(Z, zt, out=B)
        out["target_rank"] = B.sum(-1).view(C, S)  # exact in float32 (< 2^24)
        _normalise(Z, B, zmax)  # Z = q, B = log q
        out["target_logprob"] = B.gather(1, tgt).view(C, S)
        if topk:
            vals, ids = B.topk(topk, dim=-1)
            out["topk_logprob"] = vals.view(C, S, topk)
            out["topk_id"] = ids.view(C, S, topk)
            out["top1_id"] = out["topk_id"][..., 0]
        # row-wise dot products as multiply + sum: torch's sum is a cascade (pairwise) reduction,
        # accurate to ~1e-7 relative; bmm/mm dots over 49k terms err by up to 1e-4 relative.
        torch.mul(Z, B, out=Z)
        out["entropy"] = -Z.sum(-1).view(C, S)
        torch.mul(B.view(C, S, V), p.unsqueeze(1), out=B.view(C, S, V))
        p_logq = B.sum(-1).view(C, S)
        out["kl_to_final"] = neg_hp.unsqueeze(1) - p_logq
        return out


def _token_chunk(token_chunk: int | None, n_sites: int, vocab: int) -> int:
    if token_chunk is None:
        rows = DEFAULT_BUFFER_MB * 2**20 // (2 * 4 * vocab)
        return max(1, rows // n_sites)
    if token_chunk < 1:
        raise InputError("token_chunk must be at least 1")
    return int(token_chunk)


def _positions(ids: torch.Tensor, mask: torch.Tensor, first_position: bool):
    """Flat (row, pos) of the positions used, and their next-token targets (-1 if none)."""
    sel = mask.clone()
    if not first_position:
        sel[:, 0] = False
    b_idx, t_idx = sel.nonzero(as_tuple=True)
    T = ids.shape[1]
    nxt = (t_idx + 1).clamp(max=T - 1)
    has_next = (t_idx + 1 < T) & mask[b_idx, nxt]
    targets = torch.where(has_next, ids[b_idx, nxt], torch.full_like(t_idx, -1))
    return b_idx, t_idx, targets


def _iter_chunks(
    model,
    inputs,
    *,
    mask,
    sites,
    lens,
    batch_size,
    window,
    max_batch_tokens,
    token_chunk,
    first_position,
    topk=0,
    timings=None,
    target_fn=None,
    max_tokens=None,
):
    """Yield (batch, rs, b_idx, t_idx, targets, chosen targets, metrics) per chunk of positions."""
    S = len(sites)
    C = _token_chunk(token_chunk, S, model.vocab_size)
    if max_tokens is not None and max_tokens < 1:
        raise InputError("max_tokens must be at least 1")
    dec = _Decoder(model, C * S)
    t_fwd = t_dec = 0.0
    used = 0
    with torch.inference_mode():
        for batch in lens_batches(
            model, inputs, mask=mask, batch_size=batch_size, window=window, max_batch_tokens=max_batch_tokens
        ):
            if max_tokens is not None:
                if used >= max_tokens:
                    break
                # forward only the windows that can still contribute
                per_row = batch.mask.sum(1) - (0 if first_position else 1)
                keep = int((per_row.cumsum(0) < (max_tokens - used)).sum()) + 1
                batch = _Batch(batch.ids[:keep], batch.mask[:keep], batch.doc_index[:keep], batch.window_index[:keep])
            t0 = time.perf_counter()
            rs = model.residual_stream(batch.ids, mask=batch.mask, sites=sites)
            t1 = time.perf_counter()
            ids, m = rs.input_ids, rs.mask
            b_all, t_all, tg_all = _positions(ids, m, first_position)
            if max_tokens is not None:
                b_all, t_all, tg_all = (v[: max_tokens - used] for v in (b_all, t_all, tg_all))
                used += len(b_all)
            for start in range(0, len(b_all), C):
                bi, ti = b_all[start : start + C], t_all[start : start + C]
                targets = tg_all[start : start + C]
                p, neg_hp, final_top = dec.final(rs.logits[bi, ti])
                chosen = targets if target_fn is None else target_fn(targets, final_top)
                xs = rs.resid[:, bi, ti]  # [S, c, d]
                xs = lens.translate(xs, sites).transpose(0, 1).contiguous()  # [c, S, d]
                met = dec.run(xs, p, neg_hp, final_top, chosen.clamp(min=0), topk=topk)
                met["final_top1_id"] = final_top
                yield batch, rs, bi, ti, targets, chosen, met
            t_dec += time.perf_counter() - t1
            t_fwd += t1 - t0
    if timings is not None:
        timings["forward_s"] = timings.get("forward_s", 0.0) + t_fwd
        timings["decode_s"] = timings.get("decode_s", 0.0) + t_dec


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
    batch_size: int = 8,
    window: int | None = None,
    max_batch_tokens: int = 1024,
    token_chunk: int | None = None,
    first_position: bool = True,
    max_tokens: int | None = None,
    timings: dict | None = None,
    progress: bool = False,
    total: int | None = None,
) -> pd.DataFrame:
    """Dataset-level logit lens: one row per site with the means of every metric.

    ``inputs``: a LongTensor ``[batch, pos]`` (optional boolean ``mask``), a list of documents,
    or one string. ``lens``: a :class:`~depthscope.analyses.lenses.Lens` (default: the plain
    :class:`~depthscope.analyses.lenses.LogitLens`; a ``TunedLens`` translates each site's
    stream before decoding; its ``kind`` fills the ``lens`` column). ``sites``: indices,
    labels or TransformerLens names (default: all 2L+1, or the tuned lens's sites). Streaming:
    ``batch_size`` windows of at most ``window`` tokens per forward (documents longer than the
    window are split), at most ``max_batch_tokens`` padded tokens per forward, and
    ``token_chunk`` positions (x all sites) decoded at once (default: a 400 MB buffer budget).
    ``first_position=False`` skips position 0 of every window (the attention sink).

    Returns columns ``site, label, layer, sublayer, depth, lens``, then for each metric in
    ``kl_to_final, cross_entropy, entropy, top1_agreement, top1_accuracy, target_rank,
    target_log_rank`` its mean over positions and ``<metric>_std`` (population std), then
    ``n_positions`` (positions used by kl/entropy/agreement) and ``n_next`` (positions with a
    next token, used by cross_entropy/accuracy/rank), ``n_docs`` and ``n_windows`` (documents
    and windows holding at least one position: the intervals' clusters are the documents, or
    the windows when there is a single document), and for each
    metric ``<metric>_se`` (its mean's standard error, clustered by document) and
    ``<metric>_lo``/``<metric>_hi`` (the 95% interval, Student t over the clusters, cut to the
    metric's range; :mod:`depthscope.analyses.intervals`). ``max_tokens`` stops after that many
    positions (in input order). ``timings`` (a dict) receives the seconds
    spent in forward passes (``forward_s``) and in decoding + metrics (``decode_s``).
    ``progress``: a bar over positions (:mod:`depthscope.common.progress`), with an ETA when
    ``total`` (the number of positions, e.g. the documents' token count) is given.
    """
    from depthscope.common.progress import progress_bar

    lens.check(model)
    sites = lens.resolve_sites(model, sites)
    S = len(sites)
    acc = _Sums(S)
    if max_tokens is not None and total is not None:
        total = min(total, max_tokens)
    bar = progress_bar(total, desc=f"{lens.kind} lens", unit="tok", enabled=progress)
    for batch, _rs, bi, _ti, targets, _chosen, met in _iter_chunks(
        model,
        inputs,
        mask=mask,
        sites=sites,
        lens=lens,
        batch_size=batch_size,
        window=window,
        max_batch_tokens=max_batch_tokens,
        token_chunk=token_chunk,
        first_position=first_position,
        timings=timings,
        max_tokens=max_tokens,
    ):
        valid = targets >= 0
        acc.n_all += len(targets)
        acc.n_next += int(valid.sum())
        rank = met["target_rank"]
        acc.add_chunk(
            batch,
            bi,
            {
                "kl_to_final": (met["kl_to_final"], None),
                "cross_entropy": (-met["target_logprob"], valid),
                "entropy": (met["entropy"], None),
                "top1_agreement": (met["top1_agreement"], None),
                "top1_accuracy": (rank == 0, valid),
                "target_rank": (rank, valid),
                "target_log_rank": (torch.log10(1.0 + rank.double()), valid),
            },
        )
        bar.update(len(targets))
    bar.close()
    if acc.n_all == 0:
        raise InputError("no positions to decode (every window has a single token and first_position=False?)")
    df = site_frame(sites, model.n_layers)
    df["lens"] = lens.kind
    for name in METRICS:
        n = acc.n_all if name in _ALL_POSITIONS else acc.n_next
        mean, std = acc.mean_std(name, n)
        df[name] = mean
        df[name + "_std"] = std
    df["n_positions"] = acc.n_all
    df["n_next"] = acc.n_next
    clusters = pick_clusters(acc.docs, acc.windows)
    df["n_docs"] = acc.docs.n_clusters
    df["n_windows"] = acc.windows.n_clusters
    extra = {}
    for name in METRICS:
        se, g = clusters.se(name)
        for suffix, col in interval_columns(df[name], se, g, _BOUNDS[name]).items():
            extra[f"{name}_{suffix}"] = col
    return pd.concat([df, pd.DataFrame(extra, index=df.index)], axis=1)


# ----------------------------------------------------------------------------- per token
def _decode_token(tok, i: int) -> str:
    if tok is None:
        return str(i)
    return tok.decode([int(i)])


def logit_lens_tokens(
    model,
    inputs: torch.Tensor | Sequence[str] | str,
    *,
    lens: Lens = LOGIT_LENS,
    sites=None,
    k: int = 5,
    target=None,
    mask: torch.Tensor | None = None,
    batch_size: int = 8,
    window: int | None = None,
    max_batch_tokens: int = 1024,
    token_chunk: int | None = None,
    first_position: bool = True,
    max_tokens: int | None = None,
) -> pd.DataFrame:
    """Per position and site: the lens's top-``k`` tokens and a target token's log-prob and rank.

    ``target``: None (default) follows the actual next token, and at a window's last position
    (no next token) the model's own top-1 prediction (``target_kind`` says which); a string (one
    token, e.g. ``" Paris"``) or a token id fixes one target at every position.

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
    k = min(int(k), model.vocab_size)
    sites = lens.resolve_sites(model, sites)
    fixed = None if target is None else model.token_id(target, "target")

    def target_fn(targets, final_top):
        if fixed is not None:
            return torch.full_like(targets, fixed)
        return torch.where(targets >= 0, targets, final_top)

    frames = []
    sf = site_frame(sites, model.n_layers)
    for batch, rs, bi, ti, targets, chosen, met in _iter_chunks(
        model,
        inputs,
        mask=mask,
        sites=sites,
        lens=lens,
        batch_size=batch_size,
        window=window,
        max_batch_tokens=max_batch_tokens,
        token_chunk=token_chunk,
        first_position=first_position,
        topk=k,
        target_fn=target_fn,
        max_tokens=max_tokens,
    ):
        frames.append(_token_rows(model, lens, sf, k, fixed is not None, batch, rs, bi, ti, targets, chosen, met))
    if not frames:
        raise InputError("no positions to decode")
    return pd.concat(frames, ignore_index=True)


def _token_rows(model, lens, sf, k: int, fixed: bool, batch, rs, bi, ti, targets, chosen, met) -> pd.DataFrame:
    """One chunk's rows of :func:`logit_lens_tokens`: (position, site) pairs, position-major.
    (Many parameters: the chunk as :func:`_iter_chunks` yields it.)"""
    S, tok = len(sf), model.tokenizer
    c = len(bi)
    rep = lambda v: np.repeat(np.asarray(v), S)  # noqa: E731  per position -> per (position, site)
    ids = rs.input_ids[bi, ti].cpu()
    part = pd.DataFrame({col: np.tile(sf[col].to_numpy(), c) for col in sf.columns})
    part["lens"] = lens.kind
    part["doc"] = rep([batch.doc_index[int(b)] for b in bi])
    part["window"] = rep([batch.window_index[int(b)] for b in bi])
    part["position"] = rep(ti.cpu().numpy())
    part["token_id"] = rep(ids.numpy())
    part["token"] = rep([_decode_token(tok, i) for i in ids.tolist()])
    part["next_id"] = rep(targets.cpu().numpy())
    part["next_token"] = rep([_decode_token(tok, i) if i >= 0 else "" for i in targets.tolist()])
    ft = met["final_top1_id"].cpu()
    part["final_top1_id"] = rep(ft.numpy())
    part["final_top1_token"] = rep([_decode_token(tok, i) for i in ft.tolist()])
    if fixed:
        kinds = ["fixed"] * c
    else:
        kinds = ["next" if t >= 0 else "model_top1" for t in targets.tolist()]
    part["target_kind"] = rep(kinds)
    part["target_id"] = rep(chosen.cpu().numpy())
    part["target_token"] = rep([_decode_token(tok, i) for i in chosen.tolist()])
    lp = met["target_logprob"].reshape(-1).double().cpu().numpy()
    part["target_logprob"] = lp
    part["target_prob"] = np.exp(lp)
    part["target_rank"] = met["target_rank"].reshape(-1).cpu().numpy().astype(np.int64)
    part["kl_to_final"] = met["kl_to_final"].reshape(-1).double().cpu().numpy()
    part["entropy"] = met["entropy"].reshape(-1).double().cpu().numpy()
    part["top1_agreement"] = met["top1_agreement"].reshape(-1).cpu().numpy()
    top_ids = met["topk_id"].reshape(-1, k).cpu().numpy()
    top_p = met["topk_logprob"].reshape(-1, k).double().exp().cpu().numpy()
    uniq, inverse = np.unique(top_ids, return_inverse=True)  # decode each distinct token once
    words = np.array([_decode_token(tok, int(t)) for t in uniq], dtype=object)[inverse.reshape(top_ids.shape)]
    cols = {}  # all top-k columns at once (one concat, not 3k column insertions)
    for i in range(k):
        cols[f"top{i + 1}_id"] = top_ids[:, i].astype(np.int64)
        cols[f"top{i + 1}_token"] = words[:, i]
        cols[f"top{i + 1}_prob"] = top_p[:, i]
    return pd.concat([part, pd.DataFrame(cols, index=part.index)], axis=1)
