"""The lens jobs: logit / tuned lens tables and figures over a text, and tuned-lens training.

==========================  =====================================================================
:class:`LensConfig`         settings of :func:`lens_job` (its defaults are the only defaults)
:func:`lens_job`            tables ``lens_by_site``, ``lens_tokens``; figures (PNG and SVG)
                            ``lens_metrics``, ``lens_top1_heatmap``, ``lens_rank_trajectory``
                            (``_tuned`` suffix for a tuned lens's token figures)
:class:`LensTrainConfig`    settings of :func:`lens_train_job`
:func:`lens_train_job`      trains a tuned lens into a folder; table ``tuned_lens_eval`` (held-out
                            comparison with the logit lens)
==========================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from depthscope.analyses.jobs.base import JobResult, Output
from depthscope.analyses.tuned_lens_config import TunedLensTraining

DEFAULT_PROMPT = "The capital of France is"
#: the most top tokens per position and site in ``lens_tokens`` (three columns each)
MAX_TOP_K = 1000


@dataclass
class LensConfig:
    """What :func:`lens_job` computes. ``sites``: labels/indices (None: all); ``tuned``: a tuned
    lens folder to compare with the plain logit lens; ``source``: the text's name (figure title)."""

    prompt: str = DEFAULT_PROMPT
    sites: Sequence | None = None
    batch_size: int = 8
    window: int | None = None
    max_tokens: int | None = None
    first_position: bool = True
    top_k: int = 5
    tuned: Path | None = None
    source: str | None = None
    progress: bool = False

    def validate(self) -> LensConfig:
        """Check the settings (before the model loads); returns self. ``window`` is at least 2
        tokens (one position and its next token); ``top_k`` at most :data:`MAX_TOP_K`."""
        from depthscope.common.errors import InputError
        from depthscope.probes.config import check_number

        check_number("batch_size", self.batch_size)
        check_number("window", self.window, minimum=2, allow_none=True)
        check_number("max_tokens", self.max_tokens, allow_none=True)
        check_number("top_k", self.top_k)
        if self.top_k > MAX_TOP_K:
            raise InputError(f"top_k must be at most {MAX_TOP_K} (three table columns each), got {self.top_k}")
        if not self.prompt:
            raise InputError("the prompt is empty")
        return self


def token_counts(model, docs: Sequence[str]) -> list[int]:
    """Tokens of each document (one tokenizer pass; sizes the progress bar and :func:`split_note`)."""
    return [len(ids) for ids in model.tokenizer(list(docs))["input_ids"]] if docs else []


def split_note(model, docs: Sequence[str], window: int | None, counts: Sequence[int] | None = None) -> str | None:
    """Say how many documents are longer than the window (they are split, not truncated)."""
    from depthscope.analyses.text import windows as split

    ctx = model.max_context or 2048
    w = min(window or 512, ctx)
    long_docs, pieces = 0, 0
    for n in counts if counts is not None else token_counts(model, docs):
        if n > w:
            long_docs += 1
            pieces += len(split(list(range(n)), w))
    if long_docs:
        return (
            f"{long_docs} document(s) longer than the {w}-token window were split into {pieces} windows "
            f"(each window starts a fresh context)"
        )
    return None


def lens_job(model, docs: Sequence[str], config: LensConfig, out: Output) -> JobResult:
    """The logit lens (and a tuned lens when ``config.tuned`` is set) over ``docs`` and on the
    prompt; writes the tables and figures named in the module doc. Summary: per lens the mean
    KL to the final distribution over sites, plus ``n_positions`` and ``split_note``."""
    import pandas as pd

    from depthscope.analyses.lens import LOGIT_LENS, logit_lens, logit_lens_tokens
    from depthscope.analyses.lenses import TunedLens
    from depthscope.analyses.plots.lens import plot_lens_metrics, plot_rank_trajectory, plot_top1_heatmap
    from depthscope.analyses.tables import site_first

    config.validate()
    model.unembed.check()
    lenses = [LOGIT_LENS] + ([TunedLens.load(config.tuned, model)] if config.tuned is not None else [])
    kw = dict(
        sites=config.sites, batch_size=config.batch_size, window=config.window, first_position=config.first_position
    )
    counts = token_counts(model, docs)
    big = dict(max_tokens=config.max_tokens, progress=config.progress, total=sum(counts))
    by_site = site_first(
        pd.concat(
            [logit_lens(model, docs, lens=lens, **big, **kw) for lens in lenses],
            ignore_index=True,
        )
    )
    tokens = site_first(
        pd.concat(
            [logit_lens_tokens(model, config.prompt, lens=lens, k=config.top_k, **kw) for lens in lenses],
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
    summary = {
        "model": str(model.name),
        "n_positions": n_positions,
        "mean_kl_to_final": {k: float(g["kl_to_final"].mean()) for k, g in by_site.groupby("lens")},
        "split_note": split_note(model, docs, config.window, counts),
    }
    return JobResult(tables={"lens_by_site": by_site, "lens_tokens": tokens}, summary=summary, files=list(out.written))


@dataclass
class LensTrainConfig:
    """What :func:`lens_train_job` trains: ``training`` (the trainer's settings,
    :class:`~depthscope.analyses.tuned_lens.TunedLensTraining`) and ``eval_tokens`` held-out
    tokens (from the last tenth of the documents) to compare it with the logit lens (0: no
    comparison)."""

    training: TunedLensTraining = field(default_factory=TunedLensTraining)
    eval_tokens: int = 128
    progress: bool = True

    def validate(self) -> LensTrainConfig:
        """Check the settings (before the model loads); returns self. ``eval_tokens`` 0: no comparison."""
        from depthscope.probes.config import check_number

        self.training.validate()
        check_number("eval_tokens", self.eval_tokens, minimum=0)
        return self


def lens_train_job(model, docs: Sequence[str], config: LensTrainConfig, folder: Path) -> JobResult:
    """Train a tuned lens on ``docs`` (all but the held-out tenth) into ``folder`` (lens files and
    a checkpoint), then write ``tuned_lens_eval`` there. Summary: the lens, the numbers of
    training and held-out documents, and the held-out mean KL of both lenses."""
    import pandas as pd

    from depthscope.analyses.lens import LOGIT_LENS, logit_lens
    from depthscope.analyses.tables import site_first
    from depthscope.analyses.tuned_lens import train_tuned_lens

    config.validate()
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
            kl_logit=float(a["kl_to_final"].mean()),
            kl_tuned=float(b["kl_to_final"].mean()),
        )
    return result
