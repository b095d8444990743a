"""``depthscope sae train``'s work: activations of one site streamed to a store, a TopK SAE trained
on them, evaluated on held-out documents, saved in SAELens's layout with a metrics table.

=============================  ==============================================================
offers                         what
=============================  ==============================================================
:func:`sae_train_job`          text -> ``OUT/sae/`` (cfg.json + sae_weights.safetensors),
                               ``sae_metrics`` and ``sae_training`` tables, the
                               ``sae_training_curve`` plot
:func:`split_documents`        the documents for training and for evaluation, by token counts
:func:`next_token_losses`      clean, SAE-spliced and mean-ablated next-token loss of a site
=============================  ==============================================================

Position 0 (the first token, a BOS where the tokenizer adds one) is left out everywhere: its
activations are outliers by orders of magnitude in most models, so it is not trained on, not
counted in variance explained, and neither spliced nor ablated in the loss comparison.
``loss_recovered = (L_mean_ablation - L_sae) / (L_mean_ablation - L_clean)``: 1 when splicing
the reconstruction costs nothing, 0 when it is as bad as replacing the site by its mean.
The activation stores (``OUT/activations``, ``OUT/eval_activations``) and the training
checkpoint (``OUT/checkpoint.pt``) make a killed run resume; they are removed at the end
unless ``keep_activations``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from depthscope.analyses.features.config import SaeTrainConfig
from depthscope.analyses.features.plots import plot_sae_training
from depthscope.analyses.features.training import sae_metrics, train_topk
from depthscope.analyses.jobs.base import Output
from depthscope.analyses.next_token import next_token_nll
from depthscope.common.errors import InputError
from depthscope.common.progress import progress_bar
from depthscope.hooks.activation_cache import CacheSettings, write_activations
from depthscope.hooks.points import parse_point, tl_name
from depthscope.hooks.sae import SAE, save_sae
from depthscope.hooks.sites import parse_site, site_from_index

#: documents per forward pass of the loss comparison
LOSS_BATCH = 8


@dataclass
class SaeTrainResult:
    sae: SAE
    metrics: pd.DataFrame
    log: pd.DataFrame
    files: list[Path] = field(default_factory=list)


class _Rows:
    """The rows of a store's point at positions > 0, as an ``[n, d]`` array read by row numbers."""

    def __init__(self, acts, point: str):
        self.feats = acts[point]
        self.keep = np.flatnonzero(acts.index_array()[:, 1] > 0)
        self.shape = (len(self.keep), *self.feats.shape[1:])

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, idx):
        return self.feats[self.keep[idx]]


def split_documents(model, texts, train_tokens: int, eval_tokens: int) -> tuple[list[str], list[str]]:
    """The first documents holding ``train_tokens`` tokens after position 0, then the next ones
    holding ``eval_tokens``; an error naming the counts when the text is too short."""
    texts = list(texts)
    counts = []
    for a in range(0, len(texts), 256):  # batched: one tokenizer call per 256 documents
        counts += (model.tokenize(texts[a : a + 256])[1].sum(1) - 1).clamp(min=0).tolist()
    total = np.cumsum(counts)
    cut = int(np.searchsorted(total, train_tokens)) + 1
    rest = np.cumsum(counts[cut:])
    if cut > len(texts) or not len(rest) or rest[-1] < eval_tokens:
        have = int(total[-1]) if len(total) else 0
        raise InputError(
            f"the text has {have} tokens after each document's first; --tokens {train_tokens} and --eval-tokens "
            f"{eval_tokens} need {train_tokens + eval_tokens}: give more text or lower them"
        )
    end = cut + int(np.searchsorted(rest, eval_tokens)) + 1
    return list(texts[:cut]), list(texts[cut:end])


def _site_columns(model, point) -> dict:
    """The shared site columns for a residual site; for another point its name and layer."""
    if point.kind in ("embed", "attn", "mlp"):
        s = site_from_index(parse_site(point.name, model.n_layers), model.n_layers)
        return {"site": s.index, "label": s.label, "layer": s.layer, "sublayer": s.sublayer, "depth": s.depth}
    else:
        return {"site": None, "label": point.name, "layer": point.layer, "sublayer": point.kind, "depth": None}


@torch.no_grad()
def next_token_losses(model, texts, point: str, sae: SAE, mean: torch.Tensor) -> dict:
    """Token-weighted next-token loss over ``texts`` with the site clean, with ``sae``'s
    reconstruction in place of every position after the first, and with those positions
    replaced by ``mean``."""

    def splice(t, ctx):
        return torch.cat([t[:, :1], sae.reconstruct(t[:, 1:]).to(t.dtype)], 1)

    def ablate(t, ctx):
        return torch.cat([t[:, :1], mean.to(t.dtype).expand_as(t[:, 1:])], 1)

    sums = {"clean": [0.0, 0], "sae": [0.0, 0], "mean_ablation": [0.0, 0]}
    for a in range(0, len(texts), LOSS_BATCH):
        batch = texts[a : a + LOSS_BATCH]
        for name, hooks in (("clean", None), ("sae", {point: splice}), ("mean_ablation", {point: ablate})):
            r = model.run(batch, hooks=hooks)
            nll, scored = next_token_nll(r.logits, r.input_ids, r.mask)
            s, n = float(nll.double().sum()), int(scored.sum())
            sums[name][0] += s
            sums[name][1] += n
    return {f"lm_loss_{k}": s / max(n, 1) for k, (s, n) in sums.items()}


def _train(model, docs, point, cfg: SaeTrainConfig, out: Path):
    settings = CacheSettings(progress=cfg.progress, overwrite=True, desc=f"activations at {point.name}")
    acts = write_activations(model, docs, [point.name], out / "activations", settings=settings)
    rows = _Rows(acts, point.name)
    total = (len(rows) // cfg.batch_size) * cfg.epochs
    with progress_bar(total, desc=f"SAE at {point.name}", unit="step", enabled=cfg.progress) as bar:
        sae, log = train_topk(rows, cfg, checkpoint=out / "checkpoint.pt", bar=bar)
    mean = torch.as_tensor(np.asarray(rows[np.arange(0, len(rows), max(1, len(rows) // 16384))])).float().mean(0)
    return sae, log, mean, len(rows)


def sae_train_job(model, texts, site: str, cfg: SaeTrainConfig, output: Output, *, keep_activations=False):
    """Train a TopK SAE at ``site`` (any ``[batch, pos, d]`` hook point) on ``texts`` and write it
    with its metrics to ``output`` (see the module docstring)."""
    point = parse_point(site, model.n_layers)
    if output.folder is None:
        raise InputError("sae_train_job writes its activation store and SAE: give an output folder")
    out = Path(output.folder)
    train_docs, eval_docs = split_documents(model, texts, cfg.tokens, cfg.eval_tokens)
    sae, log, mean, n_train = _train(model, train_docs, point, cfg, out)
    sae.hook_name = tl_name(point)
    settings = CacheSettings(progress=cfg.progress, overwrite=True, desc="held-out activations")
    held = _Rows(
        write_activations(model, eval_docs, [point.name], out / "eval_activations", settings=settings), point.name
    )
    metrics = {**sae_metrics(sae, held), **next_token_losses(model, eval_docs, point.name, sae, mean)}
    gap = metrics["lm_loss_mean_ablation"] - metrics["lm_loss_clean"]
    metrics["loss_recovered"] = (metrics["lm_loss_mean_ablation"] - metrics["lm_loss_sae"]) / gap if gap else np.nan
    row = {**_site_columns(model, point), "point": point.name, "latents": cfg.latents, "k": cfg.k}
    table = pd.DataFrame([{**row, "train_tokens": n_train, **metrics}])
    files = [save_sae(sae, out / "sae", model_name=model.name, extra_metadata={"depthscope_point": point.name})]
    files += output.table(table, "sae_metrics") + output.table(pd.DataFrame(log), "sae_training")
    files += [p for p in [output.figure(plot_sae_training, pd.DataFrame(log), name="sae_training_curve")] if p]
    if not keep_activations:
        for name in ("activations", "eval_activations"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / "checkpoint.pt").unlink(missing_ok=True)
    return SaeTrainResult(sae=sae, metrics=table, log=pd.DataFrame(log), files=files)
