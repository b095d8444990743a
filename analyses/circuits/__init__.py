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
``config.py``       :class:`PatchConfig` (``depthscope patch``), :class:`CircuitConfig`
                    (``depthscope circuit``)
``plots.py``,       the patching heatmaps, the attribution scatter, the path-patching
``path_plots.py``   figure, drawn from the tables
``graph.py``        circuits as graphs: :class:`CircuitGraph` (MIB's senders, receivers and
                    real edges), :func:`circuit_graph`, :func:`prune_circuit`, MIB's JSON
``graph_runs.py``   batches of equal-length pairs, senders' writes, receivers' projections
``eap.py``          :func:`edge_attribution` (EAP, EAP-IG), :func:`score_edges`
``evaluate.py``     :func:`evaluate_circuit` (exact), :class:`CircuitEvaluator`
``faithfulness.py`` :func:`circuit_faithfulness` (f(k), CPR, CMD, random circuits),
                    :func:`circuit_stability` (Jaccard over bootstrap resamples)
``graph_plots.py``, the faithfulness curve and the circuit drawn as a graph; the circuit
``graph_html.py``   as a self-contained interactive page and as JSON
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
    "CircuitConfig": "config",
    "CircuitGraph": "graph",
    "circuit_graph": "graph",
    "edge_matrix": "graph",
    "prune_circuit": "graph",
    "mib_graph": "graph",
    "edge_attribution": "eap",
    "score_edges": "eap",
    "EdgeScores": "eap",
    "evaluate_circuit": "evaluate",
    "CircuitEvaluator": "evaluate",
    "circuit_faithfulness": "faithfulness",
    "faithfulness_curve": "faithfulness",
    "circuit_stability": "faithfulness",
    "smallest_faithful": "faithfulness",
    "top_circuit": "faithfulness",
    "plot_faithfulness": "graph_plots",
    "plot_circuit": "graph_plots",
    "circuit_html": "graph_html",
    "circuit_json": "graph_html",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
