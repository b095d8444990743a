"""The norms room's settings (``depthscope norms``): torch-free, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from depthscope.analyses.defaults import DEFAULT_PROMPT
from depthscope.analyses.text_settings import TextWindows
from depthscope.common.errors import InputError
from depthscope.common.settings import BATCH, Checked, setting


@dataclass(frozen=True)
class NormsConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.norms.norms_job` computes. ``target``/``contrast``:
    DLA tokens (single-token strings; target None: the model's top prediction); ``text``: how the
    text is read (the BOS rule, window, stride and caps every free-text analysis shares;
    ``max_tokens`` counts the tokens read); ``heads``: also per-head write norms (one more pass);
    ``source``: the text's name (recorded in the summary).
    Checked on construction; the fields declare the ``norms`` options."""

    prompt: str = setting(
        DEFAULT_PROMPT, "--prompt", "-p", help="Prompt for the per-position heatmap and the DLA bars."
    )
    target: str | None = setting(
        None,
        "--target",
        help="Target token of the DLA, a single token such as ' Paris' (mind the leading space); default: the "
        "model's top prediction.",
    )
    contrast: str | None = setting(
        None, "--contrast", help="Optional contrast token: attribute logit\\[target] - logit\\[contrast]."
    )
    batch_size: int = setting(4, "--batch-size", min=1, max=BATCH, help="Sequences per forward pass.")
    text: TextWindows = setting(factory=TextWindows)
    heads: bool = setting(
        False,
        "--heads",
        help="Also per-head attention write norms over the text (head_writes table and plot; one more pass).",
    )
    progress: bool = False
    source: str | None = None

    def check(self) -> None:
        """A prompt."""
        if not self.prompt:
            raise InputError("the prompt is empty")
