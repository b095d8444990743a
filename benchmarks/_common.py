"""Shared helpers for benchmarks: real text, interleaved timing, peak memory in a subprocess."""

from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path

UD = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud"
FALLBACK = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Researchers measured how the residual stream of a transformer grows with depth.",
    "In 1889 the tower was completed for the World's Fair and soon became a symbol of Paris.",
    "She said that the committee would publish its findings after the summer break.",
]


def ud_sentences(name: str = "en_ewt-ud-dev.conllu", limit: int | None = None) -> list[str]:
    """`# text = ` lines of a UD file in ../shared/data/ud (the fallback sentences if absent)."""
    path = UD / name
    if not path.is_file():
        out = FALLBACK * 50
    else:
        out = [m.group(1) for m in re.finditer(r"^# text = (.+)$", path.read_text(encoding="utf-8"), re.M)]
    return out[:limit] if limit else out


def interleaved(fns: dict, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, the functions run in turn (A B C A B C ...)."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def env_line() -> str:
    import torch

    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores"
