"""The report room: the main job (``depthscope run``) and its HTML/markdown report.

=================  ==================================================================
``main_job.py``    :func:`run_report`, :func:`render_report`
``data.py``        the report's page from the run's tables
``findings.py``    the sentences the report states, pure functions of the tables
``config.py``      :class:`ReportConfig`
``templates/``     the Jinja2 layouts
=================  ==================================================================
"""

from __future__ import annotations

from depthscope.common.lazy import lazy_exports

_EXPORTS = {
    "run_report": "main_job",
    "render_report": "main_job",
    "ReportConfig": "config",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
