"""The causal room: whether the model uses what a site encodes.

=================  ==================================================================
``used.py``        :func:`causal_tests`: LEACE erasure per site, its effect on probes
                   and on the model's next-token loss against random erasures
``erasure.py``     the erasers (LEACE; random controls of the same rank, their edit as
                   large as LEACE's in the stream's units, or whitened), :func:`edit_rms`
``loss.py``        the held-out next-token loss per document, :func:`used_score`,
                   :func:`used_interval`
``layers.py``      :func:`layer_interventions`: every block skipped or swapped
``counterfactuals  counterfactual examples (JSONL): :class:`Counterfactual`,
.py``              :func:`read_counterfactuals`, :func:`write_counterfactuals`
``templates.py``   generated datasets: :func:`agreement_examples`, :func:`ioi_examples`
``iia.py``         :func:`interchange`: full-vector interchange interventions, IIA per
                   site and position
``alignment.py``   :func:`das`: distributed alignment search (and Boundless DAS)
``solving.py``     :func:`solved`: the examples the unintervened model answers right
``subspaces.py``   :class:`Subspace` (save, load, steer, score as a probe)
``swaps.py``       the batched intervened forwards both share
``config.py``      :class:`CausalConfig`, :class:`LayersConfig`, :class:`LocalizeConfig`
``plots.py``,      the figures, drawn from the tables
``layer_plots.py``,
``localize_plots
.py``
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "causal_tests": "used",
    "CausalResult": "used",
    "fit_erasure": "erasure",
    "random_erasure": "erasure",
    "edit_rms": "erasure",
    "layer_interventions": "layers",
    "used_score": "loss",
    "used_interval": "loss",
    "CausalConfig": "config",
    "LayersConfig": "config",
    "plot_causal": "plots",
    "plot_layers": "layer_plots",
    "Counterfactual": "counterfactuals",
    "read_counterfactuals": "counterfactuals",
    "write_counterfactuals": "counterfactuals",
    "split_examples": "counterfactuals",
    "agreement_examples": "templates",
    "ioi_examples": "templates",
    "interchange": "iia",
    "das": "alignment",
    "solved": "solving",
    "DasResult": "alignment",
    "random_basis": "alignment",
    "Subspace": "subspaces",
    "save_subspaces": "subspaces",
    "load_subspaces": "subspaces",
    "score_subspace": "subspaces",
    "LocalizeConfig": "config",
    "plot_iia": "localize_plots",
    "plot_three_curves": "localize_plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
