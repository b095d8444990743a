"""An attribution graph as files a user can reload, and as circuit-tracer's/Neuronpedia's graph JSON.

=========================  ===================================================================
offers                     what
=========================  ===================================================================
:func:`node_ids`           each node's id string, in adjacency order (Neuronpedia's node ids)
:func:`node_table`         one row per node: id, kind, layer, position, feature, activation,
                           input, bias, probability, influence and the shared site columns
:func:`graph_json`         the pruned graph as circuit-tracer's ``create_graph_files`` writes
                           it: ``metadata``, ``qParams``, ``nodes``, ``links``
:func:`write_graph`        ``nodes.parquet``, ``adjacency.npz``, ``attribution_summary.json``,
                           ``graph.json`` and ``graph-metadata.json`` into a folder
:func:`read_graph`         the :class:`AttributionGraph` back from such a folder
``GRAPH_FILES``            the file names
=========================  ===================================================================

Node ids (circuit-tracer's ``frontend/graph_models.py``, read by Neuronpedia's and
circuit-tracer's graph viewers): a feature ``{layer}_{feature}_{position}``, an error node
``{layer}_-1_{position}``, an input token ``E_{token id}_{position}``, a logit
``{n_layers + 1}_{token id}_{last position}``. The table and the JSON use the same ids. Site
columns: a feature or error node at layer ``l`` is the site ``l.mlp`` (what the MLP writes),
a token ``embed``, a logit has no site (label ``logits``).

The JSON holds only the pruned graph (:func:`~depthscope.analyses.circuits.features.prune.prune_graph`),
as circuit-tracer's does: the kept nodes that have a kept edge (tokens and logits always), the
kept edges with their raw weights (``source``, ``target``, ``weight``), each node's
``influence`` its cumulative share of influence (what the viewers' pruning slider reads). The
parquet table and ``adjacency.npz`` hold the whole graph (``influence`` there is the node's
influence itself; ``cumulative_influence`` the viewers' number; ``in_pruned_graph`` the JSON's
nodes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from depthscope.analyses.circuits.features.graph import AttributionGraph
from depthscope.analyses.circuits.features.prune import PrunedGraph, graph_scores, prune_graph
from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text, atomic_write, json_text

__all__ = ["node_ids", "node_table", "graph_json", "write_graph", "read_graph", "GRAPH_FILES"]

GRAPH_FILES = {
    "nodes": "nodes.parquet",
    "adjacency": "adjacency.npz",
    "summary": "attribution_summary.json",
    "json": "graph.json",
    "json_index": "graph-metadata.json",
}
#: circuit-tracer's ``feature_type`` of each kind
FEATURE_TYPES = {
    "feature": "cross layer transcoder",
    "error": "mlp reconstruction error",
    "token": "embedding",
    "logit": "logit",
}


def _kinds(graph: AttributionGraph) -> np.ndarray:
    s = graph.kind_slices()
    out = np.empty(graph.n_nodes, dtype=object)
    for kind, sl in s.items():
        out[sl] = kind
    return out


def _layer_position(graph: AttributionGraph) -> tuple[np.ndarray, np.ndarray]:
    """Each node's layer (-1 for tokens, ``n_layers`` for logits) and position."""
    n_pos = graph.n_pos
    feats = np.asarray(graph.features, dtype=np.int64).reshape(-1, 3)
    err_layer, err_pos = np.divmod(np.arange(graph.n_errors), max(n_pos, 1))
    layer = np.concatenate(
        [feats[:, 0], err_layer, np.full(n_pos, -1), np.full(graph.n_logits, graph.n_layers)]
    ).astype(np.int64)
    position = np.concatenate([feats[:, 1], err_pos, np.arange(n_pos), np.full(graph.n_logits, n_pos - 1)])
    return layer, position.astype(np.int64)


def node_ids(graph: AttributionGraph) -> list[str]:
    """Each node's id (Neuronpedia's convention, above), in adjacency order."""
    layer, position = _layer_position(graph)
    feats = np.asarray(graph.features, dtype=np.int64).reshape(-1, 3)
    ids = [f"{lay}_{f}_{pos}" for lay, pos, f in feats.tolist()]
    s = graph.kind_slices()
    ids += [f"{layer[i]}_-1_{position[i]}" for i in range(s["error"].start, s["error"].stop)]
    ids += [f"E_{t}_{p}" for p, t in enumerate(graph.tokens)]
    ids += [f"{graph.n_layers + 1}_{t}_{graph.n_pos - 1}" for t in graph.logit_tokens]
    return ids


def _site_columns(kinds: np.ndarray, layer: np.ndarray) -> dict:
    """The shared site columns: ``l.mlp`` for features and errors, ``embed`` for tokens."""
    site, label, sublayer, depth, lay = [], [], [], [], []
    for kind, lyr in zip(kinds, layer.tolist()):
        if kind in ("feature", "error"):
            site.append(2 * lyr + 2), label.append(f"{lyr}.mlp"), sublayer.append("mlp")
            depth.append(lyr + 1.0), lay.append(lyr)
        elif kind == "token":
            site.append(0), label.append("embed"), sublayer.append("embed"), depth.append(0.0), lay.append(-1)
        else:
            site.append(None), label.append("logits"), sublayer.append("logits"), depth.append(None), lay.append(None)
    return {
        "site": pd.array(site, dtype="Int64"),
        "label": label,
        "layer": pd.array(lay, dtype="Int64"),
        "sublayer": sublayer,
        "depth": pd.array(depth, dtype="Float64").astype(float),
    }


def node_table(graph: AttributionGraph, pruned: PrunedGraph | None = None) -> pd.DataFrame:
    """One row per node in adjacency order: ``node`` (its id), ``kind`` (feature, error, token,
    logit), ``layer``, ``position``, ``feature`` (a feature's index in its transcoder),
    ``token_id``/``token`` (a token's or a logit's), ``activation`` (a feature's), ``input`` and
    ``bias`` (a target's input and constant term), ``probability`` (a logit's), ``influence``
    (on the logits), ``cumulative_influence`` and ``in_pruned_graph`` (from ``pruned``, by
    default :func:`prune_graph` at circuit-tracer's thresholds), and the site columns."""
    pruned = prune_graph(graph) if pruned is None else pruned
    n = graph.n_nodes
    if len(pruned.node_mask) != n:
        raise InputError(f"node_table: the pruning has {len(pruned.node_mask)} nodes, the graph {n}")
    kinds = _kinds(graph)
    layer, position = _layer_position(graph)
    s = graph.kind_slices()
    feature = pd.array([None] * n, dtype="Int64")
    feature[s["feature"]] = np.asarray(graph.features, dtype=np.int64).reshape(-1, 3)[:, 2]
    token_id = pd.array([None] * n, dtype="Int64")
    token_id[s["token"]] = np.asarray(graph.tokens, dtype=np.int64)
    token_id[s["logit"]] = np.asarray(graph.logit_tokens, dtype=np.int64)
    token = np.full(n, None, dtype=object)
    token[s["token"]] = list(graph.token_strings)
    token[s["logit"]] = list(graph.logit_strings)
    activation = np.full(n, np.nan)
    activation[s["feature"]] = np.asarray(graph.activations, dtype=np.float64)
    probability = np.full(n, np.nan)
    probability[s["logit"]] = np.asarray(graph.logit_probabilities, dtype=np.float64)
    sites = _site_columns(kinds, layer)
    table = pd.DataFrame(
        {
            "node": node_ids(graph),
            "kind": kinds.astype(str),
            "layer": sites.pop("layer"),
            "position": position,
            "feature": feature,
            "token_id": token_id,
            "token": token,
            "activation": activation,
            "input": np.asarray(graph.inputs, dtype=np.float64),
            "bias": np.asarray(graph.bias, dtype=np.float64),
            "probability": probability,
            "influence": pruned.influence,
            "cumulative_influence": pruned.cumulative_scores,
            "in_pruned_graph": _json_node_mask(graph, pruned),
            **sites,
        }
    )
    return table


def _json_node_mask(graph: AttributionGraph, pruned: PrunedGraph) -> np.ndarray:
    """The nodes circuit-tracer's JSON keeps: kept nodes with a kept edge to or from another
    kept node, and every token and logit."""
    edges = pruned.edge_mask.tocoo()
    keep = pruned.node_mask
    both = keep[edges.row] & keep[edges.col]
    used = np.zeros(graph.n_nodes, dtype=bool)
    used[edges.row[both]] = True
    used[edges.col[both]] = True
    s = graph.kind_slices()
    used[s["token"].start :] = True
    return used & keep


def _process_token(token: str) -> str:
    """circuit-tracer's ``process_token``: newlines, tabs and carriage returns made visible."""
    return token.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _cantor(x: int, y: int) -> int:
    """The Cantor pairing circuit-tracer numbers a feature node's ``feature`` with."""
    return (x + y) * (x + y + 1) // 2 + y


def _json_node(row, n_layers: int, last: int) -> dict:
    """One node as circuit-tracer's ``frontend/graph_models.Node`` writes it."""
    kind = row.kind
    node = {
        "node_id": row.node,
        "ctx_idx": int(row.position),
        "feature_type": FEATURE_TYPES[kind],
        "token_prob": 0.0,
        "is_target_logit": False,
        "run_idx": 0,
        "reverse_ctx_idx": 0,
        "clerp": "",
        "influence": float(row.cumulative_influence),
        "activation": None,
    }
    if kind == "feature":
        lay, f = int(row.layer), int(row.feature)
        node.update(feature=_cantor(lay, f), layer=str(lay), jsNodeId=f"{lay}_{f}-0", activation=float(row.activation))
    elif kind == "error":
        lay, pos = int(row.layer), int(row.position)
        node.update(feature=-1, layer=str(lay), jsNodeId=f"{lay}_-1-{pos}")
    elif kind == "token":
        pos = int(row.position)
        node.update(feature=pos, layer="E", jsNodeId=f"E_{int(row.token_id)}-{pos}")
    else:  # a logit: no influence (circuit-tracer gives it none), its probability in the clerp
        p, tid = float(row.probability), int(row.token_id)
        node.update(feature=tid, layer=str(n_layers + 1), ctx_idx=last, jsNodeId=f"L_{tid}-{last}", token_prob=p)
        node.update(influence=None, is_target_logit=bool(row.target))
        node["clerp"] = f'Output "{_process_token(str(row.token))}" (p={p:.3f})'
    return node


def graph_json(graph: AttributionGraph, pruned: PrunedGraph | None = None, *, slug: str = "attribution-graph") -> dict:
    """The pruned graph as circuit-tracer's ``create_graph_files`` writes it (for its local
    viewer and Neuronpedia's): ``metadata`` (``slug``, ``scan``, ``prompt_tokens``, ``prompt``,
    ``node_threshold``, ``schema_version``; with depthscope's ``generation_settings`` and
    ``pruning_settings``), ``qParams`` (empty: nothing pinned), ``nodes``, ``links``."""
    pruned = prune_graph(graph) if pruned is None else pruned
    table = node_table(graph, pruned)
    table["target"] = False
    first_logit = graph.kind_slices()["logit"].start
    if graph.n_logits:
        table.loc[first_logit, "target"] = True  # circuit-tracer marks the top logit
    kept = table[table["in_pruned_graph"]]
    nodes = [_json_node(row, graph.n_layers, graph.n_pos - 1) for row in kept.itertuples(index=False)]
    ids = table["node"].to_numpy()
    adjacency = sp.csr_matrix(graph.adjacency)
    mask = pruned.edge_mask.tocoo()
    keep = table["in_pruned_graph"].to_numpy()
    on = keep[mask.row] & keep[mask.col]
    rows, cols = mask.row[on], mask.col[on]
    weights = np.asarray(adjacency[rows, cols]).ravel()
    links = [{"source": ids[c], "target": ids[r], "weight": float(w)} for r, c, w in zip(rows, cols, weights)]
    settings = dict(graph.settings)
    scan = str(settings.get("scan") or settings.get("transcoders") or graph.model_name or "depthscope")
    metadata = {
        "slug": slug,
        "scan": scan,
        "transcoder_list": [],
        "prompt_tokens": [_process_token(t) for t in graph.token_strings],
        "prompt": graph.prompt,
        "node_threshold": float(pruned.node_threshold),
        "schema_version": 1,
        "generation_settings": settings,
        "pruning_settings": {"node_threshold": pruned.node_threshold, "edge_threshold": pruned.edge_threshold},
    }
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}


def _summary(graph: AttributionGraph, pruned: PrunedGraph, scores: dict, table: pd.DataFrame) -> dict:
    kinds = table["kind"]
    kept = table["in_pruned_graph"]
    adjacency = sp.csr_matrix(graph.adjacency)
    adjacency.eliminate_zeros()
    return {
        **scores,
        "prompt": graph.prompt,
        "model": graph.model_name,
        "n_layers": graph.n_layers,
        "tokens": [int(t) for t in graph.tokens],
        "token_strings": list(graph.token_strings),
        "logit_tokens": [int(t) for t in graph.logit_tokens],
        "logit_strings": list(graph.logit_strings),
        "logit_probabilities": [float(p) for p in graph.logit_probabilities],
        "n_nodes": graph.n_nodes,
        "n_features": graph.n_features,
        "n_errors": graph.n_errors,
        "n_tokens": graph.n_pos,
        "n_logits": graph.n_logits,
        "n_edges": int(adjacency.nnz),
        "pruned_n_nodes": int(kept.sum()),
        "pruned_n_features": int((kept & (kinds == "feature")).sum()),
        "pruned_n_errors": int((kept & (kinds == "error")).sum()),
        "pruned_n_edges": int(pruned.edge_mask.nnz),
        "node_threshold": pruned.node_threshold,
        "edge_threshold": pruned.edge_threshold,
        "settings": dict(graph.settings),
        "files": dict(GRAPH_FILES),
    }


def _save_npz(path: str, matrix: sp.csr_matrix) -> None:
    """``scipy.sparse.save_npz`` into exactly ``path`` (given a name, it would append ``.npz``)."""
    with open(path, "wb") as f:
        sp.save_npz(f, matrix, compressed=True)


def write_graph(
    graph: AttributionGraph, out_dir, *, pruned: PrunedGraph | None = None, slug: str = "attribution-graph"
) -> dict:
    """Write ``graph`` into ``out_dir``: ``nodes.parquet`` (:func:`node_table`),
    ``adjacency.npz`` (``scipy.sparse.save_npz``; rows targets, columns sources),
    ``attribution_summary.json`` (both scores of the full and the pruned graph, node and edge
    counts, the settings, the prompt and the targets), ``graph.json`` (:func:`graph_json`) and
    ``graph-metadata.json`` (circuit-tracer's index of the graphs in a folder). ``pruned``
    defaults to :func:`prune_graph` at 0.8 and 0.98. Every file is written atomically; returns
    ``{name: path}`` (the keys of :data:`GRAPH_FILES`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pruned = prune_graph(graph) if pruned is None else pruned
    table = node_table(graph, pruned)
    scores = graph_scores(graph, pruned)
    paths = {name: out / file for name, file in GRAPH_FILES.items()}
    atomic_write(paths["nodes"], lambda t: table.to_parquet(t, index=False))
    adjacency = sp.csr_matrix(graph.adjacency)
    atomic_write(paths["adjacency"], lambda t: _save_npz(t, adjacency))
    atomic_text(paths["summary"], json_text(_summary(graph, pruned, scores, table)))
    data = graph_json(graph, pruned, slug=slug)
    atomic_text(paths["json"], json_text(data, indent=None))
    atomic_text(paths["json_index"], json_text({"graphs": [data["metadata"]]}))
    return paths


def _nan(values) -> np.ndarray:
    return pd.to_numeric(pd.Series(values), errors="coerce").astype(float).to_numpy()


def read_graph(out_dir) -> AttributionGraph:
    """The :class:`AttributionGraph` that :func:`write_graph` wrote into ``out_dir`` (nodes,
    adjacency, prompt, targets and settings; the pruning is in the table's
    ``in_pruned_graph``)."""
    folder = Path(out_dir)
    missing = [f for f in ("nodes", "adjacency", "summary") if not (folder / GRAPH_FILES[f]).is_file()]
    if missing:
        raise InputError(f"read_graph: {folder} lacks {[GRAPH_FILES[f] for f in missing]} (write it with write_graph)")
    table = pd.read_parquet(folder / GRAPH_FILES["nodes"])
    summary = json.loads((folder / GRAPH_FILES["summary"]).read_text(encoding="utf-8"))
    adjacency = sp.load_npz(folder / GRAPH_FILES["adjacency"]).tocsr()
    feats = table[table["kind"] == "feature"]
    features = feats[["layer", "position", "feature"]].to_numpy(dtype=np.int64).reshape(-1, 3)
    graph = AttributionGraph(
        prompt=summary["prompt"],
        tokens=[int(t) for t in summary["tokens"]],
        token_strings=list(summary["token_strings"]),
        n_layers=int(summary["n_layers"]),
        features=features,
        activations=feats["activation"].to_numpy(dtype=np.float64),
        logit_tokens=[int(t) for t in summary["logit_tokens"]],
        logit_strings=list(summary["logit_strings"]),
        logit_probabilities=_nan(summary["logit_probabilities"]),
        adjacency=adjacency,
        inputs=_nan(table["input"]),
        bias=_nan(table["bias"]),
        model_name=summary.get("model") or "",
        settings=dict(summary.get("settings") or {}),
    )
    if graph.n_nodes != len(table) or adjacency.shape != (len(table), len(table)):
        raise InputError(
            f"read_graph: {folder} is inconsistent: {len(table)} nodes in the table, adjacency {adjacency.shape}, "
            f"{graph.n_nodes} nodes from the summary's tokens and logits"
        )
    return graph
