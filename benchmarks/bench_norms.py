"""Contribution norms against a bare forward over the same token batches, at two corpus sizes.

The UD English EWT dev text as one token sequence cut into windows of a fixed width, batched by
``analyses.text.token_batches`` exactly as ``contribution_norms`` batches them (so every batch
has the same shape and only the number of batches grows with the corpus). Arms, interleaved:

| arm | what runs |
| --- | --- |
| bare forward | the decoder body ``hf_model.model(ids, mask)`` over every batch (no LM head: norms needs none) |
| capture | ``residual_stream(ids, return_logits=False, check_finite=False)`` over every batch |
| norms | ``contribution_norms(model, docs, batch_size=...)``: capture, every metric, aggregation |

``capture`` splits the cost: norms - capture is the metrics and aggregation. Memory: norms' own
peak memory, the peak resident memory of ``contribution_norms`` minus that of a bare forward
loop over the same batches, each arm and size in a fresh subprocess; flat means the larger
corpus (3-4x the batches) needs no more of it than the smaller one (ratio <= 1.1). (A loop of
bare forwards itself peaks higher after several batches than after one, ~+17-44 MB at 2x64
tokens with glibc + torch 2.13; subtracting it keeps that out.)
"""

from __future__ import annotations

from benchmarks._common import Row, Settings, float32_model, interleave, mb, measure_peak, peak_memory, text_ids

NAME = "norms"


def _sizes(quick: bool) -> tuple[list[int], int, int]:
    """Corpus sizes (tokens), windows per batch, window width."""
    return ([128, 384], 2, 64) if quick else ([1024, 4096], 4, 128)


def _arms(model, n_tokens: int, batch_size: int, window: int) -> dict:
    import torch

    from depthscope.analyses.norms import contribution_norms
    from depthscope.analyses.text import token_batches

    ids = text_ids(model, n_tokens)[None]
    batches = list(token_batches(model, ids, batch_size=batch_size, window=window))
    body = getattr(model.hf_model, "model", model.hf_model)

    def bare():
        with torch.no_grad():
            for b in batches:
                body(input_ids=b.ids, attention_mask=b.mask.long(), use_cache=False)

    def capture():
        for b in batches:
            model.residual_stream(b.ids, mask=b.mask, return_logits=False, check_finite=False)

    def norms():
        return contribution_norms(model, ids, batch_size=batch_size, window=window)

    return {"bare": bare, "capture": capture, "norms": norms}, batches


def memory_arm(arm: str, n_tokens: int, batch_size: int, window: int) -> dict:
    """(subprocess) Peak resident memory of one arm over a corpus of ``n_tokens`` tokens."""
    model = float32_model()
    arms, batches = _arms(model, n_tokens, batch_size, window)
    warm, _ = _arms(model, 16, 1, 16)
    warm[arm]()  # a warm model: weights touched, kernels initialised, on a tiny input
    m = measure_peak(arms[arm])
    return {"extra": m["extra"], "tokens": sum(int(b.mask.sum()) for b in batches), "batches": len(batches)}


def run(settings: Settings) -> list[Row]:
    sizes, batch_size, window = _sizes(settings.quick)
    model = float32_model()
    rows = []
    for n in sizes:
        arms, batches = _arms(model, n, batch_size, window)
        n_tok = sum(int(b.mask.sum()) for b in batches)
        t = interleave(arms, settings)
        note = (
            f"{n_tok} tokens, {len(batches)} batches of {batch_size}x{window}; capture alone "
            f"{t['capture'].ratio_to(t['bare']):.2f}x bare, so metrics + aggregation "
            f"{t['norms'].median - t['capture'].median:.3f} s of {t['norms'].median:.3f} s"
        )
        rows.append(
            Row(
                f"norms time / bare forward, {n_tok} tokens",
                f"{t['norms'].median:.3f} s ({t['norms'].spread})",
                f"{t['bare'].median:.3f} s ({t['bare'].spread})",
                t["norms"].ratio_to(t["bare"]),
                "<= 1.3",
                note,
                extra={"capture_s": t["capture"].median},
            )
        )
    mem = {
        (n, a): peak_memory(
            "bench_norms", "memory_arm", settings.threads, arm=a, n_tokens=n, batch_size=batch_size, window=window
        )
        for n in sizes
        for a in ("norms", "bare")
    }
    n1, n2 = mem[(sizes[0], "norms")], mem[(sizes[1], "norms")]
    b1, b2 = mem[(sizes[0], "bare")], mem[(sizes[1], "bare")]
    own1, own2 = n1["extra"] - b1["extra"], n2["extra"] - b2["extra"]  # norms' own memory at each size
    rows.append(
        Row(
            f"norms' own peak memory (above a bare forward loop), {n2['tokens']} / {n1['tokens']} tokens",
            f"{mb(own2):.1f} MB ({n2['batches']} batches)",
            f"{mb(own1):.1f} MB ({n1['batches']} batches)",
            own2 / own1 if own1 > 2**20 else float("nan"),
            "<= 1.1",
            f"peak resident memory above the warm model, fresh subprocess per arm and size: norms "
            f"{mb(n1['extra']):.1f} / {mb(n2['extra']):.1f} MB, a bare forward loop over the same batches "
            f"{mb(b1['extra']):.1f} / {mb(b2['extra']):.1f} MB; batches of {batch_size}x{window}",
        )
    )
    for r in rows:
        r.bench = NAME
    return rows
