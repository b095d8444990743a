"""Variables: where the model computes a variable, by interchange interventions and DAS.

=================  ==================================================================
``counterfactuals  counterfactual examples (JSONL): :class:`Counterfactual`,
.py``              :func:`read_counterfactuals`, :func:`write_counterfactuals`
``templates.py``   generated datasets: :func:`agreement_examples`, :func:`ioi_examples`
``iia.py``         :func:`interchange`: full-vector interchange interventions, IIA per
                   site and position
``alignment.py``   :func:`das`: distributed alignment search (and Boundless DAS),
                   :func:`measure_subspaces`
``solving.py``     :func:`solved`: the examples the unintervened model answers right
``subspaces.py``   :class:`Subspace` (save, load, steer, score as a probe)
``swaps.py``       the batched intervened forwards they share
``config.py``      :class:`LocalizeConfig` (``depthscope localize``)
``localize_plots   the figures, drawn from the tables
.py``
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "Counterfactual": "counterfactuals",
    "read_counterfactuals": "counterfactuals",
    "write_counterfactuals": "counterfactuals",
    "split_examples": "counterfactuals",
    "overlap": "counterfactuals",
    "agreement_examples": "templates",
    "ioi_examples": "templates",
    "interchange": "iia",
    "das": "alignment",
    "measure_subspaces": "alignment",
    "solved": "solving",
    "DasResult": "alignment",
    "random_basis": "alignment",
    "random_control": "alignment",
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
