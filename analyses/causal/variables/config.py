"""The settings of interchange interventions and DAS (``depthscope localize``), torch-free so ``--help`` stays light.

=========================  ====================================================================
:class:`LocalizeConfig`    what ``depthscope localize`` runs: interchange interventions or DAS on
                           counterfactual examples, at sites and named positions
=========================  ====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from depthscope.common.errors import InputError
from depthscope.common.settings import BATCH, SEED, Checked, Limit, setting

#: how ``depthscope localize`` measures IIA: full-vector interchange, or a learned subspace (DAS)
LOCALIZE_METHODS = ("interchange", "das")


def _at_least_zero(name: str, value) -> None:
    if not value >= 0:
        raise InputError(f"{name} must be at least 0, got {value!r}")


@dataclass(frozen=True)
class LocalizeConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.localize.localize_job` runs: interchange interventions
    or DAS on the counterfactual ``examples`` (JSONL, :mod:`~depthscope.analyses.causal.variables.counterfactuals`;
    every line checked on construction, before any model loads), tested on ``test`` or on a
    seeded ``1 - train_fraction`` of the examples, each position's best site chosen on a seeded
    ``select_fraction`` of the train examples (``only_solved``: of both, those the model solves,
    :func:`~depthscope.analyses.causal.variables.solving.solved`), at ``sites`` and named ``positions``; DAS learns
    ``dim`` directions (``boundless``: a learned mask over a full rotation instead) for ``epochs``
    passes over the train examples with Adam at ``lr``; ``probe_task`` adds the probe and causal
    tests of that word task (on the bundled EWT sample, ``probe_sentences`` train sentences) for
    the figure of three curves. The fields declare the ``localize`` options."""

    examples: str | Path | None = setting(
        None, "--examples", cli_type=Path | None, help="Counterfactual examples (JSONL: base, source, candidates...)."
    )
    test: str | Path | None = setting(
        None, "--test", cli_type=Path | None, help="Held-out examples (JSONL); default: split --examples."
    )
    train_fraction: float = setting(
        0.5,
        "--train-fraction",
        positive=True,
        max=0.99,
        help="Without --test: the seeded share to train on.",
    )
    select_fraction: float = setting(
        0.2,
        "--select-fraction",
        max=0.9,
        check=_at_least_zero,
        help="The seeded share of the train examples held out to choose each position's best site on (DAS trains "
        "on the rest); its IIA is then the test examples'. 0: choose on the test examples (biased upward).",
    )
    only_solved: bool = setting(
        False,
        "--only-solved/--all-examples",
        help="Keep the train and test examples the model solves (base_label on the base, source_label on the source).",
    )
    method: str = setting("interchange", "--method", choices=LOCALIZE_METHODS, help="interchange (full vector) or das.")
    dim: int = setting(1, "--dim", min=1, max=Limit(65536, "directions of a subspace"), help="DAS: directions learned.")
    sites: str = setting("resid", "--sites", help="Residual sites: 'resid' (all) or a comma list (embed,3.attn,3.mlp).")
    positions: str = setting("END", "--positions", help="Named positions of the examples, comma-separated (END: last).")
    boundless: bool = setting(
        False, "--boundless/--no-boundless", help="DAS: learn a mask over a full rotation (Boundless DAS), not --dim."
    )
    epochs: int = setting(4, "--epochs", min=1, max=Limit(10_000, "passes over the train examples"), help="DAS epochs.")
    lr: float = setting(1e-2, "--lr", positive=True, max=10.0, help="DAS: Adam's learning rate.")
    batch_size: int = setting(32, "--batch-size", min=1, max=BATCH, help="Examples per forward pass.")
    seed: int = setting(
        0, "--seed", min=0, max=SEED, help="Seed of the split, the initial and the random bases (0 .. 2**32-1)."
    )
    probe_task: str | None = setting(
        None, "--probe-task", help="A word task (e.g. feats:Number): draw its probe accuracy and 'used' beside IIA."
    )
    probe_sentences: int = setting(
        100,
        "--probe-sentences",
        min=2,
        max=Limit(1_000_000, "sentences"),
        help="--probe-task: EWT train sentences (test: half as many; the loss on 600 tokens).",
    )
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the figures.")
    progress: bool = False

    def check(self) -> None:
        """The example files exist and every line is an example (read here, before any model)."""
        from depthscope.analyses.causal.variables.counterfactuals import read_counterfactuals  # torch: lazy (--help)

        for name in ("examples", "test"):
            p = getattr(self, name)
            if p is not None:
                read_counterfactuals(p)
        if self.boundless and self.method != "das":
            raise InputError("--boundless is a kind of DAS: use it with --method das")
