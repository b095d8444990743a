"""The hooked decoder: the residual stream after every sublayer of a real checkpoint.

>>> from depthscope.hooks import load_model
>>> model = load_model()                         # SmolLM2-135M-Instruct, offline
>>> rs = model.residual_stream(["The capital of France is"])
>>> rs.labels[:3], rs.resid.shape               # (['embed', '0.attn', '0.mlp'], [61, 1, 6, 576])

Sites are captured with PyTorch forward hooks on the unmodified Hugging Face modules, put there by
the hook engine (:mod:`depthscope.hooks.engine`), so the numbers are the model's own; hooks are
removed when a call ends, also on error.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from depthscope.common.errors import ContextLengthError, InputError, NonFiniteActivationError
from depthscope.hooks.arch import ResolvedArch, resolve
from depthscope.hooks.engine import Engine, Hooks, State, normalise_hooks
from depthscope.hooks.generate import Generation
from depthscope.hooks.generate import generate as _generate
from depthscope.hooks.points import Point, parse_point
from depthscope.hooks.run import Run, is_left_padded, position_ids, row_positions
from depthscope.hooks.run import run as _run
from depthscope.hooks.sae_splice import generate_with_saes, run_with_saes
from depthscope.hooks.sites import parse_site, parse_sites, site_frame, site_labels
from depthscope.hooks.unembed import Unembed

Inputs = torch.Tensor | Sequence[str] | str
FINAL = Point("final", -1)  # the final norm's output (ResidualStream.final)


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


@dataclass
class ResidualStream:
    """The stream at a set of sites for one batch.

    ``resid[i]`` is the stream after site ``sites[i]`` (labels in ``labels``), shape
    ``[n_sites, batch, pos, d_model]`` (or ``[n_sites, n, d_model]`` at the flat ``positions``
    asked for). ``mask`` is True at real (non-padding) tokens.
    ``logits`` are the model's own output logits (None when not requested); ``final``
    is the final normed stream (decoders; None otherwise or when not captured).
    """

    sites: list[int]
    labels: list[str]
    resid: torch.Tensor
    input_ids: torch.Tensor
    mask: torch.Tensor
    logits: torch.Tensor | None
    final: torch.Tensor | None
    n_layers: int
    positions: torch.Tensor | None = None  # flat indices kept (resid is then [sites, n, d])

    def __getitem__(self, name) -> torch.Tensor:
        idx = parse_site(name, self.n_layers)
        try:
            return self.resid[self.sites.index(idx)]
        except ValueError:
            raise KeyError(f"site {name!r} was not captured; captured: {self.labels}") from None

    @property
    def depths(self) -> list[float]:
        return site_frame(self.sites, self.n_layers)["depth"].tolist()

    def site_frame(self):
        """The shared tidy columns (site, label, layer, sublayer, depth) of these sites."""
        return site_frame(self.sites, self.n_layers)


class HookedModel:
    """A transformers model with depthscope's residual sites.

    Attributes: ``hf_model`` (the unmodified transformers model), ``tokenizer``,
    ``n_layers``, ``d_model``, ``n_sites`` (2L+1), ``labels``, ``arch`` (where blocks,
    sublayers, norms and the unembedding live), ``unembed`` (the decoding object,
    :class:`~depthscope.hooks.unembed.Unembed`), ``name`` (a readable spec).
    """

    def __init__(self, hf_model: nn.Module, tokenizer=None, name: str | None = None, source: str | None = None):
        self.hf_model = hf_model.eval()
        # an analysis tool: the weights are read, never trained (decode() outside no_grad then
        # builds no graph); call hf_model.requires_grad_(True) to train the model itself
        self.hf_model.requires_grad_(False)
        self.tokenizer = tokenizer
        #: the block streamer of a model loaded with ``stream=True`` (:mod:`depthscope.hooks.streaming`), else None
        self.streamer = None
        self.arch: ResolvedArch = resolve(hf_model)
        self.n_layers = len(self.arch.blocks)
        self.n_sites = 2 * self.n_layers + 1
        self.labels = site_labels(self.n_layers)
        cfg = hf_model.config
        self.d_model = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
        self.name = name or getattr(cfg, "_name_or_path", None) or type(hf_model).__name__
        self.source = source or self.name
        self.is_decoder = self.arch.layout != "post_norm"
        #: final norm + unembedding (+ logit post-processing): see depthscope.hooks.unembed
        self.unembed = Unembed(
            self.arch,
            name=self.name,
            d_model=self.d_model,
            is_decoder=self.is_decoder,
            cls_name=type(hf_model).__name__,
        )
        if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is None:
            # decoders often ship without a pad token; right padding with EOS is harmless
            # because padded positions are masked and come after every real token.
            if getattr(tokenizer, "eos_token", None) is not None:
                tokenizer.pad_token = tokenizer.eos_token

    # ------------------------------------------------------------------ metadata
    @property
    def streamed(self) -> bool:
        """Whether the blocks' weights are streamed from disk (``load_model(..., stream=True)``)."""
        return self.streamer is not None

    def named_weights(self):
        """Every parameter as ``(name, tensor)``, as ``hf_model.named_parameters()`` gives them for the
        model in memory; a streamed model's blocks are read from its files one tensor at a time."""
        if self.streamer is None:
            return self.hf_model.named_parameters()
        from depthscope.hooks.streaming import named_weights

        return named_weights(self.streamer)

    def refuse_streamed(self, what: str, why: str) -> None:
        """A clear error for what a streamed model cannot do."""
        if self.streamer is not None:
            raise InputError(f"{what} is refused on a streamed model ({self.name}): {why}; load it without stream=True")

    def __repr__(self) -> str:
        return (
            f"HookedModel({self.name!r}, family={self.arch.family}, layout={self.arch.layout}, "
            f"n_layers={self.n_layers}, d_model={self.d_model}, n_sites={self.n_sites})"
        )

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype

    @property
    def max_context(self) -> int | None:
        cfg = self.hf_model.config
        for key in ("max_position_embeddings", "n_positions", "n_ctx"):
            v = getattr(cfg, key, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_model.config.vocab_size)

    def sites(self):
        """All sites as a DataFrame with the shared columns."""
        return site_frame(range(self.n_sites), self.n_layers)

    def site_index(self, name) -> int:
        return parse_site(name, self.n_layers)

    def fingerprint(self) -> dict:
        """What identifies this model for caches and sweeps (architecture and tokenizer)."""
        cfg = self.hf_model.config
        tok = self.tokenizer
        return {
            "family": self.arch.family,
            "model_type": getattr(cfg, "model_type", None),
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "vocab_size": self.vocab_size,
            "tokenizer": type(tok).__name__ if tok is not None else None,
            "tokenizer_vocab": len(tok) if tok is not None else None,
        }

    # ------------------------------------------------------------------ inputs
    def tokenize(self, texts: str | Sequence[str], *, add_special_tokens: bool = True, padding_side: str = "right"):
        """Batch ``texts`` padded on ``padding_side`` ("right" or "left"); returns (input_ids, mask)
        with mask True at real tokens. Left-padded batches get correct absolute positions in
        ``run``/``residual_stream``/``generate`` (position ids ``cumsum(mask) - 1``)."""
        if padding_side not in ("right", "left"):
            raise InputError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: pass token ids, or load_model(..., tokenizer=...)")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) and not hasattr(texts, "__iter__"):
            raise InputError(f"inputs must be strings or a LongTensor of token ids, got {type(texts).__name__}")
        texts = list(texts)
        if not texts:
            raise InputError("empty input: no texts given")
        if any(not isinstance(t, str) for t in texts):
            raise InputError("inputs must be strings or a LongTensor of token ids")
        if any(len(t) == 0 for t in texts):
            raise InputError("empty input: a text is the empty string")
        old_side = getattr(self.tokenizer, "padding_side", "right")
        try:
            self.tokenizer.padding_side = padding_side
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
        finally:
            self.tokenizer.padding_side = old_side
        ids, mask = enc["input_ids"], enc["attention_mask"].bool()
        if ids.shape[1] == 0 or not mask.any(dim=1).all():
            raise InputError("empty input: a text tokenizes to no tokens")
        return ids, mask

    def token_id(self, token, what: str = "token") -> int:
        """One token's id: an id (an int or a one-element tensor) checked against the vocabulary, or a
        string the tokenizer encodes as exactly one token (mind the leading space: ``" Paris"``)."""
        if isinstance(token, torch.Tensor) and token.numel() == 1:
            token = int(token)
        if isinstance(token, numbers.Integral) and not isinstance(token, bool):  # numpy integers too
            if not 0 <= int(token) < self.vocab_size:
                raise InputError(f"{what} token id {token} out of range 0..{self.vocab_size - 1}")
            return int(token)
        if not isinstance(token, str) or not token:
            raise InputError(f"the {what} must be a non-empty string or a token id, got {token!r}")
        if self.tokenizer is None:
            raise InputError(f"a string {what} needs a tokenizer; pass a token id")
        ids = self.tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            pieces = [self.tokenizer.decode([i]) for i in ids]
            raise InputError(
                f"{what} {token!r} is {len(ids)} tokens {pieces}, not one; pass a single token "
                f"(mind the leading space, e.g. ' Paris') or a token id"
            )
        return int(ids[0])

    def _prepare(self, inputs: Inputs, mask: torch.Tensor | None, padding_side: str = "right"):
        if isinstance(inputs, torch.Tensor):
            ids = inputs
            if ids.dim() == 1:
                ids = ids[None]
            if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
                raise InputError(f"token ids must be a LongTensor [batch, pos], got {tuple(ids.shape)} {ids.dtype}")
            if ids.numel() == 0:
                raise InputError("empty input: no tokens")
            ids = ids.long()
            if mask is None:
                mask = torch.ones_like(ids, dtype=torch.bool)
            else:
                mask = mask.bool()
                if mask.dim() == 1:
                    mask = mask[None]
                if mask.shape != ids.shape:
                    raise InputError(f"mask shape {tuple(mask.shape)} != ids shape {tuple(ids.shape)}")
            vs = self.vocab_size
            if int(ids.max()) >= vs or int(ids.min()) < 0:
                raise InputError(f"token id out of range 0..{vs - 1}")
        else:
            ids, mask = self.tokenize(inputs, padding_side=padding_side)
        ctx = self.max_context
        if ctx is not None and ids.shape[1] > ctx:
            raise ContextLengthError(
                f"input has {ids.shape[1]} tokens but {self.name} has a context of {ctx}; split it "
                f"into windows (depthscope.analyses.text.windows) or truncate it"
            )
        return ids.to(self.device), mask.to(self.device)

    # ------------------------------------------------------------------ hooks
    def _forward(self, ids, mask):
        kwargs = {}
        if is_left_padded(mask):  # absolute-position models need the real positions
            kwargs["position_ids"] = position_ids(mask)
        return self.hf_model(input_ids=ids, attention_mask=mask.long(), use_cache=False, **kwargs)

    @contextlib.contextmanager
    def hooks(self, hooks: Hooks) -> Iterator[HookedModel]:
        """Context manager: user hook functions at named points for every forward inside it.

        A hook is called as ``fn(tensor, ctx)`` (``ctx`` is the point's label, a ``str``, so
        ``fn(stream, label)`` works), e.g. with the stream at a residual site ``[batch, pos,
        d_model]``; returning a tensor replaces it (for ``l.attn`` of pre-norm models the
        attention write becomes ``new - resid_pre``), returning None only reads. Any hook point of
        :mod:`depthscope.hooks.points` is accepted. Hooks are removed on exit, also when the body
        raises.
        """
        with Engine(self, (), normalise_hooks(hooks, self.n_layers)):
            yield self

    def run_with_hooks(self, inputs: Inputs, hooks, *, mask=None) -> torch.Tensor:
        """Run the model with user hooks at named sites and return its logits."""
        ids, mask = self._prepare(inputs, mask)
        with torch.no_grad(), self.hooks(hooks):
            out = self._forward(ids, mask)
        return _logits_of(out)

    # ------------------------------------------------------------------ research calls
    def run(
        self,
        inputs: Inputs,
        *,
        cache=None,
        hooks=None,
        grad: bool = False,
        padding_side: str = "right",
        mask: torch.Tensor | None = None,
        saes=None,
        keep_error: bool = True,
        **to_disk,
    ) -> Run:
        """One forward that caches and intervenes at any hook point (residual sites, ``l.pattern``,
        ``l.z``, ``l.heads``, ``l.attn_out``, ``l.neurons``, ``l.mlp_out``; TransformerLens
        aliases too). ``cache``: names, ``"all"``, ``"resid"`` or None; ``hooks``: {name: fn(tensor,
        ctx) -> replacement or None}; ``grad=True`` keeps the graph (``run.grad(name)``). See
        :mod:`depthscope.hooks.run`. ``saes``: {point: SAE} spliced in, adding the points
        ``<point>.sae.features``, ``.sae.reconstruction``, ``.sae.error`` (see
        :mod:`depthscope.hooks.sae_splice`; ``keep_error=False`` runs on the reconstruction).
        ``cache_to=DIR`` (the one other keyword): the cached points of every token of the documents
        ``inputs`` are written to disk chunk by chunk and the store is returned
        (:mod:`depthscope.hooks.activation_cache`)."""
        if grad:
            self.refuse_streamed("grad=True", "a backward needs every block's weights held for the whole graph")
        kw = dict(cache=cache, hooks=hooks, grad=grad, padding_side=padding_side, mask=mask)
        if to_disk:
            return _run_to_disk(self, inputs, saes, kw, **to_disk)
        if saes:
            return run_with_saes(_run, self, inputs, saes=saes, keep_error=keep_error, **kw)
        return _run(self, inputs, **kw)

    def generate(
        self,
        prompts,
        *,
        max_new_tokens: int = 20,
        hooks=None,
        cache=None,
        padding_side: str = "left",
        mask: torch.Tensor | None = None,
        saes=None,
        keep_error: bool = True,
        **generation_kwargs,
    ) -> Generation:
        """Greedy (or any transformers ``generate`` setting) continuation of ``prompts`` with
        ``hooks`` at every step (``cache`` keeps points per step); returns the new tokens and text.
        See :mod:`depthscope.hooks.generate`. ``saes`` as in :meth:`run`, at every step."""
        self.refuse_streamed("generation", "each new token would read every block's weights again")
        kw = dict(max_new_tokens=max_new_tokens, padding_side=padding_side, mask=mask, **generation_kwargs)
        if saes:
            return generate_with_saes(
                _generate, self, prompts, saes=saes, keep_error=keep_error, cache=cache, hooks=hooks, **kw
            )
        return _generate(self, prompts, hooks=hooks, cache=cache, **kw)

    # ------------------------------------------------------------------ capture
    def residual_stream(
        self,
        inputs: Inputs,
        *,
        sites=None,
        mask: torch.Tensor | None = None,
        return_logits: bool = True,
        hooks=None,
        check_finite: bool = True,
        positions: torch.Tensor | None = None,
        padding_side: str = "right",
    ) -> ResidualStream:
        """The stream at ``sites`` (default: all 2L+1) for a batch.

        ``inputs`` is a LongTensor ``[batch, pos]`` (with an optional boolean ``mask``) or a
        list of strings (batched with right padding). ``sites`` accepts indices, labels and
        TransformerLens names. With ``return_logits=False`` the forward stops after the last
        requested site, so early sites cost only the blocks before them. ``hooks`` adds user
        hook functions (see :meth:`hooks`) for this call only. NaN or inf in a captured site
        raises :class:`NonFiniteActivationError` unless ``check_finite=False``.

        ``positions`` keeps only some token positions: a boolean ``[batch, pos]`` mask or a
        LongTensor of flat indices ``b * pos + p``. Each site's stream is then gathered inside
        its hook (the full ``[batch, pos, d_model]`` tensor is freed as the forward goes on)
        and ``resid`` is ``[n_sites, n_positions, d_model]``, rows in flat-index order.
        ``padding_side`` pads lists of strings on the right (default) or left.
        """
        ids, mask = self._prepare(inputs, mask, padding_side=padding_side)
        wanted = parse_sites(sites, self.n_layers)
        points = [parse_point(s, self.n_layers) for s in wanted]
        positions = _flat_positions(positions, ids)
        buffer = _SiteBuffer(points, positions)
        cache = list(points)
        if return_logits and self.is_decoder and wanted[-1] == self.n_sites - 1 and self.arch.final_norm is not None:
            cache.append(FINAL)
        user = normalise_hooks(hooks, self.n_layers)
        state = State(mask=mask, positions=row_positions(mask))
        out = None
        eng = Engine(self, cache, user, state=state, sink=buffer, stop=not return_logits)
        eng.check_finite = check_finite  # False: a hook may write NaN on purpose
        with torch.no_grad(), eng:
            out = self._forward(ids, mask)
        missing = [p.name for p in points if p.name not in eng.store]
        if missing:
            raise RuntimeError(f"sites not reached by the forward pass: {missing}")
        labels = [p.name for p in points]
        if check_finite:
            refuse_non_finite(buffer.out, labels)
        return ResidualStream(
            sites=list(wanted),
            labels=labels,
            resid=buffer.out,
            input_ids=ids,
            mask=mask,
            logits=_logits_of(out) if return_logits else None,
            final=eng.store.get(FINAL.name),
            n_layers=self.n_layers,
            positions=positions,
        )

    # ------------------------------------------------------------------ decoding
    @property
    def can_decode(self) -> bool:
        return self.unembed.available

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from any site's stream (the logit lens): ``self.unembed(h)``."""
        return self.unembed(h)

    def norm_reading(self, site: int) -> nn.Module | None:
        """The norm that next reads the stream after ``site`` (ln1/ln2 of a block or the final norm)."""
        s = self.site_index(site)
        arch = self.arch
        if arch.layout == "post_norm":
            return None
        if s == self.n_sites - 1:
            return arch.final_norm
        if s % 2 == 0:  # embed or l.mlp: next block's ln1
            return arch.ln1[s // 2]
        layer = s // 2
        return arch.ln2[layer] if arch.layout == "sequential" else None


def _run_to_disk(model, inputs, saes, kw: dict, cache_to=None, **unknown):
    """``model.run(..., cache_to=DIR)`` (:func:`depthscope.hooks.run.cache_run`); refuses other keywords."""
    if unknown:
        raise TypeError(f"run() got unexpected keyword arguments {sorted(unknown)}")
    if saes:
        raise InputError("cache_to with saes is not supported: cache the SAE's input points, or run without cache_to")
    return _run(model, inputs, cache_to=cache_to, **kw)


def _flat_positions(positions, ids: torch.Tensor) -> torch.Tensor | None:
    """``positions`` of :meth:`HookedModel.residual_stream` (a bool ``[batch, pos]`` mask or flat
    indices ``b * pos + p``) as checked flat indices, or None (keep every position)."""
    if positions is None:
        return None
    positions = torch.as_tensor(positions, device=ids.device)
    if positions.dtype == torch.bool:
        if positions.shape != ids.shape:
            raise InputError(f"positions mask shape {tuple(positions.shape)} != ids shape {tuple(ids.shape)}")
        positions = positions.reshape(-1).nonzero().reshape(-1)
    positions = positions.long().reshape(-1)
    n_flat = ids.numel()
    if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= n_flat):
        raise InputError(f"positions must be flat indices in 0..{n_flat - 1}")
    return positions


class _SiteBuffer:
    """The engine's sink for :meth:`HookedModel.residual_stream`: the one ``[sites, ...]`` result,
    allocated at the first capture and filled while the forward runs. Each site's stream is copied
    (with ``positions``: its rows gathered) straight into its slot, so the model frees the stream as
    usual and nothing is stacked afterwards; other points (``final``) keep their own tensor, of
    those rows only."""

    def __init__(self, points: list[Point], positions: torch.Tensor | None):
        self.slot = {p: i for i, p in enumerate(points)}
        self.positions = positions
        self.out: torch.Tensor | None = None

    def _slot(self, i: int, like: torch.Tensor, rows: tuple) -> torch.Tensor:
        if self.out is None:
            self.out = torch.empty((len(self.slot), *rows, like.shape[-1]), dtype=like.dtype, device=like.device)
        return self.out[i]

    def __call__(self, point: Point, t: torch.Tensor) -> torch.Tensor:
        i = self.slot.get(point)
        if self.positions is None:
            return t if i is None else self._slot(i, t, tuple(t.shape[:-1])).copy_(t)
        flat, idx = t.reshape(-1, t.shape[-1]), self.positions
        if i is None:
            return flat.index_select(0, idx)
        return torch.index_select(flat, 0, idx, out=self._slot(i, flat, (len(idx),)))


def _logits_of(out) -> torch.Tensor:
    if out is None:
        return None
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "last_hidden_state"):
        return None
    return _first_tensor(out)


def refuse_non_finite(resid: torch.Tensor, labels: list[str]) -> None:
    # one reduction, no full-size boolean tensor: NaN/inf propagate into the sum (a finite
    # overflow only sends us to the exact check below, which then finds nothing). The sum runs in
    # the stream's own dtype when it has float32's range (bfloat16 too): on the CPU,
    # sum(dtype=float32) of a bfloat16 tensor first makes a float32 copy of all of it (2x the
    # result); float16 (range 65504) is summed per site in float32, one site's copy at a time.
    if resid.dtype in (torch.float32, torch.float64, torch.bfloat16):
        total = resid.sum()
    else:
        total = torch.stack([r.sum(dtype=torch.float32) for r in resid.flatten(1)]).sum()
    if bool(torch.isfinite(total)):
        return
    bad = (~torch.isfinite(resid)).flatten(2).any(-1)  # [site, batch (or position)]
    for i, lab in enumerate(labels):
        if bool(bad[i].any()):
            n = int((~torch.isfinite(resid[i])).sum())
            raise NonFiniteActivationError(
                f"NaN/inf in the residual stream first at site {lab} ({n} values; rows "
                f"{bad[i].nonzero().flatten().tolist()}): the weights may be corrupt or overflow their dtype"
            )
