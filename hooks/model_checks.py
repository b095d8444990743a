"""A checkpoint's config, tokenizer and weights checked against each other before anything is allocated,
and a loaded model checked against what an analysis needs of it.

==================================  ================================================================
:func:`check_config_dict`           every size field of a raw config (layers, widths, heads,
                                    vocabulary, context; nested configs too) is a whole number in
                                    its range, every norm epsilon finite and positive, read
                                    before transformers builds the config object
:func:`check_config`                the same for a config object (defaults and aliases resolved)
:func:`meta_model`                  the model a config builds, on the meta device (no memory)
:func:`check_weights`               the checkpoint's tensors have the shapes the config builds
:func:`check_names`                 the checkpoint holds every parameter the config builds and no
                                    tensor of a layer it does not build
:func:`check_tokenizer_files`       tokenizer.json / tokenizer_config.json are JSON objects
:func:`check_vocab`                 no token id of the tokenizer reaches past the embedding rows
:func:`embedding_rows`              the rows of a model's input embedding
:func:`gguf_config_sizes`           the size fields of a GGUF's metadata, read from its header
:func:`require_decoder`             refuse an encoder where an analysis compares next-token logits
                                    (patching, edge attribution, interchange interventions)
==================================  ================================================================

Order (``depthscope.hooks.loading``): raw config -> config object -> meta model (parameters
counted and checked against the device's free memory) -> tokenizer against the embedding rows ->
checkpoint shapes against the meta model -> the weights are read. A config asking for 1e9 layers
is refused by the first step: transformers' config classes build lists per layer, and building
layers, even on the meta device, takes about a millisecond each.

Bounds. A size field must be an integer (not a bool or a float) from 1 to its bound in
:data:`SIZE_FIELDS`: the bounds are well above every published model (the largest have under 200
layers, widths under 32k and vocabularies under 300k) and keep a meta build under seconds; the
machine's memory is the tighter bound, checked on the parameter count
(:func:`depthscope.hooks.devices.check_fits`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from depthscope.common.errors import CheckpointError, InputError, ModelSpecError

#: the most layers accepted (five times the deepest published decoders; a meta build of this many takes seconds)
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_WIDTHS = ("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "ffn_dim", "d_ff", "head_dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")
#: size field -> its largest accepted value
SIZE_FIELDS = {
    **dict.fromkeys(_LAYERS, MAX_LAYERS),
    **dict.fromkeys(_WIDTHS, MAX_WIDTH),
    **dict.fromkeys(_HEADS, MAX_HEADS),
    "vocab_size": MAX_VOCAB,
    **dict.fromkeys(_POSITIONS, MAX_POSITIONS),
}
#: canonical names transformers' config objects answer for every family (through attribute_map)
CANONICAL = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: norm epsilons: an infinite one makes every logit equal, a zero or negative one divides by zero or worse
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
#: missing / unexpected tensor names quoted in a refusal
SHOWN = 3


def _bad_size(value, most: int) -> str | None:
    """Why ``value`` is not a size from 1 to ``most`` (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be a whole number from 1 to {most:,}, got {value!r} ({type(value).__name__})"
    if value < 1:
        return f"must be at least 1, got {value}"
    if value > most:
        return f"is {value:,}, past the most depthscope accepts ({most:,})"
    return None


def check_config_dict(raw, where: str, prefix: str = "") -> None:
    """Refuse a raw config (the JSON of ``where``) whose size fields are not integers in range;
    ``null`` is left to the config class's default. Nested configs (``text_config``...) are checked
    too, their fields named with the path (``text_config.num_hidden_layers``)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must hold a JSON object, got {type(raw).__name__}")
    for key, value in raw.items():
        if isinstance(value, dict):
            check_config_dict(value, where, f"{prefix}{key}.")
            continue
        if key in EPS_FIELDS and value is not None:
            _check_eps(value, f"{where}: {prefix}{key}")
        most = SIZE_FIELDS.get(key)
        if most is None or value is None:
            continue
        values = value if isinstance(value, list) and key not in _LAYERS else [value]  # per-layer widths
        if len(values) > MAX_LAYERS:
            raise ModelSpecError(f"{where}: {prefix}{key} lists {len(values):,} values, more than {MAX_LAYERS} layers")
        why = next((w for w in (_bad_size(v, most) for v in values) if w), None)
        if why:
            raise ModelSpecError(f"{where}: {prefix}{key} {why}; the config does not describe a usable model")


def _check_eps(value, what: str) -> None:
    """Refuse a norm epsilon that is not a finite positive number (``what`` names the file and field)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or value <= 0:
        raise ModelSpecError(
            f"{what} must be a finite positive number (e.g. 1e-05), got {value!r}; the config does not describe "
            f"a usable model"
        )


def check_config(config, where: str) -> None:
    """:func:`check_config_dict` on a config object, then its canonical sizes (resolved through the
    class's defaults and aliases, e.g. GPT-2's ``n_layer``) checked the same way."""
    check_config_dict(config.to_dict(), where)
    for key in CANONICAL:
        try:
            value = getattr(config, key)
        except AttributeError:
            continue
        if value is not None:
            why = _bad_size(value, SIZE_FIELDS[key])
            if why:
                raise ModelSpecError(f"{where}: {key} {why}; the config does not describe a usable model")


def meta_model(config, auto_class):
    """The model ``auto_class`` builds from ``config`` on the meta device (shapes, no memory);
    None when the class cannot be built that way (the checks that need it are then skipped)."""
    try:
        with torch.device("meta"):
            return auto_class.from_config(config)
    except Exception:
        return None


def embedding_rows(model) -> int | None:
    """Rows of ``model``'s input embedding (None when it has no ``get_input_embeddings``)."""
    try:
        emb = model.get_input_embeddings()
        return int(emb.weight.shape[0])
    except Exception:
        return None


def _checkpoint_shapes(files) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the headers of safetensors ``files`` (no tensor is read)."""
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    shapes[k] = tuple(h.get_slice(k).get_shape())
        except Exception as e:
            raise CheckpointError(f"cannot load the checkpoint: {f} is not a readable safetensors file ({e})") from e
    return shapes


def check_weights(meta, files, where: str) -> None:
    """Refuse a checkpoint whose tensors are not the ones the config builds: shapes first (e.g. an
    embedding of another vocabulary size; names match exactly or after the model's prefix,
    ``model.``/``transformer.``), then names (:func:`check_names`). Only safetensors headers are read."""
    if meta is None or not files:
        return
    got = _checkpoint_shapes(files)
    prefix = getattr(meta, "base_model_prefix", "") or ""
    bad = []
    for name, t in meta.state_dict().items():
        short = name.removeprefix(prefix + ".") if prefix else name
        shape = got.get(name, got.get(short, got.get(f"{prefix}.{name}")))
        if shape is not None and shape != tuple(t.shape):
            bad.append(f"{name} is {list(shape)}, the config builds {list(t.shape)}")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ModelSpecError(
            f"the weights in {where} do not match its config.json: {'; '.join(bad[:3])}{more}; "
            f"the config and the weights do not belong together"
        )
    check_names(meta, got, where)


def _renamer(meta):
    """Checkpoint name -> the name transformers loads it as (the model's weight renamings, e.g. the
    legacy ``LayerNorm.gamma``, and its base-model prefix added or dropped); None when the model has
    weight converters (several tensors merged into one: names cannot be compared one to one)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(meta)
    except Exception:
        return None
    if any(not isinstance(t, WeightRenaming) for t in transforms):
        return None
    built, prefix = meta.state_dict(), getattr(meta, "base_model_prefix", None) or None
    return lambda k: rename_source_key(k, transforms, [], prefix, built)[0]


def _matcher(patterns):
    """A test for names matching any of transformers' ``_keys_to_ignore_on_load_*`` ``patterns``."""
    rx = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return lambda name: rx is not None and rx.search(name) is not None


def _layerless(name: str) -> str:
    """``name`` with its layer indices generalised (``model.layers.7.mlp`` -> ``model.layers.*.mlp``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _absent(meta, got: set[str]) -> list[str]:
    """The parameters ``meta`` builds that ``got`` lacks, tied copies and ignored names excepted."""
    tied = dict(getattr(meta, "all_tied_weights_keys", None) or {})  # tied copy -> its source
    have = got | {src for dst, src in tied.items() if dst in got}
    ignored = _matcher(getattr(meta, "_keys_to_ignore_on_load_missing", None))
    return [n for n, _ in meta.named_parameters() if n not in have and n not in tied and not ignored(n)]


def check_names(meta, names, where: str) -> None:
    """Refuse a checkpoint (tensor ``names``, from its headers) that lacks a parameter the config
    builds (it would start random) or holds a tensor of a layer the config does not build (it would
    be dropped). Buffers, tied copies and the names transformers ignores are not required."""
    rename = _renamer(meta)
    if meta is None or rename is None:
        return
    try:
        got = {rename(k) for k in names}
    except Exception:
        return
    built = meta.state_dict()
    ignored = _matcher(getattr(meta, "_keys_to_ignore_on_load_unexpected", None))
    kinds = {_layerless(n) for n in built}
    extra = sorted(k for k in got - set(built) if _layerless(k) in kinds and not ignored(k))
    missing = _absent(meta, got)
    if not missing and not extra:
        return
    parts = [
        f"{len(ns)} tensor(s) {what}: {', '.join(ns[:SHOWN])}{', ...' if len(ns) > SHOWN else ''}"
        for ns, what in (
            (missing, "the config builds are not in the checkpoint"),
            (extra, "of layers it does not build"),
        )
        if ns
    ]
    layers = getattr(meta.config, "num_hidden_layers", None)
    raise ModelSpecError(
        f"the weights in {where} do not match its config.json: {'; '.join(parts)}; check num_hidden_layers "
        f"({layers}) and the other size fields of config.json against the weight files"
    )


def check_tokenizer_files(folder: Path) -> None:
    """Refuse a tokenizer.json or tokenizer_config.json in ``folder`` that is not a JSON object
    (the message names the file and, for broken JSON, the line)."""
    for name in TOKENIZER_FILES:
        f = Path(folder) / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{f} is not valid JSON: {str(e)[:200]}; the tokenizer cannot be read") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{f} must hold a JSON object, got {type(data).__name__}")


def check_vocab(tokenizer, rows: int | None, where: str) -> None:
    """Refuse a tokenizer that can produce ids at or past the embedding's ``rows`` (an id there is
    an IndexError in the embedding lookup): the message names the ids and tokens."""
    if tokenizer is None or rows is None:
        return
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return
    past = sorted((i, t) for t, i in vocab.items() if isinstance(i, int) and i >= rows)
    if not past:
        return
    ids = f"id {past[0][0]}" if len(past) == 1 else f"ids {past[0][0]}..{past[-1][0]}"
    examples = ", ".join(repr(t) for _, t in past[:3])
    raise ModelSpecError(
        f"the tokenizer of {where} has {len(past)} token(s) past the embedding's {rows} rows ({ids}: {examples}"
        f"{', ...' if len(past) > 3 else ''}); the tokenizer and the weights do not belong together"
    )


#: GGUF metadata key (after ``{arch}.``) -> the config field it sets
GGUF_SIZES = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_value(f, kind: int, depth: int = 0):
    """One GGUF metadata value read from ``f`` (arrays are skipped over and read as None)."""
    import struct

    if kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[kind]
        data = f.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, data)[0]
    if kind == 8:  # string: u64 length + bytes
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
        return None
    if kind == 9 and depth == 0:  # array: u32 item type, u64 count, items
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALARS and item != 8:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _gguf_value(f, item, depth + 1)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_config_sizes(path: Path) -> dict:
    """The size fields of a GGUF's metadata as config fields (``llama.block_count`` ->
    ``num_hidden_layers``...), read from the header alone (no tensor, no tokenizer array is
    decoded), so :func:`check_config_dict` can refuse a lying GGUF before transformers builds it."""
    import struct

    out = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return {}
            _version, _tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            for _ in range(n_kv):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(min(n, 1 << 16)).decode("utf-8", "replace")
                value = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
                field = GGUF_SIZES.get(key.split(".", 1)[-1])
                if field is not None and value is not None:
                    out[field] = value
    except (struct.error, EOFError, ValueError, OSError):
        pass  # a truncated or odd header: transformers' own reader reports it
    return out


def require_decoder(model, what: str = "patching") -> None:
    """Refuse an encoder (BERT-style, ``model.is_decoder`` False): ``what`` compares the logits a
    prompt gives for its next token at the last position, which an encoder does not predict (a
    masked-LM head predicts each position's own token; a bare encoder has no logits at all)."""
    if not model.is_decoder:
        family = getattr(getattr(model, "arch", None), "family", "encoder")
        raise InputError(
            f"{model.name} is an encoder ({family}): {what} compares next-token logits (target vs foil at the "
            f"last position), which an encoder does not predict; patch a decoder (a causal language model)"
        )
