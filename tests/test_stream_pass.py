"""Layer-major passes (hooks/stream_pass.py): a streamed analysis sends every batch through block l
before any goes to block l + 1, so each block's weights are read from the files exactly once per
pass, and its numbers are the in-memory model's and batch-by-batch streaming's, bit for bit in
float32 (several batches, a toy Llama); streams past the spill bound wait on disk and come back
exact; per-item hooks stay with their item; a failure in one item fails the pass cleanly; the
pass's progress counts blocks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from depthscope.hooks import load_model, stream_pass
from depthscope.hooks.stream_pass import layer_major
from tests.conftest import make_tiny

N_LAYERS = 4
TEXTS = [
    "The cat sat on the mat.",
    "A much longer second document about dogs, logs and the weather in spring.",
    "Short one.",
    "Hello world, this is the fourth text of the set.",
    "Five: numbers 1 2 3 4 5 and letters a b c.",
    "The last document closes the list.",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("stream_pass")
    make_tiny("llama", vocab_size=len(tiny_tokenizer), n_layers=N_LAYERS, seed=5).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _reads(model) -> list[int]:
    return list(model.streamer.reads_by_block)


def _since(model, before: list[int]) -> list[int]:
    return [a - b for a, b in zip(_reads(model), before)]


def _all_meta(model) -> bool:
    return all(p.device.type == "meta" for b in model.arch.blocks for p in b.parameters() if p.dim() >= 2)


def test_the_lens_reads_each_block_once_and_equals_memory_and_batch_by_batch(folder, monkeypatch):
    from depthscope.analyses import logit_lens

    mem, st = load_model(folder), load_model(folder, stream=True)
    want = logit_lens(mem, TEXTS, batch_size=1)  # six batches
    before = _reads(st)
    got = logit_lens(st, TEXTS, batch_size=1)
    assert _since(st, before) == [1] * N_LAYERS  # one pass: every block read once, not once per batch
    pd.testing.assert_frame_equal(want, got, check_exact=True)
    assert _all_meta(st)
    monkeypatch.setattr(stream_pass, "PASS_BYTES", 0)  # every batch a pass of its own: today's streaming
    before = _reads(st)
    one_by_one = logit_lens(st, TEXTS, batch_size=1)
    assert _since(st, before) == [len(TEXTS)] * N_LAYERS
    pd.testing.assert_frame_equal(want, one_by_one, check_exact=True)


def test_the_pass_bound_splits_a_text_into_passes(folder, monkeypatch):
    st = load_model(folder, stream=True)
    ids = [st.tokenize(t)[0] for t in TEXTS]
    monkeypatch.setattr(stream_pass, "PASS_BYTES", 3)  # three items of one byte each per pass
    before = _reads(st)
    got = list(layer_major(st, ids, lambda x: st.residual_stream(x).resid, held=lambda x: 1))
    assert _since(st, before) == [2] * N_LAYERS
    mem = load_model(folder)
    for x, r in zip(ids, got):
        assert torch.equal(mem.residual_stream(x).resid, r)


def test_the_activation_cache_and_norms_read_each_block_once(folder, tmp_path):
    from depthscope.analyses import contribution_norms
    from depthscope.hooks import CacheSettings, write_activations

    mem, st = load_model(folder), load_model(folder, stream=True)
    settings = CacheSettings(chunk_tokens=16, progress=False)  # several chunks
    a = write_activations(mem, TEXTS, "resid", tmp_path / "mem", settings=settings)
    before = _reads(st)
    b = write_activations(st, TEXTS, "resid", tmp_path / "st", settings=settings)
    assert _since(st, before) == [1] * N_LAYERS
    assert len(list((tmp_path / "st" / "chunks").iterdir())) > 2
    for name in a:
        assert np.array_equal(np.asarray(a[name][:]), np.asarray(b[name][:])), name
    before = _reads(st)
    got = contribution_norms(st, TEXTS, batch_size=2)
    assert _since(st, before) == [1] * N_LAYERS
    pd.testing.assert_frame_equal(contribution_norms(mem, TEXTS, batch_size=2), got, check_exact=True)


def test_streams_past_the_spill_bound_wait_on_disk_and_come_back_exact(folder, monkeypatch):
    st, mem = load_model(folder, stream=True), load_model(folder)
    ids = [st.tokenize(t)[0] for t in TEXTS]
    restored = []
    real = stream_pass._restore
    monkeypatch.setattr(stream_pass, "_restore", lambda h, p: (restored.append(p), real(h, p)))
    monkeypatch.setattr(stream_pass, "SPILL_BYTES", 0)
    got = list(layer_major(st, ids, lambda x: st.residual_stream(x)))
    assert len(restored) == len(TEXTS) * N_LAYERS  # every waiting stream went to disk and came back
    for x, r in zip(ids, got):
        want = mem.residual_stream(x)
        assert torch.equal(want.resid, r.resid) and torch.equal(want.logits, r.logits)


def test_each_items_hooks_stay_with_its_forward(folder):
    st, mem = load_model(folder, stream=True), load_model(folder)
    ids = [st.tokenize(t)[0] for t in TEXTS[:4]]

    def edited(model, k, x):
        def scale(t, ctx):
            return t * (k + 2)

        return model.run(x, hooks={"1.mlp": scale}, cache=["2.resid_mid"])

    before = _reads(st)
    got = list(layer_major(st, list(enumerate(ids)), lambda kx: edited(st, *kx)))
    assert _since(st, before) == [1] * N_LAYERS
    for k, x in enumerate(ids):
        want = edited(mem, k, x)
        assert torch.equal(want.logits, got[k].logits)
        assert torch.equal(want["2.resid_mid"], got[k]["2.resid_mid"])


def test_a_failing_item_fails_the_pass_and_leaves_the_model_clean(folder):
    st = load_model(folder, stream=True)
    ids = [st.tokenize(t)[0] for t in TEXTS[:3]]

    def boom(t, ctx):
        raise ValueError("item 1 fails")

    def fn(kx):
        k, x = kx
        return st.run(x, hooks={"2.attn": boom} if k == 1 else None).logits

    with pytest.raises(ValueError, match="item 1 fails"):
        list(layer_major(st, list(enumerate(ids)), fn))
    assert _all_meta(st)
    again = list(layer_major(st, ids, lambda x: st.run(x).logits))  # the model still works
    assert torch.equal(again[0], load_model(folder).run(ids[0]).logits)


def test_progress_counts_the_blocks_of_a_pass(folder, monkeypatch):
    import depthscope.common.progress as progress

    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.kw, self.done = total, kw, 0
            bars.append(self)

        def update(self, n=1):
            self.done += n

        def close(self):
            pass

    monkeypatch.setattr(progress, "progress_bar", Bar)
    st = load_model(folder, stream=True)
    ids = [st.tokenize(t)[0] for t in TEXTS[:3]]
    list(layer_major(st, ids, lambda x: st.residual_stream(x), progress=True))
    assert [(b.total, b.kw["unit"], b.done) for b in bars] == [(N_LAYERS, "block", N_LAYERS)]


def test_a_model_in_memory_runs_the_items_one_after_the_other(folder):
    mem = load_model(folder)
    order = []
    got = list(layer_major(mem, [1, 2, 3], lambda x: order.append(x) or x * 2))
    assert got == [2, 4, 6] and order == [1, 2, 3]


def test_probe_feature_extraction_reads_each_block_once(folder, tmp_path, monkeypatch):
    import re

    from depthscope.probes.corpora.spans import SpanTable, map_spans, tokenize_passages
    from depthscope.probes.store.activations import extract_spans

    mem, st = load_model(folder), load_model(folder, stream=True)
    tok = tokenize_passages(st.tokenizer, TEXTS, max_tokens=64)
    p, cs, ce = [], [], []
    for i, t in enumerate(TEXTS):
        for m in re.finditer(r"\w+", t):
            p.append(i), cs.append(m.start()), ce.append(m.end())
    table = map_spans(tok, SpanTable(np.array(p), np.array(cs), np.array(ce)))
    kw = dict(pooling="mean", progress=False, dtype="float32", batch_tokens=24)  # several batches
    a = extract_spans(mem, tok, table, store_dir=tmp_path / "mem", **kw)
    before = _reads(st)
    b = extract_spans(st, tok, table, store_dir=tmp_path / "st", **kw)
    assert _since(st, before) == [1] * N_LAYERS
    ids = np.arange(len(table))
    (x1, m1), (x2, m2) = a.gather(ids, 8), b.gather(ids, 8)
    assert torch.equal(m1, m2) and torch.equal(x1, x2)
    monkeypatch.setattr(stream_pass, "PASS_BYTES", 0)
    before = _reads(st)
    extract_spans(st, tok, table, store_dir=tmp_path / "per_batch", **kw)
    assert min(_since(st, before)) > 1  # batch by batch: several reads, so the pass above did save some


def _scale(k: float):
    """A hook that scales its point by ``k``."""
    return lambda t, ctx: t * k


def _blocks_in_place(model) -> bool:
    from depthscope.hooks.streaming import StreamedBlock

    return all(isinstance(b, StreamedBlock) and b._stream[0] == i for i, b in enumerate(model.arch.blocks))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("stream_pass_gpt2")
    make_tiny("gpt2", vocab_size=len(tiny_tokenizer), n_layers=N_LAYERS, seed=6).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2's loop reads the live block list, llama's a copy
def test_forwards_that_start_at_other_blocks_share_a_pass(family, folder, gpt2_folder):
    """Items that start at a block (from_block, each with its own stream) share one pass: each worker
    keeps its own block list, the blocks before the earliest start are not read, the others once."""
    from depthscope.hooks import from_block

    where = folder if family == "llama" else gpt2_folder
    st, mem = load_model(where, stream=True), load_model(where)
    ids = [st.tokenize(t)[0] for t in TEXTS[:3]]
    entering = {
        (b, i): mem.run(x, cache=[f"{b}.resid_pre"])[f"{b}.resid_pre"] for b in (1, 2) for i, x in enumerate(ids)
    }
    items = [(b, i, k) for b in (2, 1) for i in range(len(ids)) for k in range(2)]  # starts 2 and 1 mixed

    def run(model, item):
        b, i, k = item
        scale = {f"{b}.mlp": _scale(k + 2)}
        with from_block(model, b, entering[(b, i)].clone()):
            return model.run(ids[i], hooks=scale, cache=["3.resid_mid"])

    before = _reads(st)
    got = list(layer_major(st, items, lambda item: run(st, item)))
    assert _since(st, before) == [0, 1, 1, 1]  # block 0 is never run; every other block read once
    assert _blocks_in_place(st) and _all_meta(st)
    for item, r in zip(items, got):
        want = run(mem, item)
        assert torch.equal(want.logits, r.logits), item
        assert torch.equal(want["3.resid_mid"], r["3.resid_mid"]), item
        b, i, k = item  # and the plain forward from the embedding, with the same edit
        plain = mem.run(ids[i], hooks={f"{b}.mlp": _scale(k + 2)})
        assert torch.equal(plain.logits, r.logits), item


def test_causal_erased_forwards_read_each_block_once_per_site(folder, monkeypatch):
    """The causal test's forwards on a streamed model: the clean streams advanced to a site's block
    in one pass, and every eraser's forward of every batch from there in one pass; the losses are
    the in-memory model's, bit for bit."""
    from depthscope.analyses.causal.erasure.loss import BATCH_TOKENS, doc_nll, doc_nlls, held_out
    from depthscope.analyses.causal.erasure.prefix import Prefixes

    st, mem = load_model(folder, stream=True), load_model(folder)
    text = held_out(st, TEXTS, window=32)
    hooks = [{"2.attn": _scale(1 + 0.25 * k)} for k in range(3)]
    prefixes = Prefixes(st, text, 2, BATCH_TOKENS)
    assert len(prefixes.batches) > 1
    before = _reads(st)
    prefixes.advance(2)
    # blocks 0 and 1 once for every batch; block 2 may be read ahead while block 1 computes (the
    # forwards stop at its input: the read ahead is dropped, or cancelled before it starts)
    reads = _since(st, before)
    assert reads[:2] == [1, 1] and reads[2] in (0, 1) and reads[3] == 0
    before = _reads(st)
    got = doc_nlls(st, text, hooks, prefixes=prefixes)
    assert _since(st, before) == [0, 0, 1, 1]  # 3 erasers x the batches: one read of each block from the site's
    assert _blocks_in_place(st) and _all_meta(st)
    ref = Prefixes(mem, held_out(mem, TEXTS, window=32), 2, BATCH_TOKENS)
    ref.advance(2)
    for h, g in zip(hooks, got):
        for want in (doc_nll(mem, text, h, prefixes=ref), doc_nll(mem, text, h, batch_size=2)):
            assert np.array_equal(want.nll, g.nll) and np.array_equal(want.tokens, g.tokens)
    # the erasers share each batch's clean stream: with every waiting stream spilled to disk, each
    # forward spills its own copy, and the shared streams stay whole
    monkeypatch.setattr(stream_pass, "SPILL_BYTES", 0)
    spilled = doc_nlls(st, text, hooks, prefixes=prefixes)
    for g, s in zip(got, spilled):
        assert np.array_equal(g.nll, s.nll)
    assert all(torch.equal(a, b) for a, b in zip(prefixes.streams, ref.streams))


def test_each_worker_keeps_its_own_block_order(gpt2_folder):
    """Items that rearrange the blocks (block_order's skip) share one pass: gpt2's loop reads the
    live block list, so each worker's arrangement must be in place at each of its turns."""
    from depthscope.hooks.block_order import block_order, skip

    st, mem = load_model(gpt2_folder, stream=True), load_model(gpt2_folder)
    ids = [st.tokenize(t)[0] for t in TEXTS[:2]]
    items = [(layer, i) for layer in (None, 1, 2) for i in range(len(ids))]

    def run(model, item):
        layer, i = item
        order = list(range(N_LAYERS)) if layer is None else skip(N_LAYERS, layer)
        with block_order(model, order):
            return model.run(ids[i]).logits

    before = _reads(st)
    got = list(layer_major(st, items, lambda item: run(st, item)))
    assert _since(st, before) == [1] * N_LAYERS  # a skipped block still runs (its output dropped)
    assert _blocks_in_place(st) and _all_meta(st)
    for item, r in zip(items, got):
        assert torch.equal(run(mem, item), r), item
    assert not torch.equal(got[0], got[2])  # skipping block 1 changes the logits
