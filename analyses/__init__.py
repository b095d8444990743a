"""depthscope.analyses: lens, norms, patching, sweeps, plots, reports and the command line.

Every analysis takes a :class:`depthscope.hooks.HookedModel` and inputs (token ids or texts),
streams them through the residual sites, and returns tidy pandas DataFrames with the shared
columns ``site, label, layer, sublayer, depth`` (plus ``checkpoint``/``step`` in sweeps).
Names are imported lazily so ``import depthscope.analyses`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util

#: the rooms, each exporting its own names (its ``__init__``); every one of them is exported here too
ROOMS = ("lens", "norms", "circuits", "causal", "features", "sweeps", "probing", "report")
#: names of the shared modules at the top of analyses/, and jobs that the docs name
_SHARED = {
    "write_table": "tables",
    "read_documents": "text",
    "token_batches": "text",
    "text_rows": "text",
    "TextRows": "text",
    "TextWindows": "text_settings",
    "sae_train_job": "jobs.sae",
    "transcoders_train_job": "jobs.transcoders",
}


def _exports() -> dict[str, str]:
    """Every room's exported names (their ``__init__`` imports nothing heavy), and the shared ones."""
    out = {}
    for room in ROOMS:
        for name in importlib.import_module(f"{__name__}.{room}").__all__:
            if name in out:
                raise ImportError(f"depthscope.analyses: {name!r} is exported by the rooms {out[name]} and {room}")
            out[name] = room
    return {**out, **_SHARED}


_EXPORTS = _exports()
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """An exported name from its room, or one of the package's modules (``analyses.circuits``)."""
    mod = _EXPORTS.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'depthscope.analyses' has no attribute {name!r}")
