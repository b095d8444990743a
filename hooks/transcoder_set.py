"""Transcoder sets: one transcoder per layer (MLP input -> MLP output), read and written in
SAELens's layout and in circuit-tracer's transcoder-set layout.

=============================  ==============================================================
offers                         what
=============================  ==============================================================
:func:`load_transcoder_set`    a folder in either layout -> ``{layer: SAE}``
:func:`save_transcoder_set`    ``{layer: SAE}`` -> a folder in one layout or both
``LAYOUTS``                    ``both``, ``saelens``, ``circuit-tracer``
=============================  ==============================================================

A folder written with ``layout="both"`` (the default) holds both, side by side::

    layer_0/cfg.json, layer_0/sae_weights.safetensors    SAELens: one folder per layer
    ...                                                  (depthscope.hooks.load_sae reads each)
    config.yaml                                          circuit-tracer: the set's settings
    layer_0.safetensors, layer_1.safetensors, ...        circuit-tracer: one file per layer

circuit-tracer's layout (``circuit_tracer/transcoder/single_layer_transcoder.py`` and
``circuit_tracer/utils/caching.py``, 2026): ``config.yaml`` holds ``model_kind:
transcoder_set``, ``model_name``, ``feature_input_hook`` and ``feature_output_hook``
(TransformerLens hook names inside a block), ``activation`` (``topk``, ``relu``, ``jumprelu``)
and ``k`` for TopK, and ``scan`` (a name for feature dashboards); each ``layer_{i}.safetensors``
holds ``W_enc [d_sae, d_in]`` (the transpose of SAELens's: circuit-tracer encodes with
``F.linear``), ``W_dec [d_sae, d_out]``, ``b_enc [d_sae]``, ``b_dec [d_out]``,
``activation_function.threshold [d_sae]`` for JumpReLU and ``W_skip [d_out, d_in]`` for skip
transcoders. The file list is left out of ``config.yaml``, as in circuit-tracer's cache and in a
Hugging Face repo it downloads (it lists ``layer_*.safetensors``), so the folder loads there as
it is; a ``transcoders`` list in a config read here (file names, or the older ``{layer,
filepath}`` entries) is honoured, relative paths taken from the folder.

Hook names: depthscope writes ``mlp.hook_in`` (the MLP's input after its norm: depthscope's
``l.mlp_in``, circuit-tracer's ``ReplacementMLP.hook_in``) and ``hook_mlp_out`` (the MLP's write
into the stream: ``l.mlp_out``). Reading, ``mlp.hook_in`` becomes ``blocks.{i}.ln2.hook_normalized``
and ``mlp.hook_out`` ``blocks.{i}.hook_mlp_out``: the same tensor except in families with a norm
after the MLP (Gemma-2/3, OLMo-2), where circuit-tracer's ``mlp.hook_out`` is before that norm and
depthscope's ``l.mlp_out`` after it. Other hook names are kept as ``blocks.{i}.<hook>``.

Differences to know: circuit-tracer's TopK keeps the ``k`` largest pre-activations as they are
(a negative one stays negative), SAELens's and depthscope's ReLU them, so the two agree wherever
the ``k``-th largest pre-activation is positive; circuit-tracer needs layers ``0..n-1`` all
present and one latent width for all of them, which a set of some layers (``--layers``) does not
give it. Settings circuit-tracer cannot express (input normalisation, decoder-norm rescaling) are
an error when writing its layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text, atomic_write
from depthscope.hooks.sae import _DTYPES, CFG_FILE, SAE, _check_shapes, load_sae, save_sae

LAYOUTS = ("both", "saelens", "circuit-tracer")
CONFIG_FILE = "config.yaml"
#: the hook names written to config.yaml (inside a block, TransformerLens names)
INPUT_HOOK, OUTPUT_HOOK = "mlp.hook_in", "hook_mlp_out"
#: circuit-tracer's ReplacementMLP hooks -> the TransformerLens names depthscope parses
_FROM_CT = {"mlp.hook_in": "ln2.hook_normalized", "mlp.hook_out": "hook_mlp_out"}
#: depthscope point kinds / TransformerLens names -> what config.yaml says
_TO_CT = {"mlp_in": INPUT_HOOK, "ln2.hook_normalized": INPUT_HOOK, "mlp_out": OUTPUT_HOOK}
_ACTIVATION = {"topk_transcoder": "topk", "transcoder": "relu", "skip_transcoder": "relu"}
_LAYER_DIR = re.compile(r"^layer_(\d+)$")
_LAYER_FILE = re.compile(r"^layer_(\d+)\.safetensors$")


# --------------------------------------------------------------------------------------- saving


def save_transcoder_set(transcoders: dict[int, SAE], path, *, model_name: str | None = None, layout: str = "both"):
    """Write ``{layer: transcoder}`` to the folder ``path`` in SAELens's layout (``layer_{i}/``),
    circuit-tracer's (``config.yaml`` + ``layer_{i}.safetensors``) or both (the default); every
    file atomically. Returns the folder."""
    if layout not in LAYOUTS:
        raise InputError(f"unknown transcoder-set layout {layout!r}; one of {', '.join(LAYOUTS)}")
    _check_set(transcoders)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if layout in ("both", "circuit-tracer"):
        _check_circuit_tracer(transcoders)
    for layer, tc in sorted(transcoders.items()):
        if layout in ("both", "saelens"):
            save_sae(tc, folder / f"layer_{layer}", model_name=model_name)
        if layout in ("both", "circuit-tracer"):
            state = {"W_enc": tc.W_enc.T, "W_dec": tc.W_dec, "b_enc": tc.b_enc, "b_dec": tc.b_dec}
            state.update({"activation_function.threshold": tc.threshold} if tc.threshold is not None else {})
            state.update({"W_skip": tc.W_skip} if tc.W_skip is not None else {})
            state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
            atomic_write(folder / f"layer_{layer}.safetensors", lambda tmp, s=state: save_file(s, tmp))
    if layout in ("both", "circuit-tracer"):
        atomic_text(folder / CONFIG_FILE, _config_yaml(transcoders, model_name, folder))
    return folder


def _check_set(transcoders) -> None:
    """A non-empty ``{int layer >= 0: transcoder}`` whose input and output widths agree."""
    if not isinstance(transcoders, dict) or not transcoders:
        raise InputError("a transcoder set is a non-empty dict {layer: SAE}")
    for layer, tc in transcoders.items():
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise InputError(f"transcoder-set keys are layer numbers >= 0, got {layer!r}")
        if not isinstance(tc, SAE) or not tc.is_transcoder:
            raise InputError(f"layer {layer}: not a transcoder (an SAE whose architecture is a transcoder's): {tc!r}")
    widths = {(tc.d_in, tc.d_out) for tc in transcoders.values()}
    if len(widths) > 1:
        each = ", ".join(f"layer {i}: {tc.d_in} -> {tc.d_out}" for i, tc in sorted(transcoders.items()))
        raise InputError(f"the transcoders' widths differ ({each}): one set reads and writes one model's widths")


def _check_circuit_tracer(transcoders: dict[int, SAE]) -> None:
    """What circuit-tracer's layout cannot hold: one activation (and k) and one latent width for
    the set, no input normalisation or decoder-norm rescaling."""
    kinds = {(tc.architecture, tc.k) for tc in transcoders.values()}
    if len(kinds) > 1:
        raise InputError(f"circuit-tracer's config.yaml names one activation for the set, got {sorted(kinds, key=str)}")
    if len({tc.d_sae for tc in transcoders.values()}) > 1:
        raise InputError("circuit-tracer's layout needs one latent width (d_sae) for every layer; use layout='saelens'")
    for layer, tc in transcoders.items():
        if tc.normalize_activations != "none" or tc.rescale_acts_by_decoder_norm or tc.reshape_hook_z:
            raise InputError(
                f"layer {layer}: circuit-tracer's layout has no input normalisation or decoder-norm rescaling "
                f"({tc.normalize_activations}, rescale={tc.rescale_acts_by_decoder_norm}); use layout='saelens'"
            )
        if tc.threshold is not None and tc.W_skip is not None:
            raise InputError(f"layer {layer}: a JumpReLU skip transcoder is not written in circuit-tracer's layout")


def _relative(name: str | None, layer: int, default: str) -> str:
    """The hook name inside block ``layer`` that config.yaml records for ``name``."""
    if name is None:
        return default
    m = re.match(r"^(?:blocks\.)?(\d+)\.(.+)$", name)
    if m is None or int(m.group(1)) != layer:
        raise InputError(f"the transcoder of layer {layer} reads or writes {name!r}, which is not in block {layer}")
    return _TO_CT.get(m.group(2), m.group(2))


def _config_yaml(transcoders: dict[int, SAE], model_name: str | None, folder: Path) -> str:
    import yaml  # lazy: only this layout needs it

    hooks_in, hooks_out = set(), set()
    for layer, tc in transcoders.items():
        hooks_in.add(_relative(tc.hook_name, layer, INPUT_HOOK))
        hooks_out.add(_relative(tc.hook_name_out, layer, OUTPUT_HOOK))
    if len(hooks_in) > 1 or len(hooks_out) > 1:
        raise InputError(f"the transcoders read or write different hooks ({sorted(hooks_in)} -> {sorted(hooks_out)})")
    first = next(iter(transcoders.values()))
    config = {
        "model_kind": "transcoder_set",
        "model_name": model_name,
        "feature_input_hook": hooks_in.pop(),
        "feature_output_hook": hooks_out.pop(),
        "activation": _ACTIVATION.get(first.architecture, "jumprelu"),
        "scan": f"{(model_name or 'model').split('/')[-1]}/{folder.resolve().name}",
        "layers": sorted(transcoders),
        "d_transcoder": first.d_sae,
    }
    config.update({"k": first.k} if first.k else {})
    return yaml.safe_dump(config, sort_keys=False)


# -------------------------------------------------------------------------------------- loading


def load_transcoder_set(path, *, dtype=None, device=None, layout: str = "auto") -> dict[int, SAE]:
    """``{layer: SAE}`` from a folder in SAELens's layout (``layer_{i}/cfg.json``) or
    circuit-tracer's (``config.yaml`` + ``layer_{i}.safetensors``); ``layout="auto"`` reads
    SAELens's where both are present (it keeps every setting). ``dtype``: None keeps the stored one."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"no transcoder-set folder at {folder}")
    if layout not in ("auto", "saelens", "circuit-tracer"):
        raise InputError(f"unknown transcoder-set layout {layout!r}; one of auto, saelens, circuit-tracer")
    layer_dirs = {int(m.group(1)): p for p in folder.iterdir() if (m := _LAYER_DIR.match(p.name)) and p.is_dir()}
    has_saelens = any((p / CFG_FILE).is_file() for p in layer_dirs.values())
    has_ct = (folder / CONFIG_FILE).is_file()
    if layout == "saelens" or (layout == "auto" and has_saelens):
        if not layer_dirs:
            raise InputError(f"{folder}: no layer_<i>/ folders (SAELens's layout: layer_<i>/{CFG_FILE})")
        out = {i: load_sae(p, dtype=dtype, device=device) for i, p in sorted(layer_dirs.items())}
    elif layout == "circuit-tracer" or has_ct:
        out = _load_circuit_tracer(folder, _dtype(dtype), device)
    else:
        raise InputError(
            f"{folder} is not a transcoder set: no {CONFIG_FILE} (circuit-tracer's layout) and no "
            f"layer_<i>/{CFG_FILE} (SAELens's layout)"
        )
    _check_set(out)
    return out


def _dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InputError(f"unknown dtype {dtype!r}; one of {list(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def _read_config(folder: Path) -> dict:
    import yaml  # lazy: only this layout needs it

    path = folder / CONFIG_FILE
    if not path.is_file():
        raise InputError(f"{folder}: no {CONFIG_FILE} (circuit-tracer's transcoder-set layout)")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise InputError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: the config is not a mapping")
    kind = config.get("model_kind", "transcoder_set")
    if kind != "transcoder_set":
        raise InputError(f"{path}: model_kind {kind!r} is not supported (only per-layer transcoder_set)")
    missing = [k for k in ("feature_input_hook", "feature_output_hook") if not config.get(k)]
    if missing:
        raise InputError(f"{path}: missing {', '.join(missing)}")
    return config


def _layer_files(folder: Path, config: dict) -> dict[int, Path]:
    """``{layer: file}`` from the config's ``transcoders`` list, else ``layer_{i}.safetensors``."""
    listed = config.get("transcoders")
    if listed is None:
        files = {int(m.group(1)): p for p in folder.iterdir() if (m := _LAYER_FILE.match(p.name))}
        if not files:
            raise InputError(f"{folder}: {CONFIG_FILE} but no layer_<i>.safetensors files")
        want = config.get("layers")
        gone = sorted(set(want) - set(files)) if isinstance(want, list) else []
        if gone:
            raise InputError(f"{folder}: {CONFIG_FILE} lists layers {gone} whose layer_<i>.safetensors is missing")
        return files
    if not isinstance(listed, list) or not listed:
        raise InputError(f"{folder / CONFIG_FILE}: transcoders is not a non-empty list")
    out = {}
    for i, entry in enumerate(listed):
        layer, file = (entry.get("layer"), entry.get("filepath")) if isinstance(entry, dict) else (i, entry)
        if not isinstance(file, str) or not isinstance(layer, int):
            raise InputError(f"{folder / CONFIG_FILE}: transcoder entry {entry!r} names no file and layer")
        if file.startswith("hf://"):
            raise InputError(f"{folder / CONFIG_FILE}: {file} is on the Hugging Face hub; download the set first")
        out[layer] = Path(file) if Path(file).is_absolute() else folder / file
    return out


def _read_layer(file: Path, dtype) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise InputError(f"transcoder file {file} is missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise InputError(f"{file}: not a readable safetensors file ({e})") from None
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state.items()}


def _load_circuit_tracer(folder: Path, dtype, device) -> dict[int, SAE]:
    """The circuit-tracer layout as SAEs in SAELens's conventions (``W_enc`` transposed back)."""
    config = _read_config(folder)
    activation = config.get("activation")
    hook_in = _FROM_CT.get(config["feature_input_hook"], config["feature_input_hook"])
    hook_out = _FROM_CT.get(config["feature_output_hook"], config["feature_output_hook"])
    out = {}
    for layer, file in sorted(_layer_files(folder, config).items()):
        state = _read_layer(file, dtype)
        threshold = state.pop("activation_function.threshold", state.pop("threshold", None))
        k = config.get("k", int(state.pop("k")) if "k" in state else None)
        state.pop("k", None)
        if "W_enc" not in state:
            raise InputError(f"{file}: no W_enc (found {sorted(state)})")
        state["W_enc"] = state["W_enc"].T.contiguous()  # circuit-tracer stores [d_sae, d_in]
        if activation == "topk":
            arch = "topk_transcoder"
            if not isinstance(k, int) or k < 1 or k > state["W_enc"].shape[1]:
                raise InputError(f"{folder / CONFIG_FILE}: activation topk needs k in 1..d_sae, got {k!r}")
        elif threshold is not None and activation in (None, "jumprelu"):
            arch, state["threshold"] = "jumprelu_transcoder", threshold
        elif activation in (None, "relu"):
            arch = "skip_transcoder" if "W_skip" in state else "transcoder"
        else:
            raise InputError(
                f"{folder / CONFIG_FILE}: activation {activation!r} is not supported (topk, relu, jumprelu)"
            )
        if state.get("W_skip") is not None and arch != "skip_transcoder":
            raise InputError(f"{file}: a skip connection with activation {activation!r} is not supported")
        _check_shapes(state, arch, file)
        weights = {n: state.get(n) for n in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")}
        sae = SAE(
            **weights,
            architecture=arch,
            hook_name=f"blocks.{layer}.{hook_in}",
            hook_name_out=f"blocks.{layer}.{hook_out}",
            k=k if arch == "topk_transcoder" else None,
            apply_b_dec_to_input=False,
            cfg={"circuit_tracer": {k_: v for k_, v in config.items() if k_ != "transcoders"}},
            source=str(file),
        )
        out[layer] = sae.to(device=device) if device is not None else sae
    return out
