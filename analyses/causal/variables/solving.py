"""Which counterfactual examples the model solves: IIA measured on those alone (Geiger et al. 2021;
MIB's causal-variable track) asks whether a site carries the variable where the model computes it.

An example whose base the model already gets wrong says nothing about where the variable lives:
an intervention that changes nothing can still match its label (``iia_unchanged``), and one that
works cannot score where the model fails after the site. The field's protocol keeps the examples
whose base the model answers with ``base_label`` and, where the source's own answer is known,
whose source it answers with ``source_label``.

=====================  ========================================================================
:func:`solved`         per example: the unintervened model's argmax over the candidates at the
                       base's last position is ``base_label`` and, where ``source_label`` is
                       set, the source's is ``source_label`` (a boolean array)
=====================  ========================================================================

The forwards are those of the interchange interventions (:class:`~depthscope.analyses.causal.variables.swaps.Runner`
with the identity edit), so a kept example is one the intervened runs see the model solve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from depthscope.analyses.causal.variables.counterfactuals import (
    END,
    Counterfactual,
    as_counterfactuals,
    tokenize_examples,
)
from depthscope.analyses.causal.variables.swaps import Runner, candidate_scores, make_batches
from depthscope.common.errors import InputError
from depthscope.hooks.interventions import Unchanged
from depthscope.hooks.model_checks import require_decoder

__all__ = ["solved"]


def _predicts(model, examples: Sequence[Counterfactual], batch_size: int) -> np.ndarray:
    """Per example: whether the model's argmax over the candidates at the base's last position is
    ``label`` (no intervention: the identity edit at the embedding)."""
    runner = Runner(model, make_batches(model, tokenize_examples(model, examples), END, batch_size))
    hits = np.zeros(len(examples), dtype=bool)
    with torch.no_grad():
        for i, batch in enumerate(runner.batches):
            hits[batch.rows] = candidate_scores(runner.logits(i, 0, Unchanged()), batch)[0]
    return hits


def solved(model, examples, *, batch_size: int = 32) -> np.ndarray:
    """A boolean per example of ``examples`` (a ``.jsonl`` path or a list): the model predicts
    ``base_label`` for the base and, where ``source_label`` is set, ``source_label`` for the source
    (the argmax over ``candidates`` at the last position, no intervention). Every example needs a
    ``base_label``; a missing one raises :class:`InputError` naming the example."""
    require_decoder(model, "checking which examples the model solves")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    exs = as_counterfactuals(examples)
    for i, e in enumerate(exs):
        if e.base_label is None:
            where = e.where or f"example {i}"
            raise InputError(f"{where}: no 'base_label'; --only-solved needs base_label on every example")
    ok = _predicts(model, [replace(e, label=e.base_label, positions=None) for e in exs], batch_size)
    with_source = [i for i, e in enumerate(exs) if e.source_label is not None]
    if with_source:
        sources = [replace(exs[i], base=exs[i].source, label=exs[i].source_label, positions=None) for i in with_source]
        ok[with_source] &= _predicts(model, sources, batch_size)
    return ok
