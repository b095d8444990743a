"""Capture of every residual site against a bare forward and the real competitors, plus the roofline.

Same model (SmolLM2-135M, float32), same ``[batch, tokens]`` ids of UD English EWT text, in the
same run, arms interleaved:

| arm | what runs |
| --- | --- |
| bare forward | ``hf_model(ids, attention_mask, use_cache=False)`` (transformers, with logits) |
| depthscope | ``HookedModel.residual_stream(ids)``: all 2L+1 = 61 sites and the logits |
| transformers hidden states | the same forward with ``output_hidden_states=True`` (L+1 = 31 block outputs) |
| TransformerLens | ``TransformerBridge.run_with_cache`` keeping the ``hook_resid_*`` hooks (3L = 90 names) |

Figures: time ratios to the bare forward and to each competitor; peak extra memory of capture
(peak resident memory above a bare forward's, each arm in a fresh subprocess) over the size of
the captured tensor; forward throughput as a fraction of the matmul rate measured in this run
(2 x parameters FLOP per token). TransformerLens 4.x has no ``HookedTransformer``: its bridge
wraps the very same HF module (booted offline from a second copy of the weights).
"""

from __future__ import annotations

import time
import warnings

from benchmarks._common import Row, Settings, float32_model, interleave, mb, measure_peak, peak_memory, text_ids

NAME = "capture"


def _sizes(quick: bool) -> tuple[int, int]:
    return (4, 64) if quick else (8, 128)


def _bridge(model):
    """A TransformerLens bridge over a second copy of the same weights (offline), or None."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    other = float32_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerBridge.boot_transformers("smollm2-135m", hf_model=other.hf_model, tokenizer=other.tokenizer)


def _arms(model, ids, bridge=None) -> dict:
    import torch

    mask = torch.ones_like(ids)
    hf = model.hf_model

    def bare():
        with torch.no_grad():
            return hf(input_ids=ids, attention_mask=mask, use_cache=False)

    def depthscope():
        return model.residual_stream(ids, mask=mask.bool())

    def hidden_states():
        with torch.no_grad():
            return hf(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)

    arms = {"bare": bare, "depthscope": depthscope, "hidden_states": hidden_states}
    if bridge is not None:

        def tl():
            with torch.no_grad():
                return bridge.run_with_cache(ids, names_filter=lambda name: "hook_resid" in name)

        arms["transformerlens"] = tl
    return arms


def memory_arm(arm: str, batch: int, tokens: int) -> dict:
    """(subprocess) Peak resident memory of one arm above the resident memory before it."""

    model = float32_model()
    bridge = _bridge(model) if arm == "transformerlens" else None
    ids = text_ids(model, batch * tokens).reshape(batch, tokens)
    fn = _arms(model, ids, bridge)[arm]
    _arms(model, ids[:1, :8], bridge)[arm]()  # touch the weights, initialise kernels: a warm model
    holder = {}

    def run():
        holder["out"] = fn()  # the result stays alive until the peak is read, as for a user

    m = measure_peak(run)
    out = holder["out"]
    if arm == "depthscope":
        result = out.resid.numel() * out.resid.element_size()
    elif arm == "hidden_states":
        result = sum(h.numel() * h.element_size() for h in out.hidden_states)
    elif arm == "transformerlens":
        result = sum(v.numel() * v.element_size() for v in out[1].values())
    else:
        result = 0
    holder.clear()
    del out
    return {"extra": m["extra"], "peak": m["peak"], "result_bytes": result, "hwm_reset": m["hwm_reset"]}


def matmul_rate(d: int, rows: int, settings: Settings, seconds: float = 0.5, dtype: str = "float32") -> float:
    """FLOP/s of a ``[rows, d] @ [d, 4d]`` matmul (the MLP's shape) in ``dtype`` on this machine,
    now: the best of repeated runs for ``seconds``, on the clock the arms are timed with."""
    import torch

    clock = time.process_time if settings.clock == "cpu" else time.perf_counter
    dt = getattr(torch, dtype)
    a, b = torch.randn(rows, d, dtype=dt), torch.randn(d, 4 * d, dtype=dt)
    out = torch.empty(rows, 4 * d, dtype=dt)
    torch.mm(a, b, out=out)
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = clock()
        torch.mm(a, b, out=out)
        best = min(best, clock() - t)
    return 2 * rows * d * 4 * d / best


def run(settings: Settings) -> list[Row]:
    batch, tokens = _sizes(settings.quick)
    model = float32_model()
    ids = text_ids(model, batch * tokens).reshape(batch, tokens)
    bridge = _bridge(model)
    t = interleave(_arms(model, ids, bridge), settings)
    rate = matmul_rate(model.d_model, batch * tokens, settings)
    params = sum(p.numel() for p in model.hf_model.parameters())  # tied embeddings counted once
    n_tok = batch * tokens
    bare = t["bare"]
    shape = f"{batch}x{tokens} tokens, {model.n_sites} sites"
    rows = [
        Row(
            "capture time / bare forward",
            f"{t['depthscope'].median:.3f} s ({t['depthscope'].spread})",
            f"{bare.median:.3f} s ({bare.spread})",
            t["depthscope"].ratio_to(bare),
            "<= 1.05",
            shape,
        ),
        Row(
            "capture time / transformers output_hidden_states",
            f"{t['depthscope'].median:.3f} s (61 sites)",
            f"{t['hidden_states'].median:.3f} s (31 states)",
            t["depthscope"].ratio_to(t["hidden_states"]),
            "",
            shape,
        ),
    ]
    if "transformerlens" in t:
        rows.append(
            Row(
                "capture time / TransformerLens run_with_cache(resid)",
                f"{t['depthscope'].median:.3f} s (61 sites)",
                f"{t['transformerlens'].median:.3f} s (90 names)",
                t["depthscope"].ratio_to(t["transformerlens"]),
                "",
                shape,
            )
        )
    flops = 2 * params * n_tok / bare.median
    rows.append(
        Row(
            "forward throughput / matmul roofline",
            f"{flops / 1e9:.1f} GFLOP/s ({n_tok / bare.median:.0f} tok/s)",
            f"{rate / 1e9:.1f} GFLOP/s (mm {n_tok}x{model.d_model}x{4 * model.d_model})",
            flops / rate,
            "",
            f"2 x {params / 1e6:.1f}M params FLOP/token",
        )
    )
    rows += _memory_rows(settings, batch, tokens, bridge is not None)
    for r in rows:
        r.bench = NAME
    return rows


def _memory_rows(settings: Settings, batch: int, tokens: int, with_tl: bool) -> list[Row]:
    arms = ["bare", "depthscope", "hidden_states"] + (["transformerlens"] if with_tl else [])
    mem = {
        a: peak_memory("bench_capture", "memory_arm", settings.threads, arm=a, batch=batch, tokens=tokens) for a in arms
    }
    bare = mem["bare"]["extra"]

    def extra(a):
        return mem[a]["extra"] - bare

    d = mem["depthscope"]
    shape = f"{batch}x{tokens} tokens; fresh subprocess per arm; bare forward peak {mb(bare):.0f} MB"
    rows = [
        Row(
            "capture peak extra memory / result size",
            f"{mb(extra('depthscope')):.1f} MB above bare forward",
            f"{mb(d['result_bytes']):.1f} MB result [61,{batch},{tokens},576]",
            extra("depthscope") / d["result_bytes"],
            "<= 1.2",
            shape,
        )
    ]
    for a, label in (
        ("hidden_states", "transformers output_hidden_states"),
        ("transformerlens", "TransformerLens run_with_cache(resid)"),
    ):
        if a in mem:
            rows.append(
                Row(
                    f"  (reference) {label}: extra memory / its result",
                    f"{mb(extra(a)):.1f} MB above bare forward",
                    f"{mb(mem[a]['result_bytes']):.1f} MB result",
                    extra(a) / max(mem[a]["result_bytes"], 1),
                    "",
                    shape,
                )
            )
    return rows
