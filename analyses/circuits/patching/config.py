"""The settings of activation and path patching (``depthscope patch``): torch-free, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from depthscope.analyses.defaults import IOI_CLEAN, IOI_CORRUPTED
from depthscope.common.errors import InputError
from depthscope.common.settings import TOKENS, Checked, changed_flags, setting


@dataclass(frozen=True)
class PatchConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.patch.patch_job` computes: the prompt pair, the
    metric ``logit[target] - logit[foil]`` at the last token (``foil`` None: ``logprob[target]``)
    or a JSONL file of ``pairs`` (each with its own prompts and tokens), the ``method``
    (``activation`` patching, or ``path`` patching from ``senders`` to ``receivers``), the hook
    points (comma-separated names or group words; None: every residual site and every head, see
    :mod:`depthscope.analyses.jobs.patch`), the positions mode (``last`` | ``all`` | ``each`` |
    names of positions the pairs give; None: a default per part), the ``direction`` (``denoise``:
    clean values into the corrupted run; ``noise``: corrupted values into the clean run), whether
    to add the attribution estimate, the tokens per forward and the figures. Checked on
    construction; the fields declare the ``patch`` options."""

    clean: str = setting(
        IOI_CLEAN, "--clean", help="The clean prompt (default: the IOI example with 'John' as the giver)."
    )
    corrupted: str = setting(
        IOI_CORRUPTED, "--corrupted", help="The corrupted prompt (default: the same with 'Mary' as the giver)."
    )
    target: str = setting(
        " Mary",
        "--target",
        help="Token the clean prompt should predict next, one token (mind the leading space: ' Mary').",
    )
    foil: str | None = setting(
        " John",
        "--foil",
        cli_type=str,
        show=lambda foil: foil or "",
        parse=lambda text: text or None,
        help="Contrast token: the metric is the target's logit minus the foil's at the last token; '' for "
        "the log-probability of the target.",
    )
    pairs: Path | None = setting(
        None,
        "--pairs",
        cli_type=Path | None,
        help="A JSONL file of prompt pairs, one JSON object per line with clean, corrupted, target, foil (and "
        'optional named positions, e.g. "positions": {"S2": 9, "END": -1}): patch every pair and '
        "write the means over pairs (patching.parquet) and the per-pair rows (patching_pairs.parquet).",
    )
    method: str = setting(
        "activation",
        "--method",
        choices=("activation", "path"),
        help="activation: patch each hook point; path: path patching from --senders to --receivers (Wang et al. "
        "2022), every other head frozen at its corrupted value.",
    )
    senders: str = setting(
        "heads",
        "--senders",
        help="Path patching: whose output is sent ('heads', '<l>.heads', '<l>.heads.<h>', '<l>.mlp_out', "
        "'<l>.attn_out', the stream at residual sites: 'embed', '<l>.attn', '<l>.mlp'), comma-separated.",
    )
    receivers: str = setting(
        "logits",
        "--receivers",
        help="Path patching: where it is received, patched together: 'logits', or '<l>.q', '<l>.k', '<l>.v' "
        "(every head of layer l, or '<l>.q.<h>' one head) and '<l>.mlp_in' (the MLP's input), comma-separated.",
    )
    freeze_mlps: bool = setting(
        False,
        "--freeze-mlps/--recompute-mlps",
        help="Path patching: freeze every MLP at its corrupted value too (with --receivers logits: the direct "
        "effect only); default: MLPs recomputed, as Wang et al.",
    )
    positions: str | None = setting(
        None,
        "--positions",
        help="Token positions to patch: last (the last token), all (every position at once), each (one patch "
        "per position: prompts of the same token length, or the positions each pair names) or names of "
        "positions every pair gives ('S2,END'). Default: each for the residual sites (last when the prompts "
        "differ in token length) and last for the heads; last with --sites; all for --method path.",
    )
    sites: str | None = setting(
        None,
        "--sites",
        help="Comma-separated hook points or group words (e.g. 'embed,10.attn,23.heads' or "
        "'resid,attn_out,mlp_out,heads,z'). Default: every residual site and every attention head "
        "('resid,heads'), as in the README's IOI example.",
    )
    direction: str = setting(
        "denoise",
        "--direction",
        choices=("denoise", "noise"),
        help="denoise: patch clean values into the corrupted run (what an activation or path suffices to "
        "restore); noise: corrupted values into the clean run (what the clean behaviour needs; Wang et al.'s "
        "path patching). fraction_recovered is (patched - corrupted) / (clean - corrupted) either way.",
    )
    attribution: bool = setting(
        True,
        "--attribution/--no-attribution",
        help="Also the gradient (attribution patching) estimate of every patch, and its rank correlation "
        "with exact patching.",
    )
    batch_tokens: int = setting(
        2048,
        "--batch-tokens",
        min=1,
        max=TOKENS,
        help="Tokens per forward pass (patched rows x recomputed positions; a position a row holds as a "
        "cached prefix counts for what its keys and values weigh).",
    )
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the heatmaps (and the attribution-vs-exact scatter).")

    def check(self) -> None:
        """Both prompts or a pairs file (not both), hook points when ``sites`` is given, and no
        option of the other method."""
        if not self.clean or not self.corrupted:
            raise InputError("the clean and the corrupted prompt must not be empty")
        if self.sites is not None and not str(self.sites).strip(" ,"):
            raise InputError("sites is empty: name hook points or group words, or leave it out for the default")
        if self.positions is not None and not str(self.positions).strip(" ,"):
            raise InputError("positions is empty: last, all, each or position names")
        if self.pairs is not None:
            both = changed_flags(self, ("clean", "corrupted", "target", "foil"))
            if both:
                raise InputError(f"--pairs reads the prompts and tokens from its file: leave out {', '.join(both)}")
            from depthscope.analyses.circuits.pairs import (
                read_pairs,
            )  # lazy: pandas; every line checked before the model loads

            read_pairs(self.pairs)
        other = ("senders", "receivers", "freeze_mlps") if self.method == "activation" else ("sites",)
        wrong = changed_flags(self, other)
        if wrong:
            raise InputError(f"{', '.join(wrong)} do not apply to --method {self.method}")
        if self.method == "path" and self.positions not in (None, "all", "last"):
            raise InputError(f"--method path patches the senders at all positions or the last: got {self.positions!r}")
