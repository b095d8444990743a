"""A circuit as a self-contained interactive HTML page, and as JSON (nodes, edges, scores).

=====================  =========================================================================
offers                 what
=====================  =========================================================================
circuit_json           the circuit as a JSON-ready dict: ``nodes`` (id, label, kind, layer, head,
                       x, y) and ``edges`` (sender, receiver, kind, score), largest |score| first
circuit_html           one HTML file, no network: the graph drawn as SVG by a small inline script,
                       the data inline; hovering an edge shows its sender, receiver and score,
                       hovering a node highlights its edges, a slider shows the top n edges
MAX_HTML_EDGES         the most edges one page holds (the largest by |score|)
=====================  =========================================================================

The layout is :func:`~depthscope.analyses.circuits.edges.plots.node_positions` (the input on top,
the layers downwards, the logits at the bottom). The page needs no server and loads nothing: open
it from disk. With ``#selftest`` after its address the script also hovers its first edge once and
writes the tooltip's text into ``body[data-selftest]`` (what the tests read from a headless
browser's DOM).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd

from depthscope.analyses.circuits.edges.plots import _shape, circuit_rows, node_positions, receiver_node
from depthscope.common.errors import InputError
from depthscope.common.files import atomic_text

__all__ = ["circuit_json", "circuit_html", "MAX_HTML_EDGES"]

MAX_HTML_EDGES = 5000


def _node(name: str, xy: tuple[float, float]) -> dict:
    if name in ("embed", "logits"):
        kind, layer, head, label = name, None, None, name
    else:
        parts = name.split(".")
        layer = int(parts[0])
        kind = "head" if parts[1] == "heads" else "mlp"
        head = int(parts[2]) if kind == "head" else None
        label = f"head {layer}.{head}" if kind == "head" else f"MLP {layer}"
    return {"id": name, "label": label, "kind": kind, "layer": layer, "head": head, "x": xy[0], "y": xy[1]}


def circuit_json(edges: pd.DataFrame, n_edges: int | None = None) -> dict:
    """The circuit of an edge table (the rows of
    :func:`~depthscope.analyses.circuits.edges.plots.circuit_rows`) as a dict: ``n_layers``,
    ``n_heads``, ``model``, ``method``, ``metric``, ``nodes`` (every node of the graph, with
    ``in_circuit``) and ``edges`` (``sender``, ``receiver``, ``node`` (the receiving node),
    ``kind`` (q, k, v, mlp_in, logits) and ``score``), the largest |score| first."""
    if "score" not in edges.columns:
        raise InputError("circuit_json: the table lacks the column score")
    n_layers, n_heads = _shape(edges)
    rows = circuit_rows(edges, n_edges)
    rows = rows.reindex(rows["score"].abs().sort_values(ascending=False, kind="stable").index)
    out_edges = [
        {
            "sender": s,
            "receiver": r,
            "node": receiver_node(r),
            "kind": "logits" if r == "logits" else r.split(".")[1],
            "score": float(score),
        }
        for s, r, score in zip(rows["sender"], rows["receiver"], rows["score"])
    ]
    used = {e["sender"] for e in out_edges} | {e["node"] for e in out_edges}
    nodes = [{**_node(n, xy), "in_circuit": n in used} for n, xy in node_positions(n_layers, n_heads).items()]
    attrs = edges.attrs
    return {
        "n_layers": n_layers,
        "n_heads": n_heads,
        "model": str(attrs.get("model", "")),
        "method": str(attrs.get("method", "")),
        "metric": str(attrs.get("metric", "")),
        "n_pairs": attrs.get("n_pairs"),
        "nodes": nodes,
        "edges": out_edges,
    }


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 16px; color: #222; }
#graph { border: 1px solid #ddd; background: #fff; }
#tip { position: fixed; pointer-events: none; background: #222; color: #fff; padding: 4px 8px;
       border-radius: 4px; font-size: 12px; display: none; white-space: nowrap; }
.edge { fill: none; stroke-opacity: 0.7; cursor: pointer; }
.edge.k { stroke-dasharray: 6 3; } .edge.v { stroke-dasharray: 2 3; }
.edge.dim { stroke-opacity: 0.06; } .edge.hot { stroke-opacity: 1; }
.node { fill: #ccc; } .node.on { fill: #222; cursor: pointer; }
.label { font-size: 9px; fill: #333; pointer-events: none; }
.legend span { margin-right: 14px; }
</style></head>
<body>
<h2>__TITLE__</h2>
<p>__SUBTITLE__</p>
<p class="legend"><span style="color:#1f5fa8">&#9644; corrupting the edge lowers the metric</span>
<span style="color:#c0392b">&#9644; raises it</span><span>solid: into a query, an MLP or the logits</span>
<span>dashed: into a key</span><span>dotted: into a value</span><span>width: |score|</span></p>
<p><label>edges shown: <input id="count" type="range" min="1" value="1"> <b id="shown"></b></label></p>
<svg id="graph" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="tip"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("data").textContent);
  var NS = "http://www.w3.org/2000/svg", dx = 46, dy = 30, pad = 50;
  var svg = document.getElementById("graph"), tip = document.getElementById("tip");
  var width = pad * 2 + dx * (data.n_heads + 1.5), height = pad * 2 + dy * (data.n_layers + 1);
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  var pos = {};
  data.nodes.forEach(function (n) { pos[n.id] = [pad + dx * n.x, pad + dy * n.y]; });
  var top = data.edges.reduce(function (m, e) { return Math.max(m, Math.abs(e.score)); }, 0) || 1;
  function el(name, attrs) {
    var e = document.createElementNS(NS, name);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    return e;
  }
  function show(text, ev) {
    tip.textContent = text; tip.style.display = "block";
    tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
  }
  function hide() { tip.style.display = "none"; }
  var edges = data.edges.map(function (e) {
    var a = pos[e.sender], b = pos[e.node];
    var mx = (a[0] + b[0]) / 2 + (b[1] - a[1]) * 0.18, my = (a[1] + b[1]) / 2 - (b[0] - a[0]) * 0.18;
    var d = "M" + a[0] + "," + a[1] + " Q" + mx + "," + my + " " + b[0] + "," + b[1];
    var p = el("path", {"class": "edge " + e.kind, d: d, stroke: e.score < 0 ? "#1f5fa8" : "#c0392b",
      "stroke-width": (0.6 + 4 * Math.abs(e.score) / top).toFixed(2)});
    p.dataset.sender = e.sender; p.dataset.node = e.node;
    p.addEventListener("mouseover", function (ev) {
      show(e.sender + " \\u2192 " + e.receiver + "   score " + e.score.toPrecision(4), ev); p.classList.add("hot");
    });
    p.addEventListener("mouseout", function () { hide(); p.classList.remove("hot"); });
    svg.appendChild(p);
    return p;
  });
  data.nodes.forEach(function (n) {
    var xy = pos[n.id];
    var c = el("circle", {"class": "node" + (n.in_circuit ? " on" : ""), cx: xy[0], cy: xy[1],
      r: n.in_circuit ? 5 : 2.5});
    if (n.in_circuit) {
      c.addEventListener("mouseover", function (ev) {
        var mine = 0;
        edges.forEach(function (p) {
          var on = p.dataset.sender === n.id || p.dataset.node === n.id;
          mine += on && p.style.display !== "none" ? 1 : 0;
          p.classList.toggle("dim", !on);
        });
        show(n.label + ": " + mine + " edges shown", ev);
      });
      c.addEventListener("mouseout", function () {
        hide(); edges.forEach(function (p) { p.classList.remove("dim"); });
      });
      var t = el("text", {"class": "label", x: xy[0] + 6, y: xy[1] - 5}); t.textContent = n.label; svg.appendChild(t);
    }
    svg.appendChild(c);
  });
  var slider = document.getElementById("count"), shown = document.getElementById("shown");
  slider.max = Math.max(1, edges.length); slider.value = edges.length;
  function update() {
    var n = +slider.value;
    edges.forEach(function (p, i) { p.style.display = i < n ? "" : "none"; });
    shown.textContent = Math.min(n, edges.length) + " of " + edges.length;
  }
  slider.addEventListener("input", update); update();
  document.body.dataset.edges = String(edges.length);
  if (location.hash === "#selftest" && edges.length) {
    edges[0].dispatchEvent(new MouseEvent("mouseover", {clientX: 10, clientY: 10, bubbles: true}));
    document.body.dataset.selftest = tip.textContent;
  }
})();
</script>
</body></html>
"""


def circuit_html(edges: pd.DataFrame, path, *, n_edges: int | None = None, title: str | None = None) -> Path:
    """Write the circuit of an edge table (:func:`circuit_json`; at most :data:`MAX_HTML_EDGES`
    edges, the largest by |score|) as one self-contained HTML page to ``path``; returns the path."""
    data = circuit_json(edges, n_edges)
    note = ""
    if len(data["edges"]) > MAX_HTML_EDGES:
        note = f" (the {MAX_HTML_EDGES} largest of {len(data['edges'])} edges)"
        data["edges"] = data["edges"][:MAX_HTML_EDGES]
    head = title or f"Circuit of {len(data['edges'])} edges{note}"
    bits = [b for b in (data["method"], data["model"], data["metric"]) if b]
    if data.get("n_pairs"):
        bits.append(f"{data['n_pairs']} pairs")
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    page = (
        _PAGE.replace("__TITLE__", html.escape(head))
        .replace("__SUBTITLE__", html.escape("; ".join(bits)))
        .replace("__DATA__", payload)
    )
    return atomic_text(Path(path), page)
