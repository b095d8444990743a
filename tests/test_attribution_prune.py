"""Influence, pruning and the replacement/completeness scores of an attribution graph
(analyses/circuits/features/prune.py) against numbers worked out by hand, against the closed
form w((I - Â)^-1 - I), and against a direct dense numpy port of circuit-tracer's formulas
(``circuit_tracer/graph.py``) on random DAG-shaped graphs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from depthscope.analyses.circuits.features.graph import AttributionGraph
from depthscope.analyses.circuits.features.prune import (
    graph_scores,
    influence,
    node_influence,
    normalized_adjacency,
    prune_graph,
    pruned_adjacency,
)
from depthscope.common.errors import InputError

# The hand-built graph: 2 layers, 1 position (one input token), 3 features, 2 error nodes,
# 2 target logits. Node order (circuit-tracer's): features, errors (layer-major), tokens, logits.
F0, F1, F2, E0, E1, T, L0, L1 = range(8)
NAMES = ["f0", "f1", "f2", "e0", "e1", "t", "l0", "l1"]


def hand_graph(dense: bool = False) -> AttributionGraph:
    """f0 (layer 0, feature 7), f1 (layer 1, feature 3), f2 (layer 1, feature 9); logits l0
    (p = 0.6), l1 (p = 0.2). Edges, A[target, source]:

    f0 <- t 2                                  |row| 2:  Â  t 1
    f1 <- t 3, e0 -1                           |row| 4:  Â  t .75, e0 .25
    f2 <- f0 2                                 |row| 2:  Â  f0 1
    l0 <- f1 4, f2 2, e1 4                     |row| 10: Â  f1 .4, f2 .2, e1 .4
    l1 <- f1 -3, f2 1, t 6                     |row| 10: Â  f1 .3, f2 .1, t .6
    """
    a = np.zeros((8, 8))
    a[F0, T] = 2.0
    a[F1, T], a[F1, E0] = 3.0, -1.0
    a[F2, F0] = 2.0
    a[L0, F1], a[L0, F2], a[L0, E1] = 4.0, 2.0, 4.0
    a[L1, F1], a[L1, F2], a[L1, T] = -3.0, 1.0, 6.0
    inputs = np.full(8, np.nan)
    inputs[[F0, F1, F2, L0, L1]] = [2.5, 2.0, 2.0, 10.5, 4.0]
    bias = np.full(8, np.nan)
    bias[[F0, F1, F2, L0, L1]] = inputs[[F0, F1, F2, L0, L1]] - a[[F0, F1, F2, L0, L1]].sum(1)
    return AttributionGraph(
        prompt="Paris",
        tokens=[42],
        token_strings=["Paris"],
        n_layers=2,
        features=np.array([[0, 0, 7], [1, 0, 3], [1, 0, 9]]),
        activations=np.array([1.5, 0.5, 2.0]),
        logit_tokens=[11, 12],
        logit_strings=[" is", ","],
        logit_probabilities=np.array([0.6, 0.2]),
        adjacency=a if dense else sp.csr_matrix(a),
        inputs=inputs,
        bias=bias,
        model_name="hand",
    )


def test_influence_worked_by_hand():
    # w = p at the logits: w[l0] = .6, w[l1] = .2. Influence = w Â + w Â² + w Â³ + ...
    # term 1 (w Â, sources of the logits):
    #   f1 = .6*.4 + .2*.3 = .30;  f2 = .6*.2 + .2*.1 = .14;  e1 = .6*.4 = .24;  t = .2*.6 = .12
    # term 2 (term 1 through the features' rows):
    #   from f1 .30: t += .30*.75 = .225, e0 += .30*.25 = .075;  from f2 .14: f0 += .14*1 = .14
    # term 3: from f0 .14: t += .14;  term 4: 0 (t and the errors have no inputs): the series stops.
    # influence: f0 .14, f1 .30, f2 .14, e0 .075, e1 .24, t .12+.225+.14 = .485, logits 0.
    # (All of the logits' weight ends at the pure sources: t + e0 + e1 = .485+.075+.24 = .8 = .6+.2.)
    want = np.array([0.14, 0.30, 0.14, 0.075, 0.24, 0.485, 0.0, 0.0])
    for dense in (False, True):
        got = node_influence(hand_graph(dense))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # the closed form: w ((I - Â)^-1 - I)
    g = hand_graph()
    norm = normalized_adjacency(g.adjacency).toarray()
    w = np.zeros(8)
    w[[L0, L1]] = [0.6, 0.2]
    closed = w @ (np.linalg.inv(np.eye(8) - norm) - np.eye(8))
    np.testing.assert_allclose(closed, want, atol=1e-12)


def test_scores_worked_by_hand():
    # replacement = I[tokens] / (I[tokens] + I[errors]) = .485 / (.485 + .075 + .24) = .485/.8 = .60625
    # completeness: each node's share of Â input not from errors, weighted by I + w:
    #   I + w:  f0 .14, f1 .30, f2 .14, e0 .075, e1 .24, t .485, l0 .6, l1 .2;  total 2.18
    #   from errors: f1 .25 (e0), l0 .4 (e1), the rest 0
    #   numerator = 2.18 - .25*.30 - .4*.6 = 2.18 - .075 - .24 = 1.865;  completeness = 1.865/2.18
    scores = graph_scores(hand_graph())
    assert scores["replacement_score"] == pytest.approx(0.485 / 0.8, abs=1e-12)
    assert scores["completeness_score"] == pytest.approx(1.865 / 2.18, abs=1e-12)
    assert set(scores) == {"replacement_score", "completeness_score"}


def test_node_and_edge_pruning_worked_by_hand():
    g = hand_graph()
    pruned = prune_graph(g)  # circuit-tracer's defaults: 0.8 of node influence, 0.98 of edge influence
    # Nodes by influence: t .485, f1 .30, e1 .24, f0 .14, f2 .14, e0 .075, l0 0, l1 0; total 1.38.
    # Cumulative shares: .485/1.38 = .351, .785/1.38 = .569, 1.025/1.38 = .743, 1.165/1.38 = .844 ...
    # the first reaching .8 is the 4th (index 3): threshold .14, so e0 (.075) goes; t, l0, l1 stay always.
    # Node-pruned Â' (e0's column gone, f1's row renormalised): f1 <- t 1; the other rows as before.
    # Its influence I': term 1 as before (f1 .30, f2 .14, e1 .24, t .12); term 2 t += .30, f0 += .14;
    # term 3 t += .14. I' + w at the targets: f0 .14, f1 .30, f2 .14, l0 .6, l1 .2 (total 1.38).
    # Edge scores Â'[t, s] (I'[t] + w[t]):
    #   f1<-t .30;  f0<-t .14;  f2<-f0 .14;  l0<-f1 .4*.6 = .24;  l0<-e1 .24;  l0<-f2 .2*.6 = .12;
    #   l1<-t .6*.2 = .12;  l1<-f1 .3*.2 = .06;  l1<-f2 .1*.2 = .02;  total 1.38.
    # Sorted cumulative: .30 .54 .78 .92 1.06 1.18 1.30 1.36 1.38 (/1.38: ... .942, .9855, 1): the
    # first at >= .98 is the 8th (.06), so only l1<-f2 (.02) goes. Every feature keeps an input and an
    # output edge (f2 still writes to l0), so the cleaning removes nothing.
    want_nodes = np.array([1, 1, 1, 0, 1, 1, 1, 1], dtype=bool)
    np.testing.assert_array_equal(pruned.node_mask, want_nodes)
    kept = {(NAMES[r], NAMES[c]) for r, c in zip(*pruned.edge_mask.nonzero())}
    assert kept == {("f0", "t"), ("f1", "t"), ("f2", "f0"), ("l0", "f1"), ("l0", "f2"), ("l0", "e1"),
                    ("l1", "f1"), ("l1", "t")}  # fmt: skip
    np.testing.assert_allclose(pruned.influence, [0.14, 0.30, 0.14, 0.075, 0.24, 0.485, 0, 0], atol=1e-12)
    # cumulative shares (circuit-tracer's node ``influence`` in the JSON), ties (f0, f2) aside
    cum = pruned.cumulative_scores
    for node, share in ((T, 0.485), (F1, 0.785), (E1, 1.025), (E0, 1.38), (L0, 1.38), (L1, 1.38)):
        assert cum[node] == pytest.approx(share / 1.38, abs=1e-12)
    assert {round(cum[F0] * 1.38, 9), round(cum[F2] * 1.38, 9)} == {1.165, 1.305}
    node_mask, edge_mask, cumulative = pruned  # unpacks as circuit-tracer's PruneResult
    assert node_mask is pruned.node_mask and edge_mask is pruned.edge_mask and cumulative is cum


def test_cleaning_cascade_worked_by_hand():
    # At edge_threshold .7 (the same edge scores as above): cumulative .30 .54 .78 .92 1.06 /1.38 =
    # .217 .391 .565 .667 .768: the first >= .7 is the 5th, threshold .14: kept f1<-t, l0<-f1, l0<-e1,
    # f0<-t, f2<-f0 (f0<-t and f2<-f0 are both exactly I'[f2] = .14: f0's only path is through f2).
    # Cleaning, pass 1: f2 has no kept outgoing edge (l0<-f2 .12 and l1<-f2 .02 went): f2 goes, and
    # with it f2<-f0. Pass 2: now f0 has no outgoing edge: f0 goes, and f0<-t. Pass 3: nothing changes.
    pruned = prune_graph(hand_graph(), node_threshold=0.8, edge_threshold=0.7)
    np.testing.assert_array_equal(pruned.node_mask, np.array([0, 1, 0, 0, 1, 1, 1, 1], dtype=bool))
    kept = {(NAMES[r], NAMES[c]) for r, c in zip(*pruned.edge_mask.nonzero())}
    assert kept == {("f1", "t"), ("l0", "f1"), ("l0", "e1")}


def test_pruned_scores_worked_by_hand():
    # The pruned graph (defaults): the edges f0<-t 2, f1<-t 3, f2<-f0 2, l0<-f1 4, l0<-f2 2, l0<-e1 4,
    # l1<-f1 -3, l1<-t 6. Â: f0<-t 1; f1<-t 1; f2<-f0 1; l0: f1 .4, f2 .2, e1 .4; l1: f1 1/3, t 2/3.
    # Influence: term 1: f1 .24 + .2/3, f2 .12, e1 .24, t .4/3;  term 2: t += .24 + .2/3, f0 += .12;
    # term 3: t += .12.  t = .4/3 + .24 + .2/3 + .12 = .56; e1 .24 (t + e1 = .8).
    # replacement = .56 / (.56 + .24) = .7
    # completeness: I + w = f0 .12, f1 .24+.2/3, f2 .12, e1 .24, t .56, l0 .6, l1 .2: total 6.44/3;
    # only l0 has error input (.4): numerator 6.44/3 - .4*.6 = 5.72/3; completeness = 5.72/6.44.
    g = hand_graph()
    pruned = prune_graph(g)
    a = pruned_adjacency(g, pruned).toarray()
    assert np.count_nonzero(a) == 8 and a[L1, F2] == 0 and a[F1, E0] == 0 and a[L1, F1] == -3.0
    scores = graph_scores(g, pruned)
    assert scores["pruned_replacement_score"] == pytest.approx(0.7, abs=1e-12)
    assert scores["pruned_completeness_score"] == pytest.approx(5.72 / 6.44, abs=1e-12)
    assert scores["replacement_score"] == pytest.approx(0.60625, abs=1e-12)


def test_a_cycle_is_refused_and_bad_thresholds_too():
    g = hand_graph(dense=True)
    g.adjacency[T, L0] = 1.0  # the logit feeds the token: a cycle
    with pytest.raises(InputError, match="cycle"):
        node_influence(g)
    with pytest.raises(InputError, match="node_threshold"):
        prune_graph(hand_graph(), node_threshold=1.5)
    with pytest.raises(InputError, match="cycle"):
        influence(sp.csr_matrix(np.array([[0.0, 1.0], [1.0, 0.0]])), np.array([1.0, 0.0]), max_iter=50)


# --- a direct dense numpy port of circuit-tracer's formulas, as its graph.py writes them -----


def _ref_normalize(m):
    m = np.abs(m)
    return m / np.clip(m.sum(1, keepdims=True), 1e-10, None)


def _ref_influence(a, w):
    current = w @ a
    total = current.copy()
    for _ in range(1000):
        if not current.any():
            return total
        current = current @ a
        total += current
    raise RuntimeError


def _ref_threshold(scores, fraction):
    s = np.sort(scores)[::-1]
    cum = np.cumsum(s) / s.sum()
    return s[min(int(np.searchsorted(cum, fraction)), len(s) - 1)]


def _ref_prune(a, w, n_features, n_tokens, n_logits, node_t, edge_t):
    inf = _ref_influence(_ref_normalize(a), w)
    node_mask = inf >= _ref_threshold(inf, node_t)
    node_mask[-n_logits - n_tokens :] = True
    pm = a.copy()
    pm[~node_mask] = 0
    pm[:, ~node_mask] = 0
    norm = _ref_normalize(pm)
    edge_scores = norm * (_ref_influence(norm, w) + w)[:, None]
    edge_mask = edge_scores >= _ref_threshold(edge_scores.ravel(), edge_t)
    old = node_mask.copy()
    node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
    while not (node_mask == old).all():
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
    order = np.argsort(-inf, kind="stable")
    cum = np.zeros_like(inf)
    cum[order] = np.cumsum(inf[order]) / inf.sum()
    return node_mask, edge_mask, cum


def _ref_scores(a, w, n_features, n_errors, n_tokens):
    norm = _ref_normalize(a)
    inf = _ref_influence(norm, w)
    err = slice(n_features, n_features + n_errors)
    tok = slice(n_features + n_errors, n_features + n_errors + n_tokens)
    replacement = inf[tok].sum() / (inf[tok].sum() + inf[err].sum())
    out = inf + w
    completeness = ((1 - norm[:, err].sum(1)) * out).sum() / out.sum()
    return replacement, completeness


def random_graph(seed: int, n_layers: int = 3, n_pos: int = 4, n_features: int = 30, n_logits: int = 3):
    """A random graph shaped like an attribution graph: a feature at layer l reads features and
    errors of layers below l and the tokens; logits read everything; edges at positions <= the
    target's."""
    rng = np.random.default_rng(seed)
    layers = np.sort(rng.integers(0, n_layers, n_features))
    pos = rng.integers(0, n_pos, n_features)
    feats = np.stack([layers, pos, rng.integers(0, 500, n_features)], 1)
    order = np.lexsort((feats[:, 2], feats[:, 1], feats[:, 0]))
    feats = feats[order]
    n_err = n_layers * n_pos
    n = n_features + n_err + n_pos + n_logits
    src_layer = np.concatenate([feats[:, 0], np.repeat(np.arange(n_layers), n_pos), np.full(n_pos, -1)])
    src_pos = np.concatenate([feats[:, 1], np.tile(np.arange(n_pos), n_layers), np.arange(n_pos)])
    a = np.zeros((n, n))
    for i in range(n_features):  # feature targets
        ok = (src_layer < feats[i, 0]) & (src_pos <= feats[i, 1])
        a[i, : len(ok)] = np.where(ok & (rng.random(len(ok)) < 0.5), rng.normal(size=len(ok)), 0.0)
    for j in range(n_logits):
        row = n - n_logits + j
        a[row, : len(src_layer)] = np.where(rng.random(len(src_layer)) < 0.6, rng.normal(size=len(src_layer)), 0.0)
    probs = np.sort(rng.dirichlet(np.ones(n_logits + 2))[:n_logits])[::-1]
    return AttributionGraph(
        prompt="x",
        tokens=list(range(n_pos)),
        token_strings=[f"t{i}" for i in range(n_pos)],
        n_layers=n_layers,
        features=feats,
        activations=rng.random(n_features),
        logit_tokens=list(range(100, 100 + n_logits)),
        logit_strings=[f"l{i}" for i in range(n_logits)],
        logit_probabilities=probs,
        adjacency=sp.csr_matrix(a),
        inputs=np.full(n, np.nan),
        bias=np.full(n, np.nan),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("thresholds", [(0.8, 0.98), (0.6, 0.9), (0.9, 0.7)])
def test_matches_a_dense_port_of_circuit_tracer(seed, thresholds):
    g = random_graph(seed)
    a = g.dense()
    w = np.zeros(g.n_nodes)
    w[-g.n_logits :] = g.logit_probabilities
    node_mask, edge_mask, cum = _ref_prune(a, w, g.n_features, g.n_pos, g.n_logits, *thresholds)
    pruned = prune_graph(g, *thresholds)
    np.testing.assert_array_equal(pruned.node_mask, node_mask)
    np.testing.assert_array_equal(pruned.edge_mask.toarray(), edge_mask)
    np.testing.assert_allclose(pruned.cumulative_scores, cum, atol=1e-12)
    assert 0 < pruned.node_mask[: g.n_features].sum() < g.n_features or thresholds[0] >= 0.9
    ref_full = _ref_scores(a, w, g.n_features, g.n_errors, g.n_pos)
    ref_pruned = _ref_scores(np.where(edge_mask & node_mask[:, None] & node_mask[None, :], a, 0.0), w,
                             g.n_features, g.n_errors, g.n_pos)  # fmt: skip
    scores = graph_scores(g, pruned)
    np.testing.assert_allclose([scores["replacement_score"], scores["completeness_score"]], ref_full, atol=1e-12)
    np.testing.assert_allclose(
        [scores["pruned_replacement_score"], scores["pruned_completeness_score"]], ref_pruned, atol=1e-12
    )
    # and the closed form of the influence
    norm = _ref_normalize(a)
    closed = w @ (np.linalg.inv(np.eye(g.n_nodes) - norm) - np.eye(g.n_nodes))
    np.testing.assert_allclose(node_influence(g), closed, atol=1e-10)
