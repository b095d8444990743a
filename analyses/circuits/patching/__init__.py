"""Activation and path patching: which activations carry a behaviour, one hook point (or path) at a time.

==================  =================================================================
``runs.py``         the patch plan, the batched patched forwards and the job every method
                    shares (positions, token budget, direction: ``denoise`` | ``noise``)
``results.py``      the tables every method returns: one pair's rows, the loop over pairs,
                    the means over pairs with their notes
``activation.py``   :func:`activation_patching`, :func:`attribution_patching`,
                    :func:`patch_pairs`
``paths.py``        :func:`path_patching` (Wang et al. 2022), :func:`path_patch_pairs`
``config.py``       :class:`PatchConfig` (``depthscope patch``)
``plots.py``,       the patching heatmaps, the attribution scatter, the path-patching
``path_plots.py``   figure, drawn from the tables
==================  =================================================================

The prompt pairs and token metrics they read are the circuits room's (``pairs.py``, ``prompts.py``).
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "activation_patching": "activation",
    "attribution_patching": "activation",
    "patch_pairs": "activation",
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
