"""The report's Jinja2 templates (``report.html.j2``, ``report.md.j2``, ``report.css``), laid out
by :func:`depthscope.analyses.report.main_job.render_report`; a package so that the wheel ships them
(pyproject's package data)."""
