"""Edge graphs: circuits as the edges between senders and receivers, scored, evaluated and drawn.

====================  =================================================================
``graph.py``          circuits as graphs: :class:`CircuitGraph` (MIB's senders, receivers and
                      real edges), :func:`circuit_graph`, :func:`prune_circuit`, MIB's JSON
``runs.py``           batches of equal-length pairs, senders' writes, receivers' projections
``ablation.py``       mean and zero ablation: :func:`sender_means` (:class:`SenderMeans`), the
                      ablated writes both the scores and the evaluation use
``eap.py``            :func:`edge_attribution` (EAP, EAP-IG), :func:`score_edges`
``evaluate.py``       :func:`evaluate_circuit` (exact), :class:`CircuitEvaluator`
``faithfulness.py``   :func:`circuit_faithfulness` (f(k), CPR, CMD, random circuits),
                      :func:`circuit_stability` (Jaccard over bootstrap resamples)
``config.py``         :class:`CircuitConfig` (``depthscope circuit``)
``plots.py``,         the faithfulness curve and the circuit drawn as a graph; the circuit
``html.py``           as a self-contained interactive page and as JSON
====================  =================================================================

The prompt pairs and token metrics they read are the circuits room's (``pairs.py``, ``prompts.py``).
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "CircuitConfig": "config",
    "CircuitGraph": "graph",
    "circuit_graph": "graph",
    "edge_matrix": "graph",
    "prune_circuit": "graph",
    "mib_graph": "graph",
    "SenderMeans": "ablation",
    "sender_means": "ablation",
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
    "plot_faithfulness": "plots",
    "plot_circuit": "plots",
    "circuit_html": "html",
    "circuit_json": "html",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
