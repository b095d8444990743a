"""The attribution graph's files, JSON, figure and HTML view (analyses/circuits/features/export.py,
plots.py, html.py) on hand-built graphs: the files reload to the same graph, the node table has
Neuronpedia's ids and the shared site columns, and the graph JSON read back the way
circuit-tracer's frontend reads it (node ids, ``feature_type``, links by ``source``/``target``)
gives the pruned graph's nodes and edges, whose scores recomputed from the JSON alone equal the
summary's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from test_attribution_prune import E0, E1, F0, F1, F2, L0, L1, T, hand_graph, random_graph

from depthscope.analyses.circuits.features.export import GRAPH_FILES, node_table, read_graph, write_graph
from depthscope.analyses.circuits.features.html import attribution_html, attribution_view
from depthscope.analyses.circuits.features.plots import node_layout, plot_attribution_graph
from depthscope.analyses.circuits.features.prune import graph_scores, prune_graph, pruned_adjacency
from depthscope.common.errors import InputError


def _strict(text: str):
    """JSON as a strict parser reads it (no NaN/Infinity)."""

    def refuse(word):
        raise ValueError(f"non-standard JSON constant {word}")

    return json.loads(text, parse_constant=refuse)


def test_node_table_ids_sites_and_values():
    g = hand_graph()
    t = node_table(g)
    # Neuronpedia's ids: feature {layer}_{feature}_{pos}, error {layer}_-1_{pos}, token E_{id}_{pos},
    # logit {n_layers + 1}_{id}_{last pos}
    assert t["node"].tolist() == ["0_7_0", "1_3_0", "1_9_0", "0_-1_0", "1_-1_0", "E_42_0", "3_11_0", "3_12_0"]
    assert t["kind"].tolist() == ["feature"] * 3 + ["error"] * 2 + ["token"] + ["logit"] * 2
    # a feature or error node at layer l is the site l.mlp (index 2l + 2, depth l + 1); a token is embed
    assert t["label"].tolist() == ["0.mlp", "1.mlp", "1.mlp", "0.mlp", "1.mlp", "embed", "logits", "logits"]
    assert t["site"].tolist()[:6] == [2, 4, 4, 2, 4, 0] and t["site"].isna().tolist()[6:] == [True, True]
    assert t["depth"].tolist()[:6] == [1.0, 2.0, 2.0, 1.0, 2.0, 0.0]
    assert t["layer"].tolist()[:6] == [0, 1, 1, 0, 1, -1] and t["layer"].isna().tolist()[6:] == [True, True]
    assert t["sublayer"].tolist() == ["mlp"] * 5 + ["embed"] + ["logits"] * 2
    assert t["feature"].tolist()[:3] == [7, 3, 9] and t["feature"].isna().sum() == 5
    np.testing.assert_allclose(t["activation"][:3], [1.5, 0.5, 2.0])
    np.testing.assert_allclose(t["probability"][[L0, L1]], [0.6, 0.2])
    assert t["probability"].isna().sum() == 6
    np.testing.assert_allclose(t["influence"], [0.14, 0.30, 0.14, 0.075, 0.24, 0.485, 0, 0], atol=1e-12)
    # completeness of the hand graph's targets: input = sum of incoming edges + bias
    a = g.dense()
    targets = [F0, F1, F2, L0, L1]
    np.testing.assert_allclose(t["input"][targets], a[targets].sum(1) + t["bias"][targets])
    assert t["in_pruned_graph"].tolist() == [True, True, True, False, True, True, True, True]
    assert t["token"][T] == "Paris" and t["token"][L0] == " is"


def test_files_round_trip(tmp_path):
    g = hand_graph()
    g.settings = {"max_feature_nodes": 8, "transcoders": "hand-set"}
    paths = write_graph(g, tmp_path / "out")
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(GRAPH_FILES.values())
    back = read_graph(tmp_path / "out")
    assert (back.prompt, back.tokens, back.token_strings, back.n_layers) == ("Paris", [42], ["Paris"], 2)
    assert (back.logit_tokens, back.logit_strings, back.model_name) == ([11, 12], [" is", ","], "hand")
    assert back.settings == g.settings
    np.testing.assert_array_equal(back.features, g.features)
    np.testing.assert_allclose(back.activations, g.activations)
    np.testing.assert_allclose(back.logit_probabilities, g.logit_probabilities)
    np.testing.assert_array_equal(back.dense(), g.dense())
    np.testing.assert_array_equal(back.inputs, g.inputs)  # NaN where the node is a source only
    np.testing.assert_array_equal(back.bias, g.bias)
    # the adjacency is plain scipy: rows targets, columns sources
    a = sp.load_npz(paths["adjacency"])
    assert a.shape == (8, 8) and a[F1, E0] == -1.0 and a[E0, F1] == 0.0
    summary = _strict(paths["summary"].read_text())
    scores = graph_scores(g, prune_graph(g))
    for key, value in scores.items():
        assert summary[key] == pytest.approx(value, abs=1e-12)
    assert summary["pruned_replacement_score"] == pytest.approx(0.7, abs=1e-12)  # worked by hand there
    assert (summary["n_nodes"], summary["n_features"], summary["n_errors"], summary["n_edges"]) == (8, 3, 2, 10)
    assert (summary["pruned_n_nodes"], summary["pruned_n_features"], summary["pruned_n_edges"]) == (7, 3, 8)
    assert (summary["node_threshold"], summary["edge_threshold"]) == (0.8, 0.98)
    table = pd.read_parquet(paths["nodes"])
    assert len(table) == 8 and table["node"][E1] == "1_-1_0"
    # the same graph, reloaded, writes the same files
    write_graph(back, tmp_path / "again")
    assert _strict((tmp_path / "again" / GRAPH_FILES["summary"]).read_text()) == summary
    with pytest.raises(InputError, match="lacks"):
        read_graph(tmp_path / "nowhere")


# --- a reader of the graph JSON written from circuit-tracer's frontend conventions -----------


def read_frontend_json(data: dict, n_layers: int) -> dict:
    """What circuit-tracer's viewer (``frontend/assets/attribution_graph/util-cg.js``,
    ``formatData``) takes from the JSON: nodes by ``node_id`` with their ``feature_type``,
    ``layer`` (``E`` for embeddings, ``n_layers + 1`` for logits), ``ctx_idx``, the logit
    probability parsed from the clerp's ``(p=...)``; links kept when both ends are nodes."""
    nodes = {}
    for d in data["nodes"]:
        kind = {"cross layer transcoder": "feature", "mlp reconstruction error": "error", "embedding": "token",
                "logit": "logit"}[d["feature_type"]]  # fmt: skip
        node = {"kind": kind, "layer": d["layer"], "ctx": d["ctx_idx"], "influence": d["influence"]}
        if kind == "logit":
            node["p"] = float(d["clerp"].split("(p=")[1].split(")")[0])
            assert d["layer"] == str(n_layers + 1) and d["jsNodeId"].startswith("L_")
        if kind == "token":
            assert d["layer"] == "E" and d["node_id"] == f"E_{d['node_id'].split('_')[1]}_{d['ctx_idx']}"
        if kind == "error":
            assert d["feature"] == -1 and d["node_id"] == f"{d['layer']}_-1_{d['ctx_idx']}"
        if kind == "feature":
            layer, feat, ctx = (int(x) for x in d["node_id"].split("_"))
            assert (str(layer), ctx) == (d["layer"], d["ctx_idx"]) and d["jsNodeId"] == f"{layer}_{feat}-0"
            node["feature"] = feat
        assert d["node_id"] not in nodes
        nodes[d["node_id"]] = node
    links = {
        (e["source"], e["target"]): e["weight"] for e in data["links"] if e["source"] in nodes and e["target"] in nodes
    }
    assert len(links) == len(data["links"])
    return {"nodes": nodes, "links": links, "tokens": data["metadata"]["prompt_tokens"]}


def _index_of(graph, node_id: str) -> int:
    """The adjacency index of a Neuronpedia node id in ``graph`` (parsed, not looked up)."""
    parts = node_id.split("_")
    if parts[0] == "E":
        return graph.token_index(int(parts[2]))
    layer, middle, pos = int(parts[0]), int(parts[1]), int(parts[2])
    if layer == graph.n_layers + 1:
        return graph.logit_index(graph.logit_tokens.index(middle))
    if middle == -1:
        return graph.error_index(layer, pos)
    hits = np.flatnonzero((graph.features == [layer, pos, middle]).all(1))
    assert len(hits) == 1
    return int(hits[0])


def _scores_from_links(graph, links: dict) -> tuple[float, float]:
    """circuit-tracer's two scores computed from the JSON's links alone (dense numpy)."""
    n = graph.n_nodes
    a = np.zeros((n, n))
    for (s, t), w in links.items():
        a[_index_of(graph, t), _index_of(graph, s)] = w
    norm = np.abs(a) / np.clip(np.abs(a).sum(1, keepdims=True), 1e-10, None)
    w = np.zeros(n)
    w[graph.kind_slices()["logit"]] = graph.logit_probabilities
    inf = np.zeros(n)
    term = w @ norm
    while term.any():
        inf += term
        term = term @ norm
    s = graph.kind_slices()
    tok, err = inf[s["token"]].sum(), inf[s["error"]].sum()
    out = inf + w
    return tok / (tok + err), ((1 - norm[:, s["error"]].sum(1)) * out).sum() / out.sum()


@pytest.mark.parametrize("which", ["hand", "random"])
def test_graph_json_reads_back_as_the_pruned_graph(tmp_path, which):
    g = hand_graph() if which == "hand" else random_graph(2, n_layers=3, n_pos=5, n_features=60)
    pruned = prune_graph(g)
    paths = write_graph(g, tmp_path, pruned=pruned, slug="my-graph")
    data = _strict(paths["json"].read_text())
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    meta = data["metadata"]
    assert meta["slug"] == "my-graph" and meta["schema_version"] == 1 and meta["node_threshold"] == 0.8
    assert meta["prompt"] == g.prompt and len(meta["prompt_tokens"]) == g.n_pos
    assert _strict(paths["json_index"].read_text())["graphs"][0]["slug"] == "my-graph"
    got = read_frontend_json(data, g.n_layers)
    table = node_table(g, pruned)
    want_nodes = set(table.loc[table["in_pruned_graph"], "node"])
    assert set(got["nodes"]) == want_nodes
    a = pruned_adjacency(g, pruned).tocoo()
    ids = table["node"].tolist()
    want_links = {(ids[c], ids[r]): v for r, c, v in zip(a.row, a.col, a.data)}
    assert got["links"].keys() == want_links.keys()
    for key, weight in want_links.items():
        assert got["links"][key] == pytest.approx(weight, abs=0)
    # every node id parses back to its adjacency index, and the kinds agree with the table
    for node_id, node in got["nodes"].items():
        assert table.at[_index_of(g, node_id), "kind"] == node["kind"]
    probs = sorted(round(n["p"], 3) for n in got["nodes"].values() if n["kind"] == "logit")
    assert probs == sorted(round(float(p), 3) for p in g.logit_probabilities)
    # each node's JSON influence is circuit-tracer's cumulative share (what the viewer's slider reads)
    for node_id, node in got["nodes"].items():
        if node["kind"] != "logit":
            assert node["influence"] == pytest.approx(pruned.cumulative_scores[_index_of(g, node_id)])
    # the pruned graph's scores from the JSON alone equal the summary's
    summary = _strict(paths["summary"].read_text())
    replacement, completeness = _scores_from_links(g, got["links"])
    assert replacement == pytest.approx(summary["pruned_replacement_score"], abs=1e-12)
    assert completeness == pytest.approx(summary["pruned_completeness_score"], abs=1e-12)


def test_layout_keeps_nodes_in_their_row_and_column():
    g = random_graph(1, n_layers=4, n_pos=5, n_features=80)
    t = node_table(g)
    xy = node_layout(t, g.n_layers)
    rows = np.where(t["kind"] == "token", 0, np.where(t["kind"] == "logit", g.n_layers + 1, t["layer"].fillna(0) + 1))
    # a cell's grid stays within its column and its row, centred on the cell
    assert (np.abs(xy["y"] - rows) <= 0.3 + 1e-9).all()
    assert (np.abs(xy["x"] - t["position"]) <= 0.4 + 1e-9).all()
    assert not xy.duplicated().any()  # nodes sharing a cell are side by side, never on top of each other
    cells = pd.DataFrame({"row": rows, "pos": t["position"], "dx": xy["x"] - t["position"], "n": 1})
    for _, cell in cells.groupby(["row", "pos"]):
        assert abs(cell["dx"].mean()) < 1e-9 or len(cell) > 10  # a full first row is centred; single rows too
        assert cell["dx"].nunique() == min(len(cell), 10)  # at most ten side by side


def test_figure_is_drawn(tmp_path):
    g = random_graph(0, n_layers=3, n_pos=4, n_features=30)
    tops = {0: ["Paris", " France"], 3: ["\n", "<s>"]}
    path = plot_attribution_graph(g, tmp_path / "graph.png", top_tokens=tops)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    # a pruning that keeps no feature still draws (tokens and logits only)
    pruned = prune_graph(g, node_threshold=0.0, edge_threshold=0.0)
    plot_attribution_graph(g, tmp_path / "empty.png", pruned=pruned)
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_figure_rank_labels_do_not_overlap(tmp_path, monkeypatch):
    """On a clumped graph (two positions, most features in a few cells) the rank numbers of the
    most influential features are placed where no two overlap, each near its node; the figure's
    edges are capped at ``MAX_FIGURE_EDGES``."""
    from matplotlib import pyplot as plt

    from depthscope.analyses.circuits.features import plots

    g = random_graph(4, n_layers=2, n_pos=2, n_features=90, n_logits=8)
    table = node_table(g, prune_graph(g, node_threshold=1.0, edge_threshold=1.0))
    xy = node_layout(table, g.n_layers)
    shown = table[table["in_pruned_graph"]]
    fig, ax = plt.subplots(figsize=(5, 3))
    plots._axes(ax, g)
    feats = plots._label_features(ax, shown, xy, max_labels=20)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts if t.get_text().isdigit()]
    assert len(boxes) == len(feats) == 20
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b)
    plt.close(fig)
    drawn = []
    real = plots._draw_edges
    monkeypatch.setattr(plots, "_draw_edges", lambda ax, edges, xy: drawn.append(len(edges)) or real(ax, edges, xy))
    monkeypatch.setattr(plots, "MAX_FIGURE_EDGES", 10)
    plot_attribution_graph(g, tmp_path / "capped.png")
    assert drawn == [10] and len(plots.pruned_edges(g, prune_graph(g), node_table(g))) > 10


def _page_data(page: str) -> dict:
    m = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    return _strict(m.group(1).replace("<\\/", "</"))


def test_html_is_self_contained_and_holds_the_pruned_graph(tmp_path):
    g = hand_graph()
    g.token_strings = ["</script><b>Paris"]  # the page must survive any token text
    page = attribution_html(g, tmp_path / "graph.html", top_tokens={F1: ["Paris", "France"]}).read_text()
    assert "<script src" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    data = _page_data(page)
    assert data["tokens"] == ["</script><b>Paris"]
    ids = [n["id"] for n in data["nodes"]]
    assert ids == ["0_7_0", "1_3_0", "1_9_0", "1_-1_0", "E_42_0", "3_11_0", "3_12_0"]  # e0 pruned
    edges = {(ids[e["source"]], ids[e["target"]]): e["weight"] for e in data["edges"]}
    assert len(edges) == 8 and edges[("1_3_0", "3_12_0")] == -3.0 and ("1_9_0", "3_12_0") not in edges
    assert [abs(e["weight"]) for e in data["edges"]] == sorted((abs(e["weight"]) for e in data["edges"]), reverse=True)
    f1 = data["nodes"][ids.index("1_3_0")]
    assert f1["top_tokens"] == ["Paris", "France"] and f1["activation"] == 0.5 and f1["influence"] == pytest.approx(0.3)
    assert data["scores"]["pruned_replacement_score"] == pytest.approx(0.7)
    view = attribution_view(g)
    assert len(view["nodes"]) == 7


def test_html_view_works_in_a_headless_browser(tmp_path):
    """The page draws every node and edge, and clicking the most influential feature (``#selftest``)
    lists its incoming and outgoing edges with their weights, its activation and its top tokens."""
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless browser (apt-get install -y chromium)")
    g = hand_graph()
    page = attribution_html(g, tmp_path / "graph.html", top_tokens={F1: ["Paris", "France"]})
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.resolve().as_uri() + "#selftest"]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'data-nodes="7"' in dom and 'data-edges="8"' in dom
    text = re.search(r'data-selftest="([^"]*)"', dom).group(1)
    # f1 (L1 #3, influence .30) is the most influential feature: input from t (3), outputs to l0 (4), l1 (-3)
    assert text.startswith("L1 #3") and "0.5000" in text and '"Paris"' in text.replace("&quot;", '"')
    assert "incoming edges (1)" in text and "outgoing edges (2)" in text
    assert "-3.000" in text and "4.000" in text and "3.000" in text
    # the panel is fixed at the window's right, in view beside the graph; the graph fits its pane
    assert 'data-panel="fixed visible beside"' in dom and 'data-fits="true"' in dom
    assert 'data-drawn="8"' in dom and 'data-hot="3"' in dom  # all 8 drawn; the clicked node's 3 highlighted


def test_html_view_draws_only_the_largest_edges(tmp_path):
    """A graph with more edges than ``drawn_edges``: the page draws that many, the largest by
    |weight|, and a click draws every edge of the clicked node, listed in the panel."""
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless browser (apt-get install -y chromium)")
    g = random_graph(3, n_layers=4, n_pos=6, n_features=120)
    page = attribution_html(g, tmp_path / "graph.html", drawn_edges=25)
    data = _page_data(page.read_text())
    n_edges = len(data["edges"])
    assert data["drawn_edges"] == 25 and n_edges > 25
    best = max(
        (i for i, n in enumerate(data["nodes"]) if n["kind"] == "feature"), key=lambda i: data["nodes"][i]["influence"]
    )
    degree = sum(best in (e["source"], e["target"]) for e in data["edges"])
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900", "--dump-dom",
           page.resolve().as_uri() + "#selftest"]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert f'data-edges="{n_edges}"' in dom and 'data-drawn="25"' in dom and f'data-hot="{degree}"' in dom
    assert 'data-panel="fixed visible beside"' in dom and 'data-fits="true"' in dom
