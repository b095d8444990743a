"""depthscope.hooks: models in, residual-stream sites out.

The first stage of depthscope's one-way flow (model -> residual sites -> analyses -> tidy
tables -> plots/report). Everything here knows models; nothing here knows data or plots.
Names are imported lazily (PEP 562), so ``import depthscope.hooks`` and its errors stay cheap
(no torch) until a model name is used: the command line's ``--help`` depends on it.

Research calls on a :class:`HookedModel` (see :mod:`.points`, :mod:`.run`, :mod:`.generate`):
``model.run(inputs, cache=..., hooks=..., grad=False, padding_side="right") -> Run`` reads and
replaces any hook point (residual sites, ``l.pattern``, ``l.z``, ``l.heads``, ``l.attn_out``,
``l.neurons``, ``l.mlp_out``; TransformerLens aliases too); ``model.generate(prompts,
max_new_tokens=..., hooks=...) -> Generation`` runs hooks at every generation step. All of them,
``model.hooks`` and ``model.residual_stream`` included, put their hooks on the model through one
engine (:mod:`.engine`), which reads every point where the registry (:data:`.points.REGISTRY`)
says it lives.
"""

from __future__ import annotations

import importlib

from depthscope.common.errors import (
    CheckpointError,
    ContextLengthError,
    DefaultModelMissing,
    DepthscopeError,
    InputError,
    ModelSpecError,
    NonFiniteActivationError,
    OutputError,
    UnsupportedArchitecture,
)
from depthscope.common.runtime import tune_allocator

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
    "Unembed": "unembed",
    "FrozenUnembed": "unembed",
    "model_digest": "depthscope.common.digest",
    "Generation": "generate",
    "POINT_KINDS": "points",
    "Point": "points",
    "parse_point": "points",
    "parse_points": "points",
    "point_names": "points",
    "tl_name": "points",
    "HookContext": "engine",
    "Run": "run",
    "SAE": "sae",
    "load_sae": "sae",
    "save_sae": "sae",
    "load_transcoder_set": "transcoder_set",
    "save_transcoder_set": "transcoder_set",
    "Activations": "activation_cache",
    "CacheSettings": "activation_cache",
    "open_activations": "activation_cache",
    "write_activations": "activation_cache",
    "train_tiny_series": "toy",
    "from_block": "block_start",
    "stream_plan": "streaming",
    "require_decoder": "model_checks",
    "KVPrefix": "late_start",
    "tail_logits": "late_start",
    "Intervention": "interventions",
    "Unchanged": "interventions",
    "VectorSwap": "interventions",
    "SubspaceSwap": "interventions",
    "RotatedSwap": "interventions",
    "FeatureSwap": "interventions",
}

_SUBMODULES = {
    "activation_cache",
    "arch",
    "attention",
    "block_order",
    "block_start",
    "devices",
    "engine",
    "generate",
    "interventions",
    "late_start",
    "loading",
    "model",
    "points",
    "run",
    "sae",
    "sae_splice",
    "sites",
    "toy",
    "transcoder_set",
    "unembed",
}

__all__ = [
    "load_model",
    "HookedModel",
    "ResidualStream",
    "Unembed",
    "FrozenUnembed",
    "model_digest",
    "Run",
    "SAE",
    "load_sae",
    "save_sae",
    "load_transcoder_set",
    "save_transcoder_set",
    "Activations",
    "CacheSettings",
    "open_activations",
    "write_activations",
    "train_tiny_series",
    "from_block",
    "stream_plan",
    "require_decoder",
    "KVPrefix",
    "tail_logits",
    "Intervention",
    "Unchanged",
    "VectorSwap",
    "SubspaceSwap",
    "RotatedSwap",
    "FeatureSwap",
    "HookContext",
    "Generation",
    "Point",
    "POINT_KINDS",
    "parse_point",
    "parse_points",
    "point_names",
    "tl_name",
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
    "OutputError",
]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        if name in _SUBMODULES:  # ``depthscope.hooks.arch`` without importing it first
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod if "." in mod else f"{__name__}.{mod}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
