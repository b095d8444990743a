"""``depthscope transcoders train``: one TopK transcoder per layer (MLP input -> MLP output) on a
text's activations, saved in SAELens's and circuit-tracer's layouts; the options are the fields of
:class:`~depthscope.analyses.features.config.TranscoderTrainConfig`, the work is
:func:`depthscope.analyses.jobs.transcoders.transcoders_train_job`."""

from __future__ import annotations

import typer
from rich.console import Console

from depthscope.analyses.commands.common import begin, load_model
from depthscope.analyses.commands.options import add, options
from depthscope.analyses.commands.sae import EXTRA
from depthscope.analyses.features.config import TranscoderTrainConfig
from depthscope.analyses.jobs import Output

TRAIN = options(
    "text model device dtype out layers latents k tokens eval_tokens epochs batch_size lr dead_tokens seed store_gb "
    "window stride bos max_docs keep_activations per_line threads force",
    TranscoderTrainConfig,
    extra=EXTRA[1:],
)


def train(o) -> None:
    """Train a TopK transcoder per layer (--layers, default all) from l.mlp_in to l.mlp_out on TEXT
    and write OUT/transcoders (layer_<i>/ in SAELens's layout; config.yaml + layer_<i>.safetensors
    in circuit-tracer's; depthscope.hooks.load_transcoder_set reads either), transcoder_metrics
    (one row per layer on the --eval-tokens after the training tokens: L0, variance explained of
    the MLP output, CE loss score against zero ablation, KL, ...) and transcoder_training as
    Parquet and CSV, and the plot transcoder_metrics_by_layer. A killed run resumes, skipping finished layers."""
    from depthscope.analyses.jobs.transcoders import transcoders_train_job  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    docs = read_documents(o.text, per_line=o.per_line)
    cfg = begin(o, TranscoderTrainConfig, "transcoders-train", {"text": str(o.text)}, progress=True)
    res = transcoders_train_job(load_model(o, show=True), docs, cfg, Output(o.out), keep_activations=o.keep_activations)
    t = res.metrics
    Console(stderr=True).print(
        f"{len(t)} layers ({len(res.reused)} reused): variance explained {t.variance_explained.min():.3f}.."
        f"{t.variance_explained.max():.3f}, CE loss score {t.ce_loss_score.min():.3f}..{t.ce_loss_score.max():.3f}, "
        f"L0 {t.l0.mean():.1f}"
    )
    Console().print(f"wrote {o.out / 'transcoders'} and " + ", ".join(p.name for p in res.files[1:]))


def register(app: typer.Typer) -> None:
    tc = typer.Typer(name="transcoders", help="Transcoders per layer: train a set.", no_args_is_help=True)
    add(tc, "train", TRAIN, train)
    app.add_typer(tc, name="transcoders")
