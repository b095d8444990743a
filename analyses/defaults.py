"""Defaults that several rooms' settings share: the prompts and tokens the analyses start from,
and the setting helpers of the probe-data options. Torch-free (the commands read it for ``--help``).
"""

from __future__ import annotations

from pathlib import Path

from depthscope.common.settings import comma_list, setting

#: the prompt of the lens's token view and of the norms' per-position view and DLA
DEFAULT_PROMPT = "The capital of France is"
#: the token whose logit the report's DLA attributes
DEFAULT_TARGET = " Paris"
#: the most top tokens per position and site in ``lens_tokens`` (three columns each)
MAX_TOP_K = 1000
#: the default prompt pair of ``depthscope patch``: the IOI example of the README
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"

RESUME_HELP = (
    "Reuse what an earlier run in --out finished with the same model, data, settings and depthscope code "
    "(a killed run continues; --no-resume computes everything again, and records it for the next run)."
)


def tasks_setting(help: str) -> object:
    """The ``--task``/``-t`` setting (a comma-separated list of probe tasks) with ``help``."""
    return setting(None, "--task", "-t", param="task", cli_type=str | None, parse=comma_list, help=help)


def data_file_setting(name: str, what: str) -> object:
    """A ``--train``/``--test``/``--dev`` file setting (None: the default named in ``what``)."""
    return setting(None, f"--{name}", cli_type=Path | None, help=what)
