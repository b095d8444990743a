"""depthscope.hooks: models in, residual-stream sites out.

The first stage of depthscope's one-way flow (model -> residual sites -> analyses -> tidy
tables -> plots/report). Everything here knows models; nothing here knows data or plots.
Names are imported lazily (PEP 562), so ``import depthscope.hooks`` and its errors stay cheap
(no torch) until a model name is used: the command line's ``--help`` depends on it.
"""

from __future__ import annotations

import importlib

from .errors import (
    CheckpointError,
    ContextLengthError,
    DefaultModelMissing,
    DepthscopeError,
    InputError,
    ModelSpecError,
    NonFiniteActivationError,
    UnsupportedArchitecture,
)
from .runtime import tune_allocator

_EXPORTS = {
    "load_model": "loading",
    "cache_dir": "loading",
    "default_gguf_path": "loading",
    "HookedModel": "model",
    "ResidualStream": "model",
    "SITE_COLUMNS": "sites",
    "Site": "sites",
    "all_sites": "sites",
    "parse_site": "sites",
    "parse_sites": "sites",
    "site_frame": "sites",
    "site_from_index": "sites",
    "site_labels": "sites",
    "model_digest": "digest",
    "Unembed": "unembed",
    "FrozenUnembed": "unembed",
}

_SUBMODULES = {"arch", "digest", "files", "loading", "model", "sites", "toy", "unembed"}

__all__ = [
    "load_model",
    "HookedModel",
    "ResidualStream",
    "Unembed",
    "FrozenUnembed",
    "model_digest",
    "Site",
    "SITE_COLUMNS",
    "all_sites",
    "parse_site",
    "parse_sites",
    "site_frame",
    "site_from_index",
    "site_labels",
    "cache_dir",
    "default_gguf_path",
    "tune_allocator",
    "DepthscopeError",
    "ModelSpecError",
    "CheckpointError",
    "DefaultModelMissing",
    "UnsupportedArchitecture",
    "InputError",
    "ContextLengthError",
    "NonFiniteActivationError",
]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        if name in _SUBMODULES:  # ``depthscope.hooks.arch`` without importing it first, as before
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
