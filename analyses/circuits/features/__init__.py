"""Feature circuits: attribution graphs over transcoder features (Ameisen et al. 2025, "Circuit
Tracing"; the circuit-tracer library), beside the edge circuits of ``edges/``.

=====================  =================================================================
``graph.py``           :class:`AttributionGraph`: the nodes (features, error nodes, input
                       tokens, target logits) in adjacency order and the adjacency (rows
                       targets, columns sources), with the node table
``replacement.py``     the replacement model of one prompt: attention patterns and norm
                       scales frozen, MLPs replaced by transcoder + error
``attribute.py``       :func:`attribution_graph`: the graph's edges from batched backward passes
``heads.py``           :func:`edge_by_head`: one edge split into the residual path and each head
``prune.py``           influence, node and edge pruning, replacement and completeness scores
                       (circuit-tracer's ``graph.py`` definitions)
``export.py``          the files: ``nodes.parquet``, ``adjacency.npz``, the summary, the
                       circuit-tracer/Neuronpedia graph JSON
``plots.py``,          the static figure and the self-contained HTML view
``html.py``
``config.py``          :class:`AttributeConfig`: the settings of ``depthscope attribute``
                       (torch-free; the job is ``analyses/jobs/attribute.py``)
=====================  =================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "AttributionGraph": "graph",
    "NODE_KINDS": "graph",
    "node_influence": "prune",
    "prune_graph": "prune",
    "PrunedGraph": "prune",
    "pruned_adjacency": "prune",
    "graph_scores": "prune",
    "node_table": "export",
    "graph_json": "export",
    "write_graph": "export",
    "read_graph": "export",
    "plot_attribution_graph": "plots",
    "attribution_html": "html",
    "ReplacementModel": "replacement",
    "replacement_model": "replacement",
    "attribution_graph": "attribute",
    "attribution_graph_of": "attribute",
    "AttributionConfig": "attribute",
    "edge_by_head": "heads",
    "AttributeConfig": "config",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
