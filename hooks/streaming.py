"""Layer streaming: a model larger than memory, one block's weights resident at a time, exact.

>>> model = load_model("path/to/13b", dtype="bfloat16", stream=True)   # or --stream
>>> model.residual_stream(texts)   # every analysis runs as on a model in memory

=============================  ================================================================
:func:`load_streamed`          a :class:`~depthscope.hooks.model.HookedModel` whose blocks live in
                               the checkpoint's safetensors files: everything outside the blocks
                               (embeddings, final norm, unembedding, buffers) is resident
:class:`BlockStreamer`         reads a block's tensors from the files, puts them into the block
                               for one forward and drops them after; reads (and converts) the
                               next block in a thread while the current one computes
:class:`StreamedBlock`         stands for a block in the model's own block list: its forward has
                               the streamer load the block, runs it, and releases it
:func:`stream_plan`            the sizes that bound a streamed run's memory
:func:`expected_peak`          that bound (or the in-memory model's) in words, for a forward of
                               ``tokens`` tokens: what ``depthscope info`` prints before it runs
=============================  ================================================================

How it stays exact. The model is the transformers model of the checkpoint, built with its
parameters on the ``meta`` device (its buffers real, computed as ``from_pretrained`` computes
them). The resident parameters are read from the files at load time; a block's parameters are
read when the forward reaches it, converted to the model's dtype exactly as ``from_pretrained``
converts them, and placed into the block's own modules. The block then runs its own forward with
its own kernels, so every hook point, every analysis and every number is the same as with the
whole model in memory, bit for bit at the same dtype and device (``tests/test_streaming.py``
checks it on the families). Nothing but the weights' residence changes.

Order and cost. Each forward streams the blocks once, in the order the model runs them (also
under :func:`~depthscope.hooks.block_order.block_order`): one read of the block weights per
forward. The analyses that send a text in batches (lens, activation cache, norms) run their
batches as one layer-major pass (:func:`~depthscope.hooks.stream_pass.layer_major`): every batch
through block ``l`` before any goes through ``l + 1``, so the weights are read once per pass, not
once per batch. Block ``l + 1`` is read and converted in a thread while block ``l`` computes.

Memory. Two blocks are resident (the one computing, and the one read ahead), plus the resident
tensors and the activations: :func:`stream_plan` gives the bound.
Generation and gradients are refused on a streamed model (each step would read every block
again; a backward would need every block's weights held for the whole graph).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from depthscope.common.errors import CheckpointError, InputError
from depthscope.hooks.arch import resolve
from depthscope.hooks.stream_pass import worker


def _weight_index(folder: Path) -> dict[str, Path]:
    """Tensor name in the files -> the safetensors file holding it (``model.safetensors.index.json``
    or every ``*.safetensors`` file's header)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        absent = sorted({v for v in wm.values() if not (folder / v).is_file()})
        if absent:
            raise CheckpointError(f"{index} lists shard file(s) that are not in {folder}: {', '.join(absent[:5])}")
        out = {k: folder / v for k, v in wm.items()}
        _check_index(out, index)
        return out
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    if not out:
        raise CheckpointError(f"{folder}: streaming reads safetensors files, and there are none")
    return out


def _check_index(index: dict[str, Path], source: Path) -> None:
    """Refuse, before a pass starts, an index that names a shard for a tensor whose header lacks it
    (the pass would end in that block): the tensor, the shard named, and the shard holding it if any."""
    heads = {f: _header(f)[1] for f in sorted(set(index.values()))}
    for name, f in index.items():
        if name not in heads[f]:
            holder = next((g.name for g, h in heads.items() if name in h), None)
            where = f"it is in {holder}" if holder else "no shard holds it"
            raise CheckpointError(
                f"{source} names {f.name} for tensor {name!r}, but {f.name}'s header lacks it ({where}); "
                "the index and the shards disagree: fetch the checkpoint again"
            )


#: safetensors dtype names -> torch dtypes (the header's ``dtype`` of each tensor)
_FILE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _aligned(n: int) -> int:
    """``n`` rounded up to 64 bytes: every tensor in a read buffer starts aligned for any dtype."""
    return -(-n // 64) * 64


def _header(path: Path) -> tuple[int, dict]:
    """A safetensors file's data start (8 + header length) and its header (name -> dtype, shape,
    data_offsets relative to the data start)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return 8 + n, head


class BlockStreamer:
    """Reads blocks' parameters from the checkpoint's safetensors files on demand.

    ``names[l]`` lists block ``l``'s parameters as ``(module, attribute, name)``. When the forward
    reaches a block (:meth:`enter`), each of its tensors is read from its file with a plain read (no
    memory map: the process holds only what it reads), converted to ``dtype`` and moved to
    ``device`` one tensor at a time, and assigned to its module for that forward; :meth:`leave`
    replaces them by ``meta`` tensors. The next block is read and converted in a worker thread
    while the current one computes, so :meth:`enter` usually finds it ready: two blocks are
    resident at most."""

    def __init__(self, index: dict[str, tuple[Path, str]], names: list[list[tuple]], dtype: torch.dtype, device):
        self.index, self.names, self.dtype, self.device = index, names, dtype, torch.device(device)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="depthscope-stream")
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.Lock()
        self.headers: dict[Path, tuple[int, dict]] = {}
        self.reads = 0  # blocks put in place so far
        self.reads_by_block = [0] * len(names)  # reads from the files of each block (a test counts them)
        self.bytes_read = 0
        self.free: list[torch.Tensor] = []  # the pool of read buffers (two blocks' worth in a pass)
        self.slots: dict[int, torch.Tensor | None] = {}  # block in place -> the buffer its tensors view
        self.read_s = 0.0  # seconds reading and converting blocks (in the worker thread or not)
        self.wait_s = 0.0  # seconds forwards waited for a block's read (0 when reading keeps ahead)

    def _where(self, name: str) -> tuple[Path, int, int, dict]:
        """(file, absolute byte offset, byte length, header entry) of tensor ``name``."""
        path, key = self.index[name]
        if path not in self.headers:
            self.headers[path] = _header(path)
        start, head = self.headers[path]
        entry = head[key]
        begin, end = entry["data_offsets"]
        return path, start + begin, end - begin, entry

    def _read(self, layer: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Block ``layer``'s tensors read from the files into a buffer of the pool and converted to
        ``dtype`` on ``device``, as ``from_pretrained`` converts them (in the worker thread for the
        block read ahead); and the buffer when the tensors are views of it (the file's dtype on the
        CPU: it goes back to the pool when the block leaves), else None (back already)."""
        self.reads_by_block[layer] += 1
        t0 = time.perf_counter()
        where = [self._where(name) for _, _, name in self.names[layer]]
        slot = self._slot(sum(_aligned(w[2]) for w in where))
        out, start = [], 0
        for (_, _, name), w in zip(self.names[layer], where):
            out.append(self._tensor(name, w, slot[start : start + w[2]]).to(self.dtype).to(self.device))
            start += _aligned(w[2])
        base = slot.data_ptr()
        shared = any(t.device.type == "cpu" and base <= t.data_ptr() < base + max(len(slot), 1) for t in out)
        if not shared:
            self._give_back(slot)
        self.read_s += time.perf_counter() - t0
        return out, slot if shared else None

    def _slot(self, size: int) -> torch.Tensor:
        """A buffer of at least ``size`` bytes from the pool (a new one when none is free). The
        pool reuses the same memory for every block: reading into fresh memory is several times
        slower (the kernel finds and zeroes new pages under the page cache's pressure)."""
        with self.lock:
            for i, s in enumerate(self.free):
                if len(s) >= size:
                    return self.free.pop(i)
        return torch.empty(size, dtype=torch.uint8)

    def _give_back(self, slot: torch.Tensor | None) -> None:
        if slot is not None:
            with self.lock:
                self.free.append(slot)

    def _tensor(self, name: str, where: tuple, into: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` (at ``where``: file, offset, length, header entry) read in the file's
        dtype (its own bytes, exactly) into the bytes ``into``, and viewed there."""
        path, offset, length, entry = where
        dtype = _FILE_DTYPES.get(entry["dtype"])
        if dtype is None:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as h:
                return h.get_tensor(self.index[name][1])
        if not length:
            return torch.empty(entry["shape"], dtype=dtype)
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            view, done = memoryview(into.numpy()), 0
            while done < length:
                got = f.readinto(view[done:])
                if not got:
                    raise CheckpointError(f"{path}: tensor {name} is cut short ({done} of {length} bytes)")
                done += got
        self.bytes_read += length
        return into.view(dtype).reshape(entry["shape"])

    def prefetch(self, layer: int) -> None:
        """Start reading block ``layer`` in the worker thread (no-op when it is already pending)."""
        with self.lock:
            if layer not in self.pending:
                self.pending[layer] = self.pool.submit(self._read, layer)

    def enter(self, layer: int, next_layer: int | None) -> None:
        """Block ``layer``'s parameters in place (the block read ahead, or read now), and
        ``next_layer`` read ahead while it computes; a block read ahead for nothing is dropped."""
        with self.lock:
            fut = self.pending.pop(layer, None)
            stale, self.pending = self.pending, {}
        self._forget(stale.values())
        t0 = time.perf_counter()
        tensors, self.slots[layer] = fut.result() if fut is not None else self._read(layer)
        self.wait_s += time.perf_counter() - t0
        if next_layer is not None:
            self.prefetch(next_layer)
        for (module, attr, _), t in zip(self.names[layer], tensors):
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)
        self.reads += 1

    def leave(self, layer: int) -> None:
        """Block ``layer``'s parameters back to ``meta`` tensors (their memory freed)."""
        for module, attr, _ in self.names[layer]:
            p = module._parameters[attr]
            module._parameters[attr] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        self._give_back(self.slots.pop(layer, None))

    def drain(self) -> None:
        """Forget reads ahead that no forward took (a forward stopped early, or raised): their
        memory is freed once the read running, if any, ends."""
        with self.lock:
            pending, self.pending = self.pending, {}
        self._forget(pending.values())

    def _forget(self, futures) -> None:
        """Reads ahead dropped: cancelled, or (already running) waited for, their buffers back in
        the pool (a read running into a buffer must end before the buffer serves another)."""
        for fut in futures:
            if not fut.cancel():
                self._give_back(fut.result()[1])


class StreamedBlock(nn.Module):
    """Stands for block ``layer`` in the model's block list: loads it, runs it, releases it. Every
    other attribute is the block's (``attention_type``, ``layer_idx``...), so the model's own
    forward loop treats it as the block."""

    def __init__(self, block: nn.Module, layer: int, streamer: BlockStreamer, blocks: nn.ModuleList):
        super().__init__()
        self.block = block
        object.__setattr__(self, "_stream", (layer, streamer, blocks))  # not submodules: no cycle

    def forward(self, *args, **kwargs):
        layer, streamer, blocks = self._stream
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise InputError(
                "gradients through a streamed model are refused: a backward needs every block's weights "
                "held for the whole graph; load the model without stream=True"
            )
        here = worker()
        if here is not None and here[0].streamer is streamer:  # a layer-major pass: its turn, the block in place
            here[0].park(here[1], layer, _next_layer(blocks, self), args[0] if args else kwargs.get("hidden_states"))
            return self.block(*args, **kwargs)
        streamer.enter(layer, _next_layer(blocks, self))
        try:
            return self.block(*args, **kwargs)
        finally:
            streamer.leave(layer)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)


def _next_layer(blocks: nn.ModuleList, me: nn.Module) -> int | None:
    """The block index of the streamed block that runs after ``me`` in the list (None: the last)."""
    seen = False
    for b in blocks:
        inner = b
        while not isinstance(inner, StreamedBlock) and hasattr(inner, "block"):
            inner = inner.block  # block_order's Identity wraps a streamed block
        if seen and isinstance(inner, StreamedBlock):
            return inner._stream[0]
        seen = seen or inner is me
    return None


@dataclass(frozen=True)
class StreamPlan:
    """Bytes of a streamed model: ``block`` (the largest block's weights), ``resident`` (everything
    else), ``activation_per_token`` (the forward's largest per-token tensors: the stream, the MLP's
    hidden layer and one site captured per layer); :meth:`peak` for a forward of ``tokens``."""

    block: int
    resident: int
    activation_per_token: int
    n_blocks: int

    @property
    def held(self) -> int:
        """The weights a streamed run holds: the largest block twice (the one computing and the one
        read ahead) and the resident tensors."""
        return 2 * self.block + self.resident

    def peak(self, tokens: int, slack: int = 2 * 2**30) -> int:
        """The memory bound of a forward of ``tokens`` tokens: :attr:`held`, the activations, and
        ``slack`` for the runtime."""
        return self.held + tokens * self.activation_per_token + slack

    def tokens_within(self, budget: int, slack: int = 2 * 2**30) -> int:
        """The most tokens of one forward whose :meth:`peak` stays within ``budget`` bytes (at least 1)."""
        room = budget - (self.held + slack)
        return max(1, room // max(self.activation_per_token, 1))


def stream_plan(config, dtype: torch.dtype, capture_sites: int = 0) -> StreamPlan:
    """The sizes of a streamed model of transformers ``config`` in ``dtype`` (from the config alone,
    before any weight is read); ``capture_sites``: residual sites kept per token (float32)."""
    d = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    ff = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * d)
    L = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    vocab = int(getattr(config, "vocab_size", 0))
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 1))
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    d_head = int(getattr(config, "head_dim", 0) or d // max(heads, 1))
    size = torch.finfo(dtype).bits // 8
    attn = d * heads * d_head + 2 * d * kv * d_head + heads * d_head * d
    mlp = 3 * d * ff  # gated MLPs; a plain MLP has 2: the bound stays an upper bound
    block = (attn + mlp + 4 * d) * size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    resident = (vocab * d * (1 if tied else 2) + d) * size
    per_token = (4 * d + 2 * ff) * 4 + vocab * 4 + capture_sites * d * 4
    return StreamPlan(block, resident, per_token, L)


def expected_peak(m, tokens: int) -> str:
    """The memory a forward of ``tokens`` tokens is bounded by, before it runs: streamed, the largest
    block, the resident tensors, the activations and 2 GB (:func:`~depthscope.hooks.streaming.stream_plan`);
    in memory, the weights and the activations."""
    plan = stream_plan(m.hf_model.config, m.dtype, capture_sites=m.n_sites)
    gib = 2**30
    if m.streamed:
        return (
            f"streamed: expected peak {plan.peak(tokens) / gib:.2f} GiB for {tokens} tokens (largest block "
            f"{plan.block / gib:.2f} GiB twice: computing and read ahead, resident {plan.resident / gib:.2f} GiB, "
            f"activations "
            f"{tokens * plan.activation_per_token / gib:.2f} GiB, 2 GiB runtime); each forward reads "
            f"{plan.block * plan.n_blocks / gib:.2f} GiB of block weights"
        )
    weights = sum(p.numel() * p.element_size() for p in m.hf_model.parameters())
    acts = tokens * plan.activation_per_token
    peak = (weights + acts) / gib + 0.5
    return f"in memory: expected peak {peak:.2f} GiB for {tokens} tokens (weights {weights / gib:.2f} GiB)"


def load_streamed(folder: Path, hf_cls, config, dtype: torch.dtype, device):
    """``(transformers model, streamer)`` for ``folder``: its parameters outside the blocks
    (the block list :func:`~depthscope.hooks.arch.resolve` finds) and its blocks' vectors (norm gains, biases: a few
    kilobytes a block, and analyses read norm gains between forwards) resident; the blocks' matrices
    streamed from the safetensors files."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        hf = hf_cls.from_config(config, dtype=dtype)
    hf.eval()
    index = _renamed(_weight_index(folder), hf, folder)
    _buffers_like_from_pretrained(hf, dtype)
    blocks = resolve(hf).blocks
    block_path = next(n for n, m in hf.named_modules() if m is blocks)
    tied = _tied_names(hf)
    missing = [n for n, _ in hf.named_parameters(remove_duplicate=False) if n not in index and n not in tied]
    if missing:
        raise CheckpointError(
            f"cannot stream {folder}: {len(missing)} parameters have no tensor of the same name in its "
            f"safetensors files (e.g. {missing[:3]}); load it without --stream"
        )
    prefix = block_path + "."
    names: list[list[tuple]] = [[] for _ in blocks]
    resident, order = [], []
    for full, param in hf.named_parameters():
        if full in tied:  # the input embedding's tensor (named there), as named_parameters lists it in memory
            continue
        module_name, _, attr = full.rpartition(".")
        ref = (hf.get_submodule(module_name), attr, full)
        if full.startswith(prefix) and param.dim() >= 2:
            layer = int(full[len(prefix) :].split(".", 1)[0])
            order.append((full, layer, len(names[layer])))
            names[layer].append(ref)
        else:
            order.append((full, None, ref))
            if full in index:
                resident.append(ref)
    streamer = BlockStreamer(index, names, dtype, device)
    streamer.order = order
    _load_resident(streamer, resident)
    if tied:
        hf.tie_weights()
    _buffers_to(hf, device)
    for i in range(len(blocks)):
        blocks[i] = StreamedBlock(blocks[i], i, streamer, blocks)
    return hf, streamer


def named_weights(streamer: BlockStreamer):
    """Every parameter of the streamed model as ``(name, tensor)`` in the order, names and values
    of the same model in memory (``named_parameters``): resident ones as they are, a block's read
    from the files one tensor at a time (for :func:`~depthscope.common.digest.model_digest`: a
    streamed model's digest is the in-memory model's)."""
    from safetensors import safe_open

    for full, layer, ref in streamer.order:
        if layer is None:
            module, attr, _ = ref
            yield full, module._parameters[attr]
            continue
        path, key = streamer.index[streamer.names[layer][ref][2]]
        with safe_open(str(path), framework="pt") as h:
            yield full, h.get_tensor(key).to(streamer.dtype)


def _renamed(index: dict[str, Path], hf, folder: Path) -> dict:
    """The index keyed by the model's parameter names: the checkpoint's tensor names through the
    renames transformers applies when it loads this model (``conversion_mapping``: e.g. GPT-NeoX's
    ``embed_out`` is ``lm_head``). Values are ``(file, name in the file)``. A checkpoint whose tensors
    transformers converts (splits, fuses, reshapes) is refused: only renamed tensors stream."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # an older transformers: the checkpoint's names are the model's
        return {k: (f, k) for k, f in index.items()}
    transforms = get_model_conversion_mapping(hf)
    out = {}
    for key, f in index.items():
        name = key
        for t in transforms:
            renamed, matched = t.rename_source_key(name)
            if matched is None:
                continue
            if not isinstance(t, WeightRenaming):
                raise CheckpointError(
                    f"cannot stream {folder}: transformers converts its tensor {key!r} when it loads it "
                    f"({type(t).__name__}); load it without --stream"
                )
            name = renamed
        out[name] = (f, key)
    return out


def _buffers_like_from_pretrained(hf: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers in ``dtype``, as ``from_pretrained(dtype=...)`` leaves them (the rotary
    frequencies of a bfloat16 Llama are bfloat16 there)."""
    for module in hf.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)


def _tied_names(hf) -> set[str]:
    """Names of the output-embedding parameters a model ties to its input embedding (not in its files)."""
    if not getattr(hf.config, "tie_word_embeddings", False) or hf.get_output_embeddings() is None:
        return set()
    out = hf.get_output_embeddings()
    name = next(n for n, m in hf.named_modules() if m is out)
    return {f"{name}.{attr}" for attr, p in out.named_parameters(recurse=False)}


def _buffers_to(hf: nn.Module, device) -> None:
    """Every buffer on ``device`` (``module.to`` would also try to move the parameters left on meta)."""
    for module in hf.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != torch.device(device):
                module._buffers[name] = buf.to(device)


def _load_resident(streamer: BlockStreamer, resident: list) -> None:
    """The parameters outside the blocks, and the blocks' vectors, read once (as a block's are)."""
    from safetensors import safe_open

    by_file: dict[Path, list] = {}
    for module, attr, name in resident:
        path, key = streamer.index[name]
        by_file.setdefault(path, []).append((module, attr, key))
    for path, refs in by_file.items():
        with safe_open(str(path), framework="pt") as h:
            for module, attr, key in refs:
                t = h.get_tensor(key).to(streamer.dtype).to(streamer.device)
                module._parameters[attr] = nn.Parameter(t, requires_grad=False)
