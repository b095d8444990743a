"""``depthscope lens`` (logit lens / tuned lens over a text file: tables and plots) and
``depthscope lens-train`` (train a tuned lens on a text file): thin wrappers of
:mod:`depthscope.analyses.jobs.lens`."""

from __future__ import annotations

from pathlib import Path

import typer

from depthscope.analyses.commands.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    ModelOpt,
    OutOpt,
    TextOpt,
    ThreadsOpt,
    positive,
    prepare_out,
    set_threads,
)
from depthscope.analyses.jobs.lens import MAX_TOP_K, LensConfig, LensTrainConfig
from depthscope.analyses.tuned_lens_config import TunedLensTraining

_L, _T, _TT = LensConfig(), LensTrainConfig(), TunedLensTraining()


def _sites(spec: str | None):
    if spec is None or not spec.strip():
        return None
    return [s.strip() for s in spec.split(",") if s.strip()]


def _print_sites(by_site) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("lens", "site", "depth", "KL(final‖lens)", "CE", "entropy", "top-1 agree", title="per-site means")
    for row in by_site.itertuples():
        n = len(by_site[by_site["lens"] == row.lens])
        step = max(1, n // 8)
        if row.site % step == 0 or row.site == by_site["site"].max():
            table.add_row(
                row.lens,
                row.label,
                f"{row.depth:g}",
                f"{row.kl_to_final:.3f}",
                f"{row.cross_entropy:.3f}",
                f"{row.entropy:.3f}",
                f"{row.top1_agreement:.3f}",
            )
    Console().print(table)


def lens(
    text: Path = TextOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    prompt: str = typer.Option(
        _L.prompt,
        "--prompt",
        "-p",
        help="Prompt for the per-token heatmap and rank trajectories.",
    ),
    out: Path = OutOpt,
    per_line: bool = typer.Option(
        True,
        "--per-line/--whole-file",
        help="One document per non-blank line (default), or the whole file as one document.",
    ),
    max_tokens: int | None = typer.Option(
        _L.max_tokens,
        "--max-tokens",
        min=1,
        help="Stop after this many token positions of the text.",
    ),
    batch_size: int = typer.Option(_L.batch_size, "--batch-size", min=1, help="Windows per forward pass."),
    window: int | None = typer.Option(
        _L.window,
        "--window",
        min=2,
        help="Tokens per window (default min(context, 512)); longer documents are split.",
    ),
    tuned: Path | None = typer.Option(
        _L.tuned,
        "--tuned",
        help="A tuned lens folder (from lens-train) to compare with the plain logit lens.",
    ),
    sites: str | None = typer.Option(
        None,
        "--sites",
        help="Comma-separated sites (e.g. 'embed,10.attn,29.mlp'); default all.",
    ),
    first_position: bool = typer.Option(
        _L.first_position,
        "--first-position/--skip-first-position",
        help="Include position 0 of every window (default) or skip it (attention sink).",
    ),
    top_k: int = typer.Option(
        _L.top_k,
        "--top-k",
        min=1,
        max=MAX_TOP_K,
        help=f"Top tokens per position and site in the token table (at most {MAX_TOP_K} and the vocabulary).",
    ),
    threads: int | None = ThreadsOpt,
    force: bool = ForceOpt,
):
    """Logit lens at every sublayer over TEXT: per-site table (KL to the final distribution,
    cross-entropy, entropy, top-1 agreement/accuracy, next-token rank), the prompt's per-token
    table, and plots (metrics vs depth, top-1 heatmap, rank trajectories), written to OUT."""
    from rich.console import Console

    from depthscope.analyses.commands.common import load
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.lens import lens_job
    from depthscope.analyses.text import read_documents

    set_threads(threads)
    console = Console(stderr=True)
    docs = read_documents(text, per_line=per_line)
    cfg = LensConfig(
        prompt=prompt,
        sites=_sites(sites),
        batch_size=batch_size,
        window=window,
        max_tokens=max_tokens,
        first_position=first_position,
        top_k=top_k,
        tuned=tuned,
        source=text.name,
        progress=True,
    ).validate()
    prepare_out(out, "lens", {"model": model or "default", "text": str(text)}, force)
    m = load(model, device, dtype)
    m.unembed.check()
    console.print(
        f"logit lens: {m.name}, {len(docs)} document(s) from {text}" + (f"; tuned lens: {tuned}" if tuned else "")
    )
    res = lens_job(m, docs, cfg, Output(out))
    if res.summary.get("split_note"):
        console.print(res.summary["split_note"])
    _print_sites(res.tables["lens_by_site"])
    for p in res.files:
        typer.echo(f"wrote {p}")


def lens_train(
    text: Path = typer.Option(..., "--text", "-t", help="Plain-text training file (UTF-8)."),
    out: Path = typer.Option(
        Path("tuned-lens"),
        "--out",
        "-o",
        help="Folder for the tuned lens and its training checkpoint.",
    ),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    steps: int = typer.Option(
        _TT.steps,
        "--steps",
        min=1,
        help="Adam steps (bounded; each trains every site on --tokens-per-step tokens).",
    ),
    tokens_per_step: int = typer.Option(
        _TT.tokens_per_step,
        "--tokens-per-step",
        min=1,
        help="Tokens per step (x all sites).",
    ),
    cache_tokens: int = typer.Option(
        _TT.cache_tokens,
        "--cache-tokens",
        min=1,
        help="Tokens whose streams are captured once and trained on.",
    ),
    lr: float = typer.Option(_TT.lr, "--lr", callback=positive, help="Learning rate of the (RMS-scaled) biases."),
    weight_lr: float = typer.Option(
        _TT.weight_lr, "--weight-lr", callback=positive, help="Learning rate of the d x d matrices."
    ),
    per_line: bool = typer.Option(
        True,
        "--per-line/--whole-file",
        help="One document per line (default) or the whole file.",
    ),
    sites: str | None = typer.Option(None, "--sites", help="Comma-separated sites to translate; default all."),
    resume: bool = typer.Option(
        _TT.resume,
        "--resume/--no-resume",
        help="Continue from a checkpoint in OUT (default).",
    ),
    checkpoint_every: int = typer.Option(
        _TT.checkpoint_every,
        "--checkpoint-every",
        min=1,
        help="Steps between checkpoints.",
    ),
    eval_tokens: int = typer.Option(
        _T.eval_tokens,
        "--eval-tokens",
        min=0,
        help="Held-out tokens (the last tenth of the documents) to compare with the logit lens; 0 to skip.",
    ),
    threads: int | None = ThreadsOpt,
):
    """Train a tuned lens (Belrose et al. 2023) at every sublayer site on TEXT, on the CPU:
    bounded steps, a progress bar, checkpoints every --checkpoint-every steps (rerun to resume).
    Then compare its KL to the final distribution with the plain logit lens on held-out text."""
    from rich.console import Console

    from depthscope.analyses.commands.common import load
    from depthscope.analyses.jobs.lens import lens_train_job
    from depthscope.analyses.text import read_documents

    set_threads(threads)
    console = Console(stderr=True)
    docs = read_documents(text, per_line=per_line)
    training = TunedLensTraining(
        steps=steps,
        tokens_per_step=tokens_per_step,
        cache_tokens=cache_tokens,
        lr=lr,
        weight_lr=weight_lr,
        sites=_sites(sites),
        resume=resume,
        checkpoint_every=checkpoint_every,
    ).validate()
    cfg = LensTrainConfig(training=training, eval_tokens=eval_tokens).validate()
    prepare_out(out, "lens-train", None)  # the folder may hold a checkpoint to resume
    m = load(model, device, dtype)
    m.unembed.check()
    console.print(
        f"training a tuned lens for {m.name} on {text}; {steps} steps x {tokens_per_step} tokens; checkpoints in {out}"
    )
    res = lens_train_job(m, docs, cfg, out)
    s = res.summary
    typer.echo(
        f"wrote {out}/tuned_lens.safetensors and tuned_lens.json ({s['lens']}; "
        f"{s['n_train_docs']} training document(s))"
    )
    if "kl_tuned" in s:
        typer.echo(
            f"held-out mean KL(final‖lens) over sites, {s['eval_tokens']} tokens of {s['n_eval_docs']} "
            f"held-out document(s): logit lens {s['kl_logit']:.3f}, tuned lens {s['kl_tuned']:.3f} nats"
        )
    for p in res.files:
        typer.echo(f"wrote {p}")


def register(app: typer.Typer) -> None:
    app.command("lens")(lens)
    app.command("lens-train")(lens_train)
