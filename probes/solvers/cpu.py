"""How probes use this CPU: the opt-in precision rule (decided from CPU flags, never by timing) and threads.

=========================  ====================================================================
``resolve_precision(p)``   ``"float32"`` / ``"bfloat16"`` -> that dtype; ``"auto"`` -> the rule
``compute_dtype()``        ``resolve_precision("auto")``
``precision_rule()``       the dtype the rule gives for this CPU, and why (a sentence)
``step_work(probe, ...)``  the multiply-adds of one minibatch step (what ``threads_for`` reads)
=========================  ====================================================================

Probes store and multiply features in float32 by default (``ProbeConfig.precision``), on every
machine, so the same data give the same numbers whatever the CPU. ``precision="auto"`` opts in
to bfloat16 where it is fast, by this rule:

1. ``DEPTHSCOPE_PROBE_DTYPE`` (``float32`` or ``bfloat16``) when set;
2. else ``bfloat16`` when the CPU multiplies bf16 natively: ``/proc/cpuinfo`` lists
   ``amx_bf16`` or ``avx512_bf16`` AND torch's kernels use AVX512 or AMX
   (``torch.backends.cpu.get_cpu_capability()``): there bf16 products are faster than float32
   at equal probe accuracy (``benchmarks/bench_probes.py`` measures both);
3. else ``float32``: on anything uncertain (no ``/proc/cpuinfo``, other flags, AVX2 only).

``DEPTHSCOPE_CPU_FLAGS`` (flags separated by spaces or commas) and ``DEPTHSCOPE_CPU_CAPABILITY``
(e.g. ``AMX``) stand in for ``/proc/cpuinfo`` and torch's capability, so the rule can be tried as
another CPU would resolve it (``pytest --fake-cpu amx`` sets both for a test run).

The rule reads CPU flags, never a timing, so one machine always resolves ``auto`` the same way,
and the summary records the precision used (``precision``). Only the
feature matrices and their products are bf16; standardisation happens in float32 first and
parameters, optimiser state, logits and losses stay float32.
"""

from __future__ import annotations

import functools
import os

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
ENV = "DEPTHSCOPE_PROBE_DTYPE"


FLAGS_ENV, CAPABILITY_ENV = "DEPTHSCOPE_CPU_FLAGS", "DEPTHSCOPE_CPU_CAPABILITY"


def cpu_flags() -> frozenset:
    """The CPU feature flags: ``DEPTHSCOPE_CPU_FLAGS`` when set, else ``/proc/cpuinfo``'s (empty
    where there is none)."""
    forced = os.environ.get(FLAGS_ENV)
    if forced is not None:
        return frozenset(forced.replace(",", " ").split())
    return _proc_flags()


@functools.cache
def _proc_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def torch_capability() -> str:
    """torch's CPU capability (``AVX2``, ``AVX512``, ``AMX``...; ``DEPTHSCOPE_CPU_CAPABILITY`` when set)."""
    forced = os.environ.get(CAPABILITY_ENV, "").strip()
    if forced:
        return forced
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch, or no CPU backend info: uncertain
        return "unknown"


def precision_rule(flags=None, capability=None) -> tuple:
    """``(dtype, reason)`` of rules 2-3 for the given (default: this machine's) flags and
    torch CPU capability."""
    flags = cpu_flags() if flags is None else frozenset(flags)
    capability = torch_capability() if capability is None else capability
    has = [f for f in BF16_FLAGS if f in flags]
    wide = capability.upper().startswith(("AVX512", "AMX"))
    if has and wide:
        return torch.bfloat16, f"CPU flags {', '.join(has)} and torch capability {capability}"
    return torch.float32, f"no native bf16 (flags: {', '.join(has) or 'none'}; torch capability {capability})"


def resolve_precision(precision: str = "auto") -> torch.dtype:
    """The dtype the feature products compute in, for ``ProbeConfig.precision`` (see the
    module docstring for the ``auto`` rule)."""
    if precision in ("float32", "bfloat16"):
        return getattr(torch, precision)
    if precision != "auto":
        raise ValueError(f"precision must be auto, float32 or bfloat16, got {precision!r}")
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        if env not in ("float32", "bfloat16"):
            raise ValueError(f"{ENV} must be float32 or bfloat16, got {env!r}")
        return getattr(torch, env)
    return precision_rule()[0]


def compute_dtype() -> torch.dtype:
    """``resolve_precision("auto")``: the environment variable, else the CPU-flag rule."""
    return resolve_precision("auto")


def step_work(probe, feats, batch_size: int) -> float:
    """Multiply-adds of one step of ``probe`` (a BatchedProbe) on a minibatch of ``feats``."""
    width = probe.G * (probe.C if probe.kind == "linear" else probe.hidden)
    return float(probe.U) * min(batch_size, len(feats)) * feats.n_spans * feats.d * max(width, 1)
