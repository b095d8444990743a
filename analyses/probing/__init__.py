"""The probing room of analyses/: the probe job's configuration and figures (the probing
science itself is :mod:`depthscope.probes`).

=================  ==================================================================
``config.py``      :class:`ProbeJobConfig` (``depthscope probe``)
``plots.py``       per-site curves, the overview, Tenney's summary figure
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "ProbeJobConfig": "config",
    "plot_overview": "plots",
    "plot_probe_curves": "plots",
    "plot_tenney": "plots",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
