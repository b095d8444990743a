"""Caching every hook point against the residual sites only (issue 12): time and memory.

Arms, interleaved in one run on the same ``[batch, tokens]`` ids of UD English EWT text:
a bare transformers forward, ``model.run(ids, cache="resid")`` (the 61 residual sites),
``cache=<every point but the pattern>`` and ``cache="all"`` (which also routes every attention
layer through the eager pattern path). Memory is the bytes the cache holds.
"""

from __future__ import annotations

from benchmarks._common import Row, Settings, float32_model, interleave, mb, text_ids, timing_note

NAME = "points"


def run(settings: Settings) -> list[Row]:
    import torch

    from depthscope.hooks import point_names

    batch, tokens = (2, 64) if settings.quick else (4, 128)
    model = float32_model()
    ids = text_ids(model, batch * tokens).reshape(batch, tokens)
    no_pattern = [n for n in point_names(model.n_layers) if not n.endswith(".pattern")]
    caches = {"resid": "resid", "all but pattern": no_pattern, "all": "all"}

    def bare():
        with torch.no_grad():
            model.hf_model(input_ids=ids, use_cache=False)

    arms = {"bare": bare, **{k: (lambda c=c: model.run(ids, cache=c)) for k, c in caches.items()}}
    t = interleave(arms, settings)
    held = {
        k: sum(v.numel() * v.element_size() for v in model.run(ids, cache=c).cache.values()) for k, c in caches.items()
    }
    shape = f"{batch}x{tokens} tokens"
    rows = [
        Row(
            f"run(cache='resid') time / bare forward, {shape}",
            f"{t['resid'].median:.3f} s",
            f"{t['bare'].median:.3f} s",
            t["resid"].ratio_to(t["bare"]),
            note=timing_note(t),
            bench=NAME,
        )
    ]
    for k in ("all but pattern", "all"):
        rows.append(
            Row(
                f"run(cache='{k}') time / cache='resid', {shape}",
                f"{t[k].median:.3f} s",
                f"{t['resid'].median:.3f} s",
                t[k].ratio_to(t["resid"]),
                bench=NAME,
            )
        )
        rows.append(
            Row(
                f"run(cache='{k}') memory held / cache='resid', {shape}",
                f"{mb(held[k]):.1f} MB",
                f"{mb(held['resid']):.1f} MB",
                held[k] / held["resid"],
                bench=NAME,
            )
        )
    return rows
