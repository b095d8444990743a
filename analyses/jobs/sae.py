"""``depthscope sae train``'s work: activations of one site streamed to a store, a TopK SAE trained
on them, evaluated on the held-out text that follows, saved in SAELens's layout with a metrics table.

=============================  ==============================================================
offers                         what
=============================  ==============================================================
:func:`sae_train_job`          text -> ``OUT/sae/`` (cfg.json + sae_weights.safetensors),
                               ``sae_metrics`` and ``sae_training`` tables, the
                               ``sae_training_curve`` plot
:func:`split_rows`             the text's rows for training and for evaluation, by tokens
:func:`sae_evaluate_job`       a saved SAE (SAELens's layout) on a text -> the ``sae_metrics``
                               table (``depthscope sae evaluate``; :func:`evaluate_sae` in Python)
=============================  ==============================================================

The text is read as every free-text analysis reads it (``SaeTrainConfig.text``, a
:class:`~depthscope.analyses.text_settings.TextWindows`: the BOS token prepended to every
window, documents longer than the window split): the first ``tokens`` tokens train, the next
``eval_tokens`` evaluate, cut inside a document where the count falls (one long document serves
both). Tokens are counted after each window's first position: that position (the BOS, whose
activations are outliers by orders of magnitude) is not trained on and not evaluated. The
evaluation is :func:`~depthscope.analyses.features.evaluate.evaluate_sae` (variance explained,
L0, dead latents, clean / spliced / zero- / mean-ablated loss, SAELens's CE loss score, KL).
The activation store (``OUT/activations``) and the training checkpoint (``OUT/checkpoint.pt``)
make a killed run resume; they are removed at the end unless ``keep_activations``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from depthscope.analyses.features.config import SaeTrainConfig
from depthscope.analyses.features.evaluate import evaluate_sae
from depthscope.analyses.features.plots import plot_sae_training
from depthscope.analyses.features.training import train_topk
from depthscope.analyses.jobs.base import Output
from depthscope.analyses.text import TextRows, text_rows
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.activation_cache import CacheSettings, write_activations
from depthscope.hooks.points import parse_point, tl_name
from depthscope.hooks.sae import SAE, save_sae


@dataclass
class SaeTrainResult:
    sae: SAE
    metrics: pd.DataFrame
    log: pd.DataFrame
    files: list[Path] = field(default_factory=list)


class _Rows:
    """The rows of a store's point, as an ``[n, d]`` array read by row numbers."""

    def __init__(self, acts, point: str):
        self.feats = acts[point]
        self.shape = self.feats.shape

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx):
        return self.feats[idx]


def split_rows(model, texts, cfg: SaeTrainConfig) -> tuple[TextRows, TextRows]:
    """The rows of the first ``cfg.tokens`` tokens of ``texts`` (read under ``cfg.text``, counted
    after each window's first position), then of the next ``cfg.eval_tokens``; an error naming
    what the text holds when it is too short."""
    texts = list(texts)
    train = text_rows(model, texts, replace(cfg.text, max_tokens=cfg.tokens), skip=1, need=False)
    held = text_rows(model, texts, replace(cfg.text, max_tokens=cfg.eval_tokens), skip=1, start=train.end, need=False)
    if train.n_tokens < cfg.tokens or held.n_tokens < cfg.eval_tokens:
        have = train.n_tokens + held.n_tokens
        n_docs = len(texts[: cfg.text.max_docs] if cfg.text.max_docs else texts)
        raise InputError(
            f"the text has {have} tokens to train and evaluate on ({n_docs} document(s), counted after each "
            f"window's first token); --tokens {cfg.tokens} and --eval-tokens {cfg.eval_tokens} need "
            f"{cfg.tokens + cfg.eval_tokens}: give more text or lower them"
        )
    return train, held


def _train(model, rows: TextRows, point, cfg: SaeTrainConfig, out: Path):
    settings = CacheSettings(progress=cfg.progress, overwrite=True, desc=f"activations at {point.name}")
    acts = write_activations(model, rows.rows, [point.name], out / "activations", settings=settings, first=rows.first)
    store = _Rows(acts, point.name)
    total = (len(store) // cfg.batch_size) * cfg.epochs
    with progress_bar(total, desc=f"SAE at {point.name}", unit="step", enabled=cfg.progress) as bar:
        sae, log = train_topk(store, cfg, checkpoint=out / "checkpoint.pt", bar=bar)
    return sae, log, len(store)


def sae_train_job(model, texts, site: str, cfg: SaeTrainConfig, output: Output, *, keep_activations=False):
    """Train a TopK SAE at ``site`` (any ``[batch, pos, d]`` hook point) on ``texts`` and write it
    with its metrics to ``output`` (see the module docstring)."""
    point = parse_point(site, model.n_layers)
    if output.folder is None:
        raise InputError("sae_train_job writes its activation store and SAE: give an output folder")
    out = Path(output.folder)
    train_rows, eval_rows = split_rows(model, texts, cfg)
    sae, log, n_train = _train(model, train_rows, point, cfg, out)
    sae.hook_name = tl_name(point)
    metrics = evaluate_sae(model, sae, eval_rows, point=point.name, progress=cfg.progress)
    table = metrics.copy()
    at = table.columns.get_loc("point") + 1
    for i, (name, value) in enumerate({"latents": cfg.latents, "k": cfg.k, "train_tokens": n_train}.items()):
        table.insert(at + i, name, value)
    files = [save_sae(sae, out / "sae", model_name=model.name, extra_metadata={"depthscope_point": point.name})]
    files += output.table(table, "sae_metrics") + output.table(pd.DataFrame(log), "sae_training")
    files += [p for p in [output.figure(plot_sae_training, pd.DataFrame(log), name="sae_training_curve")] if p]
    if not keep_activations:
        shutil.rmtree(out / "activations", ignore_errors=True)
        (out / "checkpoint.pt").unlink(missing_ok=True)
    return SaeTrainResult(sae=sae, metrics=table, log=pd.DataFrame(log), files=files)


def sae_evaluate_job(model, texts, sae_path, cfg: SaeTrainConfig, output: Output, *, point: str | None = None):
    """Evaluate the SAE saved at ``sae_path`` (a folder in SAELens's layout: ``cfg.json`` and
    ``sae_weights.safetensors``) at ``point`` (None: the hook it records) on the first
    ``cfg.eval_tokens`` tokens of ``texts``, read as ``cfg.text`` says; the metrics of
    :func:`evaluate_sae`, one row, written as ``sae_metrics``. Returns the table."""
    from depthscope.hooks.sae import load_sae  # lazy, as the module's other readers

    sae = load_sae(sae_path, dtype=str(model.dtype).replace("torch.", ""))
    rows = text_rows(model, list(texts), replace(cfg.text, max_tokens=cfg.eval_tokens), skip=1, need=False)
    if rows.n_tokens == 0:
        raise InputError("the text has no tokens to evaluate the SAE on (counted after each window's first token)")
    table = evaluate_sae(model, sae, rows, point=point, batch_size=cfg.batch_size, progress=cfg.progress)
    table.insert(0, "sae", str(sae_path))
    output.table(table, "sae_metrics")
    return table
