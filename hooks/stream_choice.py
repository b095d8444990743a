"""Whether a checkpoint streams: its weights against the memory free, and what is said either way.

=============================  ================================================================
:func:`decide`                 True to stream a model of ``n_params`` parameters: asked to
                               (``stream=True``), or ``stream=None`` and its weights do not fit
                               while the streamed ones (largest block twice + resident tensors) do;
                               otherwise in memory, or a :class:`ModelTooLarge` whose message
                               names ``--stream``, the streamed bound and the remedies this
                               machine offers
:func:`plan_words`             the streamed plan in words: the bound of a forward and the bytes
                               each forward reads (:func:`~depthscope.hooks.streaming.stream_plan`)
:func:`read_rate`              this disk's read rate, measured once per process on a file written
                               and dropped from the page cache (or ``$DEPTHSCOPE_READ_RATE``, GB/s)
:func:`paper_plan`             the plan of a folder holding only a ``config.json`` (no weights): what
                               ``depthscope info --stream`` prints for a model not downloaded
=============================  ================================================================

The comparison is of weights held, on both sides with the same 10% headroom: in memory every
weight, streamed the largest block twice (computing, read ahead) and the resident tensors
(embeddings, final norm, unembedding).
A forward's activations are needed either way; the plan prints them for :data:`PLAN_TOKENS` tokens.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from depthscope.common.errors import InputError
from depthscope.hooks.devices import GiB, ModelTooLarge, remedies, short_of

log = logging.getLogger("depthscope")

#: tokens of the forward whose bound the plan prints
PLAN_TOKENS = 512
#: headroom on the weights held, as :func:`~depthscope.hooks.devices.check_fits` takes it
HEADROOM = 1.1


def decide(n_params: int, config, dtype: torch.dtype, device: torch.device, stream: bool | None) -> bool:
    """True when the model streams: ``stream=True``; or ``stream=None`` and its weights (times
    :data:`HEADROOM`) exceed ``device``'s free memory while the streamed weights fit (the plan is
    logged). A model that fits neither way, or that does not fit with ``stream=False``, is refused
    with the sizes, the streamed bound and the remedies (:class:`ModelTooLarge`)."""
    if stream:
        return True
    if n_params <= 0:
        return False
    need = n_params * torch.empty((), dtype=dtype).element_size()
    free = short_of(need, device, HEADROOM)
    if free is None:
        return False
    plan = _plan(config, dtype)
    held = plan.held if plan is not None else None
    fits_streamed = held is not None and held * HEADROOM <= free
    if stream is None and fits_streamed:
        log.warning(
            "the weights (%.2f GiB in %s) do not fit in %s's %.2f GiB free: streaming them block by block; %s",
            need / GiB,
            _name(dtype),
            device,
            free / GiB,
            plan_words(plan),
        )
        return True
    raise ModelTooLarge(_refusal(n_params, need, dtype, device, free, held, stream, fits_streamed))


def _refusal(n_params, need, dtype, device, free, held, stream, fits_streamed) -> str:
    """The refusal: sizes, then the streamed bound and the ways out that apply here."""
    head = (
        f"the model has {n_params / 1e9:.2f}B parameters: {need / GiB:.2f} GiB in {_name(dtype)}"
        f" (+{HEADROOM - 1:.0%} headroom) but {device} has {free / GiB:.2f} GiB free"
    )
    if held is None:
        streamed = "--stream cannot size this model's blocks"
    elif fits_streamed:  # only --no-stream refused it
        streamed = f"streamed, it would hold {held / GiB:.2f} GiB: leave out --no-stream (stream=False) to stream it"
    else:
        streamed = (
            f"even streamed (--stream) it would hold {held / GiB:.2f} GiB (largest block twice + resident tensors)"
        )
    return f"{head}; {streamed}; use " + ", ".join(remedies(dtype))


def _plan(config, dtype):
    from depthscope.hooks.streaming import stream_plan

    if config is None:
        return None
    plan = stream_plan(config, dtype)
    return plan if plan.n_blocks > 0 and plan.block > 0 else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_words(plan, tokens: int = PLAN_TOKENS, rate: float | None = None) -> str:
    """``plan`` in words: the bound of a forward of ``tokens`` tokens, the bytes of block weights each
    forward reads and, given ``rate`` (bytes per second), how long that read takes."""
    reads = plan.block * plan.n_blocks
    text = (
        f"streamed bound {plan.peak(tokens) / GiB:.2f} GiB for a forward of {tokens} tokens (largest block "
        f"{plan.block / GiB:.2f} GiB twice, resident {plan.resident / GiB:.2f} GiB, activations "
        f"{tokens * plan.activation_per_token / GiB:.2f} GiB, 2 GiB runtime); each forward reads "
        f"{reads / GiB:.1f} GiB of block weights ({plan.n_blocks} blocks)"
    )
    if rate:
        text += f", {reads / rate:.0f} s at this disk's {rate / 1e9:.2f} GB/s"
    return text


@functools.lru_cache(maxsize=1)
def read_rate(nbytes: int = 256 * 2**20) -> float:
    """Bytes per second this machine's disk reads: ``$DEPTHSCOPE_READ_RATE`` (GB/s) when set, else a file of
    ``nbytes`` written to the temporary folder, synced, dropped from the page cache and read once
    (measured once per process)."""
    env = os.environ.get("DEPTHSCOPE_READ_RATE")
    if env:
        try:
            rate = float(env)
        except ValueError:
            rate = 0.0
        if not 0 < rate < float("inf"):
            raise InputError(f"$DEPTHSCOPE_READ_RATE is {env!r}: give the disk's read rate in GB/s, e.g. 0.5")
        return rate * 1e9
    fd, name = tempfile.mkstemp(prefix="depthscope-read-rate-")
    try:
        block = os.urandom(2**20)
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        with open(name, "rb", buffering=0) as f:
            while f.read(2**24):
                pass
        return nbytes / max(time.perf_counter() - start, 1e-6)
    finally:
        os.unlink(name)


def paper_plan(spec, dtype) -> str | None:
    """The streamed plan of the folder ``spec`` when it holds a ``config.json`` and no weights (a model
    sized before it is downloaded), with the read time per forward at :func:`read_rate`; None for
    anything else (a model to load)."""
    if not spec or not isinstance(spec, (str, os.PathLike)):
        return None
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file() or any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        return None
    from transformers import AutoConfig

    from depthscope.hooks.devices import parameter_count, resolve_dtype

    dtype = resolve_dtype(dtype)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    plan = _plan(config, dtype)
    if plan is None:
        return None
    n = parameter_count(config)
    weights = n * torch.empty((), dtype=dtype).element_size()
    rate = read_rate()
    return (
        f"{folder.name} (config only, no weights): {n / 1e9:.2f}B parameters, {weights / GiB:.1f} GiB in "
        f"{_name(dtype)}; {plan_words(plan, rate=rate)}"
    )
