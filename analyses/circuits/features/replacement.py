"""The replacement model of one prompt: attention patterns and norm scales frozen at the prompt's
values, each MLP replaced by its transcoder's features plus an error node (Ameisen et al. 2025,
"Circuit Tracing"; circuit-tracer's ``ReplacementModel``, reimplemented on depthscope's engine).

==============================  ==============================================================
offers                          what
==============================  ==============================================================
:func:`replacement_model`       one clean forward -> :class:`ReplacementModel`
:class:`ReplacementModel`       what the clean forward recorded (patterns, norm scales, MLP
                                outputs, transcoder activations, errors, last logits) and
                                ``run``: the frozen, linear model on given sources
:class:`FrozenNorm`             a norm with its scale frozen: ``gain * centre(x) / sigma + bias``
:class:`Sources`                the sources of one frozen forward: block 0's input and each
                                MLP's write
==============================  ==============================================================

The frozen model (``ReplacementModel.run``) is the model's own forward through the hook engine
with these replacements: ``l.z`` (the heads' outputs entering the output projection) <- the clean
pattern times the values of ``ln1``, its scale frozen, applied to the stream entering block
``l`` (the model's query, key and value projections are skipped: they hand on zeros, and the
attention run on them is discarded); in sandwich families (Gemma-2, OLMo-2) ``l.attn_out`` <- the
post-attention norm, frozen, of ``l.proj_out``; ``embed`` and ``l.mlp_out`` <- the sources. The
MLP's input is recomputed as ``ln2`` frozen of the stream it reads (``l.attn`` in sequential
blocks, the block input in parallel ones) and kept as the transcoder's input (the targets' side;
the real MLP is skipped, :mod:`~depthscope.hooks.sublayer_skip`); the final norm is frozen
likewise. Everything between the
sources and those inputs is then affine: queries and keys do not matter (the pattern is fixed),
norms divide by constants (LayerNorm's mean-centring is linear and stays). With the clean sources
(token embeddings, and each MLP's true output = features + transcoder bias + error) the frozen
model's logits equal the model's (``tests/test_attribution.py``); every build checks that the
frozen model gives back the clean MLP inputs and final norm output, so a family whose blocks it
would read wrongly is refused (:class:`~depthscope.common.errors.UnsupportedArchitecture`).

Sources, as circuit-tracer defines them: an active feature ``(l, p, f)`` writes
``activation * W_dec[f]`` into ``l.mlp_out`` at ``p``; the error node ``(l, p)`` writes
``mlp_out - (sum of its features' writes + b_dec)`` (a skip transcoder's skip term is in the
error); the token node ``p`` writes block 0's input at ``p`` -- token plus position embedding in
GPT-2 (learned positions are not a node of their own: the input of block 0 is what the model
reads), the scaled embedding in Gemma. The transcoders' ``b_dec`` and all the model's biases are
constants: a target's ``bias``. Layers without a transcoder have no features: their error node
is the whole MLP output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from depthscope.analyses.circuits.features.patterns import Patterns, mix
from depthscope.common.errors import InputError, UnsupportedArchitecture
from depthscope.hooks.arch import linear_weight, read_qkv
from depthscope.hooks.engine import Engine, cache_points
from depthscope.hooks.points import Point
from depthscope.hooks.sae import SAE, sae_point
from depthscope.hooks.sublayer_skip import out_width, skipped
from depthscope.hooks.unembed import NormParams

#: relative error above which a norm is not read as gain * centre(x) / sigma + bias
NORM_TOLERANCE = 1e-3


@dataclass
class FrozenNorm:
    """A norm with its scale ``sigma`` ``[pos, 1]`` frozen at the clean stream: ``x -> gain *
    centre(x) / sigma + bias`` (``linear=True``: without the bias). ``kind``: "rms" or "layer"."""

    kind: str
    gain: torch.Tensor
    bias: torch.Tensor | None
    sigma: torch.Tensor

    def centre(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True) if self.kind == "layer" else x

    def __call__(self, x: torch.Tensor, linear: bool = False) -> torch.Tensor:
        out = self.gain * self.centre(x) / self.sigma
        return out if linear or self.bias is None else out + self.bias

    def pullback(self, v: torch.Tensor, position: int) -> torch.Tensor:
        """The stream direction ``u`` with ``u . x == v . self(x, linear=True)[position]`` for every ``x``."""
        u = v * self.gain / self.sigma[position]
        return self.centre(u)  # centring is symmetric: v . centre(x) == centre(v) . x


def freeze_norm(norm: nn.Module | None, x: torch.Tensor, what: str) -> FrozenNorm | None:
    """``norm`` read as gain/bias/eps and frozen at its clean input ``x`` ``[pos, d]``; checked
    against the module on ``x`` (Gemma's ``1 + weight`` gain is tried when the weight alone does
    not fit). None for no norm (OLMo-2's missing pre-norms)."""
    if norm is None:
        return None
    d = x.shape[-1]
    params = NormParams.of(norm, d)
    with torch.no_grad():
        ref = norm(x.unsqueeze(0))[0].double()
    tol = max(NORM_TOLERANCE, 4 * torch.finfo(x.dtype).eps)  # a bfloat16 norm rounds its output at 4e-3
    errs = []
    for gain in (params.gain, params.gain + 1):
        p = NormParams(params.kind, gain, params.bias, params.eps)
        errs.append(float((ref - p.apply(x)).abs().max() / ref.abs().max().clamp_min(1e-12)))
        if errs[-1] <= tol:
            dt, dev = x.dtype, x.device
            bias = None if p.bias is None else p.bias.to(dev, dt)
            return FrozenNorm(p.kind, gain.to(dev, dt), bias, p.sigma(x).to(dev, dt))
    raise UnsupportedArchitecture(
        f"{what} ({type(norm).__name__}) is not gain * centre(x) / sqrt(mean(centre(x)^2) + eps) [+ bias]: "
        f"its scale cannot be frozen (relative error {min(errs):.1e})"
    )


@dataclass
class Sources:
    """The sources of one frozen forward (batch ``B``): ``embed`` ``[B, pos, d]`` (block 0's input)
    and ``mlp_out`` (one ``[B, pos, d]`` per layer: each MLP's write)."""

    embed: torch.Tensor
    mlp_out: list[torch.Tensor]


@dataclass
class FrozenOutputs:
    """What a frozen forward returns: ``mlp_in`` (per layer ``[B, pos, d]``: the transcoders'
    inputs, ln2 frozen), ``final`` ``[B, pos, d]`` (the final norm's output, frozen), ``heads``
    (per layer ``[B, pos, heads, d]``, when asked for: each head's write before any post-norm)."""

    mlp_in: list[torch.Tensor]
    final: torch.Tensor
    heads: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ReplacementModel:
    """One prompt's replacement model (see the module doc). Tensors on the model's device in its
    dtype; ``acts[l]`` ``[pos, d_sae]`` the transcoder activations as a sparse (COO, coalesced:
    row-major order) tensor of the active features (None where a layer has no transcoder;
    ``.to_dense()`` for the dense one), ``pre[l]`` their pre-activations at the same entries
    (sparse: only active features are ever targets; a dense pair costs 1 GB at 1,024 tokens on the
    default model), ``errors`` ``[L, pos, d]``, ``logits`` ``[vocab]`` the model's own at the last
    position, what the logit targets read (``pre_logits`` before any soft-capping; every
    position's would be 0.4 GB at 1,024 tokens with a 49k vocabulary)."""

    model: object
    transcoders: dict[int, SAE]
    ids: torch.Tensor  # [1, pos]
    embed: torch.Tensor  # [pos, d]
    patterns: Patterns  # per layer [1, heads, pos, pos], kept packed (patterns.py)
    ln1: list[FrozenNorm | None]
    ln2: list[FrozenNorm | None]
    post_attn: list[FrozenNorm | None]  # sandwich families' post-attention norm
    final_norm: FrozenNorm
    mlp_in: list[torch.Tensor]  # per layer [pos, d]: the clean MLP input
    mlp_out: torch.Tensor  # [L, pos, d]: the true MLP outputs
    acts: list[torch.Tensor | None]
    pre: list[torch.Tensor | None]
    errors: torch.Tensor  # [L, pos, d]
    b_dec: torch.Tensor  # [L, d]: each transcoder's decoder bias (zero where none)
    logits: torch.Tensor  # [vocab]: the last position's
    pre_logits: torch.Tensor  # [vocab]: before soft-capping (= logits without it)

    @property
    def n_layers(self) -> int:
        return len(self.patterns)

    @property
    def n_pos(self) -> int:
        return self.ids.shape[1]

    def decoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """The write of one unit of each feature: ``W_dec[f]`` (divided by its norm for TopK
        transcoders that rescale by it) ``[n, d]``."""
        sae = self.transcoders[layer]
        rows = sae.W_dec[features]
        if sae.architecture == "topk" and sae.rescale_acts_by_decoder_norm:
            rows = rows / rows.norm(dim=-1, keepdim=True)
        return rows

    def activation(self, layer: int, position: int, feature: int) -> torch.Tensor:
        """One feature's activation at one position (a 0-d tensor; zero when it is not active)."""
        acts = self.acts[layer]
        idx = acts.indices()
        hit = ((idx[0] == position) & (idx[1] == feature)).nonzero()
        return acts.values()[hit[0, 0]] if len(hit) else acts.values().new_zeros(())

    def feature_writes(self, layer: int) -> torch.Tensor:
        """Sum of the active features' writes at each position ``[pos, d]`` (zero without a transcoder)."""
        acts = self.acts[layer]
        if acts is None:
            return torch.zeros_like(self.embed)
        sae = self.transcoders[layer]
        W = sae.W_dec
        if sae.architecture == "topk" and sae.rescale_acts_by_decoder_norm:
            W = W / W.norm(dim=-1, keepdim=True)
        return acts.to_dense() @ W

    def clean_sources(self, batch: int = 1) -> Sources:
        """The sources of the clean prompt: token embeddings and the true MLP outputs."""
        return Sources(_rows(self.embed, batch), [_rows(m, batch) for m in self.mlp_out])

    def bias_sources(self, batch: int = 1) -> Sources:
        """Every source zeroed: block 0's input zero, each MLP writes only its ``b_dec``."""
        zero = torch.zeros_like(self.embed)
        return Sources(_rows(zero, batch), [_rows(zero + b, batch) for b in self.b_dec])

    def run(self, sources: Sources, heads: bool = False) -> FrozenOutputs:
        """One forward of the frozen model on ``sources`` (gradients flow when they require grad)."""
        return frozen_forward(self, sources, heads)

    def logits_of(self, final: torch.Tensor) -> torch.Tensor:
        """Logits of frozen final-norm outputs ``[..., d]`` (unembedding, logit scale; before any
        soft-capping, which the logit targets leave out: it is not linear)."""
        un = self.model.unembed
        out = un.linear(final)
        return out * un.logit_scale if un.logit_scale is not None else out


def _rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    return x.unsqueeze(0).expand(batch, *x.shape).contiguous()


def _check_transcoders(model, transcoders: dict[int, SAE]) -> dict[int, SAE]:
    """Transcoders keyed by layer, reading ``l.mlp_in`` and writing ``l.mlp_out`` of that layer,
    with no input normalisation (which would make the pre-activation non-linear)."""
    L, d = model.n_layers, model.d_model
    out = {}
    for layer, sae in dict(transcoders).items():
        if not isinstance(layer, int) or not 0 <= layer < L:
            raise InputError(f"transcoder key {layer!r} is no layer of {model.name} (0..{L - 1})")
        if sae.d_in != d or sae.d_out != d:
            raise InputError(f"the transcoder at layer {layer} maps {sae.d_in} -> {sae.d_out}, the model has d={d}")
        if sae.normalize_activations != "none" or sae.reshape_hook_z:
            raise InputError(
                f"the transcoder at layer {layer} normalises its input ({sae.normalize_activations}): its "
                f"pre-activation is not linear in the stream; fold the normalisation into W_enc first"
            )
        if sae.hook_name is not None:
            want = (Point("mlp_in", layer), Point("mlp_out", layer))
            got = (sae_point(sae, L), sae_point(sae, L, out=True))
            if got != want:
                raise InputError(
                    f"the transcoder at layer {layer} reads {got[0].name} and writes {got[1].name}; "
                    f"attribution needs {want[0].name} -> {want[1].name}"
                )
        out[layer] = sae.to(device=model.device, dtype=model.dtype)
    return out


def _record(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The clean forward: every stream, pattern, MLP input and output, post-attention projection
    output (sandwich families) and the last block's output, one stopped forward."""
    arch, L = model.arch, model.n_layers
    points = [Point("embed", -1)]
    for layer in range(L):
        points += [Point(k, layer) for k in ("pattern", "attn", "mlp_in", "mlp_out", "mlp")]
        points += [Point("proj_out", layer)] if arch.sandwich else []
    mask = torch.ones_like(ids, dtype=torch.bool)
    return cache_points(model, ids, mask, points)


def replacement_model(model, transcoders: dict[int, SAE], prompt) -> ReplacementModel:
    """The replacement model of ``prompt`` (a string, or token ids ``[pos]``): one clean forward
    records the attention patterns, the norms' scales, the MLP inputs and outputs; the
    transcoders' activations and errors follow (see the module doc)."""
    from depthscope.hooks.model_checks import require_decoder

    require_decoder(model, "attribution graphs")
    model.refuse_streamed(
        "attribution graphs", "the backward passes need every block's weights held for the whole graph"
    )
    model.unembed.check()
    arch, L = model.arch, model.n_layers
    if arch.layout not in ("sequential", "parallel"):
        raise UnsupportedArchitecture(f"{model.name}: attribution needs a pre-norm decoder (layout {arch.layout})")
    transcoders = _check_transcoders(model, transcoders)
    ids = _token_ids(model, prompt)
    store = _record(model, ids)
    patterns = Patterns(ids.shape[1], ids.device)
    for layer in range(L):  # packed one at a time: the dense ones are let go as they are read
        patterns.append(store.pop(f"{layer}.pattern"))
    rm = ReplacementModel(
        model=model,
        transcoders=transcoders,
        ids=ids,
        embed=store["embed"][0],
        patterns=patterns,
        **_frozen_norms(arch, store, L),
        mlp_in=[store[f"{layer}.mlp_in"][0] for layer in range(L)],
        mlp_out=torch.stack([store[f"{layer}.mlp_out"][0] for layer in range(L)]),
        acts=[None] * L,
        pre=[None] * L,
        errors=torch.empty(0),
        b_dec=torch.zeros(L, model.d_model, device=ids.device, dtype=model.dtype),
        logits=torch.empty(0),
        pre_logits=torch.empty(0),
    )
    with torch.no_grad():
        un = model.unembed
        last = un.norm(store[f"{L - 1}.mlp"][0, -1])
        rm.pre_logits = rm.logits_of(last)
        rm.logits = un.post(un.linear(last))
    _encode(rm)
    _check_frozen(rm, store[f"{L - 1}.mlp"][0])
    return rm


def _frozen_norms(arch, store: dict, L: int) -> dict:
    """Every norm of the model frozen at its clean input's scale (``ln1``, ``ln2``, Gemma-2's
    ``post_attn``, ``final_norm``), from the recorded residual streams."""
    resid_pre = [store["embed"][0]] + [store[f"{layer}.mlp"][0] for layer in range(L - 1)]
    seq = arch.layout == "sequential"
    return dict(
        ln1=[freeze_norm(arch.ln1[layer], resid_pre[layer], f"block {layer}'s ln1") for layer in range(L)],
        ln2=[
            # a parallel block with one norm (GPT-J) feeds its MLP from ln1
            freeze_norm(
                arch.ln2[layer] if seq or arch.ln2[layer] is not None else arch.ln1[layer],
                store[f"{layer}.attn"][0] if seq else resid_pre[layer],
                f"block {layer}'s ln2",
            )
            for layer in range(L)
        ],
        post_attn=[
            freeze_norm(arch.attn_write[layer], store[f"{layer}.proj_out"][0], f"block {layer}'s post-attention norm")
            if arch.sandwich
            else None
            for layer in range(L)
        ],
        final_norm=freeze_norm(arch.final_norm, store[f"{L - 1}.mlp"][0], "the final norm"),
    )


def _encode(rm: ReplacementModel) -> None:
    """The transcoders' pre-activations and activations on the clean MLP inputs, their decoder
    biases and the error nodes (the MLP output the features and ``b_dec`` leave)."""
    errors = rm.mlp_out.clone()
    with torch.no_grad():
        for layer, sae in rm.transcoders.items():
            pre, acts = sae.pre_activations(rm.mlp_in[layer]), sae.encode(rm.mlp_in[layer])
            rm.acts[layer] = acts.to_sparse().coalesce()
            idx = rm.acts[layer].indices()
            vals = pre[idx[0], idx[1]]
            rm.pre[layer] = torch.sparse_coo_tensor(idx, vals, pre.shape, is_coalesced=True, check_invariants=False)
            rm.b_dec[layer] = sae.b_dec
            errors[layer] -= rm.feature_writes(layer) + sae.b_dec
    rm.errors = errors


def _check_frozen(rm: ReplacementModel, last: torch.Tensor) -> None:
    """The frozen model on the clean sources must give back the clean MLP inputs and final norm
    output: a family whose blocks it reads wrongly is refused here, never a silently wrong graph."""
    tol = max(1e-4, 8 * torch.finfo(rm.embed.dtype).eps)
    with torch.no_grad():
        out = rm.run(rm.clean_sources(1))
        want = [*rm.mlp_in, rm.model.unembed.norm(last)]
        for i, (got, ref) in enumerate(zip([*out.mlp_in, out.final[0]], want)):
            got = got[0] if got.dim() == 3 else got
            err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            if not err <= tol:
                where = f"block {i}'s MLP input" if i < rm.n_layers else "the final norm's output"
                raise UnsupportedArchitecture(
                    f"{rm.model.name} ({rm.model.arch.family}): the frozen replacement model does not reproduce "
                    f"{where} on the prompt (relative error {err:.1e}); depthscope does not know how this "
                    f"family's attention and norms combine"
                )


def _token_ids(model, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        ids, _ = model._prepare(prompt, None)
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(model.device)
    if ids.shape[0] != 1 or ids.shape[1] < 1:
        raise InputError("attribution takes one prompt of at least one token")
    return ids


class _FrozenHooks:
    """The hook functions of one frozen forward and the streams they pass between them."""

    def __init__(self, rm: ReplacementModel, src: Sources):
        self.rm, self.src, self.arch = rm, src, rm.model.arch
        self.seq = self.arch.layout == "sequential"
        self.resid_pre: dict[int, torch.Tensor] = {}
        self.resid_mid: dict[int, torch.Tensor] = {}
        self.proj_out: dict[int, torch.Tensor] = {}
        self.out = FrozenOutputs(mlp_in=[None] * rm.n_layers, final=None)

    def embed(self, t, ctx):
        self.resid_pre[0] = self.src.embed
        return self.src.embed

    def heads_in(self, t, ctx):
        """``l.z``: each head's clean pattern applied to values of ``ln1`` (frozen) of the block's
        input; the model's own attention output is dropped (with its graph)."""
        layer, rm, arch = ctx.layer, self.rm, self.arch
        x = self.resid_pre[layer]
        h = rm.ln1[layer](x) if rm.ln1[layer] is not None else x
        proj = arch.v_proj[layer]
        full = h @ linear_weight(proj).T
        if getattr(proj, "bias", None) is not None:
            full = full + proj.bias
        v = read_qkv(arch, 2, full)  # [B, pos, kv_heads, d_head]
        if v.shape[-2] != arch.n_heads:
            v = v.repeat_interleave(arch.n_heads // v.shape[-2], dim=-2)
        # one [heads, q, k] pattern for the whole batch: never copied per row
        return mix(rm.patterns, layer, v).to(t.dtype)

    def keep_proj(self, t, ctx):
        self.proj_out[ctx.layer] = t

    def post_attn(self, t, ctx):
        return self.rm.post_attn[ctx.layer](self.proj_out.pop(ctx.layer))

    def keep_mid(self, t, ctx):
        self.resid_mid[ctx.layer] = t

    def mlp_in(self, t, ctx):
        layer, rm = ctx.layer, self.rm
        x = self.resid_mid.pop(layer) if self.seq else self.resid_pre[layer]
        m = rm.ln2[layer](x) if rm.ln2[layer] is not None else x
        self.out.mlp_in[layer] = m
        return m.detach()  # the MLP itself is replaced: no graph through it

    def mlp_out(self, t, ctx):
        return self.src.mlp_out[ctx.layer]

    def block_out(self, t, ctx):
        if ctx.layer + 1 < self.rm.n_layers:
            self.resid_pre[ctx.layer + 1] = t
        else:
            self.out.final = self.rm.final_norm(t)

    def keep_heads(self, t, ctx):
        self.out.heads[ctx.layer] = t

    def table(self, heads: bool) -> dict[Point, list]:
        """``{Point: [fn]}`` for the engine, in forward order."""
        hooks = {Point("embed", -1): [self.embed]}
        for layer in range(self.rm.n_layers):
            at = {"z": self.heads_in, "mlp_in": self.mlp_in, "mlp_out": self.mlp_out}
            at |= {"heads": self.keep_heads} if heads else {}
            at |= {"proj_out": self.keep_proj, "attn_out": self.post_attn} if self.arch.sandwich else {}
            at |= {"attn": self.keep_mid} if self.seq else {}
            at["mlp"] = self.block_out
            hooks |= {Point(kind, layer): [fn] for kind, fn in at.items()}
        return hooks


def frozen_forward(rm: ReplacementModel, src: Sources, heads: bool = False) -> FrozenOutputs:
    """The frozen model's forward (see the module doc) on ``src``, through the hook engine,
    stopped after the last block; ``heads=True`` also reads each head's write (``l.heads``)."""
    h = _FrozenHooks(rm, src)
    ids = rm.ids.expand(src.embed.shape[0], -1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with (
        skipped(_thrown_away(rm.model.arch)),
        Engine(rm.model, [Point("mlp", rm.n_layers - 1)], h.table(heads), stop=True),
    ):
        rm.model._forward(ids, mask)
    return h.out


def _thrown_away(arch) -> list[tuple[nn.Module, int | None]]:
    """What the frozen forward computes only to replace: the real MLPs (their write is the
    sources' at ``l.mlp_out``) and the query, key and value projections (``l.z`` is the clean
    pattern times values recomputed from ``ln1`` frozen); they hand on zeros instead
    (:func:`~depthscope.hooks.sublayer_skip.skipped`), so the model's own attention runs on zero
    queries and keys (a uniform pattern, dropped at ``l.z``) and no graph is kept of it."""
    projs = [p for kind in (arch.q_proj, arch.k_proj, arch.v_proj) for p in kind if p is not None]
    return [(m, None) for m in arch.mlp] + [(p, out_width(p)) for p in projs]
