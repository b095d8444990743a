"""The model's next-token loss on a padded batch: one masked cross-entropy that the causal test,
the layer interventions and the SAE metrics all read.

=========================  ==================================================================
:func:`next_token_nll`     ``[batch, pos - 1]`` cross-entropy of each real next token (0 where
                           position ``t`` or ``t + 1`` is padding) and the mask of those scored
=========================  ==================================================================

Position ``t`` predicts token ``t + 1``; a pair is scored when both are real tokens, which holds
for left and right padding alike. The logits are reduced in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nll [batch, pos - 1], scored [batch, pos - 1])`` for ``logits [batch, pos, vocab]``,
    token ``ids`` and ``mask`` (True at real tokens), on the logits' device."""
    ids, mask = ids.to(logits.device), mask.to(logits.device).bool()
    scored = mask[:, 1:] & mask[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return nll * scored, scored
