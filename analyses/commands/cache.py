"""``depthscope cache``: the activations of every token of a text file written to disk, in chunks;
the options are the fields of :class:`~depthscope.analyses.jobs.configs.CacheConfig`, the work is
:func:`depthscope.analyses.jobs.cache.cache_job`."""

from __future__ import annotations

from rich.console import Console

from depthscope.analyses.commands.common import begin, load_model
from depthscope.analyses.commands.options import command, options
from depthscope.analyses.jobs.configs import CacheConfig

CACHE = options(
    "text points out model device dtype stream chunk_tokens window stride bos max_tokens max_docs whole_file threads "
    "force",
    CacheConfig,
    helps={
        "out": "Folder of the activation cache (an unfinished one of the same run is resumed).",
        "force": "Replace an activation cache of another run (model, text or points) in --out.",
    },
    required="out",
)


@command("cache", CACHE)
def cache(o) -> None:
    """Write the activations at POINTS of every token of TEXT to an activation cache in OUT.

    Documents (one per non-blank line) are read as every analysis reads text (the BOS token
    prepended to every window, documents longer than --window split into windows: each window is
    one document of the store) and run through the model a chunk at a time; each chunk's points
    are written as float32 .npy shards with their sha256 in OUT/manifest.json, which is
    rewritten after every chunk, so a killed run resumes from its last complete chunk. Read it
    with depthscope.hooks.open_activations(OUT) (point -> \\[tokens, ...] memory-mapped arrays and
    the index of document, position, token), or with numpy alone (docs/cache.md).
    """
    from depthscope.analyses.jobs.cache import cache_job, summary_table  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    docs = read_documents(o.text, per_line=not o.whole_file)
    identity = {"text": str(o.text), "points": o.points, "chunk_tokens": o.chunk_tokens}
    cfg = begin(o, CacheConfig, "cache", identity, progress=True)
    m = load_model(o, show=True)
    _, summary = cache_job(m, docs, cfg, o.out, overwrite=o.force)
    Console().print(summary_table(summary))
