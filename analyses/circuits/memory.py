"""The memory a patching or circuit run needs, estimated before its first forward and checked
against the memory free, so that a pair too long for this machine is refused with the numbers and
the way out, not after minutes at 0 % in an allocator's traceback.

======================  ==========================================================================
offers                  what
======================  ==========================================================================
Sizes                   the dimensions of a model the estimates read (``Sizes.of(model)``)
forward_bytes           one forward's activations: rows x positions through a block, the
                        attention probabilities of one layer (eager attention), the key/value
                        cache the rows hold, and the logits returned
patch_bytes             activation or attribution patching of one pair, by term
eap_bytes               edge attribution (EAP, EAP-IG) of one batch of pairs, by term
evaluate_bytes          circuit evaluation of one batch of pairs, by term
check_room              an estimate against the device's free memory
                        (:func:`~depthscope.hooks.devices.free_bytes`, as the model-loading
                        preflight reads it): :class:`WorkTooLarge` naming the estimate, its
                        largest terms, the memory free and the knobs that help
prefix_weight           what a cached key/value position costs against a computed position
                        (the token budget of patching counts both)
WorkTooLarge            the refusal (a :class:`~depthscope.hooks.devices.DeviceError` and a
                        ``MemoryError``)
======================  ==========================================================================

What the estimates count: the tensors that grow with the tokens of a pair, each at its own
precision (activations in the model's dtype, logits as the model returns them plus the float32
copy the metrics take, gradients and the attribution sums in float32); the live temporaries of a
block as ``4 d_model + 2 d_mlp`` float32 values a token (as
:func:`~depthscope.hooks.streaming.stream_plan` bounds them). They are upper bounds within a
small factor (``tests/test_memory_plan.py`` compares one with a measured peak); the weights are
already in memory when they run (the loading preflight counted them) and the check keeps 10 %
headroom. The logits are often the largest term: ``[rows, positions, vocab]`` in float32 is
197 kB a position on a 49,152-token vocabulary; patching keeps them for the last position only
where the metric reads only that one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthscope.hooks import devices
from depthscope.hooks.devices import DeviceError

__all__ = [
    "Sizes",
    "forward_bytes",
    "patch_bytes",
    "eap_bytes",
    "evaluate_bytes",
    "check_room",
    "prefix_weight",
    "WorkTooLarge",
]

GiB = 1024**3
#: bytes :func:`check_room` adds for what no term counts (the allocator's and the kernels'
#: workspace): SmolLM2-135M patching a 1,000-token pair peaked 0.5 GiB above the terms
RUNTIME = 256 * 2**20
#: bytes of a float32 value: logits as the metrics read them, gradients, attribution sums
F32 = 4
#: hook point kinds holding one d_model vector per head and token (the heads' writes)
_PER_HEAD_WRITE = ("heads",)


class WorkTooLarge(DeviceError, MemoryError):
    """The work asked (a pair's patching, a batch's edge attribution) needs more memory than the
    device has free; the message names the estimate, the memory free and what helps."""


@dataclass(frozen=True)
class Sizes:
    """A model's dimensions: ``d`` (d_model), ``ff`` (MLP width), ``heads``, ``kv`` (key/value
    heads), ``d_head``, ``layers``, ``vocab`` and ``value`` (bytes of one value of its dtype)."""

    d: int
    ff: int
    heads: int
    kv: int
    d_head: int
    layers: int
    vocab: int
    value: int

    @classmethod
    def of(cls, model) -> Sizes:
        """The sizes of a HookedModel, from its transformers config (as
        :func:`~depthscope.hooks.streaming.stream_plan` reads it)."""
        c = model.hf_model.config
        d = int(model.d_model)
        heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0) or 1)
        ff = int(getattr(c, "intermediate_size", 0) or getattr(c, "n_inner", 0) or 4 * d)
        d_head = int(getattr(c, "head_dim", 0) or d // heads)
        kv = int(getattr(c, "num_key_value_heads", 0) or heads)
        value = torch.empty((), dtype=model.dtype).element_size()
        return cls(d, ff, heads, kv, d_head, int(model.n_layers), int(model.vocab_size), value)

    @property
    def kv_token(self) -> int:
        """Bytes of one position's keys and values over every layer."""
        return 2 * self.layers * self.kv * self.d_head * self.value

    @property
    def block_token(self) -> int:
        """Bytes of a block's live temporaries a token (no gradient)."""
        return (4 * self.d + 2 * self.ff) * F32

    @property
    def logit(self) -> int:
        """Bytes of one position's logits as returned and as the metric reads them (float32)."""
        return self.vocab * (self.value + (F32 if self.value != F32 else 0))


def forward_bytes(s: Sizes, rows: int, positions: int, *, keys: int = 0, logits: int | None = None, eager=False):
    """``{term: bytes}`` of one forward of ``rows`` x ``positions`` computed positions: the
    block temporaries, the key/value cache of ``keys`` positions each row holds (a shared prefix
    repeated per row, plus the positions computed), the attention probabilities of one layer when
    ``eager`` (hook points inside the attention), and the logits of ``logits`` positions a row
    (None: every computed one)."""
    held = keys + positions if keys else 0
    return {
        "forward activations": rows * positions * s.block_token,
        "key/value cache": rows * held * s.kv_token,
        "attention probabilities": rows * s.heads * positions * (keys + positions) * F32 * 3 if eager else 0,
        "logits": rows * (positions if logits is None else logits) * s.logit,
    }


def prefix_weight(s: Sizes, last_only: bool = True) -> float:
    """What one cached key/value position of a row costs in memory, in computed positions: its
    keys and values over every layer against a position's block temporaries (and its logits,
    unless only the last position's are returned)."""
    return s.kv_token / (s.block_token + (0 if last_only else s.logit))


def _point_values(s: Sizes, kind: str, positions: int) -> int:
    """Values a token of one cached hook point holds (batch dropped)."""
    if kind in _PER_HEAD_WRITE:
        return s.heads * s.d
    if kind in ("neurons", "mlp_in_neurons"):
        return s.ff
    if kind in ("k", "v", "rot_k"):
        return s.kv * s.d_head
    if kind in ("q", "z", "rot_q"):
        return s.heads * s.d_head
    if kind in ("pattern", "scores"):
        return s.heads * positions
    return s.d


def patch_bytes(model, kinds: list[str], clean: int, corrupted: int, *, method: str, batch_tokens: int, last_only):
    """``{term: bytes}`` of patching one pair of ``clean`` and ``corrupted`` tokens at hook points
    of ``kinds`` (one entry per point): both runs' cached activations and logits, then (exact
    patching) the largest chunk of patched rows the token budget lets through (at least one patch
    and its unpatched row, each holding every position: computed, or cached as keys and values,
    :func:`~depthscope.analyses.circuits.patching.runs.plan`) or (attribution) the corrupted run's
    forward and backward. ``last_only``: the metric reads the last position only (the patched
    forwards return that position's logits only)."""
    s = Sizes.of(model)
    n = max(clean, corrupted)
    cached = sum(_point_values(s, k, n) for k in kinds) * s.value
    terms = {
        "cached activations": (clean + corrupted) * cached,
        "clean and corrupted logits": (clean + corrupted) * s.logit,
    }
    if method == "attribution":
        saved = s.layers * (10 * s.d + 4 * s.ff + 2 * s.kv * s.d_head) * s.value + cached + cached // s.value * F32
        terms["saved activations and gradients"] = corrupted * saved + corrupted * s.logit * 2
        return terms
    per = s.block_token + (0 if last_only else s.logit)  # a computed position; a cached one weighs less
    w = prefix_weight(s, last_only)
    units = max(int(batch_tokens), int(2 * corrupted * max(1.0, w)))
    # the most rows of a chunk: each counts at least one computed position and its prefix
    rows = max(2, int(batch_tokens // min(corrupted, 1 + w * (corrupted - 1))) + 1)
    terms["patched forwards"] = units * per + (rows * s.logit if last_only else 0)
    if last_only:  # a prefix reused: the one-row prefix kept for the next chunk, and its copy
        terms["kept prefix"] = 2 * corrupted * s.kv_token
    if any(k in ("pattern", "scores", "rot_q", "rot_k") for k in kinds):  # eager attention: [rows, heads, q, k]
        terms["attention probabilities"] = units * s.heads * corrupted * F32 * 3
    return terms


def eap_bytes(model, rows: int, positions: int, changed: int, *, method: str) -> dict[str, int]:
    """``{term: bytes}`` of edge attribution on a batch of ``rows`` pairs of ``positions`` tokens
    whose prompts differ from position ``positions - changed`` on: the forward with gradients
    (every block's saved activations, the cached hook points and their gradients, the logits and
    theirs), the senders' writes of both runs and their difference, and every receiver's input
    gradient (EAP-IG keeps a running sum beside them)."""
    s = Sizes.of(model)
    tokens, tail = rows * positions, rows * changed
    senders = 1 + s.layers * (s.heads + 1)
    receivers = s.layers * (3 * s.heads + 1) + 1
    saved = s.layers * ((10 * s.d + 4 * s.ff + 8 * s.d) * s.value + 8 * s.d * F32)
    terms = {
        "forward with gradients": tokens * saved,
        "logits and their gradient": tokens * s.logit * 2,
        "corrupted run's cache and logits": tokens * ((1 + 2 * s.layers) * s.d * s.value + s.logit),
        "senders' writes (both runs, difference)": 3 * tail * senders * s.d * F32,
        "receivers' input gradients": tail * receivers * s.d * F32 * (2 if method == "eap-ig" else 1),
    }
    return terms


def evaluate_bytes(model, rows: int, positions: int) -> dict[str, int]:
    """``{term: bytes}`` of evaluating circuits on a batch of ``rows`` pairs of ``positions``
    tokens: the senders' clean and ablated writes and one forward of every copy the grouped
    key/value heads need (its logits included)."""
    s = Sizes.of(model)
    copies = max(1, s.heads // max(s.kv, 1))
    senders = 1 + s.layers * (s.heads + 1)
    terms = {"senders' writes (clean and ablated)": 2 * rows * positions * senders * s.d * F32}
    terms.update(forward_bytes(s, rows * copies, positions))
    return terms


def _gib(n: float) -> str:
    """Bytes in GiB (MiB below a tenth of a GiB)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def check_room(terms: dict[str, int], device: torch.device, what: str, knobs: list[str], headroom: float = 1.1) -> int:
    """The sum of ``terms`` and :data:`RUNTIME`; :class:`WorkTooLarge` when it (times
    ``headroom``) exceeds the free memory of ``device`` (:func:`~depthscope.hooks.devices.short_of`,
    the model-loading preflight's test): the message names ``what``, the estimate and its three largest terms, the
    memory free and the ``knobs`` that make the work smaller. Unknown free memory passes."""
    terms = {**terms, "runtime workspace": RUNTIME}
    need = int(sum(terms.values()))
    free = devices.short_of(need, device, headroom)
    if free is None:
        return need
    top = sorted(((v, k) for k, v in terms.items() if v > 0), reverse=True)[:3]
    parts = ", ".join(f"{k} {_gib(v)}" for v, k in top)
    raise WorkTooLarge(
        f"{what} needs about {_gib(need)} of memory ({parts}; +{headroom - 1:.0%} headroom) but {device} has "
        f"{_gib(free)} free: nothing was run. To fit, use {'; '.join(knobs)}; or a machine with more memory"
    )
