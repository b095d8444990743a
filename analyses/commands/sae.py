"""``depthscope sae train``: a TopK sparse autoencoder at one hook point, trained on a text's
activations and saved in SAELens's layout; the options are the fields of
:class:`~depthscope.analyses.features.training.SaeTrainConfig`, the work is
:func:`depthscope.analyses.jobs.sae.sae_train_job`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from depthscope.analyses.commands.common import begin, load_model
from depthscope.analyses.commands.options import add, opt, options
from depthscope.analyses.features.config import SaeTrainConfig
from depthscope.analyses.jobs import Output

EXTRA = (
    opt("--site -s", ..., "Hook point to train at: a residual site ('6.mlp', 13) or any point ('6.mlp_out').", str),
    opt("--keep-activations", False, "Keep the activation stores and the checkpoint in OUT after training."),
)
TRAIN = options(
    "site text model device dtype out latents k tokens eval_tokens epochs batch_size lr dead_tokens seed "
    "window stride bos max_docs keep_activations per_line threads force",
    SaeTrainConfig,
    extra=EXTRA,
)


def train(o) -> None:
    """Train a TopK SAE at SITE on the activations of TEXT and write it to OUT/sae (cfg.json +
    sae_weights.safetensors: sae_lens.SAE.load_from_disk and depthscope.hooks.load_sae read it),
    with sae_metrics (on the --eval-tokens after the training tokens: variance explained, L0,
    dead latents, next-token loss clean / with the reconstruction spliced in / zero- and
    mean-ablated, SAELens's CE loss score, KL; each window's first position, the BOS, left out)
    and sae_training (the loss per step) as Parquet and CSV. A killed run resumes."""
    from depthscope.analyses.jobs.sae import sae_train_job  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    console = Console(stderr=True)
    docs = read_documents(o.text, per_line=o.per_line)
    cfg = begin(o, SaeTrainConfig, "sae-train", {"text": str(o.text), "site": o.site}, progress=True)
    m = load_model(o, show=True)
    res = sae_train_job(m, docs, o.site, cfg, Output(o.out), keep_activations=o.keep_activations)
    row = res.metrics.iloc[0]
    console.print(
        f"variance explained {row.variance_explained:.3f}, L0 {row.l0:.1f}, dead {row.dead_fraction:.1%}, "
        f"CE loss score {row.ce_loss_score:.3f} (mean ablation {row.ce_loss_score_mean:.3f}), KL {row.kl:.4f}"
    )
    Console().print(f"wrote {o.out / 'sae'} and " + ", ".join(p.name for p in res.files[1:]))


EVALUATE = options(
    "sae point text model device dtype out eval_tokens batch_size window stride bos max_docs per_line threads force",
    SaeTrainConfig,
    extra=(
        opt("--sae", ..., "Folder of the SAE (SAELens's layout: cfg.json + sae_weights.safetensors).", Path),
        opt("--point", None, "Hook point to splice it at (default: the hook its cfg.json records).", str),
    ),
)


def evaluate(o) -> None:
    """Evaluate a saved SAE on the first --eval-tokens tokens of TEXT (sae train's metrics) into OUT/sae_metrics."""
    from depthscope.analyses.jobs.sae import sae_evaluate_job  # lazy: the job imports torch
    from depthscope.analyses.text import read_documents  # lazy: imports torch

    docs = read_documents(o.text, per_line=o.per_line)
    cfg = begin(o, SaeTrainConfig, "sae-evaluate", {"text": str(o.text), "sae": str(o.sae)}, progress=True)
    table = sae_evaluate_job(load_model(o, show=True), docs, o.sae, cfg, Output(o.out), point=o.point)
    Console().print(table.T.to_string(header=False), f"\nwrote {o.out / 'sae_metrics'} (.parquet, .csv)")


def register(app: typer.Typer) -> None:
    sae = typer.Typer(name="sae", help="Sparse autoencoders: train one, evaluate a saved one.", no_args_is_help=True)
    add(sae, "train", TRAIN, train)
    add(sae, "evaluate", EVALUATE, evaluate)
    app.add_typer(sae, name="sae")
