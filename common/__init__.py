"""depthscope.common: the plumbing every layer shares (errors, atomic files, progress, content stamps,
weight digests, runtime settings). It imports nothing else of depthscope, so hooks/, probes/ and
analyses/ may all import it. Its public names are exported here (lazily: importing the package
imports none of its modules)."""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "DepthscopeError": "errors",
    "ModelSpecError": "errors",
    "CheckpointError": "errors",
    "DefaultModelMissing": "errors",
    "UnsupportedArchitecture": "errors",
    "InputError": "errors",
    "ContextLengthError": "errors",
    "NonFiniteActivationError": "errors",
    "OutputError": "errors",
    "SiteError": "errors",
    "model_digest": "digest",
    "Stages": "resume",
    "stage_key": "resume",
    "tune_allocator": "runtime",
    "peak_memory": "runtime",
    "reset_peak_memory": "runtime",
    "release_memory": "runtime",
    "side_by_side": "threads",
    "atomic_write": "files",
    "atomic_text": "files",
    "progress_bar": "progress",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
