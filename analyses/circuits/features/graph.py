"""An attribution graph: the nodes of one prompt's replacement model and the direct effects
between them, in circuit-tracer's node order.

==========================  ==============================================================
offers                      what
==========================  ==============================================================
:class:`AttributionGraph`   the nodes and the adjacency (the tidy node table: ``export.node_table``)
``NODE_KINDS``              the node kinds in adjacency order
==========================  ==============================================================

Node order (circuit-tracer's ``Graph``): the ``n_features`` active features kept (sorted by
layer, position, feature index), then the ``n_layers * n_pos`` error nodes (layer-major:
``layer * n_pos + position``), then the ``n_pos`` input-token nodes, then the ``n_logits`` target
logits. ``adjacency[t, s]`` is the direct effect of source ``s`` on target ``t`` in the frozen,
linear replacement model (rows targets, columns sources); only feature and logit rows have
entries (errors and tokens are sources only). Completeness: for every target ``t``,
``inputs[t] == adjacency[t].sum() + bias[t]``, where ``inputs`` is a feature's pre-activation or a
logit and ``bias`` the target's constant terms (encoder and decoder biases, the attention output
biases...). Sources that are not targets have ``inputs``/``bias`` NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: node kinds in adjacency order
NODE_KINDS = ("feature", "error", "token", "logit")


@dataclass
class AttributionGraph:
    """One prompt's attribution graph.

    ``adjacency`` is a ``scipy.sparse`` matrix (CSR) or a dense ``numpy`` array of shape
    ``[n_nodes, n_nodes]``; ``features[i] = (layer, position, feature)`` of feature node ``i``;
    ``activations[i]`` its activation; ``logit_tokens``/``logit_probabilities`` the targets'
    token ids and their probabilities under the model; ``settings`` what built it (transcoders,
    ``max_feature_nodes``, batch size...), written into the summary and the JSON metadata."""

    prompt: str
    tokens: list[int]
    token_strings: list[str]
    n_layers: int
    features: np.ndarray  # [n_features, 3] int64: layer, position, feature
    activations: np.ndarray  # [n_features]
    logit_tokens: list[int]
    logit_strings: list[str]
    logit_probabilities: np.ndarray  # [n_logits]
    adjacency: object  # [n_nodes, n_nodes]: scipy.sparse.csr_matrix or np.ndarray
    inputs: np.ndarray  # [n_nodes]: a target's input (pre-activation, logit); NaN for sources only
    bias: np.ndarray  # [n_nodes]: a target's constant term; NaN for sources only
    model_name: str = ""
    settings: dict = field(default_factory=dict)

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    @property
    def n_features(self) -> int:
        return int(len(self.features))

    @property
    def n_errors(self) -> int:
        return self.n_layers * self.n_pos

    @property
    def n_logits(self) -> int:
        return len(self.logit_tokens)

    @property
    def n_nodes(self) -> int:
        return self.n_features + self.n_errors + self.n_pos + self.n_logits

    def kind_slices(self) -> dict[str, slice]:
        """Each kind's rows/columns in the adjacency."""
        a = self.n_features
        b = a + self.n_errors
        c = b + self.n_pos
        return {"feature": slice(0, a), "error": slice(a, b), "token": slice(b, c), "logit": slice(c, self.n_nodes)}

    def error_index(self, layer: int, position: int) -> int:
        """The adjacency index of the error node at ``layer``, ``position``."""
        return self.n_features + layer * self.n_pos + position

    def token_index(self, position: int) -> int:
        return self.n_features + self.n_errors + position

    def logit_index(self, i: int) -> int:
        return self.n_features + self.n_errors + self.n_pos + i

    def dense(self) -> np.ndarray:
        """The adjacency as a dense array (small graphs, tests)."""
        a = self.adjacency
        return np.asarray(a.toarray() if hasattr(a, "toarray") else a)
