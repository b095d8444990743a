"""Where a model runs and in what precision: device and dtype names checked, sizes checked.

==============================  ===============================================================
:func:`resolve_device`          ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, ``"auto"`` (the
                                first GPU when torch sees one, else the CPU) -> ``torch.device``
:func:`resolve_dtype`           ``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``,
                                ``"float16"``/``"fp16"``/``"half"`` or a ``torch.dtype``
:func:`check_dtype_on`          refuse a dtype the device cannot compute in
:func:`check_fits`              refuse a model whose weights exceed the device's free memory
:func:`remedies`                what would make a model fit on this machine (the refusals' ways out)
:func:`short_of`                the device's free bytes when a placement would not fit (the
                                test behind :func:`check_fits` and the probes' features)
:func:`parameter_count`         parameters of a transformers config, counted on the meta device
:func:`require_accelerate`      ``device_map="auto"`` needs accelerate: the install command
:data:`TOLERANCE`               per-dtype tolerance of a hooked forward vs transformers' own
==============================  ===============================================================

Precision policy. All three dtypes are accepted on the CPU: torch >= 2.2 computes float16 and
bfloat16 matmuls, softmax and norms there (emulated where the CPU lacks the instructions, so
slowly but correctly). On CUDA, bfloat16 needs compute capability >= 8.0 (Ampere); older GPUs
are refused with a suggestion of float16. On Apple MPS bfloat16 needs macOS 14 and is probed.
Reductions over many values (KL, norms, probe features) are taken in float32 by the analyses,
whatever the model's dtype.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from depthscope.common.errors import DepthscopeError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
#: rel. tolerance of a hooked forward's logits vs transformers' forward in the same dtype (the hooks only
#: read the stream, so the two should agree to rounding of one dtype step across a few layers)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
INSTALL_ACCELERATE = "pip install 'accelerate>=0.26'"
GiB = 1024**3


class DeviceError(DepthscopeError, RuntimeError):
    """A device that is absent, a dtype it cannot compute in, or a model that does not fit."""


class ModelTooLarge(DeviceError, MemoryError):
    """The model's weights need more memory than the device has free."""


def resolve_device(device: str | torch.device | None = "cpu") -> torch.device:
    """The ``torch.device`` for a name; a clear error when it is not there."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda, cuda:N, mps or auto") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda or "no CUDA (a CPU build)"
            raise DeviceError(
                f"--device {device}: torch sees no CUDA GPU (torch {torch.__version__} built with {built}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceError(f"--device {device}: only {n} CUDA device(s) are visible (cuda:0..cuda:{n - 1})")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"--device {device}: this torch has no usable Apple MPS backend; use --device cpu")
    elif dev.type != "cpu":
        raise DeviceError(f"unsupported device {device!r}; use cpu, cuda, cuda:N, mps or auto")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None = "float32") -> torch.dtype:
    """The ``torch.dtype`` for a name (float32, bfloat16, float16 and their short names)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in TOLERANCE:
            raise DeviceError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16 (or fp32, bf16, fp16)")
    return DTYPES[key]


def check_dtype_on(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a dtype the device cannot compute in (see the module docstring for the policy)."""
    if dtype != torch.bfloat16:
        return
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        major, minor = torch.cuda.get_device_capability(device)
        raise DeviceError(
            f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no bfloat16; "
            f"bfloat16 needs 8.0 or newer: use --dtype float16 or float32"
        )
    if device.type == "mps":
        try:
            torch.ones(2, dtype=torch.bfloat16, device=device).sum()
        except Exception as e:
            raise DeviceError(f"this MPS device cannot compute in bfloat16 ({e}); use --dtype float16") from e


def parameter_count(config) -> int:
    """Parameters of a transformers model built from ``config``, counted without allocating
    (on the meta device); 0 when the model class cannot be built that way."""
    import transformers  # lazy: the sweep command imports this module for dtypes, without a model

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:
        try:
            with torch.device("meta"):
                model = transformers.AutoModel.from_config(config)
        except Exception:
            return 0
    return sum(p.numel() for p in model.parameters())


def free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes (CUDA: ``mem_get_info``; CPU: available RAM), or None."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            import psutil  # lazy: optional, a missing psutil only skips the check

            return int(psutil.virtual_memory().available)
        except ImportError:  # pragma: no cover - psutil ships with most environments
            return None
    return None


def short_of(nbytes: float, device: torch.device, headroom: float) -> int | None:
    """``device``'s free bytes when ``nbytes`` times ``headroom`` exceed them; None when they fit
    or the free memory is unknown. The test behind every refusal of too large a placement."""
    free = free_bytes(device)
    return free if free is not None and nbytes * headroom > free else None


def check_fits(n_params: int, dtype: torch.dtype, device: torch.device, *, headroom: float = 1.1) -> None:
    """Refuse to load ``n_params`` parameters of ``dtype`` on ``device`` when the weights
    (times ``headroom`` for buffers and the first activations) exceed its free memory."""
    if n_params <= 0:
        return
    need = n_params * torch.empty((), dtype=dtype).element_size()
    free = short_of(need, device, headroom)
    if free is not None:
        name = str(dtype).removeprefix("torch.")
        raise ModelTooLarge(
            f"the model has {n_params / 1e9:.2f}B parameters: {need / GiB:.2f} GiB in {name}"
            f" (+{headroom - 1:.0%} headroom) but {device} has {free / GiB:.2f} GiB free; use "
            + ", ".join(remedies(dtype))
        )


def remedies(dtype: torch.dtype) -> list[str]:
    """What makes a model fit that this machine offers: a 16-bit ``--dtype`` only from float32,
    ``device_map='auto'`` only where torch sees a GPU, and always a machine with more memory."""
    out = ["a smaller --dtype (bfloat16/float16 halve it)"] if dtype == torch.float32 else []
    if torch.cuda.is_available():
        out.append("device_map='auto' to spread it over GPUs")
    return [*out, "or a machine with more memory" if out else "a machine with more memory"]


def require_accelerate() -> None:
    """``device_map`` spreads a model through accelerate; say how to install it when missing."""
    if importlib.util.find_spec("accelerate") is None:
        raise DeviceError(f"device_map='auto' needs accelerate: run `{INSTALL_ACCELERATE}`")
