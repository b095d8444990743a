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
from ``ArchSpec.o_proj``, and the query/key/value projections from one of the ``QKV_LAYOUTS``
(``ArchSpec.qkv``): separate ``q_proj`` / ``k_proj`` / ``v_proj`` (grouped key/value heads),
BERT's separate ``self.query`` / ``self.key`` / ``self.value``, GPT-2's fused ``c_attn``
([q | k | v]) or GPT-NeoX's fused ``query_key_value`` (per head [q, k, v]). :func:`read_qkv` /
:func:`write_qkv` read one of q, k, v from such an output ``[..., heads, d_head]`` and put a
replacement back into it (the engine's ``qkv`` capture: ``l.q``, ``l.k``, ``l.v``);
:func:`read_values` gives the value vectors per query head (``l.values``), :func:`linear_weight`
a projection's matrix (GPT-2's ``Conv1D`` stores it transposed). Attention patterns and scores
come from :mod:`depthscope.hooks.attention` (``model.run(cache=["l.pattern"])``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

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
    qkv: str | None = None  # a key of QKV_LAYOUTS: where queries, keys and values are read
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
    qkv="q_proj",
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
        qkv="c_attn",
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
        qkv="query_key_value",
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
        qkv="query",
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
    blocks: nn.ModuleList  # the model's own list: the block at each position (block_order rearranges it)
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
    q_proj: list = field(default_factory=list)  # output holds the queries l.q (None: unsupported)
    k_proj: list = field(default_factory=list)  # output holds the keys l.k (None: unsupported)
    v_proj: list = field(default_factory=list)  # output holds the values l.v, l.values (None: unsupported)
    n_heads: int | None = None  # query heads
    n_kv_heads: int | None = None  # key/value heads (GQA; = n_heads otherwise)
    qkv: str | None = None  # a key of QKV_LAYOUTS (or None: q, k, v not readable)
    d_head: int | None = None
    sandwich: bool = False  # a norm after each sublayer (OLMo-2, Gemma-2/3)
    # --- end of hook-point fields --------------------------------------------------------------
    by_index: list = field(default_factory=list)  # block l's module, wherever block_order runs it

    def __post_init__(self):
        if not self.by_index:
            self.by_index = list(self.blocks)


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
    layout = QKV_LAYOUTS.get(spec.qkv or "")
    paths = layout.paths if layout else ("", "", "")
    return dict(
        **{f"{x}_proj": [_first(a, (path,)) if path else None for a in attn] for x, path in zip("qkv", paths)},
        attn_site=attn if spec.layout == "post_norm" else attn_write,
        attn_write=attn_write,
        mlp_write=mlp_write,
        attn_fn=each(spec.attn_fn),
        o_proj=o_proj,
        down_proj=each(spec.down_proj),
        n_heads=n_heads,
        n_kv_heads=_config_int(config, KV_HEAD_KEYS) or n_heads,
        qkv=spec.qkv,
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
                    qkv="q_proj" if _has_all(_first(b0, _GENERIC_ATTN), QKV_LAYOUTS["q_proj"].paths) else None,
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


class QKVLayout(NamedTuple):
    """Where one family keeps its queries, keys and values: ``paths`` (the submodules of the
    attention module whose outputs hold q, k and v; one module three times when fused) and
    ``fused`` (None: separate projections; ``"concat"``: ``[q | k | v]`` along the features, GPT-2;
    ``"per_head"``: per head ``[q, k, v]``, GPT-NeoX)."""

    paths: tuple[str, str, str]
    fused: str | None = None


#: q/k/v layout (``ArchSpec.qkv``) -> where its projections are and how their outputs are laid out
QKV_LAYOUTS: dict[str, QKVLayout] = {
    "q_proj": QKVLayout(("q_proj", "k_proj", "v_proj")),
    "query": QKVLayout(("self.query", "self.key", "self.value")),
    "c_attn": QKVLayout(("c_attn",) * 3, "concat"),
    "query_key_value": QKVLayout(("query_key_value",) * 3, "per_head"),
}
QKV_PARTS = ("q", "k", "v")


def _has_all(module: nn.Module | None, paths: tuple[str, ...]) -> bool:
    return module is not None and all(_get(module, p) is not None for p in paths)


def read_qkv(arch: ResolvedArch, part: int, out: torch.Tensor) -> torch.Tensor:
    """Queries (``part`` 0), keys (1) or values (2) ``[..., heads, d_head]`` from the output of
    that part's projection: query heads for q, key/value heads for k and v (as the model has
    them; grouped-query models are not expanded)."""
    fused = QKV_LAYOUTS[arch.qkv].fused
    if fused == "concat":
        d = out.shape[-1] // 3
        return out[..., part * d : (part + 1) * d].unflatten(-1, (arch.n_heads, -1))
    if fused == "per_head":
        qkv = out.unflatten(-1, (arch.n_heads, -1))
        dh = qkv.shape[-1] // 3
        return qkv[..., part * dh : (part + 1) * dh]
    heads = arch.n_heads if part == 0 else arch.n_kv_heads or arch.n_heads
    return out.unflatten(-1, (heads, -1))


def write_qkv(arch: ResolvedArch, part: int, out: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The projection output ``out`` with its ``part`` (see :func:`read_qkv`) replaced by ``new``
    ``[..., heads, d_head]``; the other parts of a fused output are kept."""
    fused = QKV_LAYOUTS[arch.qkv].fused
    if fused == "concat":
        parts = list(out.split(out.shape[-1] // 3, dim=-1))
        parts[part] = new.flatten(-2)
        return torch.cat(parts, dim=-1)
    if fused == "per_head":
        qkv = out.unflatten(-1, (arch.n_heads, -1))
        parts = list(qkv.split(qkv.shape[-1] // 3, dim=-1))
        parts[part] = new
        return torch.cat(parts, dim=-1).flatten(-2)
    return new.reshape(out.shape)


def read_values(arch: ResolvedArch, out: torch.Tensor) -> torch.Tensor:
    """Value vectors ``[B, P, n_heads, head_dim]`` (one per query head: grouped key/value heads
    expanded) from the output of ``arch.v_proj[l]``."""
    v = read_qkv(arch, 2, out)
    return v.repeat_interleave(arch.n_heads // v.shape[-2], dim=-2) if v.shape[-2] != arch.n_heads else v


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
