"""``depthscope lens`` (logit lens / tuned lens over a text file: tables and plots) and
``depthscope lens-train`` (train a tuned lens on a text file)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import ModelOpt, OutOpt

ThreadsOpt = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice; 1 is often faster on a busy shared machine).")


def _set_threads(threads: Optional[int]) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _sites(spec: Optional[str]):
    if spec is None or not spec.strip():
        return None
    return [s.strip() for s in spec.split(",") if s.strip()]


def _split_note(model, docs, window) -> Optional[str]:
    """Say how many documents are longer than the window (they are split, not truncated)."""
    from depthscope.analyses.text import windows as split

    ctx = model.max_context or 2048
    w = min(window or 512, ctx)
    tok = model.tokenizer
    long_docs, pieces = 0, 0
    for d in docs:
        n = len(tok(d)["input_ids"])
        if n > w:
            long_docs += 1
            pieces += len(split(list(range(n)), w))
    if long_docs:
        return (f"{long_docs} document(s) longer than the {w}-token window were split into {pieces} windows "
                f"(each window starts a fresh context)")
    return None


def register(app: typer.Typer) -> None:
    @app.command("lens")
    def lens(
        text: Path = typer.Option(..., "--text", "-t", help="Plain-text file (UTF-8): one document per line, or the whole file (--whole-file)."),
        model: Optional[str] = ModelOpt,
        prompt: str = typer.Option("The capital of France is", "--prompt", "-p", help="Prompt for the per-token heatmap and rank trajectories."),
        out: Path = OutOpt,
        per_line: bool = typer.Option(True, "--per-line/--whole-file", help="One document per non-blank line (default), or the whole file as one document."),
        max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Stop after this many token positions of the text."),
        batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass."),
        window: Optional[int] = typer.Option(None, "--window", help="Tokens per window (default min(context, 512)); longer documents are split."),
        tuned: Optional[Path] = typer.Option(None, "--tuned", help="A tuned lens folder (from lens-train) to compare with the plain logit lens."),
        sites: Optional[str] = typer.Option(None, "--sites", help="Comma-separated sites (e.g. 'embed,10.attn,29.mlp'); default all."),
        first_position: bool = typer.Option(True, "--first-position/--skip-first-position", help="Include position 0 of every window (default) or skip it (attention sink)."),
        top_k: int = typer.Option(5, "--top-k", help="Top tokens per position and site in the token table."),
        threads: Optional[int] = ThreadsOpt,
    ):
        """Logit lens at every sublayer over TEXT: per-site table (KL to the final distribution,
        cross-entropy, entropy, top-1 agreement/accuracy, next-token rank), the prompt's per-token
        table, and plots (metrics vs depth, top-1 heatmap, rank trajectories), written to OUT."""
        import pandas as pd
        from rich.console import Console
        from rich.table import Table

        from depthscope.analyses.lens import check_decodable, logit_lens, logit_lens_tokens
        from depthscope.analyses.plots.lens import plot_lens_metrics, plot_rank_trajectory, plot_top1_heatmap
        from depthscope.analyses.tables import site_first, write_table
        from depthscope.analyses.text import read_documents
        from depthscope.analyses.tuned_lens import TunedLens

        from .common import load

        _set_threads(threads)
        console = Console(stderr=True)
        docs = read_documents(text, per_line=per_line)
        m = load(model)
        check_decodable(m)
        tl = TunedLens.load(tuned, m) if tuned is not None else None
        site_spec = _sites(sites)
        note = _split_note(m, docs, window)
        if note:
            console.print(note)
        kw = dict(sites=site_spec, batch_size=batch_size, window=window, first_position=first_position)
        console.print(f"logit lens: {m.name}, {len(docs)} document(s) from {text}")
        frames = [logit_lens(m, docs, max_tokens=max_tokens, **kw)]
        tok_frames = [logit_lens_tokens(m, prompt, k=top_k, **kw)]
        if tl is not None:
            console.print(f"tuned lens: {tuned}")
            frames.append(logit_lens(m, docs, lens=tl, max_tokens=max_tokens, **kw))
            tok_frames.append(logit_lens_tokens(m, prompt, lens=tl, k=top_k, **kw))
        by_site = site_first(pd.concat(frames, ignore_index=True))
        tokens = site_first(pd.concat(tok_frames, ignore_index=True))
        written = write_table(by_site, out, "lens_by_site") + write_table(tokens, out, "lens_tokens")
        which = "logit and tuned lens" if tl is not None else "logit lens"
        plot_lens_metrics(by_site, out / "lens_metrics.png", title=f"{m.name}: {which} at every sublayer "
                          f"({int(by_site['n_positions'].iloc[0]):,} positions of {text.name})")
        written.append(out / "lens_metrics.png")
        for name in tokens["lens"].unique():
            part = tokens[tokens["lens"] == name]
            suffix = "" if name == "logit" else f"_{name}"
            plot_top1_heatmap(part, out / f"lens_top1_heatmap{suffix}.png")
            plot_rank_trajectory(part, out / f"lens_rank_trajectory{suffix}.png")
            written += [out / f"lens_top1_heatmap{suffix}.png", out / f"lens_rank_trajectory{suffix}.png"]

        table = Table("lens", "site", "depth", "KL(final‖lens)", "CE", "entropy", "top-1 agree", title="per-site means")
        for row in by_site.itertuples():
            n = len(by_site[by_site["lens"] == row.lens])
            step = max(1, n // 8)
            if row.site % step == 0 or row.site == by_site["site"].max():
                table.add_row(row.lens, row.label, f"{row.depth:g}", f"{row.kl_to_final:.3f}", f"{row.cross_entropy:.3f}",
                              f"{row.entropy:.3f}", f"{row.top1_agreement:.3f}")
        Console().print(table)
        for p in written:
            typer.echo(f"wrote {p}")

    @app.command("lens-train")
    def lens_train(
        text: Path = typer.Option(..., "--text", "-t", help="Plain-text training file (UTF-8)."),
        out: Path = typer.Option(Path("tuned-lens"), "--out", "-o", help="Folder for the tuned lens and its training checkpoint."),
        model: Optional[str] = ModelOpt,
        steps: int = typer.Option(250, "--steps", help="Adam steps (bounded; each trains every site on --tokens-per-step tokens)."),
        tokens_per_step: int = typer.Option(8, "--tokens-per-step", help="Tokens per step (x all sites)."),
        cache_tokens: int = typer.Option(2048, "--cache-tokens", help="Tokens whose streams are captured once and trained on."),
        lr: float = typer.Option(3e-2, "--lr", help="Learning rate of the (RMS-scaled) biases."),
        weight_lr: float = typer.Option(3e-3, "--weight-lr", help="Learning rate of the d x d matrices."),
        per_line: bool = typer.Option(True, "--per-line/--whole-file", help="One document per line (default) or the whole file."),
        sites: Optional[str] = typer.Option(None, "--sites", help="Comma-separated sites to translate; default all."),
        resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue from a checkpoint in OUT (default)."),
        checkpoint_every: int = typer.Option(25, "--checkpoint-every", help="Steps between checkpoints."),
        eval_tokens: int = typer.Option(128, "--eval-tokens", help="Held-out tokens (the last tenth of the documents) to compare with the logit lens; 0 to skip."),
        threads: Optional[int] = ThreadsOpt,
    ):
        """Train a tuned lens (Belrose et al. 2023) at every sublayer site on TEXT, on the CPU:
        bounded steps, a progress bar, checkpoints every --checkpoint-every steps (rerun to resume).
        Then compare its KL to the final distribution with the plain logit lens on held-out text."""
        from rich.console import Console

        from depthscope.analyses.lens import check_decodable, logit_lens
        from depthscope.analyses.tables import site_first, write_table
        from depthscope.analyses.text import read_documents
        from depthscope.analyses.tuned_lens import train_tuned_lens

        from .common import load

        _set_threads(threads)
        console = Console(stderr=True)
        docs = read_documents(text, per_line=per_line)
        m = load(model)
        check_decodable(m)
        n_eval = max(1, len(docs) // 10) if (eval_tokens > 0 and len(docs) >= 2) else 0
        train_docs, eval_docs = (docs[:-n_eval], docs[-n_eval:]) if n_eval else (docs, [])
        console.print(f"training a tuned lens for {m.name} on {len(train_docs)} document(s) of {text}; "
                      f"{steps} steps x {tokens_per_step} tokens; checkpoints in {out}")
        tl = train_tuned_lens(m, train_docs, out=out, sites=_sites(sites), steps=steps, tokens_per_step=tokens_per_step,
                              cache_tokens=cache_tokens, lr=lr, weight_lr=weight_lr, resume=resume,
                              checkpoint_every=checkpoint_every)
        typer.echo(f"wrote {out}/tuned_lens.safetensors and tuned_lens.json ({tl})")
        if eval_docs:
            a = logit_lens(m, eval_docs, sites=tl.sites, max_tokens=eval_tokens)
            b = logit_lens(m, eval_docs, lens=tl, max_tokens=eval_tokens)
            import pandas as pd

            both = site_first(pd.concat([a, b], ignore_index=True))
            paths = write_table(both, out, "tuned_lens_eval")
            n = int(a["n_positions"].iloc[0])
            typer.echo(f"held-out mean KL(final‖lens) over sites, {n} tokens of {len(eval_docs)} held-out document(s): "
                       f"logit lens {a['kl_to_final'].mean():.3f}, tuned lens {b['kl_to_final'].mean():.3f} nats")
            for p in paths:
                typer.echo(f"wrote {p}")
