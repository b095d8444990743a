"""``depthscope transcoders train``'s work: one TopK transcoder per layer (``l.mlp_in`` ->
``l.mlp_out``) trained on a text's activations, evaluated on the held-out text that follows, and
saved as a set in SAELens's and circuit-tracer's layouts with a per-layer metrics table.

=================================  ==========================================================
offers                             what
=================================  ==========================================================
:func:`transcoders_train_job`      text -> ``OUT/transcoders/`` (both layouts,
                                   :func:`~depthscope.hooks.transcoder_set.save_transcoder_set`),
                                   the ``transcoder_metrics`` and ``transcoder_training``
                                   tables, the ``transcoder_metrics_by_layer`` plot
=================================  ==========================================================

The text is split as ``sae train`` splits it (:func:`~depthscope.analyses.jobs.sae.split_rows`:
the first ``tokens`` tokens train, the next ``eval_tokens`` evaluate, each window's BOS left
out). Activations are collected for several layers in one pass over the training text (both
points of every layer of a group; a group is as many layers as ``store_gb`` of float32 rows
hold: ``2 x d_model x 4`` bytes per token and layer), then each layer of the group is trained
with :func:`~depthscope.analyses.features.training.train_topk` (inputs ``l.mlp_in``, targets
``l.mlp_out``) and evaluated with :func:`~depthscope.analyses.features.evaluate.evaluate_sae`
(SAEBench's core metrics: L0, variance explained of the MLP output, the CE loss score with the
transcoder spliced in against zero ablation, and the rest of that function's row).

Resumable per layer: each finished layer's SAELens folder (``OUT/transcoders/layer_{i}``) and its
metrics and training log are recorded as a stage (:mod:`depthscope.common.resume`, keyed by the
model's digest, the text's tokens, the settings but ``layers``, and depthscope's code), so a rerun
in the same folder skips the layers whose records hold and trains the rest; inside a layer, the
training checkpoint (``OUT/checkpoint_layer_{i}.pt``) and the activation store
(``OUT/activations``) resume a killed step. Store and checkpoints are removed at the end unless
``keep_activations``. The set written is every layer of the folder trained with these inputs:
the layers asked for and any others an earlier run there finished (so ``--layers 0-14`` then
``--layers 15-29`` build one set); a layer's files left by a run with other inputs are removed.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from depthscope.analyses.features.config import TranscoderTrainConfig, parse_layers
from depthscope.analyses.features.evaluate import evaluate_sae, point_columns
from depthscope.analyses.features.plots import plot_transcoder_metrics
from depthscope.analyses.features.training import train_topk
from depthscope.analyses.jobs.base import Output
from depthscope.analyses.jobs.sae import split_rows
from depthscope.analyses.text import TextRows
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.common.resume import Stages, stage_key
from depthscope.hooks.activation_cache import CacheSettings, write_activations
from depthscope.hooks.points import Point, tl_name
from depthscope.hooks.sae import CFG_FILE, SAE, WEIGHTS_FILE, load_sae, save_sae
from depthscope.hooks.stream_identity import store_digest
from depthscope.hooks.transcoder_set import save_transcoder_set

SET_FOLDER = "transcoders"


@dataclass
class TranscodersResult:
    transcoders: dict[int, SAE]
    metrics: pd.DataFrame
    log: pd.DataFrame
    files: list[Path] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)


def _tokens_digest(*parts: TextRows) -> str:
    """sha256 of the token ids and counted positions of the training and held-out rows."""
    h = hashlib.sha256()
    for rows in parts:
        for r, first in zip(rows.rows, rows.first):
            h.update(np.asarray(r, dtype=np.int64).tobytes() + int(first).to_bytes(8, "little"))
        h.update(b"|")
    return h.hexdigest()


def _layers_in(folder: Path) -> set[int]:
    """The layers with files in the set folder (``layer_{i}/`` or ``layer_{i}.safetensors``)."""
    names = [p.name.removesuffix(".safetensors") for p in folder.glob("layer_*")] if folder.is_dir() else []
    return {int(n[6:]) for n in names if n[6:].isdigit()}


def _groups(layers: list[int], per_layer_bytes: int, store_gb: float) -> list[list[int]]:
    """``layers`` in groups whose activations (``per_layer_bytes`` each) fit in ``store_gb``."""
    size = max(1, int(store_gb * 1e9 // max(per_layer_bytes, 1)))
    return [layers[i : i + size] for i in range(0, len(layers), size)]


def _train_layer(model, acts, layer: int, cfg: TranscoderTrainConfig, out: Path, eval_rows: TextRows):
    """One layer's transcoder trained on the store ``acts``, named for its points, and its metrics row."""
    x, y = acts[f"{layer}.mlp_in"], acts[f"{layer}.mlp_out"]
    total = (len(x) // cfg.batch_size) * cfg.epochs
    checkpoint = out / f"checkpoint_layer_{layer}.pt"
    with progress_bar(total, desc=f"transcoder at layer {layer}", unit="step", enabled=cfg.progress) as bar:
        tc, log = train_topk(x, cfg, targets=y, checkpoint=checkpoint, bar=bar)
    tc.hook_name, tc.hook_name_out = tl_name(Point("mlp_in", layer)), tl_name(Point("mlp_out", layer))
    row = evaluate_sae(model, tc, eval_rows, batch_size=4, progress=cfg.progress)
    row = row.drop(columns=["site", "label", "layer", "sublayer", "depth"])
    row.insert(0, "point_out", f"{layer}.mlp_out")
    for name, value in reversed(point_columns(model, Point("mlp", layer)).items()):
        row.insert(0, name, value)
    at = row.columns.get_loc("point_out") + 1
    for i, (name, value) in enumerate({"latents": cfg.latents, "k": cfg.k, "train_tokens": len(x)}.items()):
        row.insert(at + i, name, value)
    return tc, row, pd.DataFrame(log).assign(layer=layer), checkpoint


def transcoders_train_job(model, texts, cfg: TranscoderTrainConfig, output: Output, *, keep_activations=False):
    """Train a TopK transcoder for each layer of ``cfg.layers`` (None: all) of ``model`` on
    ``texts`` and write the set (those layers and any others the folder holds from the same
    inputs) with its metrics to ``output`` (see the module docstring)."""
    if output.folder is None:
        raise InputError("transcoders_train_job writes its activation store and transcoders: give an output folder")
    if not model.is_decoder:
        raise InputError(f"transcoders are scored by next-token loss: {model.name} is not a decoder LM")
    out, layers = Path(output.folder), parse_layers(cfg.layers, model.n_layers)
    train_rows, eval_rows = split_rows(model, texts, cfg)
    settings = {k: v for k, v in asdict(replace(cfg, layers=None)).items() if k not in ("progress", "store_gb")}
    base = {"model": store_digest(model), "tokens": _tokens_digest(train_rows, eval_rows), "cfg": settings}
    stages, folder = Stages(out), out / SET_FOLDER
    done, rows, logs, reused = {}, {}, {}, []
    for layer in sorted(set(layers) | _layers_in(folder)):
        key = stage_key(**base, layer=layer)
        tables = stages.tables(f"transcoder metrics {layer}", key)
        if tables is not None and stages.files(f"transcoder {layer}", key) is not None:
            done[layer] = load_sae(folder / f"layer_{layer}")
            rows[layer], logs[layer] = tables["metrics"], tables["log"]
            reused.append(layer)
        elif layer not in layers:  # another run's: not part of this set
            shutil.rmtree(folder / f"layer_{layer}", ignore_errors=True)
            (folder / f"layer_{layer}.safetensors").unlink(missing_ok=True)
    todo = [layer for layer in layers if layer not in done]
    per_layer = 2 * model.d_model * 4 * train_rows.n_tokens
    for group in _groups(todo, per_layer, cfg.store_gb):
        points = [f"{layer}.{kind}" for layer in group for kind in ("mlp_in", "mlp_out")]
        desc = f"activations of layers {group[0]}-{group[-1]}" if len(group) > 1 else f"activations of layer {group[0]}"
        store = CacheSettings(progress=cfg.progress, overwrite=True, desc=desc)
        acts = write_activations(
            model, train_rows.rows, points, out / "activations", settings=store, first=train_rows.first
        )
        for layer in group:
            tc, rows[layer], logs[layer], checkpoint = _train_layer(model, acts, layer, cfg, out, eval_rows)
            saved = save_sae(tc, folder / f"layer_{layer}", model_name=model.name)
            key = stage_key(**base, layer=layer)
            stages.record_files(f"transcoder {layer}", key, [saved / CFG_FILE, saved / WEIGHTS_FILE])
            stages.keep_tables(f"transcoder metrics {layer}", key, {"metrics": rows[layer], "log": logs[layer]})
            done[layer] = tc
            if not keep_activations:
                checkpoint.unlink(missing_ok=True)
        if not keep_activations:
            shutil.rmtree(out / "activations", ignore_errors=True)
    transcoders = dict(sorted(done.items()))
    save_transcoder_set(transcoders, folder, model_name=model.name, layout="circuit-tracer")  # SAELens's: above
    table = pd.concat([rows[layer] for layer in transcoders], ignore_index=True)
    log = pd.concat([logs[layer] for layer in transcoders], ignore_index=True)
    files = [folder, *output.table(table, "transcoder_metrics"), *output.table(log, "transcoder_training")]
    files += [p for p in [output.figure(plot_transcoder_metrics, table, name="transcoder_metrics_by_layer")] if p]
    return TranscodersResult(transcoders=transcoders, metrics=table, log=log, files=files, reused=reused)
