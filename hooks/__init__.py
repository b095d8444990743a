"""depthscope.hooks: models in, residual-stream sites out.

The first stage of depthscope's one-way flow (model -> residual sites -> analyses -> tidy
tables -> plots/report). Everything here knows models; nothing here knows data or plots.

Research calls on a :class:`HookedModel` (see :mod:`.points`, :mod:`.run`, :mod:`.generate`):
``model.run(inputs, cache=..., hooks=..., grad=False, padding_side="right") -> Run`` reads and
replaces any hook point (residual sites, ``l.pattern``, ``l.z``, ``l.heads``, ``l.attn_out``,
``l.neurons``, ``l.mlp_out``; TransformerLens aliases too); ``model.generate(prompts,
max_new_tokens=..., hooks=...) -> Generation`` runs hooks at every generation step.
"""

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
from .generate import Generation
from .loading import cache_dir, default_gguf_path, load_model
from .model import HookedModel, ResidualStream
from .points import POINT_KINDS, Point, parse_point, parse_points, point_names, tl_name
from .run import HookContext, Run
from .runtime import tune_allocator
from .sites import SITE_COLUMNS, Site, all_sites, parse_site, parse_sites, site_frame, site_from_index, site_labels

__all__ = [
    "load_model",
    "HookedModel",
    "ResidualStream",
    "Run",
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
]
