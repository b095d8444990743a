"""Erasure: whether the model uses what a site encodes (LEACE per site, blocks skipped or swapped).

=================  ==================================================================
``used.py``        :func:`causal_tests`: LEACE erasure per site, its effect on probes
                   and on the model's next-token loss against random erasures
``erasers.py``     the erasers (LEACE; random controls of the same rank, their edit as
                   large as LEACE's in the stream's units, or whitened), :func:`edit_rms`
``loss.py``        the held-out next-token loss per document, :func:`used_score`,
                   :func:`used_interval`
``prefix.py``      the forward from a site's block on, the unchanged prefix computed once
``layers.py``      :func:`layer_interventions`: every block skipped or swapped
``config.py``      :class:`CausalConfig`, :class:`LayersConfig`
``plots.py``,      the figures, drawn from the tables
``layer_plots.py``
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "causal_tests": "used",
    "CausalResult": "used",
    "fit_erasure": "erasers",
    "random_erasure": "erasers",
    "edit_rms": "erasers",
    "layer_interventions": "layers",
    "used_score": "loss",
    "used_interval": "loss",
    "CausalConfig": "config",
    "LayersConfig": "config",
    "plot_causal": "plots",
    "plot_layers": "layer_plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
