"""The attribution graph as one self-contained interactive HTML page (no network, data inline).

=========================  ===================================================================
offers                     what
=========================  ===================================================================
:func:`attribution_view`   the pruned graph as a JSON-ready dict: ``nodes`` (kind, layer,
                           position, feature, place, activation, influence, input, top tokens)
                           and ``edges`` (source, target, weight), the scores and the prompt
:func:`attribution_html`   one HTML file: the nodes laid out by layer (rows, logits on top) and
                           position (columns, the prompt's tokens); click a node to see its
                           incoming and outgoing edges with their weights, its activation,
                           influence and the tokens it writes to most
``MAX_HTML_EDGES``         the most edges one page holds (the largest by |weight|)
``DRAWN_EDGES``            how many of them it draws until a node is clicked
=========================  ===================================================================

Like the edge circuits' page (:mod:`depthscope.analyses.circuits.edges.html`): an inline script
draws SVG from the JSON in a ``<script type="application/json">`` element; the page loads nothing
and needs no server. With ``#selftest`` after its address the script clicks the most influential
feature once and writes the side panel's text into ``body[data-selftest]`` (what the tests read
from a headless browser's DOM).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from depthscope.analyses.circuits.features.export import node_table
from depthscope.analyses.circuits.features.plots import node_layout, pruned_edges
from depthscope.analyses.circuits.features.prune import PrunedGraph, graph_scores, prune_graph
from depthscope.common.files import atomic_text

__all__ = ["attribution_view", "attribution_html", "MAX_HTML_EDGES", "DRAWN_EDGES"]

#: the most edges one page holds, and how many of the largest it draws until a node is clicked
MAX_HTML_EDGES = 5000
DRAWN_EDGES = 300


def _num(value) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


def _label(row) -> str:
    if row.kind == "feature":
        return f"L{int(row.layer)} #{int(row.feature)}"
    if row.kind == "error":
        return f"error L{int(row.layer)}"
    return str(row.token)


def attribution_view(
    graph, pruned: PrunedGraph | None = None, *, top_tokens: dict[int, list[str]] | None = None
) -> dict:
    """The pruned graph of ``graph`` (``pruned`` by default :func:`prune_graph` at 0.8 and
    0.98) as a dict for the page: ``nodes`` (``index`` in the adjacency, ``id``, ``kind``,
    ``label``, ``layer``, ``position``, ``feature``, ``x``, ``y``, ``activation``,
    ``influence``, ``input``, ``bias``, ``probability``, ``token``, ``top_tokens``), ``edges``
    (``source``, ``target`` as indices into ``nodes``, ``weight``; largest |weight| first),
    ``tokens``, ``prompt``, ``model``, ``n_layers``, ``scores``, ``thresholds``."""
    pruned = prune_graph(graph) if pruned is None else pruned
    table = node_table(graph, pruned)
    xy = node_layout(table, graph.n_layers)
    edges = pruned_edges(graph, pruned, table)
    kept = table[table["in_pruned_graph"]]
    where = {int(i): k for k, i in enumerate(kept.index)}
    tops = top_tokens or {}
    nodes = [
        {
            "index": int(row.Index),
            "id": row.node,
            "kind": row.kind,
            "label": _label(row),
            "layer": None if row.kind == "logit" else int(row.layer),
            "position": int(row.position),
            "feature": None if row.kind != "feature" else int(row.feature),
            "x": float(xy.at[row.Index, "x"]),
            "y": float(xy.at[row.Index, "y"]),
            "activation": _num(row.activation),
            "influence": _num(row.influence),
            "input": _num(row.input),
            "bias": _num(row.bias),
            "probability": _num(row.probability),
            "token": None if row.token is None else str(row.token),
            "top_tokens": [str(t) for t in tops.get(int(row.Index), [])],
        }
        for row in kept.itertuples()
    ]
    out_edges = [
        {"source": where[int(e.source)], "target": where[int(e.target)], "weight": float(e.weight)}
        for e in edges.itertuples(index=False)
    ]
    return {
        "prompt": graph.prompt,
        "model": graph.model_name,
        "n_layers": graph.n_layers,
        "tokens": [str(t) for t in graph.token_strings],
        "scores": {k: _num(v) for k, v in graph_scores(graph, pruned).items()},
        "thresholds": {"node": pruned.node_threshold, "edge": pruned.edge_threshold},
        "n_features": graph.n_features,
        "nodes": nodes,
        "edges": out_edges,
    }


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>__TITLE__</title>
<style>
html { overflow-y: scroll; }  /* the scrollbar from the start: the graph is sized to the width left */
body { font: 13px system-ui, sans-serif; margin: 16px 416px 16px 16px; color: #222; }
#pane { overflow-x: auto; border: 1px solid #ddd; }
#graph { background: #fff; display: block; }
#panel { position: fixed; top: 0; right: 0; width: 380px; height: 100vh; box-sizing: border-box;
         overflow-y: auto; padding: 8px 12px; border-left: 1px solid #ddd; background: #fafafa; }
#panel h3 { margin: 4px 0 8px; } #panel table { border-collapse: collapse; width: 100%; }
#panel td { padding: 1px 6px; } #panel td.w { text-align: right; font-variant-numeric: tabular-nums; }
#panel tr.link { cursor: pointer; } #panel tr.link:hover { background: #f2f2f2; }
#tip { position: fixed; pointer-events: none; background: #222; color: #fff; padding: 4px 8px;
       border-radius: 4px; font-size: 12px; display: none; white-space: nowrap; }
.edge { fill: none; stroke-opacity: 0.25; } .edge.dim { stroke-opacity: 0.04; }
.edge.hot { stroke-opacity: 0.9; }
.node { cursor: pointer; stroke: #fff; stroke-width: 0.8; } .node.sel { stroke: #000; stroke-width: 2.5; }
.axis { font-size: 11px; fill: #555; } .lab { font-size: 9px; fill: #333; pointer-events: none; }
.pos { color: #c0392b; } .neg { color: #1f5fa8; } .muted { color: #777; }
</style></head>
<body>
<h2>__TITLE__</h2>
<p>__SUBTITLE__</p>
<p class="muted">Rows: layers (the input tokens at the bottom, the logits on top); columns: positions.
Red dots: features (area: influence on the logits); grey squares: error nodes; diamonds: tokens and
logits. Edges: red positive, blue negative. Click a node for its edges.</p>
<p>Edges drawn: the <input id="ndraw" type="number" min="0" step="50" style="width:5em"> largest by |weight|
of __NEDGES__; a clicked node's edges are all drawn, and listed in the panel.</p>
<div id="pane"><svg id="graph" xmlns="http://www.w3.org/2000/svg"></svg></div>
<div id="panel"><p class="muted">Click a node.</p></div>
<div id="tip"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("data").textContent);
  var NS = "http://www.w3.org/2000/svg", left = 50, top = 80, bottom = 60;
  var svg = document.getElementById("graph"), tip = document.getElementById("tip");
  var panel = document.getElementById("panel"), pane = document.getElementById("pane");
  var nPos = data.tokens.length, nRows = data.n_layers + 2;
  // the graph fits the pane's width (the panel is fixed at the right); the pane scrolls sideways
  // only when a column would be narrower than 70 px (long prompts)
  var colW = Math.max(70, ((pane.clientWidth || 900) - left - 20) / nPos);
  var rowH = 30;
  var width = left + colW * nPos + 20, height = top + rowH * (nRows - 1) + bottom;
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  function px(n) { return [left + colW * (n.x + 0.5), top + rowH * (nRows - 1 - n.y)]; }
  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    (parent || svg).appendChild(e);
    return e;
  }
  function fmt(v) { return v === null || v === undefined ? "\\u2013" : Number(v).toPrecision(4); }
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) {
    return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]; }); }
  for (var r = 0; r < nRows; r++) {
    var y = top + rowH * (nRows - 1 - r);
    el("line", {x1: left, x2: width - 10, y1: y, y2: y, stroke: "#eee"});
    var t = el("text", {"class": "axis", x: left - 8, y: y + 4, "text-anchor": "end"});
    t.textContent = r === 0 ? "tokens" : (r === nRows - 1 ? "logits" : "L" + (r - 1));
  }
  data.tokens.forEach(function (tok, i) {
    var x = left + colW * (i + 0.5), y0 = top + rowH * (nRows - 1) + 16;
    var t = el("text", {"class": "axis", x: x, y: y0, transform: "rotate(35 " + x + " " + y0 + ")"});
    t.textContent = JSON.stringify(tok).slice(1, -1);
  });
  var topW = data.edges.reduce(function (m, e) { return Math.max(m, Math.abs(e.weight)); }, 0) || 1;
  var gEdges = el("g", {}), gNodes = el("g", {});
  var incoming = data.nodes.map(function () { return []; });
  var outgoing = data.nodes.map(function () { return []; });
  var paths = data.edges.map(function (e, i) {
    var a = px(data.nodes[e.source]), b = px(data.nodes[e.target]);
    incoming[e.target].push(i); outgoing[e.source].push(i);
    return el("line", {"class": "edge", x1: a[0], y1: a[1], x2: b[0], y2: b[1],
      stroke: e.weight < 0 ? "#1f5fa8" : "#c0392b",
      "stroke-width": (0.4 + 3 * Math.abs(e.weight) / topW).toFixed(2)}, gEdges);
  });
  var gHot = svg.insertBefore(document.createElementNS(NS, "g"), gNodes), nDraw = document.getElementById("ndraw");
  function showTop(k) {  // only the k largest edges (data.edges is sorted by |weight|)
    k = Math.max(0, Math.min(k, paths.length));
    paths.forEach(function (p, j) { p.style.display = j < k ? "" : "none"; });
    document.body.dataset.drawn = String(k);
  }
  nDraw.value = data.drawn_edges; showTop(data.drawn_edges);
  nDraw.addEventListener("change", function () { showTop(+nDraw.value || 0); });
  var bigInf = data.nodes.reduce(function (m, n) {
    return n.kind === "feature" || n.kind === "error" ? Math.max(m, n.influence || 0) : m; }, 0) || 1;
  var colour = {feature: "#d62728", error: "#999999", token: "#555555", logit: "#1f5fa8"};
  var shapes = data.nodes.map(function (n, i) {
    var p = px(n), s, rad = 2.5 + 4.5 * Math.sqrt((n.influence || 0) / bigInf);
    if (n.kind === "feature") {
      s = el("circle", {cx: p[0], cy: p[1], r: rad.toFixed(2)}, gNodes);
    } else if (n.kind === "error") {
      s = el("rect", {x: p[0] - rad, y: p[1] - rad, width: 2 * rad, height: 2 * rad}, gNodes);
    } else {
      s = el("path", {d: "M" + p[0] + "," + (p[1] - 6) + " l6,6 l-6,6 l-6,-6 z"}, gNodes);
    }
    s.setAttribute("class", "node"); s.setAttribute("fill", colour[n.kind]);
    s.addEventListener("mouseover", function (ev) {
      tip.textContent = n.label + "  influence " + fmt(n.influence); tip.style.display = "block";
      tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
    });
    s.addEventListener("mouseout", function () { tip.style.display = "none"; });
    s.addEventListener("click", function () { select(i); });
    if (n.kind === "logit") {
      var lx = p[0] + 3, ly = p[1] - 9;  // upright, so that neighbouring logits' labels do not overlap
      var lt = el("text", {"class": "lab", x: lx, y: ly, transform: "rotate(-90 " + lx + " " + ly + ")"}, gNodes);
      lt.textContent = JSON.stringify(n.token).slice(1, -1) + " " + Number(n.probability).toFixed(3);
    }
    return s;
  });
  function rows(list, other) {
    if (!list.length) { return "<p class='muted'>none in the pruned graph</p>"; }
    var size = function (k) { return Math.abs(data.edges[k].weight); };
    list = list.slice().sort(function (a, b) { return size(b) - size(a); });
    return "<table>" + list.map(function (k) {
      var e = data.edges[k], m = data.nodes[e[other]];
      return "<tr class='link' data-node='" + e[other] + "'><td>" + esc(m.label) + "</td><td class='muted'>pos " +
        m.position + "</td><td class='w " + (e.weight < 0 ? "neg" : "pos") + "'>" + fmt(e.weight) + "</td></tr>";
    }).join("") + "</table>";
  }
  function select(i) {
    var n = data.nodes[i];
    shapes.forEach(function (s, k) { s.classList.toggle("sel", k === i); });
    var mine = {};
    incoming[i].concat(outgoing[i]).forEach(function (k) { mine[k] = true; });
    paths.forEach(function (p, k) { p.classList.toggle("dim", !mine[k]); });
    while (gHot.firstChild) { gHot.removeChild(gHot.firstChild); }
    Object.keys(mine).forEach(function (k) { var c = gHot.appendChild(paths[k].cloneNode());
      c.setAttribute("class", "edge hot"); c.removeAttribute("style"); });
    document.body.dataset.hot = String(gHot.childNodes.length);
    var h = "<h3>" + esc(n.label) + "</h3><p>" + n.kind + " at position " + n.position + " (" +
      esc(JSON.stringify(data.tokens[n.position])) + ")" + (n.layer !== null ? ", layer " + n.layer : "") + "</p>";
    h += "<table><tr><td>activation</td><td class='w'>" + fmt(n.activation) + "</td></tr>" +
      "<tr><td>influence on the logits</td><td class='w'>" + fmt(n.influence) + "</td></tr>" +
      "<tr><td>input (pre-activation / logit)</td><td class='w'>" + fmt(n.input) + "</td></tr>" +
      "<tr><td>bias</td><td class='w'>" + fmt(n.bias) + "</td></tr>" +
      (n.probability !== null ? "<tr><td>probability</td><td class='w'>" + fmt(n.probability) + "</td></tr>" : "") +
      "</table>";
    if (n.top_tokens.length) {
      h += "<p><b>writes to most</b>: " + n.top_tokens.map(function (t) {
        return "<code>" + esc(JSON.stringify(t)) + "</code>"; }).join(" ") + "</p>";
    }
    h += "<p><b>incoming edges</b> (" + incoming[i].length + ")</p>" + rows(incoming[i], "source");
    h += "<p><b>outgoing edges</b> (" + outgoing[i].length + ")</p>" + rows(outgoing[i], "target");
    panel.innerHTML = h;
    Array.prototype.forEach.call(panel.querySelectorAll("tr.link"), function (tr) {
      tr.addEventListener("click", function () { select(+tr.dataset.node); });
    });
  }
  svg.addEventListener("click", function (ev) {
    if (ev.target === svg) {
      shapes.forEach(function (s) { s.classList.remove("sel"); });
      paths.forEach(function (p) { p.classList.remove("dim"); });
      while (gHot.firstChild) { gHot.removeChild(gHot.firstChild); }
    }
  });
  document.body.dataset.nodes = String(data.nodes.length);
  document.body.dataset.edges = String(data.edges.length);
  var best = -1;
  data.nodes.forEach(function (n, i) {
    if (n.kind === "feature" && (best < 0 || n.influence > data.nodes[best].influence)) { best = i; }
  });
  if (location.hash === "#selftest" && best >= 0) {
    shapes[best].dispatchEvent(new MouseEvent("click", {bubbles: true}));
    document.body.dataset.selftest = panel.textContent;
    var box = panel.getBoundingClientRect();  // the panel in view, beside the graph, not under it
    document.body.dataset.panel = getComputedStyle(panel).position + " " +
      (box.left >= 0 && box.right <= window.innerWidth && box.top >= 0 ? "visible" : "hidden") + " " +
      (pane.getBoundingClientRect().right <= box.left ? "beside" : "under");
    document.body.dataset.fits = String(svg.getBoundingClientRect().width <= pane.clientWidth + 1);
  }
})();
</script>
</body></html>
"""


def attribution_html(
    graph,
    path,
    *,
    pruned: PrunedGraph | None = None,
    top_tokens: dict[int, list[str]] | None = None,
    title: str | None = None,
    drawn_edges: int = DRAWN_EDGES,
) -> Path:
    """Write the pruned graph of ``graph`` (:func:`attribution_view`; at most
    :data:`MAX_HTML_EDGES` edges, the largest by |weight|) as one self-contained HTML page to
    ``path``; ``top_tokens`` (adjacency index -> the tokens a feature's decoder writes to most)
    shows in each feature's panel. The page draws the ``drawn_edges`` largest edges (a box on
    the page changes it) and all the edges of a clicked node; the panel with the clicked node's
    details is fixed at the window's right edge and the graph fits the width beside it. Returns
    the path."""
    data = attribution_view(graph, pruned, top_tokens=top_tokens)
    note = ""
    if len(data["edges"]) > MAX_HTML_EDGES:
        note = f" (the {MAX_HTML_EDGES} largest of {len(data['edges'])} edges)"
        data["edges"] = data["edges"][:MAX_HTML_EDGES]
    data["drawn_edges"] = min(int(drawn_edges), len(data["edges"]))
    n_feat = sum(n["kind"] == "feature" for n in data["nodes"])
    head = title or f"Attribution graph: {n_feat} of {data['n_features']} features, {len(data['edges'])} edges{note}"
    s = data["scores"]
    bits = [b for b in (data["model"], repr(data["prompt"])) if b]
    for name, key in (("replacement", "replacement_score"), ("completeness", "completeness_score")):
        full, pr = s.get(key), s.get(f"pruned_{key}")
        if full is not None:
            bits.append(f"{name} {full:.3f}" + (f" (pruned {pr:.3f})" if pr is not None else ""))
    bits.append(
        f"pruned at {data['thresholds']['node']:g} of node and {data['thresholds']['edge']:g} of edge influence"
    )
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    page = (
        _PAGE.replace("__TITLE__", html.escape(head))
        .replace("__SUBTITLE__", html.escape("; ".join(bits)))
        .replace("__NEDGES__", str(len(data["edges"])))
        .replace("__DATA__", payload)
    )
    return atomic_text(Path(path), page)
