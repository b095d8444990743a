"""The sweeps room: an analysis over a series of training checkpoints, locally or on Ray.

==================  =================================================================
``series.py``       :func:`sweep`, :func:`discover_checkpoints`, the combined tables
``ray_engine.py``   :class:`RayEngine`
``config.py``       :class:`SweepJobConfig` (``depthscope sweep``)
``plots.py``        checkpoint x depth figures, drawn from the tables
==================  =================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "sweep": "series",
    "discover_checkpoints": "series",
    "Checkpoint": "series",
    "SweepResult": "series",
    "RayEngine": "ray_engine",
    "RayUnavailable": "ray_engine",
    "SweepJobConfig": "config",
    "plot_checkpoint_heatmap": "plots",
    "plot_metric_over_training": "plots",
    "plot_final_site_over_training": "plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
