"""The model's next-token loss on a padded batch: one masked cross-entropy that the causal test,
the layer interventions and the SAE metrics all read.

=========================  ==================================================================
:func:`next_token_nll`     ``[batch, pos - 1]`` cross-entropy of each real next token (0 where
                           position ``t`` or ``t + 1`` is padding) and the mask of those scored
=========================  ==================================================================

Position ``t`` predicts token ``t + 1``; a pair is scored when both are real tokens, which holds
for left and right padding alike, and (``first``, per row) token ``t + 1`` is at or after the
row's first counted position (:class:`~depthscope.analyses.text.TextRows`: a window's tokens that
an overlapping earlier window already predicted are context only). The logits are reduced in
float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch


def next_token_nll(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, first: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nll [batch, pos - 1], scored [batch, pos - 1])`` for ``logits [batch, pos, vocab]``,
    token ``ids``, ``mask`` (True at real tokens) and ``first`` (``[batch]``: each row's first
    position whose token is scored; None: from position 1), on the logits' device."""
    ids, mask = ids.to(logits.device), mask.to(logits.device).bool()
    scored = mask[:, 1:] & mask[:, :-1]
    if first is not None:
        target = torch.arange(1, ids.shape[1], device=logits.device)
        scored = scored & (target[None] >= first.to(logits.device)[:, None])
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return nll * scored, scored
