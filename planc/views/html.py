"""A communication graph as one self-contained HTML page to explore offline.

planc lays the graph out itself (layers by longest path, order within a layer by the
barycentre heuristic of Sugiyama et al. 1981), so the page needs no Graphviz and no
network: the positions and every node's attributes are embedded as JSON, and a little
script draws them as SVG with pan, zoom, search, filters by axis and phase, and a
panel that shows a node's attributes and reason when it is clicked.
"""

from __future__ import annotations

import html as html_escape
import json
from collections import defaultdict

import networkx as nx

from planc.views.dot import AXIS_COLORS, AXIS_FILLS, PHASE_FILLS, node_label

NODE_WIDTH, NODE_HEIGHT, GAP_X, GAP_Y = 168, 46, 26, 38
SWEEPS = 6


def _layout(graph: nx.DiGraph) -> dict[str, tuple[float, float]]:
    rank: dict[str, int] = {}
    for node in nx.topological_sort(graph):
        rank[node] = max((rank[p] + 1 for p in graph.predecessors(node)), default=0)
    rows: dict[int, list[str]] = defaultdict(list)
    for node in sorted(graph.nodes, key=lambda n: (graph.nodes[n]["stage"],
                                                   graph.nodes[n]["layer"] or -1, n)):
        rows[rank[node]].append(node)
    position = {node: i for row in rows.values() for i, node in enumerate(row)}
    for sweep in range(SWEEPS):
        ranks = sorted(rows) if sweep % 2 == 0 else sorted(rows, reverse=True)
        for r in ranks:
            neighbours = graph.predecessors if sweep % 2 == 0 else graph.successors

            def centre(node: str) -> float:
                near = [position[n] for n in neighbours(node)]
                return sum(near) / len(near) if near else position[node]

            rows[r].sort(key=centre)
            for i, node in enumerate(rows[r]):
                position[node] = i
    width = max((len(row) for row in rows.values()), default=1)
    coordinates = {}
    for r, row in rows.items():
        offset = (width - len(row)) * (NODE_WIDTH + GAP_X) / 2
        for i, node in enumerate(row):
            coordinates[node] = (offset + i * (NODE_WIDTH + GAP_X), r * (NODE_HEIGHT + GAP_Y))
    return coordinates


def _payload(graph: nx.DiGraph, title: str) -> dict:
    coordinates = _layout(graph)
    nodes = []
    for node, data in graph.nodes(data=True):
        x, y = coordinates[node]
        if data["type"] == "transfer":
            fill, stroke = AXIS_FILLS.get(data["axis"], "#eee"), AXIS_COLORS.get(data["axis"],
                                                                                "#333")
        else:
            fill, stroke = PHASE_FILLS[data["phase"]], "#6b7b8c"
        nodes.append({"id": node, "x": x, "y": y, "label": node_label(node, data).split("\n"),
                      "fill": fill, "stroke": stroke,
                      "attrs": {k: v for k, v in data.items() if v is not None}})
    edges = [{"source": u, "target": v, "kind": d.get("kind", "data")}
             for u, v, d in graph.edges(data=True)]
    axes = sorted({d["axis"] for _, d in graph.nodes(data=True) if d["type"] == "transfer"})
    return {"title": title, "nodes": nodes, "edges": edges, "axes": axes,
            "axisColors": AXIS_COLORS, "phaseFills": PHASE_FILLS,
            "size": [NODE_WIDTH, NODE_HEIGHT]}


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { margin: 0; font: 13px/1.4 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
         color: #1f2933; display: grid; grid-template-columns: 1fr 360px;
         grid-template-rows: auto 1fr; height: 100vh; }
  header { grid-column: 1 / 3; padding: 8px 14px; border-bottom: 1px solid #d9e2ec;
           display: flex; gap: 16px; align-items: center; flex-wrap: wrap; }
  header h1 { font-size: 15px; margin: 0 12px 0 0; }
  label { white-space: nowrap; }
  #canvas { overflow: hidden; cursor: grab; background: #fbfcfd; }
  #canvas.dragging { cursor: grabbing; }
  aside { border-left: 1px solid #d9e2ec; padding: 10px 14px; overflow: auto; }
  aside h2 { font-size: 14px; margin: 4px 0 8px; word-break: break-all; }
  aside table { border-collapse: collapse; width: 100%; }
  aside td { border-bottom: 1px solid #eef2f6; padding: 3px 4px; vertical-align: top;
             word-break: break-word; }
  aside td:first-child { color: #52606d; width: 110px; }
  .reason { background: #fff8e1; border-left: 3px solid #f0b429; padding: 6px 8px;
            margin: 8px 0; }
  .swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px;
            vertical-align: -1px; margin-right: 3px; border: 2px solid; }
  svg text { font-size: 11px; pointer-events: none; }
  .node rect { stroke-width: 1.2; }
  .node.transfer rect { stroke-width: 2.2; }
  .node.recompute rect { stroke-dasharray: 4 3; }
  .node { cursor: pointer; }
  .faded { opacity: 0.15; }
  .hidden { display: none; }
  .selected rect { stroke: #f0b429 !important; stroke-width: 4 !important; }
  .match rect { stroke: #0b6bcb !important; stroke-width: 3 !important; }
  path.edge { fill: none; stroke: #9aa5b1; stroke-width: 1.1; }
  path.saved { stroke-dasharray: 4 3; stroke: #cbd2d9; }
  input[type=search] { padding: 3px 6px; width: 180px; }
</style></head>
<body>
<header>
  <h1>__TITLE__</h1>
  <span id="counts"></span>
  <span id="axes"></span>
  <span id="phases"></span>
  <label><input type="checkbox" id="transfersOnly"> transfers only</label>
  <input type="search" id="search" placeholder="search nodes">
  <button id="fit">fit</button>
</header>
<div id="canvas"><svg id="svg" width="100%" height="100%">
  <defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7"
    markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"
    fill="#9aa5b1"/></marker></defs><g id="world"></g></svg></div>
<aside id="panel"><h2>Click a node</h2>
<p>Boxes are compute steps (blue: forward, orange: backward, green: optimizer; dashed:
recomputed). Bold boxes are transfers, coloured by mesh axis. Drag to pan, scroll to zoom,
click a node for its attributes and the reason a transfer exists; its ancestors and
descendants stay lit.</p></aside>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const [W, H] = data.size;
const NS = "http://www.w3.org/2000/svg";
const world = document.getElementById("world");
const svg = document.getElementById("svg");
const byId = new Map(data.nodes.map(n => [n.id, n]));
const succ = new Map(), pred = new Map();
for (const n of data.nodes) { succ.set(n.id, []); pred.set(n.id, []); }
for (const e of data.edges) { succ.get(e.source).push(e.target); pred.get(e.target).push(e.source); }
function el(tag, attrs, parent) {
  const x = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) x.setAttribute(k, v);
  if (parent) parent.appendChild(x);
  return x;
}
const edgeLayer = el("g", {}, world), nodeLayer = el("g", {}, world);
const edgeEls = data.edges.map(e => {
  const a = byId.get(e.source), b = byId.get(e.target);
  const x1 = a.x + W / 2, y1 = a.y + H, x2 = b.x + W / 2, y2 = b.y, my = (y1 + y2) / 2;
  const p = el("path", {d: `M${x1},${y1} C${x1},${my} ${x2},${my} ${x2},${y2}`,
    class: "edge " + e.kind, "marker-end": "url(#arrow)"}, edgeLayer);
  return {e, p};
});
const nodeEls = new Map();
for (const n of data.nodes) {
  const cls = "node " + n.attrs.type + (n.attrs.recompute ? " recompute" : "");
  const g = el("g", {class: cls, transform: `translate(${n.x},${n.y})`}, nodeLayer);
  el("rect", {width: W, height: H, rx: 7, fill: n.fill, stroke: n.stroke}, g);
  n.label.slice(0, 3).forEach((line, i) => {
    const t = el("text", {x: W / 2, y: 14 + i * 13, "text-anchor": "middle",
      fill: n.attrs.type === "transfer" ? n.stroke : "#1f2933"}, g);
    t.textContent = line.length > 28 ? line.slice(0, 27) + "\u2026" : line;
  });
  const title = el("title", {}, g);
  title.textContent = n.attrs.reason || n.id;
  g.addEventListener("click", ev => { ev.stopPropagation(); select(n.id); });
  nodeEls.set(n.id, g);
}
function reach(start, next) {
  const seen = new Set([start]), stack = [start];
  while (stack.length) for (const m of next.get(stack.pop())) if (!seen.has(m)) { seen.add(m); stack.push(m); }
  return seen;
}
let selected = null;
function fmt(v) { return typeof v === "object" ? JSON.stringify(v) : String(v); }
function select(id) {
  selected = id;
  const lit = id ? new Set([...reach(id, succ), ...reach(id, pred)]) : null;
  for (const [nid, g] of nodeEls) {
    g.classList.toggle("faded", !!lit && !lit.has(nid));
    g.classList.toggle("selected", nid === id);
  }
  for (const {e, p} of edgeEls) p.classList.toggle("faded", !!lit && !(lit.has(e.source) && lit.has(e.target)));
  const panel = document.getElementById("panel");
  if (!id) return;
  const n = byId.get(id);
  panel.innerHTML = "";
  const h = document.createElement("h2"); h.textContent = id; panel.appendChild(h);
  if (n.attrs.reason) { const r = document.createElement("div"); r.className = "reason"; r.textContent = n.attrs.reason; panel.appendChild(r); }
  const table = document.createElement("table");
  for (const [k, v] of Object.entries(n.attrs)) {
    if (k === "reason") continue;
    const tr = table.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = fmt(v);
  }
  panel.appendChild(table);
}
svg.addEventListener("click", () => select(null));
// filters
const hiddenAxes = new Set(), hiddenPhases = new Set();
function applyFilters() {
  const only = document.getElementById("transfersOnly").checked;
  const visible = new Set();
  for (const n of data.nodes) {
    const a = n.attrs;
    const hide = hiddenPhases.has(a.phase) || (a.type === "transfer" && hiddenAxes.has(a.axis)) || (only && a.type === "compute");
    nodeEls.get(n.id).classList.toggle("hidden", hide);
    if (!hide) visible.add(n.id);
  }
  for (const {e, p} of edgeEls) p.classList.toggle("hidden", !(visible.has(e.source) && visible.has(e.target)));
  document.getElementById("counts").textContent = `${visible.size} of ${data.nodes.length} nodes`;
}
function checkbox(container, text, color, set, key) {
  const l = document.createElement("label");
  const c = document.createElement("input"); c.type = "checkbox"; c.checked = true;
  c.addEventListener("change", () => { c.checked ? set.delete(key) : set.add(key); applyFilters(); });
  const s = document.createElement("span"); s.className = "swatch"; s.style.borderColor = color; s.style.background = color + "33";
  l.append(c, s, text); container.appendChild(l); container.append(" ");
}
for (const a of data.axes) checkbox(document.getElementById("axes"), a, data.axisColors[a] || "#333", hiddenAxes, a);
for (const [p, fill] of Object.entries(data.phaseFills)) checkbox(document.getElementById("phases"), p, "#6b7b8c", hiddenPhases, p);
document.getElementById("transfersOnly").addEventListener("change", applyFilters);
document.getElementById("search").addEventListener("input", ev => {
  const q = ev.target.value.trim().toLowerCase();
  for (const n of data.nodes) nodeEls.get(n.id).classList.toggle("match", !!q && (n.id.toLowerCase().includes(q) || n.label.join(" ").toLowerCase().includes(q)));
});
// pan and zoom
let view = {x: 0, y: 0, k: 1};
function apply() { world.setAttribute("transform", `translate(${view.x},${view.y}) scale(${view.k})`); }
function fit(readable) {
  // readable: never smaller than a legible scale; start at the top of the graph.
  const xs = data.nodes.map(n => n.x), ys = data.nodes.map(n => n.y);
  const w = Math.max(...xs) + W - Math.min(...xs) + 40, h = Math.max(...ys) + H - Math.min(...ys) + 40;
  const box = svg.getBoundingClientRect();
  view.k = Math.min(box.width / w, box.height / h, 1.2);
  view.x = (box.width - w * view.k) / 2 - (Math.min(...xs) - 20) * view.k;
  view.y = 10 - (Math.min(...ys) - 20) * view.k;
  if (readable && view.k < 0.8) {  // too small to read: legible scale, top of the graph
    const top = data.nodes.filter(n => n.y === Math.min(...ys));
    const cx = top.reduce((s, n) => s + n.x + W / 2, 0) / top.length;
    view.k = 0.8; view.x = box.width / 2 - cx * view.k; view.y = 10 - (Math.min(...ys) - 20) * view.k;
  }
  apply();
}
svg.addEventListener("wheel", ev => {
  ev.preventDefault();
  const f = Math.exp(-ev.deltaY * 0.0015), r = svg.getBoundingClientRect();
  const mx = ev.clientX - r.left, my = ev.clientY - r.top;
  view.x = mx - (mx - view.x) * f; view.y = my - (my - view.y) * f; view.k *= f; apply();
}, {passive: false});
let drag = null;
svg.addEventListener("mousedown", ev => { drag = {x: ev.clientX - view.x, y: ev.clientY - view.y}; document.getElementById("canvas").classList.add("dragging"); });
window.addEventListener("mousemove", ev => { if (drag) { view.x = ev.clientX - drag.x; view.y = ev.clientY - drag.y; apply(); } });
window.addEventListener("mouseup", () => { drag = null; document.getElementById("canvas").classList.remove("dragging"); });
document.getElementById("fit").addEventListener("click", () => fit(false));
applyFilters(); fit(true);
</script>
</body></html>
"""


def to_html(graph: nx.DiGraph, title: str) -> str:
    payload = json.dumps(_payload(graph, title)).replace("</", "<\\/")
    return _PAGE.replace("__TITLE__", html_escape.escape(title)).replace("__DATA__", payload)
