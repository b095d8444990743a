"""The circuits room: which activations carry a behaviour, over prompt pairs and datasets.

==================  =================================================================
``pairs.py``        :class:`PromptPair`, :func:`read_pairs` (JSONL), :func:`split_pairs`, means over pairs
``prompts.py``      token metrics (:func:`logit_diff`, ...), tokenised pairs
``patching/``       activation and path patching: one hook point (or path) patched at a
                    time, over pairs (:func:`activation_patching`, :func:`path_patching`,
                    :class:`PatchConfig`, their figures)
``edges/``          circuits as edge graphs: every edge scored (EAP, EAP-IG), circuits
                    evaluated and their faithfulness, drawn (:class:`CircuitGraph`,
                    :func:`edge_attribution`, :class:`CircuitConfig`, ...)
``features/``       feature circuits: attribution graphs over transcoder features, built
                    (:func:`attribution_graph`, :func:`edge_by_head`), pruned and scored as
                    circuit-tracer does, written as files, JSON, a figure and a page
                    (:class:`AttributionGraph`, :func:`prune_graph`, :func:`write_graph`, ...)
``memory.py``       the memory a pair (a batch) needs, estimated and checked before the first
                    forward (:class:`~depthscope.analyses.circuits.memory.WorkTooLarge`)
==================  =================================================================

Both read ``pairs.py`` and ``prompts.py``; every name either exports is exported here too.
"""

from __future__ import annotations

from depthscope.analyses.circuits import edges, features, patching
from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "PromptPair": "pairs",
    "read_pairs": "pairs",
    "split_pairs": "pairs",
    "mean_over_pairs": "pairs",
    "logit_diff": "prompts",
    "logit": "prompts",
    "prob": "prompts",
    "logprob": "prompts",
    "last_position": "prompts",
    **{name: f"patching.{mod}" for name, mod in patching._EXPORTS.items()},
    **{name: f"edges.{mod}" for name, mod in edges._EXPORTS.items()},
    **{name: f"features.{mod}" for name, mod in features._EXPORTS.items()},
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
