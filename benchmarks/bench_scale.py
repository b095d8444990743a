"""Billion-parameter scale: random-init Llama-shaped models in bfloat16, against the 135M default.

| shape | like | hidden / MLP / layers / heads / KV heads / vocab | parameters |
| --- | --- | --- | --- |
| ``135m`` | SmolLM2-135M (the default model, its real weights) | 576 / 1536 / 30 / 9 / 3 / 49152 | 135M |
| ``360m`` | SmolLM2-360M | 960 / 2560 / 32 / 15 / 5 / 49152 (tied) | 362M |
| ``1b`` | TinyLlama-1.1B | 2048 / 5632 / 22 / 32 / 4 / 32000 (untied) | 1.10B |

The two large models are built once with transformers from their config (random weights, no
download) directly in bfloat16 and saved as safetensors folders (``/tmp/depthscope-scale/<shape>``
unless ``$DEPTHSCOPE_SCALE_DIR``), each with a tokenizer whose ids fit its vocabulary: SmolLM2's
for the 360M, a byte-level BPE trained on UD English EWT for the 1.1B (32000 rows, fewer ids).

Figures, per model, each memory figure in a fresh subprocess (``VmHWM``, the kernel's peak
resident memory, which sees every allocation):

| figure | what is measured |
| --- | --- |
| load peak / weight bytes | ``load_model(folder, dtype=bfloat16)`` and a full weight digest: peak above the memory
  before it (libraries imported) over the weights' bytes (the 135M is a float32 file cast on load) |
| lens peak / budget | the whole process's peak through loading and ``logit_lens``, over 1.3 x weights + 0.6 GB |
| capture extra / result | peak above a bare forward's, over the captured ``[2L+1, batch, tokens, d]`` tensor |
| time per token / 135M's | bare bf16 forward seconds per token over the 135M's (parameter ratio beside it) |
| capture / GEMM rate | forward with capture at ``2 x matmul params`` FLOP per token (the input embedding
  left out when untied: a lookup), over a bf16 ``[rows, d] @ [d, 4d]`` matmul timed beside it |

Run: ``python -m benchmarks.bench_scale table`` (``--quick``: 2 x 32 tokens per forward, 64 lens
tokens; full: 2 x 128 and 256), or one step: ``python -m benchmarks.bench_scale build 1b`` builds
a folder; ``python -m benchmarks.bench_scale lens 1b 1024`` prints the lens peak as JSON. The
timings use one thread and CPU time (``Settings``); memory runs one model per subprocess, so the
1.1B needs about 3.3 GB free.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks._common import (
    LIVE_MEMORY_ENV,
    Row,
    Settings,
    interleave,
    mb,
    measure_peak,
    peak_memory,
    text_ids,
    ud_sentences,
)

NAME = "scale"
#: Llama-shaped configs of the two published models (sizes only; weights are random)
SHAPES = {
    "360m": dict(
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
}
GB = 2**30


def scale_dir(shape: str) -> Path:
    """The folder of one built model: ``$DEPTHSCOPE_SCALE_DIR/<shape>`` (default /tmp/depthscope-scale)."""
    return Path(os.environ.get("DEPTHSCOPE_SCALE_DIR", "/tmp/depthscope-scale")) / shape


def _tokenizer(shape: str):
    """SmolLM2's tokenizer (360M: the same 49152 ids), or a byte-level BPE trained on EWT (1.1B: <= 32000 ids)."""
    if shape == "360m":
        from depthscope.hooks import load_model

        return load_model().tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPES[shape]["vocab_size"],
        special_tokens=list(specials.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(ud_sentences("en_ewt-ud-train.conllu"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials["eos_token"], **specials)
    fast.model_max_length = SHAPES[shape]["max_position_embeddings"]
    return fast


def build_model_dir(shape: str, folder: str | Path | None = None) -> Path:
    """Build the random-init model ``shape`` in bfloat16 (never a float32 copy) and save it with its
    tokenizer as a safetensors folder; an existing folder with weights is kept as it is."""
    import torch
    import transformers as tf

    folder = Path(folder) if folder is not None else scale_dir(shape)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    tok = _tokenizer(shape)
    cfg = tf.LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are created, and initialised, in bfloat16
    try:
        model = tf.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(before)
    model.config.dtype = torch.bfloat16
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="1GB")
    tok.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- models and inputs
def scale_model(shape: str, dtype: str = "bfloat16"):
    """The model ``shape`` in ``dtype``: the default model for ``135m``, else the built folder."""
    import torch

    from depthscope.hooks import load_model

    dt = getattr(torch, dtype)
    return load_model(dtype=dt) if shape == "135m" else load_model(build_model_dir(shape), dtype=dt)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.hf_model.parameters())


def matmul_params(model) -> int:
    """Parameters that multiply each token (the input embedding only when it is also the unembedding)."""
    hf = model.hf_model
    emb = hf.get_input_embeddings().weight
    tied = any(p is emb for p in hf.get_output_embeddings().parameters())
    return sum(p.numel() for p in hf.parameters()) - (0 if tied else emb.numel())


def _ids(model, batch: int, tokens: int):
    return text_ids(model, batch * tokens).reshape(batch, tokens)


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- memory (subprocesses)
def load_peak(shape: str) -> dict:
    """(subprocess) The process's peak resident memory through ``load_model`` and a full weight
    digest (which reads every weight, so every page of the weights is resident), the resident
    memory before loading (depthscope, torch and transformers imported) and the weights' bytes."""
    import transformers  # noqa: F401  (imported before ``base``: libraries are not the load's memory)

    from depthscope.common.digest import model_digest
    from depthscope.hooks import load_model  # noqa: F401

    base = _status_bytes("VmRSS")
    model = scale_model(shape)
    model_digest(model)
    return {"peak": _status_bytes("VmHWM"), "base": base, "weights": weight_bytes(model)}


def lens_peak(shape: str, tokens: int) -> dict:
    """(subprocess) The process's peak resident memory through loading and ``logit_lens`` over
    ``tokens`` positions of EWT dev documents (default streaming settings)."""
    from benchmarks._common import documents
    from depthscope.analyses import logit_lens

    model = scale_model(shape)
    t = time.perf_counter()
    logit_lens(model, documents(model, tokens), max_tokens=tokens)
    return {"peak": _status_bytes("VmHWM"), "weights": weight_bytes(model), "seconds": time.perf_counter() - t}


def capture_extra(shape: str, arm: str, batch: int, tokens: int, dtype: str = "bfloat16") -> dict:
    """(subprocess) Peak memory of one forward above the memory before it: a bare forward
    (``arm="bare"``) or ``residual_stream`` (all sites and the logits), with the result's bytes."""
    model = scale_model(shape, dtype)
    ids = _ids(model, batch, tokens)
    fn = _arms(model, ids)[arm]
    _arms(model, ids[:1, :8])[arm]()  # touch the weights: a warm model
    holder = {}

    def run():
        holder["out"] = fn()

    m = measure_peak(run)
    out = holder.pop("out")
    result = out.resid.numel() * out.resid.element_size() if arm == "depthscope" else 0
    del out
    return {"extra": m["extra"], "result_bytes": result}


def _arms(model, ids) -> dict:
    import torch

    mask = torch.ones_like(ids)
    hf = model.hf_model

    def bare():
        with torch.no_grad():
            return hf(input_ids=ids, attention_mask=mask, use_cache=False)

    def depthscope():
        return model.residual_stream(ids, mask=mask.bool())

    return {"bare": bare, "depthscope": depthscope}


# ----------------------------------------------------------------------------- timing (this process)
def _sizes(quick: bool) -> tuple[int, int]:
    return (2, 32) if quick else (2, 128)


def _lens_tokens(quick: bool) -> int:
    return 64 if quick else 256


def time_model(shape: str, settings: Settings, dtype: str = "bfloat16") -> dict:
    """Bare forward and capture of one model, interleaved, with the GEMM rate measured beside them."""
    import gc

    from benchmarks.bench_capture import matmul_rate

    batch, tokens = _sizes(settings.quick)
    model = scale_model(shape, dtype)
    ids = _ids(model, batch, tokens)
    t = interleave(_arms(model, ids), settings)
    rate = matmul_rate(model.d_model, batch * tokens, settings, dtype=dtype)
    out = {
        "bare": t["bare"],
        "capture": t["depthscope"],
        "rate": rate,
        "params": matmul_params(model),
        "n_tok": batch * tokens,
        "d": model.d_model,
    }
    del model
    gc.collect()
    return out


def _time_rows(timed: dict, shape: str) -> list[Row]:
    """Capture vs bare, capture throughput vs the GEMM rate, time per token vs the 135M's."""
    t, base = timed[shape], timed["135m"]
    flops = 2 * t["params"] * t["n_tok"] / t["capture"].median
    note = f"bf16, {t['n_tok']} tokens; {t['params'] / 1e6:.0f}M matmul params"
    rows = [
        Row(
            f"{shape} bf16 capture / bare forward",
            f"{t['capture'].median:.3f} s",
            f"{t['bare'].median:.3f} s",
            t["capture"].ratio_to(t["bare"]),
            "<= 1.05",
            note,
        ),
        Row(
            f"{shape} bf16 forward with capture / bf16 GEMM rate",
            f"{flops / 1e9:.1f} GFLOP/s",
            f"{t['rate'] / 1e9:.1f} GFLOP/s (mm {t['n_tok']}x{t['d']}x{4 * t['d']})",
            flops / t["rate"],
            ">= 0.8",
            note,
        ),
    ]
    if shape != "135m":
        per_tok = (t["bare"].median / t["n_tok"]) / (base["bare"].median / base["n_tok"])
        p_ratio = t["params"] / base["params"]
        rows.append(
            Row(
                f"{shape} bf16 time per token / 135M's (over the parameter ratio)",
                f"{per_tok:.2f}x 135M's time per token",
                f"{p_ratio:.2f}x 135M's matmul params",
                per_tok / p_ratio,
                "",
                "1.0: time follows the parameter count",
            )
        )
    return rows


def _fp32_row(t: dict) -> Row:
    flops = 2 * t["params"] * t["n_tok"] / t["capture"].median
    return Row(
        "135m fp32 forward with capture / fp32 GEMM rate",
        f"{flops / 1e9:.1f} GFLOP/s",
        f"{t['rate'] / 1e9:.1f} GFLOP/s",
        flops / t["rate"],
        ">= 0.85",
        f"float32, {t['n_tok']} tokens",
    )


def _memory_rows(shape: str, settings: Settings) -> list[Row]:
    """Load, lens and capture memory of one model, each in a fresh subprocess."""
    batch, tokens = _sizes(settings.quick)
    th = settings.threads
    load = peak_memory(NAME_MODULE, "load_peak", th, env=LIVE_MEMORY_ENV, shape=shape)
    lens = peak_memory(
        NAME_MODULE, "lens_peak", th, env=LIVE_MEMORY_ENV, shape=shape, tokens=_lens_tokens(settings.quick)
    )
    cap = {
        a: peak_memory(
            NAME_MODULE, "capture_extra", th, env=LIVE_MEMORY_ENV, shape=shape, arm=a, batch=batch, tokens=tokens
        )
        for a in ("bare", "depthscope")
    }
    w = load["weights"]
    budget = 1.3 * w + 0.6 * GB
    goal = "" if shape == "135m" else "<= 1.3"  # the default model is a float32 file, cast on load
    extra = cap["depthscope"]["extra"] - cap["bare"]["extra"]
    res = cap["depthscope"]["result_bytes"]
    whole = "whole process (interpreter and libraries included)"
    return [
        Row(
            f"{shape} bf16 load peak above imports / weight bytes",
            f"{mb(load['peak'] - load['base']):.0f} MB (whole process {mb(load['peak']):.0f} MB)",
            f"{mb(w):.0f} MB",
            (load["peak"] - load["base"]) / w,
            goal,
            f"load + full digest; before it {mb(load['base']):.0f} MB (depthscope, torch, transformers)",
        ),
        Row(
            f"{shape} bf16 lens peak / (1.3 x weights + 0.6 GB)",
            f"{mb(lens['peak']):.0f} MB ({lens['peak'] / w:.2f}x weights)",
            f"{mb(budget):.0f} MB",
            lens["peak"] / budget,
            goal and "<= 1.0",
            f"{whole}; logit_lens over {_lens_tokens(settings.quick)} tokens, {lens['seconds']:.0f} s",
        ),
        Row(
            f"{shape} bf16 capture extra memory / result",
            f"{mb(extra):.1f} MB above bare forward",
            f"{mb(res):.1f} MB result",
            extra / max(res, 1),
            "<= 1.1",
            f"{batch}x{tokens} tokens; bare forward peak {mb(cap['bare']['extra']):.0f} MB",
        ),
    ]


NAME_MODULE = "bench_scale"
MODELS = ("135m", "360m", "1b")


def run(settings: Settings) -> list[Row]:
    """Every figure of the module docstring for the 135M, 360M and 1.1B models."""
    timed = {s: time_model(s, settings) for s in MODELS}
    rows = [r for s in MODELS for r in _time_rows(timed, s)]
    rows.append(_fp32_row(time_model("135m", settings, dtype="float32")))
    for s in MODELS:
        rows += _memory_rows(s, settings)
    for r in rows:
        r.bench = NAME
    return rows


def main(argv: list[str]) -> None:
    """``table [--quick]``: every figure as one table; ``build SHAPE`` / ``load SHAPE`` / ``lens
    SHAPE [TOKENS]``: one step, its figures as JSON."""
    what = argv[0] if argv else "table"
    if what == "table":
        from benchmarks._common import format_table, machine, machine_line

        settings = Settings(quick="--quick" in argv)
        settings.pin()
        rows = run(settings)
        print(machine_line(machine(settings)).replace("; float32;", "; bfloat16 (one float32 row);"))
        print(format_table(rows))
        return
    shape = argv[1]
    if what == "build":
        print(build_model_dir(shape))
    elif what == "load":
        print(json.dumps(load_peak(shape)))
    elif what == "lens":
        print(json.dumps(lens_peak(shape, int(argv[2]) if len(argv) > 2 else 1024)))
    else:
        raise SystemExit(f"unknown step {what!r}: table, build, load or lens")


if __name__ == "__main__":
    main(sys.argv[1:])
