"""The jobs layer: each analysis is computed, and its tables and figures written, by one function.

Both the command line (``analyses/commands/``) and the main job (``depthscope run``,
``analyses/report.py``) call these functions, so every table and figure has exactly one
writer and one name. A job takes a model, a configuration object (a dataclass whose defaults
are the only defaults: the CLI options and the report read them) and an :class:`Output`, and
returns a :class:`JobResult`.

| module | job | tables | configuration |
|---|---|---|---|
| ``jobs.lens`` | logit / tuned lens at every site | ``lens_*`` | ``LensConfig`` |
| ``jobs.norms`` | contribution norms, positions, DLA, heads | ``norms_*``, ``dla``, ``head_writes`` | ``NormsConfig`` |
| ``jobs.patch`` | activation + attribution patching | ``patching_by_site``, ``patching_by_head`` | ``PatchConfig`` |
| ``jobs.probe`` | Tenney-style probing | ``probes_*`` | ``ProbeJobConfig`` (tasks, files, probe configs) |

Commands stay thin: parse options, build the configuration, call the job, print its summary.
"""

from depthscope.analyses.jobs.base import JobResult, Output

__all__ = ["JobResult", "Output"]
