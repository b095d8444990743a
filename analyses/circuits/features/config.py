"""The settings of ``depthscope attribute``, apart from the attribution code so that the command
line reads them without importing torch.

=========================  ==================================================================
:class:`AttributeConfig`   the transcoders, the prompt, the targets, how many feature rows,
                           the batch of backward passes, the pruning thresholds, the tokens
                           shown per feature
=========================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from depthscope.common.errors import InputError
from depthscope.common.settings import Checked, setting

#: tokens a prompt may have (bounded time and memory: the graph holds n_layers x tokens error nodes)
MAX_PROMPT_TOKENS = 4096


def _fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise InputError(f"{name} must be in (0, 1], got {value}")


@dataclass(frozen=True)
class AttributeConfig(Checked):
    """What :func:`~depthscope.analyses.jobs.attribute.attribute_job` builds (``depthscope
    attribute``): the attribution graph of ``prompt`` with the transcoder set in ``transcoders``,
    pruned at ``node_threshold`` and ``edge_threshold`` (circuit-tracer's 0.8 and 0.98)."""

    transcoders: Path | None = setting(
        None,
        "--transcoders",
        cli_type=Path | None,
        help="A transcoder set: a folder in circuit-tracer's layout (config.yaml, layer_{i}.safetensors) or "
        "SAELens's (layer_{i}/cfg.json), as 'depthscope transcoders train' writes.",
    )
    prompt: str = setting("", "--prompt", help="The prompt to explain (the BOS token is prepended as the model does).")
    targets: str | None = setting(
        None,
        "--targets",
        help="Comma-separated target tokens, each one token of the vocabulary (e.g. ' Paris, London'). "
        "Default: the top logits until their probability reaches --logit-probability, at most --max-logits.",
    )
    max_feature_nodes: int = setting(
        2048,
        "--max-feature-nodes",
        min=1,
        max=1_000_000,
        help="Feature rows computed (features visited in order of their influence on the logits).",
    )
    logit_probability: float = setting(
        0.95,
        "--logit-probability",
        positive=True,
        max=1.0,
        help="The default targets: the top logits until their cumulative probability reaches this.",
    )
    max_logits: int = setting(10, "--max-logits", min=1, max=1000, help="At most this many default targets.")
    batch_size: int = setting(
        64, "--batch-size", min=1, max=4096, help="Targets per backward pass (the batch of the kept forward)."
    )
    node_threshold: float = setting(
        0.8, "--node-threshold", positive=True, max=1.0, help="Pruning: keep the nodes of this share of influence."
    )
    edge_threshold: float = setting(
        0.98, "--edge-threshold", positive=True, max=1.0, help="Pruning: keep the edges of this share of influence."
    )
    top_tokens: int = setting(
        5,
        "--top-tokens",
        min=0,
        max=50,
        help="Tokens shown per feature: those its decoder writes to most (0: none).",
    )

    def check(self) -> None:
        """A prompt to explain; the thresholds are shares of influence."""
        if not self.prompt.strip():
            raise InputError("--prompt is empty: give the text whose next token the graph explains")
        _fraction("--node-threshold", self.node_threshold)
        _fraction("--edge-threshold", self.edge_threshold)
        if self.targets is not None and not [t for t in self.targets.split(",") if t]:
            raise InputError("--targets names no token: give comma-separated tokens, e.g. ' Paris, London'")
