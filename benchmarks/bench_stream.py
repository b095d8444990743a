"""Models larger than memory: the lens and the activation cache of a 13B-shaped Llama streamed block by
block (``load_model(..., stream=True)``, :mod:`depthscope.hooks.streaming`), against two floors.

==========================  ===================================================================
``build [DIR]``             a random-weight Llama-2-13B-shaped checkpoint in bfloat16 (hidden
                            5120, MLP 13824, 40 layers, 40 heads; SmolLM2's tokenizer and its
                            vocabulary of 49152): 13.2B parameters, 26.4 GB, written one tensor
                            at a time, one shard per block
``lens DIR --tokens N``     ``logit_lens`` of N held-out tokens (UD English EWT test text) on the
                            streamed model, in a fresh process: peak resident memory (VmHWM),
                            seconds, seconds per token, bytes read
``cache DIR --tokens N``    the activation cache (every residual site) of the same text, likewise
``floors DIR --tokens N``   the disk's read rate on the checkpoint's files (each file's page cache
                            dropped first), and the CPU's peak rate on the lens's own product
                            shapes (a block's ``[N, 5120] x [5120, 13824]``, the unembedding's
                            ``[N, 5120] x [5120, 49152]``), best of three
``table DIR``               all of them, and the row: time per token over the slower floor
                            (reading the weights once per forward at the disk's rate; the
                            products at the peak rate)
``gpu [DIR] --tokenizer T``  on a CUDA card, the 1.1B model (built if missing, with the tokenizer
                            folder ``T``) in bfloat16, streamed under an artificial card half the
                            weights' size, then in memory: sites and logits equal, peak card
                            memory, seconds against the host-to-card and product floors
``exact [DIR]``             a 1.1B-parameter Llama (TinyLlama's shape: hidden 2048, MLP 5632,
                            22 layers, 32 heads, 4 key/value heads) built like ``build``, its
                            logit lens and every residual site of the same text in memory and
                            streamed, in one process: equal bit for bit (``torch.equal``)
==========================  ===================================================================

The weights are bfloat16 on disk; the model computes in ``--dtype`` (default float32: a CPU without
native bfloat16, like the development machine's AVX2 EPYC, multiplies bfloat16 matrices tens of
times slower than float32, so its floor would be the bfloat16 kernel's, not the machine's). The
memory bound checked is :func:`~depthscope.hooks.streaming.stream_plan`'s (the largest block, the
resident tensors, the activations, 2 GB) and the 6 GB of issue 58.

    python -m benchmarks.bench_stream build /tmp/depthscope-13b
    python -m benchmarks.bench_stream table /tmp/depthscope-13b --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=40,
    vocab_size=49152,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
SHAPE_1B = dict(
    SHAPE,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
)
GB = 1e9


def build(folder: Path, shape: dict = SHAPE, tokenizer: Path | None = None) -> Path:
    """Write the 13B-shaped checkpoint (or ``shape``'s): config, tokenizer (the default model's, or the
    folder ``tokenizer``), one safetensors shard per block (+ one for the rest), the weights drawn from
    N(0, 0.02) (norm gains 1), one tensor in memory at a time."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    from depthscope.hooks import load_model

    folder.mkdir(parents=True, exist_ok=True)
    cfg = tf.LlamaConfig(**shape, architectures=["LlamaForCausalLM"], dtype="bfloat16")
    cfg.save_pretrained(folder)
    if tokenizer is not None:
        tf.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    else:
        load_model().tokenizer.save_pretrained(folder)  # SmolLM2's (49152 ids)
    with torch.device("meta"):
        meta = tf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    shards: dict[str, dict] = {}
    for name, p in meta.named_parameters():
        shard = f"block-{name.split('.')[2]:>03}.safetensors" if ".layers." in name else "rest.safetensors"
        shards.setdefault(shard, {})[name] = p.shape
    weight_map = {}
    for shard, tensors in shards.items():
        out = {}
        for name, shape in tensors.items():
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g).mul_(0.02)
            out[name] = t.to(torch.bfloat16)
            weight_map[name] = shard
        save_file(out, str(folder / shard), metadata={"format": "pt"})
        print(f"wrote {shard}", flush=True)
    total = sum(p.numel() * 2 for p in meta.parameters())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


def _text(tokens: int) -> list[str]:
    """Held-out documents (UD English EWT test sentences) of at least ``tokens`` tokens in all."""
    from benchmarks._common import ud_sentences

    return ud_sentences("en_ewt-ud-test.conllu", max(8, tokens // 4))


def _vmhwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _documents(model, tokens: int, docs: int) -> list[str]:
    """Held-out sentences, in order, until there are at least ``docs`` of them and ``tokens`` tokens."""
    out, n = [], 0
    for s in _text(4 * max(tokens, docs)):
        out.append(s)
        n += len(model.tokenizer(s)["input_ids"])
        if len(out) >= docs and n >= tokens:
            break
    return out


def run_in_process(what: str, folder: Path, tokens: int, dtype: str, docs: int = 0) -> dict:
    """``lens`` or ``cache`` on the streamed model, here (call it in a fresh process: the peak is this
    process's). ``docs`` 0: one forward of ``tokens`` tokens; else at least ``docs`` documents of
    ``tokens`` tokens in all, batched as the commands batch them (the lens's 8 windows per forward,
    the cache's 1024 tokens per chunk), one layer-major pass over them."""
    import tempfile

    import torch

    from depthscope.analyses import logit_lens
    from depthscope.hooks import load_model, write_activations

    t0 = time.perf_counter()
    model = load_model(folder, dtype=dtype, stream=True)
    load_s = time.perf_counter() - t0
    if docs:
        texts = _documents(model, tokens, docs)
        n_tokens = sum(len(model.tokenizer(s)["input_ids"]) for s in texts)
    else:
        ids = model.tokenizer("\n".join(_text(tokens)), return_tensors="pt")["input_ids"][:, :tokens]
        texts, n_tokens = [model.tokenizer.decode(ids[0])], int(ids.shape[1])
    import depthscope.hooks.activation_cache as cache

    digest, spent = cache.store_digest, [0.0]

    def timed_digest(m):  # the cache's store identity (the files' headers and versions: no weight read), timed
        t = time.perf_counter()
        out = digest(m)
        spent[0] += time.perf_counter() - t
        return out

    cache.store_digest = timed_digest
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    split: dict = {}  # the lens's forward_s and decode_s
    if what == "lens" and docs:
        logit_lens(model, texts, timings=split)
    elif what == "lens":
        logit_lens(model, ids, batch_size=1, window=tokens, max_batch_tokens=max(tokens, 1024), timings=split)
    else:
        with tempfile.TemporaryDirectory() as d:
            write_activations(model, texts, "resid", Path(d) / "store")
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0  # CPU seconds of every thread: the share of the cores the run got
    return {
        "what": what,
        "tokens": n_tokens,
        "documents": len(texts),
        "dtype": dtype,
        "load_s": round(load_s, 1),
        "seconds": round(seconds, 1),
        "digest_s": round(spent[0], 1),
        "cpu_s": round(cpu, 1),
        **{k: round(v, 1) for k, v in split.items()},
        "s_per_token": (seconds - spent[0]) / n_tokens,
        "peak_gb": _vmhwm() / GB,
        "bytes_read_gb": model.streamer.bytes_read / GB,
        "reads_per_block": max(model.streamer.reads_by_block),
        "read_s": round(model.streamer.read_s, 1),
        "wait_s": round(model.streamer.wait_s, 1),
        "threads": torch.get_num_threads(),
    }


def drop_cached(folder: Path) -> None:
    """The checkpoint's pages dropped from the page cache (``posix_fadvise(DONTNEED)`` on each
    file: no root needed), so a run reads its weights from the disk, not from memory."""
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as h:
            os.posix_fadvise(h.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _fresh(what: str, folder: Path, tokens: int, dtype: str, docs: int = 0) -> dict:
    drop_cached(folder)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_stream",
            "_one",
            what,
            str(folder),
            "--tokens",
            str(tokens),
            "--dtype",
            dtype,
            "--docs",
            str(docs),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def disk_rate(folder: Path, limit: float = 8 * GB) -> float:
    """Bytes per second reading the checkpoint's shards (up to ``limit`` bytes), each file's page
    cache dropped first (``posix_fadvise(DONTNEED)``) so the disk, not memory, serves the read."""
    files = sorted(folder.glob("block-*.safetensors"))
    done, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb") as h:
            os.posix_fadvise(h.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while chunk := h.read(1 << 24):
                done += len(chunk)
        if done >= limit:
            break
    return done / (time.perf_counter() - t0)


def peak_rate(tokens: int, dtype: str, rounds: int = 3) -> float:
    """The best FLOP/s of the lens's own product shapes in ``dtype``."""
    import torch

    dt = getattr(torch, dtype)
    best = 0.0
    for n, k in ((SHAPE["hidden_size"], SHAPE["intermediate_size"]), (SHAPE["hidden_size"], SHAPE["vocab_size"])):
        a, b = torch.randn(tokens, n, dtype=dt), torch.randn(n, k, dtype=dt)
        a @ b
        for _ in range(rounds):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * tokens * n * k / (time.perf_counter() - t0))
    return best


def floors(folder: Path, tokens: int, dtype: str) -> dict:
    """Per token: the read floor (the weights once per forward of ``tokens``) and the compute floor
    (a forward's products, ``2 x matmul parameters``, plus the lens's unembedding at every site)."""
    d, ff, L, V = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    block = 4 * d * d + 3 * d * ff
    weight_bytes = (L * block + 2 * V * d) * 2  # bfloat16 on disk
    forward_flop = 2 * (L * block + V * d)  # per token: the blocks and the output unembedding
    lens_flop = 2 * (2 * L + 1) * d * V  # per token: the unembedding at every site
    rate, peak = disk_rate(folder), peak_rate(tokens, dtype)
    return {
        "disk_gb_s": rate / GB,
        "peak_gflop_s": peak / 1e9,
        "read_s_per_token": weight_bytes / rate / tokens,
        "compute_s_per_token": (forward_flop + lens_flop) / peak,
        "cache_compute_s_per_token": forward_flop / peak,
    }


def exact(folder: Path, tokens: int, dtype: str) -> dict:
    """The 1.1B model's logit lens and residual sites in memory and streamed: every value equal."""
    import torch

    from depthscope.analyses import logit_lens
    from depthscope.hooks import load_model

    if not (folder / "config.json").exists():
        build(folder, SHAPE_1B)
    out = {}
    for stream in (False, True):
        model = load_model(folder, dtype=dtype, stream=stream)
        ids = model.tokenizer("\n".join(_text(tokens)), return_tensors="pt")["input_ids"][:, :tokens]
        t0 = time.perf_counter()
        lens = logit_lens(model, ids, batch_size=1, window=tokens, max_batch_tokens=max(tokens, 1024))
        sites = model.residual_stream(ids, check_finite=False)
        out[stream] = (lens, sites, time.perf_counter() - t0)
        del model
    (lens0, sites0, s0), (lens1, sites1, s1) = out[False], out[True]
    numeric = lens0.select_dtypes("number").columns
    return {
        "what": "exact",
        "tokens": tokens,
        "dtype": dtype,
        "lens_equal": bool(lens0[numeric].equals(lens1[numeric])),
        "sites_equal": bool(torch.equal(sites0.resid, sites1.resid)),
        "logits_equal": bool(torch.equal(sites0.logits, sites1.logits)),
        "in_memory_s": round(s0, 1),
        "streamed_s": round(s1, 1),
    }


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _gpu_pass(model, ids, device: str) -> tuple:
    """Every residual site and the logits of ``ids``: (stream, seconds of a second, warm call, peak
    bytes allocated on the card during it; 0 off a card)."""
    import torch

    model.residual_stream(ids, check_finite=False)  # warm: kernels, the allocator
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    got = model.residual_stream(ids, check_finite=False)
    _sync(device)
    return got, time.perf_counter() - t0, torch.cuda.max_memory_allocated() if device == "cuda" else 0


def copy_rate(device: str, n_bytes: int = 1 << 30) -> float:
    """Bytes per second copying an ordinary (pageable) host tensor to ``device``, as the streamer
    copies each weight: the best of three after a warm-up."""
    import torch

    host = torch.empty(n_bytes // 2, dtype=torch.bfloat16).normal_()
    host.to(device, copy=True)
    best = 0.0
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        host.to(device, copy=True)
        _sync(device)
        best = max(best, n_bytes / (time.perf_counter() - t0))
    return best


def product_rate(tokens: int, device: str) -> float:
    """FLOP/s of the 1.1B model's MLP product ``[tokens, d] x [d, ff]`` in bfloat16 on ``device``."""
    import torch

    d, ff = SHAPE_1B["hidden_size"], SHAPE_1B["intermediate_size"]
    a = torch.randn(tokens, d, dtype=torch.bfloat16, device=device)
    b = torch.randn(d, ff, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 10 * 2 * tokens * d * ff / (time.perf_counter() - t0)


def _streamed_under_limit(folder: Path, ids, device: str, limit: int) -> dict:
    """The streamed pass with the card's allocator capped at ``limit`` bytes (off a card: no cap)."""
    import torch

    from depthscope.hooks import load_model

    model = load_model(folder, dtype="bfloat16", stream=True, device=device)
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        got, sec, peak = _gpu_pass(model, ids, device)
    except torch.OutOfMemoryError as e:
        return {"fits": False, "error": str(e)[:300]}
    finally:
        if device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
    return {"fits": True, "resid": got.resid.cpu(), "logits": got.logits.cpu(), "s": sec, "peak": peak,
            "copied": model.streamer.bytes_read, "config": model.hf_model.config}  # fmt: skip


def gpu(folder: Path, tokens: int, tokenizer: Path | None, device: str = "cuda") -> dict:
    """The 1.1B model in bfloat16 on ``device`` (a CUDA card): streamed from host memory onto the card
    under an artificial card half the weights' size (``torch.cuda.set_per_process_memory_fraction``),
    then in memory with the whole card: every residual site and the logits equal bit for bit; the
    peak card memory of each; seconds against the slower floor (the blocks' weights copied to the
    card once per forward at the measured host-to-card rate; the products at the card's bfloat16
    rate on the MLP's ``[tokens, d] x [d, ff]``)."""
    import torch

    from depthscope.hooks import load_model
    from depthscope.hooks.streaming import stream_plan

    if not (folder / "config.json").exists():
        build(folder, SHAPE_1B, tokenizer)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    ids = torch.randint(0, 49152, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    st = _streamed_under_limit(folder, ids, device, weights // 2)
    out = {"what": "gpu", "device": torch.cuda.get_device_name() if device == "cuda" else device, "tokens": tokens,
           "weights_gb": weights / GB, "card_limit_gb": weights / 2 / GB, "streamed_fits": st["fits"]}  # fmt: skip
    if not st["fits"]:
        return {**out, "error": st["error"]}
    torch.cuda.empty_cache() if device == "cuda" else None
    mem = load_model(folder, dtype="bfloat16", device=device)
    got, sec, peak = _gpu_pass(mem, ids, device)
    plan = stream_plan(st["config"], torch.bfloat16, capture_sites=2 * mem.n_layers + 1)
    embed = mem.hf_model.get_input_embeddings().weight.numel()  # a lookup, not a product
    n_params = sum(p.numel() for p in mem.hf_model.parameters()) - embed
    h2d, rate = copy_rate(device), product_rate(tokens, device)
    read_floor, compute_floor = (weights - plan.resident) / h2d, 2 * tokens * n_params / rate
    return {
        **out,
        "streamed_peak_gb": st["peak"] / GB,
        "in_memory_peak_gb": peak / GB,
        "stream_plan_bound_gb": plan.peak(tokens, slack=0) / GB,
        "sites_equal": bool(torch.equal(st["resid"], got.resid.cpu())),
        "logits_equal": bool(torch.equal(st["logits"], got.logits.cpu())),
        "streamed_s": round(st["s"], 4),
        "in_memory_s": round(sec, 4),
        "bytes_copied_gb": st["copied"] / GB,
        "host_to_card_gb_s": h2d / GB,
        "bf16_tflop_s": rate / 1e12,
        "read_floor_s": read_floor,
        "compute_floor_s": compute_floor,
        "streamed_share_of_floor": max(read_floor, compute_floor) / st["s"],
    }


def table(folder: Path, tokens: int, dtype: str, docs: int = 0) -> list[dict]:
    f = floors(folder, tokens, dtype)
    rows = []
    for what in ("lens", "cache"):
        r = _fresh(what, folder, tokens, dtype, docs)
        f = {**f, "read_s_per_token": f["read_s_per_token"] * tokens / r["tokens"]}  # one read over the run's tokens
        compute = f["compute_s_per_token"] if what == "lens" else f["cache_compute_s_per_token"]
        floor = max(compute, f["read_s_per_token"])
        r.update(floor_s_per_token=floor, share_of_floor=floor / r["s_per_token"], **f)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print("| run | tokens | peak GB | s/token | read floor | compute floor | floor/actual (goal >= 0.8) |")
    for r in rows:
        compute = r["compute_s_per_token"] if r["what"] == "lens" else r["cache_compute_s_per_token"]
        print(
            f"| {r['what']} | {r['tokens']} | {r['peak_gb']:.2f} | {r['s_per_token']:.3f} | "
            f"{r['read_s_per_token']:.3f} | {compute:.3f} | {r['share_of_floor']:.2f} |"
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("build", "lens", "cache", "floors", "table", "exact", "gpu", "_one"))
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--per-batch", action="store_true", help="lens/cache: each batch a pass of its own (as before)")
    ap.add_argument("--docs", type=int, default=0, help="lens/cache/table: at least this many documents (0: one)")
    ap.add_argument("--tokenizer", type=Path, help="gpu/build: a tokenizer folder (default: the default model's)")
    ap.add_argument("--device", default="cuda", help="gpu: the device (cpu only to check the script)")
    a = ap.parse_args(argv)
    if a.step == "gpu":
        print(json.dumps(gpu(Path(a.rest[0] if a.rest else "/tmp/depthscope-1b"), a.tokens, a.tokenizer, a.device)))
        return
    if a.per_batch:
        os.environ["DEPTHSCOPE_BENCH_PER_BATCH"] = "1"  # here and in the fresh processes
    if os.environ.get("DEPTHSCOPE_BENCH_PER_BATCH") == "1":
        from depthscope.hooks import stream_pass

        stream_pass.PASS_BYTES = 0  # every batch a pass of its own: the weights read once per batch
    if a.step == "_one":
        print(json.dumps(run_in_process(a.rest[0], Path(a.rest[1]), a.tokens, a.dtype, a.docs)))
        return
    if a.step == "exact":
        print(json.dumps(exact(Path(a.rest[0] if a.rest else "/tmp/depthscope-1b"), a.tokens, a.dtype)))
        return
    folder = Path(a.rest[0] if a.rest else "/tmp/depthscope-13b")
    if a.step == "build":
        build(folder)
    elif a.step in ("lens", "cache"):
        print(json.dumps(_fresh(a.step, folder, a.tokens, a.dtype, a.docs)))
    elif a.step == "floors":
        print(json.dumps(floors(folder, a.tokens, a.dtype)))
    else:
        table(folder, a.tokens, a.dtype, a.docs)


if __name__ == "__main__":
    main()
