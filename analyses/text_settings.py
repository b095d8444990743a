"""How a text becomes token rows: one settings object for every analysis that reads free text.

=========================  ==================================================================
:class:`TextWindows`       the BOS rule, the window, the stride, the token cap and the
                           document cap (``--bos/--no-bos``, ``--window``, ``--stride``,
                           ``--max-tokens``, ``--max-docs``)
=========================  ==================================================================

The causal test's held-out text, ``layers``, SAE training and evaluation, the activation cache,
the logit lens and the contribution norms all turn documents into token rows with
:func:`depthscope.analyses.text.text_rows` under these settings, so the same text gives the same
tokens, and the same clean next-token loss, in each of them. Torch-free: the commands build their
options from the fields (``--help`` imports no torch).

The rule, per document:

- ``bos``: when the tokenizer adds no special token at the start of a text (SmolLM2, GPT-2), its
  BOS token (else its EOS token) is prepended, as the probes and TransformerLens do; a tokenizer
  that adds one (Llama's ``<s>``) keeps its own; ``--no-bos``: the tokenizer's own tokens only.
  That leading token begins every window of the document.
- ``window``: tokens per row, the leading token included (None: min(model context, 512)); a
  longer document is split into windows, each a fresh context.
- ``stride``: document tokens between the starts of consecutive windows (None: the window less
  its leading token, no overlap). A smaller stride makes each window after a document's first
  begin with tokens the previous window already held: they are context only, and count nowhere.
- ``max_tokens``: at most this many counted tokens of the text, taken in order and cut inside a
  document (a long document is cut, not taken whole). What counts is what the analysis uses: a
  next-token loss counts predicted tokens (every position but a window's first); the lens, the
  norms and the cache count the positions they read.
- ``max_docs``: only the first this many documents.
"""

from __future__ import annotations

from dataclasses import dataclass

from depthscope.common.errors import InputError
from depthscope.common.settings import TOKENS, Checked, setting


@dataclass(frozen=True)
class TextWindows(Checked):
    """How documents become token rows (module docstring); checked on construction, and each
    field declares its command-line option."""

    bos: bool = setting(
        True,
        "--bos/--no-bos",
        help="Prepend the BOS (else EOS) token to every window when the tokenizer adds none, as the probes do "
        "(--no-bos: the tokenizer's own tokens only).",
    )
    window: int | None = setting(
        None,
        "--window",
        min=2,
        max=TOKENS,
        help="Tokens per window, the BOS included (default min(context, 512)); longer documents are split into "
        "windows, each a fresh context.",
    )
    stride: int | None = setting(
        None,
        "--stride",
        min=1,
        max=TOKENS,
        help="Document tokens between window starts (default: no overlap); with a smaller stride a window's "
        "tokens that the previous one held are context only.",
    )
    max_tokens: int | None = setting(
        None,
        "--max-tokens",
        min=1,
        help="At most this many tokens of the text, in order, cut inside a document (predicted tokens for a loss, "
        "positions read otherwise); default all.",
    )
    max_docs: int | None = setting(None, "--max-docs", min=1, help="Use only the first this many documents.")

    def check(self) -> None:
        """A stride no longer than the window (a longer one would skip tokens; with a leading BOS it
        is checked against the window's document tokens once the tokenizer is known)."""
        if self.stride is not None and self.window is not None and self.stride > self.window:
            raise InputError(
                f"--stride {self.stride} is longer than --window {self.window}: the tokens between windows would be "
                f"skipped; give a stride of at most the window"
            )
