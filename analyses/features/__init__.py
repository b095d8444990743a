"""The features room: SAEs and transcoders at a hook point.

=================  ==================================================================
``training.py``    :func:`train_topk` (a TopK SAE or transcoder), :func:`sae_metrics`
``evaluate.py``    :func:`evaluate_sae`: reconstruction, sparsity and loss scores on held-out text
``probing.py``     :func:`sparse_probing` per depth, :func:`feature_lens`
``config.py``      :class:`SaeTrainConfig`, :class:`TranscoderTrainConfig`
``plots.py``       the figures, drawn from the tables
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "train_topk": "training",
    "sae_metrics": "training",
    "evaluate_sae": "evaluate",
    "sparse_probing": "probing",
    "feature_lens": "probing",
    "SparseProbing": "probing",
    "SaeTrainConfig": "config",
    "TranscoderTrainConfig": "config",
    "plot_sparse_probing": "plots",
    "plot_sae_training": "plots",
    "plot_transcoder_metrics": "plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
