"""The jobs layer: each analysis is computed, and its tables and figures written, by one function.

Both the command line (``analyses/commands/``) and the main job (``depthscope run``,
``analyses/report/main_job.py``) call these functions, so every table and figure has exactly one
writer and one name. A job takes a model, a configuration object and an :class:`Output`, and
returns a :class:`JobResult`. The configuration is a frozen dataclass checked on construction
whose fields declare each setting once (default, bounds, flag, help:
:func:`depthscope.common.settings.setting`); the command-line options are generated from them.
The configurations live in ``jobs.configs``, which imports no torch, pandas or matplotlib (the
commands read it for ``--help``); each job module imports its heavy libraries at its top, and a
command imports its job module when it runs.

| module | job | tables | configuration (``jobs.configs``) |
|---|---|---|---|
| ``jobs.lens`` | logit / tuned lens at every site | ``lens_*`` | ``LensConfig`` |
| ``jobs.norms`` | contribution norms, positions, DLA, heads | ``norms_*``, ``dla``, ``head_writes`` | ``NormsConfig`` |
| ``jobs.patch`` | activation + attribution patching | ``patching_by_site``, ``patching_by_head`` | ``PatchConfig`` |
| ``jobs.probe`` | Tenney-style probing | ``probes_*`` | ``ProbeJobConfig`` (tasks, files, probe configs) |
| ``jobs.sweep`` | one analysis over a checkpoint series | ``sweep_*`` | ``SweepJobConfig`` |
| ``jobs.data`` | the bundled probing samples: table, copies | | |

Commands stay thin: build the configuration from the options, load the model, call the job,
print its summary (the jobs' ``summary_table`` functions).
"""

from depthscope.analyses.jobs.base import JobResult, Output

__all__ = ["JobResult", "Output"]
