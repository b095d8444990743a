"""depthscope.analyses: lens, norms, patching, sweeps, plots, reports and the command line.

Every analysis takes a :class:`depthscope.hooks.HookedModel` and inputs (token ids or texts),
streams them through the residual sites, and returns tidy pandas DataFrames with the shared
columns ``site, label, layer, sublayer, depth`` (plus ``checkpoint``/``step`` in sweeps).
Names are imported lazily so ``import depthscope.analyses`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util

_EXPORTS = {
    # logit lens (analyses/lens.py, analyses/lenses.py, analyses/tuned_lens.py)
    "logit_lens": "lens",
    "logit_lens_tokens": "lens",
    "Streaming": "lens",
    "LogitLens": "lenses",
    "TunedLens": "lenses",
    "train_tuned_lens": "tuned_lens",
    "TunedLensTraining": "tuned_lens_config",
    # contribution norms (analyses/norms/)
    "contribution_norms": "norms",
    "direct_logit_attribution": "norms",
    "norms_by_position": "norms",
    "fit_growth_rate": "norms",
    "head_write_norms": "heads",
    "norm_weighted_attention": "heads",
    # patching over prompt pairs and datasets (analyses/patching.py, analyses/path_patching.py)
    "activation_patching": "patching",
    "attribution_patching": "patching",
    "patch_pairs": "patching",
    "mean_over_pairs": "patching",
    "PromptPair": "patching",
    "read_pairs": "patching",
    "logit_diff": "patching",
    "path_patching": "path_patching",
    # main job and sweeps (analyses/report.py, analyses/sweep.py)
    "run_report": "report",
    "sweep": "sweep",
    "RayEngine": "sweep_ray",
    # shared plumbing
    "write_table": "tables",
    "read_documents": "text",
    "token_batches": "text",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """An exported name from its module, or one of the package's modules (``analyses.patching``)."""
    mod = _EXPORTS.get(name)
    if mod is not None:
        return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'depthscope.analyses' has no attribute {name!r}")
