"""The circuits room: which activations carry a behaviour, over prompt pairs and datasets.

==================  =================================================================
``pairs.py``        :class:`PromptPair`, :func:`read_pairs` (JSONL), means over pairs
``prompts.py``      token metrics (:func:`logit_diff`, ...), tokenised pairs
``runs.py``         the patch plan, the batched patched forwards and the job every method
                    shares (positions, token budget, direction: ``denoise`` | ``noise``)
``results.py``      the tables every method returns: one pair's rows, the loop over pairs,
                    the means over pairs with their notes
``patching.py``     :func:`activation_patching`, :func:`attribution_patching`
``paths.py``        :func:`path_patching` (Wang et al. 2022)
``config.py``       :class:`PatchConfig` (``depthscope patch``)
``plots.py``,       the patching heatmaps, the attribution scatter, the path-patching
``path_plots.py``   figure, drawn from the tables
==================  =================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "PromptPair": "pairs",
    "read_pairs": "pairs",
    "mean_over_pairs": "pairs",
    "logit_diff": "prompts",
    "logit": "prompts",
    "prob": "prompts",
    "logprob": "prompts",
    "last_position": "prompts",
    "activation_patching": "patching",
    "attribution_patching": "patching",
    "patch_pairs": "patching",
    "path_patching": "paths",
    "path_patch_pairs": "paths",
    "PatchConfig": "config",
    "plot_patching_sites": "plots",
    "plot_patching_heads": "plots",
    "plot_attribution_vs_exact": "plots",
    "plot_path_patching": "path_plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
