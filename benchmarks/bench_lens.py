"""The logit lens over every site against its floor: capture plus the bare unembedding matmuls.

Same windows of UD English EWT dev text, same model, float32, arms interleaved:

| arm | what runs |
| --- | --- |
| depthscope | ``logit_lens(model, ids, window=W, batch_size=B)``: all 61 sites, every metric |
| floor | ``residual_stream`` of the same windows, then the model's final norm and
  ``[rows, d] @ [d, vocab]`` into a preallocated output, in chunks of 1024 rows, for every site and token |

The floor is what any logit lens must do (the forward, and one unembedding per site and
token); the ratio is what the metrics (softmax, KL, ranks, ...) and bookkeeping add on top.
"""

from __future__ import annotations

from benchmarks._common import Row, Settings, float32_model, interleave, text_ids

NAME = "lens"


def _sizes(quick: bool) -> tuple[int, int, int]:
    """Tokens, window, windows per forward."""
    return (32, 32, 1) if quick else (256, 64, 2)


def run(settings: Settings) -> list[Row]:
    import torch

    from depthscope.analyses.lens.logit import logit_lens

    n, window, batch = _sizes(settings.quick)
    model = float32_model()
    ids = text_ids(model, n)[None]
    W = model.arch.unembed.weight  # [vocab, d]
    chunk = 1024
    out = torch.empty(chunk, W.shape[0])

    def lens():
        return logit_lens(model, ids, window=window, batch_size=batch)

    def floor():
        rows = 0
        for a in range(0, n, window * batch):
            part = ids[:, a : a + window * batch].reshape(-1, window)  # n is a multiple of window
            rs = model.residual_stream(part, check_finite=False)
            x = rs.resid.reshape(-1, rs.resid.shape[-1])
            with torch.no_grad():
                for c in range(0, len(x), chunk):
                    h = model.unembed.norm(x[c : c + chunk])
                    torch.mm(h, W.t(), out=out[: len(h)])
                    rows += len(h)
        return rows

    t = interleave({"lens": lens, "floor": floor}, settings)
    rows = floor()
    return [
        Row(
            f"logit lens / floor (capture + bare unembedding), {n} tokens",
            f"{t['lens'].median:.2f} s ({t['lens'].spread})",
            f"{t['floor'].median:.2f} s ({t['floor'].spread})",
            t["lens"].ratio_to(t["floor"]),
            "<= 1.5",
            f"{model.n_sites} sites x {n} tokens = {rows} decoded rows, vocab {W.shape[0]}; windows of {window}, "
            f"{batch} per forward",
            bench=NAME,
        )
    ]
