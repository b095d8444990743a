"""A GGUF converted into a safetensors folder one tensor at a time: never the whole model in memory.

=============================  ================================================================
:func:`convert_in_shards`      write ``config.json``, the tokenizer, ``model-NNNNN.safetensors``
                               shards of at most :data:`SHARD_BYTES` and their
                               ``model.safetensors.index.json`` into a folder, from a GGUF
=============================  ================================================================

The GGUF is memory-mapped (``gguf.GGUFReader``); each tensor is dequantised to float32, renamed
and reshaped by transformers' own tensor processor for the architecture (the steps
``from_pretrained(gguf_file=...)`` takes, ``transformers.modeling_gguf_pytorch_utils``), and held
until its shard is full. The process holds one shard and one tensor; the mapped file's pages are
the page cache's. So a GGUF larger than memory converts, and then streams
(:mod:`depthscope.hooks.streaming`). The tensors are the in-memory conversion's, in float32: a
model served from either conversion is the same model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch

#: bytes of float32 tensors per shard (the most the conversion holds at once, besides one tensor)
SHARD_BYTES = 1 << 30


def convert_in_shards(gguf: Path, out: Path, shard_bytes: int | None = None) -> None:
    """Convert ``gguf`` into the folder ``out`` (config, tokenizer, shards, index); shards of at most
    ``shard_bytes`` (None: :data:`SHARD_BYTES`)."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        parsed = gg.load_gguf_checkpoint(str(gguf), return_tensors=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised: plain safetensors
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    reader = GGUFReader(str(gguf))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")
    processor = gg.TENSOR_PROCESSORS.get(arch, gg.TensorProcessor)(config=parsed.get("config", {}))
    mapping = gg.get_gguf_hf_weights_map(meta, processor)
    writer = _Shards(out, shard_bytes or SHARD_BYTES)
    for tensor in reader.tensors:
        extra = {"tensors": {}, "config": parsed.get("config", {})}  # where MoE processors put split tensors
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=mapping,
            parsed_parameters=extra,
        )
        for name, t in extra["tensors"].items():
            writer.add(name, t)
        if result.name in mapping:
            writer.add(mapping[result.name], torch.from_numpy(np.copy(result.weights)))
    writer.close()
    config.save_pretrained(out)
    tok.save_pretrained(out)


class _Shards:
    """Tensors gathered into shards of at most ``limit`` bytes, each written when full; :meth:`close`
    writes the last one and the index."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = Path(out), limit
        self.held: dict[str, torch.Tensor] = {}
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.held and sum(x.numel() * x.element_size() for x in self.held.values()) + size > self.limit:
            self._flush()
        self.held[name] = t.to(torch.float32).contiguous()
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.held, str(self.out / name), metadata={"format": "pt"})
        self.files.append((name, list(self.held)))
        self.held = {}

    def close(self) -> None:
        if self.held:
            self._flush()
        weight_map = {t: f for f, names in self.files for t in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
