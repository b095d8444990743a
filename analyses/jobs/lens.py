"""The lens jobs: logit / tuned lens tables and figures over a text, and tuned-lens training.

==========================  =====================================================================
:func:`lens_job`            tables ``lens_by_site``, ``lens_tokens``; figures (PNG and SVG)
                            ``lens_metrics``, ``lens_top1_heatmap``, ``lens_rank_trajectory``
                            (``_tuned`` suffix for a tuned lens's token figures)
:func:`lens_train_job`      trains a tuned lens into a folder; table ``tuned_lens_eval`` (held-out
                            comparison with the logit lens)
:func:`sites_table`         the console table of ``lens_by_site`` (``depthscope lens`` prints it)
:func:`train_lines`         what ``depthscope lens-train`` prints of a training's summary
==========================  =====================================================================

Their settings are :class:`~depthscope.analyses.jobs.configs.LensConfig` and
:class:`~depthscope.analyses.jobs.configs.LensTrainConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from rich.table import Table

from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.jobs.configs import LensConfig, LensTrainConfig
from depthscope.analyses.lens.lenses import TunedLens
from depthscope.analyses.lens.logit import LOGIT_LENS, logit_lens, logit_lens_tokens
from depthscope.analyses.lens.plots import plot_lens_metrics, plot_rank_trajectory, plot_top1_heatmap
from depthscope.analyses.lens.tuned import train_tuned_lens
from depthscope.analyses.tables import site_first
from depthscope.analyses.text import RowReader
from depthscope.analyses.text_settings import TextWindows


def sites_table(by_site) -> Table:
    """The console table of ``lens_by_site``: per-site means of every lens, about eight sites each."""
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
    return table


def token_counts(model, docs: Sequence[str]) -> list[int]:
    """Tokens of each document (one tokenizer pass; sizes the progress bar and :func:`split_note`)."""
    return [len(ids) for ids in model.tokenizer(list(docs))["input_ids"]] if docs else []


def split_note(model, docs: Sequence[str], text: TextWindows, counts: Sequence[int] | None = None) -> str | None:
    """Say how many documents are longer than a window under ``text`` (they are split, not truncated)."""
    reader = RowReader(model, [], text)  # the window, its leading token and the stride, for this tokenizer
    pieces = [reader.n_windows(n) for n in (counts if counts is not None else token_counts(model, docs))]
    long_docs = sum(k > 1 for k in pieces)
    if long_docs:
        return (
            f"{long_docs} document(s) longer than the {reader.window}-token window were split into "
            f"{sum(k for k in pieces if k > 1)} windows (each window starts a fresh context)"
        )
    return None


def lens_job(model, docs: Sequence[str], config: LensConfig, out: Output) -> JobResult:
    """The logit lens (and a tuned lens when ``config.tuned`` is set) over ``docs`` and on the
    prompt; writes the tables and figures named in the module doc. Summary: per lens the mean
    KL to the final distribution over sites, plus ``n_positions`` and ``split_note``."""
    model.unembed.check()
    lenses = [LOGIT_LENS] + ([TunedLens.load(config.tuned, model)] if config.tuned is not None else [])
    kw = dict(sites=config.sites, batch_size=config.batch_size, first_position=config.first_position)
    counts = token_counts(model, docs)
    reader = RowReader(model, [], config.text, skip=0 if config.first_position else 1)
    big = dict(text=config.text, progress=config.progress, total=sum(reader.positions(n) for n in counts))
    by_site = site_first(
        pd.concat(
            [logit_lens(model, docs, lens=lens, **big, **kw) for lens in lenses],
            ignore_index=True,
        )
    )
    prompt = dict(k=config.top_k, window=config.text.window)  # the prompt as the tokenizer tokenizes it
    tokens = site_first(
        pd.concat(
            [logit_lens_tokens(model, config.prompt, lens=lens, **prompt, **kw) for lens in lenses],
            ignore_index=True,
        )
    )
    out.table(by_site, "lens_by_site")
    out.table(tokens, "lens_tokens")
    n_positions = int(by_site["n_positions"].iloc[0])
    title = None
    if config.source is not None:
        which = "logit and tuned lens" if len(lenses) > 1 else "logit lens"
        title = f"{model.name}: {which} at every sublayer ({n_positions:,} positions of {config.source})"
    out.figure(plot_lens_metrics, by_site, name="lens_metrics", title=title)
    for lens in lenses:
        part = tokens[tokens["lens"] == lens.kind]
        suffix = "" if lens.kind == "logit" else f"_{lens.kind}"
        out.figure(plot_top1_heatmap, part, name=f"lens_top1_heatmap{suffix}")
        out.figure(plot_rank_trajectory, part, name=f"lens_rank_trajectory{suffix}")
    if config.tuned is None:  # an earlier run's tuned-lens figures must not pass for this run's
        out.drop("lens_top1_heatmap_tuned", "lens_rank_trajectory_tuned")
    summary = {
        "model": str(model.name),
        "n_positions": n_positions,
        "mean_kl_to_final": {k: float(g["kl_to_final"].mean()) for k, g in by_site.groupby("lens")},
        "split_note": split_note(model, docs, config.text, counts),
    }
    return JobResult(tables={"lens_by_site": by_site, "lens_tokens": tokens}, summary=summary, files=list(out.written))


def lens_train_job(model, docs: Sequence[str], config: LensTrainConfig, folder: Path) -> JobResult:
    """Train a tuned lens on ``docs`` (all but the held-out tenth) into ``folder`` (lens files and
    a checkpoint), then write ``tuned_lens_eval`` there. Summary: the lens, the numbers of
    training and held-out documents, and the held-out mean KL of both lenses."""
    model.unembed.check()
    folder = Path(folder)
    n_eval = max(1, len(docs) // 10) if (config.eval_tokens > 0 and len(docs) >= 2) else 0
    train_docs, eval_docs = (docs[:-n_eval], docs[-n_eval:]) if n_eval else (list(docs), [])
    tl = train_tuned_lens(model, train_docs, config.training, out=folder, progress=config.progress)
    summary = {"lens": repr(tl), "n_train_docs": len(train_docs), "n_eval_docs": len(eval_docs)}
    result = JobResult(summary=summary)
    if eval_docs:
        out = Output(folder)
        a = logit_lens(model, eval_docs, lens=LOGIT_LENS, sites=tl.sites, max_tokens=config.eval_tokens)
        b = logit_lens(model, eval_docs, lens=tl, max_tokens=config.eval_tokens)
        both = site_first(pd.concat([a, b], ignore_index=True))
        out.table(both, "tuned_lens_eval")
        result.tables["tuned_lens_eval"] = both
        result.files = list(out.written)
        summary.update(
            eval_tokens=int(a["n_positions"].iloc[0]),
            kl_logit=float(a["kl_to_final"].mean(skipna=False)),
            kl_tuned=float(b["kl_to_final"].mean(skipna=False)),
        )
    return result


def train_lines(summary: dict, folder: Path) -> list[str]:
    """What ``depthscope lens-train`` prints of :func:`lens_train_job`'s summary."""
    lines = [
        f"wrote {folder}/tuned_lens.safetensors and tuned_lens.json ({summary['lens']}; "
        f"{summary['n_train_docs']} training document(s))"
    ]
    if "kl_tuned" in summary:
        lines.append(
            f"held-out mean KL(final‖lens) over sites, {summary['eval_tokens']} tokens of {summary['n_eval_docs']} "
            f"held-out document(s): logit lens {summary['kl_logit']:.3f}, tuned lens {summary['kl_tuned']:.3f} nats"
        )
    return lines
