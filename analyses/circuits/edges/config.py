"""The settings of edge attribution and circuit evaluation (``depthscope circuit``): torch-free,
checked on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from depthscope.common.errors import InputError
from depthscope.common.settings import SEED, TOKENS, Checked, setting


@dataclass(frozen=True)
class CircuitConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.circuit.circuit_job` computes (``depthscope circuit``):
    every edge of the model's graph scored over a JSONL file of ``pairs`` by ``method`` (EAP or
    EAP-IG with ``steps``), the faithfulness curve of the top circuits under ``ablation`` (the
    scores too; ``mean``: the means of ``mean_pairs`` or of the scoring pairs) with
    ``random_draws`` random circuits per size (``seed``), judged on held-out pairs (``eval_pairs``, or
    the share of ``pairs`` that ``train_fraction`` leaves, split with ``seed``; ``in_sample``: on the
    scoring pairs themselves), the stability of the top circuits over
    ``bootstrap`` resamples of the pairs, and the drawn circuit (``draw_edges``, or the smallest
    one with f >= ``threshold``). Checked on construction; the fields declare the options."""

    pairs: Path | None = setting(
        None,
        "--pairs",
        cli_type=Path | None,
        help="A JSONL file of prompt pairs (clean, corrupted, target, foil), the prompts of each pair of the same "
        "token length.",
    )
    eval_pairs: Path | None = setting(
        None,
        "--eval-pairs",
        cli_type=Path | None,
        help="A JSONL file of the pairs every faithfulness number is computed on (all of --pairs then score the "
        "edges). Default: a seeded split of --pairs (--train-fraction).",
    )
    train_fraction: float = setting(
        0.5,
        "--train-fraction",
        positive=True,
        max=0.99,
        help="The share of --pairs that scores the edges; the rest (held out) judges the circuits.",
    )
    in_sample: bool = setting(
        False,
        "--in-sample/--held-out",
        help="Judge the circuits on the same pairs that scored them (optimistic: the top edges are chosen on "
        "those pairs); the summary and the figure say so.",
    )
    method: str = setting(
        "eap",
        "--method",
        choices=("eap", "eap-ig"),
        help="eap: one gradient on the clean run (Syed et al. 2023); eap-ig: the gradient averaged over --steps "
        "inputs between the corrupted and the clean embeddings (Hanna et al. 2024).",
    )
    steps: int = setting(
        5, "--steps", min=1, max=1000, help="EAP-IG's interpolation steps (a forward and a backward each)."
    )
    ablation: str = setting(
        "counterfactual",
        "--ablation",
        choices=("counterfactual", "mean", "zero"),
        help="What an edge outside the circuit carries, in the scores and in the evaluation alike: its sender's "
        "value on the corrupted prompt, its mean over the clean prompts of the scoring pairs (or --mean-pairs; "
        "per position where the lengths match, position 0 kept clean), or zero.",
    )
    mean_pairs: Path | None = setting(
        None,
        "--mean-pairs",
        cli_type=Path | None,
        help="A JSONL file of pairs whose clean prompts give the means of --ablation mean. Default: the pairs "
        "that score the edges (never the judged ones, unless --in-sample).",
    )
    random_draws: int = setting(
        5, "--random-draws", min=0, max=100, help="Random circuits per size, the faithfulness baseline (0: none)."
    )
    bootstrap: int = setting(
        100,
        "--bootstrap",
        min=0,
        max=100_000,
        help="Resamples of the pairs for the stability of the top circuits (0: none).",
    )
    seed: int = setting(
        0, "--seed", min=0, max=SEED, help="Seed of the random circuits and of the resamples (0 .. 2**32-1)."
    )
    threshold: float = setting(
        0.8,
        "--threshold",
        positive=True,
        max=1.0,
        help="Faithfulness the reported (and drawn) smallest circuit reaches.",
    )
    draw_edges: int | None = setting(
        None,
        "--draw-edges",
        min=1,
        max=5000,
        help="Edges of the circuit drawn (top by |score|, pruned). Default: the smallest circuit with f >= "
        "--threshold when it has at most 500 edges, else the top 100.",
    )
    batch_tokens: int = setting(
        256,
        "--batch-tokens",
        min=1,
        max=TOKENS,
        help="Tokens per batch (memory: senders + receivers x d_model floats a token).",
    )
    plots: bool = setting(True, "--plots/--no-plots", help="Draw the figures and the interactive page.")

    def check(self) -> None:
        """A pairs file, read and checked before the model loads."""
        if self.pairs is None:
            raise InputError("--pairs is required: a JSONL file of prompt pairs")
        from depthscope.analyses.circuits.pairs import check_contrasts, read_pairs  # lazy: pandas; lines checked early

        n = len(check_contrasts(read_pairs(self.pairs)))
        if self.mean_pairs is not None:
            if self.ablation != "mean":
                raise InputError(f"--mean-pairs gives the means of --ablation mean; the ablation is {self.ablation}")
            read_pairs(self.mean_pairs)
        if self.eval_pairs is not None:
            if self.in_sample:
                raise InputError("--eval-pairs and --in-sample contradict each other: give one")
            check_contrasts(read_pairs(self.eval_pairs))
        elif not self.in_sample and n < 2:
            raise InputError(
                f"a held-out split needs at least 2 pairs, got {n}: give more pairs, --eval-pairs FILE, or --in-sample"
            )
