"""Where each architecture keeps its blocks, sublayers, norms and unembedding.

An :class:`ArchSpec` maps a Hugging Face model onto depthscope's residual sites. Known
families are listed in ``FAMILIES``; anything else is mapped by looking for the usual
module names, and refused with an :class:`UnsupportedArchitecture` that names the class
when that fails.

Three layouts exist:

* ``sequential`` pre-norm (Llama, Mistral, Qwen2, SmolLM, GPT-2): ``l.attn`` is
  ``resid_pre + attn_out`` and ``l.mlp`` is the block output.
* ``parallel`` pre-norm (GPT-NeoX/Pythia with ``use_parallel_residual``, GPT-J): attention and
  MLP both read ``resid_pre``; depthscope defines ``l.attn`` as ``resid_pre + attn_out`` (the
  stream as if the MLP had not yet written) and ``l.mlp`` as the block output
  ``resid_pre + attn_out + mlp_out``.
* sandwich norms (OLMo-2/3: a norm only after each sublayer; Gemma-2/3: before and after) are
  ``sequential``: the write into the stream is the post-sublayer norm's output, so ``l.attn`` is
  ``resid_pre + PostNorm(Attn(...))`` and ``resid_post = resid_pre + attn_out + mlp_out`` exactly.
* ``post_norm`` encoders (BERT): each sublayer ends in its own LayerNorm; ``l.attn`` is the
  attention sublayer's normed output and ``l.mlp`` the block output. ``h_s - h_{s-1}`` is then
  not a pure sublayer write (the norm rescales the stream), which analyses say in their docs.

Attention heads (for per-head analyses): the number of heads and key/value heads comes from
the config (``HEAD_KEYS``, ``KV_HEAD_KEYS``), the output projection of each attention module
from ``ArchSpec.o_proj``, and the value vectors from one of the ``VALUE_LAYOUTS``
(``ArchSpec.values``): a separate ``v_proj`` (grouped key/value heads), GPT-2's fused
``c_attn`` ([q | k | v]) or GPT-NeoX's fused ``query_key_value`` (per head [q, k, v]).
:func:`read_values` reads them (the engine's ``values`` capture), :func:`linear_weight` reads a
projection's matrix (GPT-2's ``Conv1D`` stores it transposed). Attention patterns come from
:mod:`depthscope.hooks.attention` (``model.run(cache=["l.pattern"])``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from depthscope.common.errors import UnsupportedArchitecture


def _get(root: nn.Module, path: str) -> nn.Module | None:
    obj = root
    for part in path.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


@dataclass
class ArchSpec:
    family: str
    layout: str  # "sequential" | "parallel" | "post_norm"
    blocks: str
    attn: tuple[str, ...]
    mlp: tuple[str, ...]
    ln1: tuple[str, ...] = ()
    ln2: tuple[str, ...] = ()
    final_norm: tuple[str, ...] = ()
    norm_kind: str = "rms"  # "rms" | "layer"
    values: str | None = None  # a key of VALUE_LAYOUTS: how value vectors are read
    extra: dict = field(default_factory=dict)
    # --- hook points below the stream (hooks/points.py) -------------------------------------
    # Module paths relative to a block, the first that exists wins. ``attn_fn``: the module that
    # calls transformers' attention function (reads/replaces l.pattern); ``o_proj``: the attention
    # output projection (its input is l.z, its per-head terms l.heads); ``down_proj``: the MLP output
    # projection (its input is l.neurons); ``attn_write`` / ``mlp_write``: the module whose output
    # is the sublayer's write into the stream (l.attn_out / l.mlp_out; empty = the sublayer itself;
    # the post-sublayer norm in sandwich families, whose l.attn site is then resid_pre + its output).
    attn_fn: tuple[str, ...] = ()
    o_proj: tuple[str, ...] = ()
    down_proj: tuple[str, ...] = ()
    attn_write: tuple[str, ...] = ()
    mlp_write: tuple[str, ...] = ()
    # --- end of hook-point fields --------------------------------------------------------------


HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
KV_HEAD_KEYS = ("num_key_value_heads",)


FAMILIES: dict[str, ArchSpec] = {}


def _register(model_types: list[str], spec: ArchSpec) -> None:
    for t in model_types:
        FAMILIES[t] = spec


_LLAMA = ArchSpec(
    family="llama",
    layout="sequential",
    blocks="layers",
    attn=("self_attn",),
    mlp=("mlp",),
    ln1=("input_layernorm",),
    ln2=("post_attention_layernorm",),
    final_norm=("norm",),
    norm_kind="rms",
    attn_fn=("self_attn",),
    o_proj=("self_attn.o_proj",),
    values="v_proj",
    down_proj=("mlp.down_proj",),
)
_register(["llama", "mistral", "qwen2", "qwen3", "smollm3"], _LLAMA)
# sandwich norms. OLMo-2/3: no norm before a sublayer, an RMSNorm after each
# (h' = h + Norm(Attn(h)), h'' = h' + Norm(MLP(h'))): the writes are the norms' outputs.
_register(
    ["olmo2", "olmo3"],
    ArchSpec(
        **{
            **_LLAMA.__dict__,
            "family": "olmo2",
            "ln1": (),
            "ln2": (),
            "attn_write": ("post_attention_layernorm",),
            "mlp_write": ("post_feedforward_layernorm",),
        }
    ),
)
# Gemma-2/3: a norm before and after each sublayer (h' = h + PostNorm(Attn(PreNorm(h))), ...)
for _t in ("gemma2", "gemma3_text"):
    _register(
        [_t],
        ArchSpec(
            **{
                **_LLAMA.__dict__,
                "family": _t.removesuffix("_text"),
                "ln2": ("pre_feedforward_layernorm",),
                "attn_write": ("post_attention_layernorm",),
                "mlp_write": ("post_feedforward_layernorm",),
            }
        ),
    )
_register(
    ["gpt2"],
    ArchSpec(
        family="gpt2",
        layout="sequential",
        blocks="h",
        attn=("attn",),
        mlp=("mlp",),
        ln1=("ln_1",),
        ln2=("ln_2",),
        final_norm=("ln_f",),
        norm_kind="layer",
        attn_fn=("attn",),
        o_proj=("attn.c_proj",),
        values="c_attn",
        down_proj=("mlp.c_proj",),
    ),
)
_register(
    ["gpt_neox"],
    ArchSpec(
        family="gpt_neox",
        layout="parallel",  # switched to sequential when use_parallel_residual is False
        blocks="layers",
        attn=("attention",),
        mlp=("mlp",),
        ln1=("input_layernorm",),
        ln2=("post_attention_layernorm",),
        final_norm=("final_layer_norm",),
        norm_kind="layer",
        attn_fn=("attention",),
        o_proj=("attention.dense",),
        values="query_key_value",
        down_proj=("mlp.dense_4h_to_h",),
    ),
)
_register(
    ["bert", "roberta", "xlm-roberta", "electra"],
    ArchSpec(
        family="bert",
        layout="post_norm",
        blocks="encoder.layer",
        attn=("attention",),
        mlp=("output",),
        norm_kind="layer",
        attn_fn=("attention.self",),
        o_proj=("attention.output.dense",),
        down_proj=("output.dense",),
        attn_write=("attention.output.dense",),  # what enters the LayerNorm with the stream
        mlp_write=("output.dense",),
    ),
)

_GENERIC_BLOCKS = ("layers", "h", "decoder.layers", "encoder.layer", "blocks")
_GENERIC_ATTN = ("self_attn", "attn", "attention", "self_attention")
_GENERIC_MLP = ("mlp", "feed_forward", "ffn")
_GENERIC_FINAL = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "decoder.final_layer_norm")


@dataclass
class ResolvedArch:
    """An ArchSpec bound to one model instance."""

    family: str
    layout: str
    blocks: nn.ModuleList
    attn: list[nn.Module]
    mlp: list[nn.Module]
    ln1: list[nn.Module | None]
    ln2: list[nn.Module | None]
    final_norm: nn.Module | None
    norm_kind: str
    unembed: nn.Module | None
    head: Callable[[torch.Tensor], torch.Tensor] | None  # encoder MLM heads
    softcap: float | None
    logit_scale: float | None
    # --- hook points below the stream (hooks/points.py); see ArchSpec ---------------------------
    attn_site: list = field(default_factory=list)  # output makes the l.attn site (with resid_pre unless post-norm)
    attn_write: list = field(default_factory=list)  # output is l.attn_out
    mlp_write: list = field(default_factory=list)  # output is l.mlp_out
    attn_fn: list = field(default_factory=list)  # calls the attention function (None: l.pattern unsupported)
    o_proj: list = field(default_factory=list)  # input is l.z (None: z/heads unsupported)
    down_proj: list = field(default_factory=list)  # input is l.neurons (None: unsupported)
    value_proj: list = field(default_factory=list)  # output holds the value vectors (None: unsupported)
    n_heads: int | None = None  # query heads
    n_kv_heads: int | None = None  # key/value heads (GQA; = n_heads otherwise)
    values: str | None = None  # a key of VALUE_LAYOUTS (or None: value vectors not readable)
    d_head: int | None = None
    sandwich: bool = False  # a norm after each sublayer (OLMo-2, Gemma-2/3)
    # --- end of hook-point fields --------------------------------------------------------------


def _first(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for n in names:
        m = _get(module, n)
        if isinstance(m, nn.Module):
            return m
    return None


def resolve(model: nn.Module) -> ResolvedArch:
    """Bind an architecture spec to ``model`` (a transformers PreTrainedModel)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    cls = type(model).__name__
    base = getattr(model, "base_model", model)
    spec = FAMILIES.get(model_type)
    if spec is not None and model_type == "gpt_neox" and not getattr(config, "use_parallel_residual", True):
        spec = ArchSpec(**{**spec.__dict__, "layout": "sequential"})
    if spec is None:
        spec = _generic_spec(base, cls, model_type)
    blocks = _get(base, spec.blocks)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise UnsupportedArchitecture(
            f"cannot find the transformer blocks of {cls} (model_type={model_type!r}) at "
            f"'{spec.blocks}'; supported families: {sorted(FAMILIES)}"
        )
    sub = _sublayers(spec, blocks, f"{cls} (model_type={model_type!r})")
    return ResolvedArch(
        family=spec.family,
        layout=spec.layout,
        blocks=blocks,
        **sub,
        final_norm=_first(base, spec.final_norm) if spec.final_norm else None,
        norm_kind=spec.norm_kind,
        **_output_heads(model, base, spec),
        softcap=getattr(config, "final_logit_softcapping", None),
        logit_scale=getattr(config, "logit_scale", None),
        **_resolve_points(spec, blocks, sub["attn"], sub["mlp"], config),
    )


def _sublayers(spec: ArchSpec, blocks: nn.ModuleList, what: str) -> dict:
    """Each block's attention, MLP and pre-sublayer norms (``attn``, ``mlp``, ``ln1``, ``ln2``)."""
    attn, mlp, ln1, ln2 = [], [], [], []
    for i, block in enumerate(blocks):
        a, m = _first(block, spec.attn), _first(block, spec.mlp)
        if a is None or m is None:
            raise UnsupportedArchitecture(
                f"block {i} of {what} has no attention ({spec.attn}) "
                f"or MLP ({spec.mlp}) submodule: depthscope cannot map this architecture"
            )
        attn.append(a)
        mlp.append(m)
        ln1.append(_first(block, spec.ln1) if spec.ln1 else None)
        ln2.append(_first(block, spec.ln2) if spec.ln2 else None)
    return dict(attn=attn, mlp=mlp, ln1=ln1, ln2=ln2)


def _output_heads(model: nn.Module, base: nn.Module, spec: ArchSpec) -> dict:
    """``unembed`` (a decoder's output embedding) and ``head`` (an encoder's MLM head), or None."""
    unembed = None
    head = None
    if hasattr(model, "get_output_embeddings"):
        out = model.get_output_embeddings()
        if isinstance(out, nn.Module) and base is not model:
            unembed = out
    if spec.layout == "post_norm":
        cls_head = _get(model, "cls") or _get(model, "lm_head")
        if cls_head is not None and base is not model:
            head = cls_head
            unembed = None
    return dict(unembed=unembed, head=head)


def _resolve_points(spec: ArchSpec, blocks, attn: list, mlp: list, config) -> dict:
    """The hook-point fields of :class:`ResolvedArch` (modules found by the spec's paths)."""

    def each(paths, default=None):
        found = [_first(b, paths) if paths else None for b in blocks]
        return [default[i] if m is None and default else m for i, m in enumerate(found)]

    attn_write, mlp_write = each(spec.attn_write, attn), each(spec.mlp_write, mlp)
    o_proj = each(spec.o_proj)
    n_heads = _config_int(config, HEAD_KEYS)
    d_head = None
    if n_heads and o_proj and o_proj[0] is not None and hasattr(o_proj[0], "weight"):
        w = o_proj[0].weight  # Linear [out, in]; GPT-2 Conv1D [in, out]
        d_in = w.shape[0] if type(o_proj[0]).__name__ == "Conv1D" else w.shape[1]
        d_head = d_in // n_heads if d_in % n_heads == 0 else None
    layout = VALUE_LAYOUTS.get(spec.values or "")
    value_proj = [getattr(a, layout[0], None) if layout else None for a in attn]
    return dict(
        value_proj=value_proj,
        attn_site=attn if spec.layout == "post_norm" else attn_write,
        attn_write=attn_write,
        mlp_write=mlp_write,
        attn_fn=each(spec.attn_fn),
        o_proj=o_proj,
        down_proj=each(spec.down_proj),
        n_heads=n_heads,
        n_kv_heads=_config_int(config, KV_HEAD_KEYS) or n_heads,
        values=spec.values,
        d_head=d_head,
        sandwich=bool(spec.attn_write) and spec.layout != "post_norm",
    )


def _config_int(config, keys) -> int | None:
    for key in keys:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _generic_spec(base: nn.Module, cls: str, model_type) -> ArchSpec:
    for path in _GENERIC_BLOCKS:
        blocks = _get(base, path)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            b0 = blocks[0]
            if _first(b0, _GENERIC_ATTN) is not None and _first(b0, _GENERIC_MLP) is not None:
                final = _first(base, _GENERIC_FINAL)
                kind = "rms" if final is not None and "rms" in type(final).__name__.lower() else "layer"
                return ArchSpec(
                    family=str(model_type or cls),
                    layout="sequential",
                    blocks=path,
                    attn=_GENERIC_ATTN,
                    mlp=_GENERIC_MLP,
                    ln1=("input_layernorm", "ln_1", "ln1"),
                    ln2=("post_attention_layernorm", "ln_2", "ln2"),
                    final_norm=_GENERIC_FINAL,
                    norm_kind=kind,
                    attn_fn=_GENERIC_ATTN,
                    values="v_proj" if hasattr(_first(b0, _GENERIC_ATTN), "v_proj") else None,
                    o_proj=tuple(f"{a}.{o}" for a in _GENERIC_ATTN for o in ("o_proj", "c_proj", "dense", "out_proj")),
                    down_proj=tuple(
                        f"{m}.{d}"
                        for m in _GENERIC_MLP
                        for d in ("down_proj", "c_proj", "dense_4h_to_h", "fc2", "fc_out")
                    ),
                )
    raise UnsupportedArchitecture(
        f"depthscope cannot map architecture {cls} (model_type={model_type!r}): no block list "
        f"with attention and MLP submodules found. Supported families: {sorted(FAMILIES)}"
    )


# ----------------------------------------------------------------------------- attention heads
def linear_weight(proj: nn.Module) -> torch.Tensor:
    """``[out, in]`` matrix (detached) of a Linear or a GPT-2 ``Conv1D`` (which stores ``[in, out]``)."""
    w = proj.weight.detach()
    return w.T if type(proj).__name__ == "Conv1D" else w


def _values_v_proj(out: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    v = out.reshape(*out.shape[:-1], n_kv, -1)
    return v.repeat_interleave(n_heads // n_kv, dim=-2)


def _values_c_attn(out: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    d = out.shape[-1] // 3
    return out[..., 2 * d :].reshape(*out.shape[:-1], n_heads, -1)


def _values_qkv(out: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    qkv = out.reshape(*out.shape[:-1], n_heads, -1)
    return qkv[..., 2 * qkv.shape[-1] // 3 :]


#: value layout -> (submodule of the attention whose output holds the values, reader of that
#: output ``[B, P, *] -> [B, P, n_heads, head_dim]`` per query head)
VALUE_LAYOUTS: dict[str, tuple[str, Callable]] = {
    "v_proj": ("v_proj", _values_v_proj),
    "c_attn": ("c_attn", _values_c_attn),
    "query_key_value": ("query_key_value", _values_qkv),
}


def read_values(arch: ResolvedArch, out: torch.Tensor) -> torch.Tensor:
    """Value vectors ``[B, P, n_heads, head_dim]`` (one per query head) from the output of
    ``arch.value_proj[l]``."""
    read = VALUE_LAYOUTS[arch.values][1]
    return read(out, arch.n_heads, arch.n_kv_heads or arch.n_heads)


def cache_keyword(hf_model: nn.Module) -> str:
    """The forward keyword that takes a key/value cache: ``cache`` in recent transformers
    (where ``past_key_values`` is deprecated), ``past_key_values`` before."""
    try:
        params = inspect.signature(hf_model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(output):
    """The key/value cache a forward returned (``output.cache``, or ``past_key_values`` in older
    transformers), or None."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is not None:
            return value
    return None
