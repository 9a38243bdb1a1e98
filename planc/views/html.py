"""A communication graph as one self-contained HTML page to explore offline.

The page embeds the whole (selected) graph: every node of every stage and layer, each
group's inner layout for every node and for its transfers only (planc.views.
graph_layout), the facts of each node's panel in human units (planc.views.graph.facts),
the reasons of ``planc explain``, and the build's group table, from which the page
computes the member ranks of every collective for any rank. Its script
(graph_page.js, graph_page_layout.js) places the groups, draws the visible ones, and
re-places them when a group is expanded or collapsed, "transfers only" is switched,
or a rank is chosen. Nothing is fetched: no network, no CDN.
"""

from __future__ import annotations

import html as html_escape
import json
from importlib import resources

import networkx as nx

from planc.graph.select import Selection, select
from planc.plan.layout import Layout
from planc.program.groups import GroupTable
from planc.lower.tables import plan_group_table, split_refs
from planc.plan.mesh import WHOLE
from planc.plan.plan import Plan
from planc.views.graph.facts import AXIS_COLORS, PHASE_FILLS, Facts, colours, lane_labels, \
    node_lines
from planc.views.graph.groups import groups_of, summary_lines
from planc.views.graph.positions import GEOMETRY, inner_layout, initially_expanded, place

# The page expands every group of a graph this small, and only groups of at most
# SMALL_GROUP nodes of a bigger one (a layer is a card until asked for).
PAGE_EXPANDED_LIMIT = 100
SMALL_GROUP = 6
ASSETS = ("graph_page.css", "graph_page_layout.js", "graph_page.js")


def _asset(name: str) -> str:
    return resources.files("planc.views").joinpath(name).read_text(encoding="utf-8")


class _Strings:
    """A table of repeated texts (reasons repeat layer after layer), by index."""

    def __init__(self):
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self.index:
            self.index[text] = len(self.items)
            self.items.append(text)
        return self.index[text]


def _flat(positions: dict, nodes: list[str], index: dict[str, int]) -> list:
    return [[index[n], round(positions[n][0], 1), round(positions[n][1], 1)] for n in nodes]


def payload(graph: nx.DiGraph, title: str, plan: Plan, table: GroupTable | None = None
            ) -> dict:
    groups = groups_of(graph)
    index = {n: i for i, n in enumerate(graph.nodes)}
    owner = {n: gi for gi, g in enumerate(groups) for n in g.nodes}
    transfer_view = select(graph, Selection(transfers_only=True))
    facts, strings = Facts(plan, graph), _Strings()
    nodes = []
    for node, data in graph.nodes(data=True):
        fill, stroke = colours(data)
        item = {"id": node, "g": owner[node], "t": data["type"][0], "lines": node_lines(data),
                "fill": fill, "stroke": stroke, "stage": data["stage"], "layer": data["layer"],
                "rows": facts.rows(node)}
        if data["type"] == "transfer":
            item.update(axis=str(data["axis"]), level=str(data.get("level", WHOLE)),
                        reason=strings(str(data.get("reason", ""))),
                        params=facts.parameters(node))
            if data.get("peer_stage") is not None:
                item["peer"] = data["peer_stage"]
        if data.get("recompute"):
            item["recompute"] = True
        nodes.append(item)
    out_groups, inners = [], {}
    for g in groups:
        inner_edges = [(u, v) for u, v in graph.subgraph(g.nodes).edges]
        inner = inners[g.key] = inner_layout(g.nodes, inner_edges)
        transfers = [n for n in g.nodes if graph.nodes[n]["type"] == "transfer"]
        t_inner = inner_layout(transfers, [(u, v) for u, v in
                                           transfer_view.subgraph(transfers).edges])
        out_groups.append({
            "key": g.key, "stage": g.stage, "kind": g.kind, "title": g.title,
            "phase": str(g.phase), "boxed": g.boxed,
            "lines": summary_lines(graph, g.nodes),
            "tlines": summary_lines(graph, g.nodes, transfers_only=True) if transfers else [],
            "inner": [inner.width, inner.height, _flat(inner.positions, g.nodes, index)],
            "tinner": [t_inner.width, t_inner.height,
                       _flat(t_inner.positions, transfers, index)]})
    expanded = initially_expanded(groups, graph.number_of_nodes(), PAGE_EXPANDED_LIMIT,
                                  SMALL_GROUP)
    first = place(groups, inners, {g["key"]: len(g["lines"]) for g in out_groups}, expanded)
    ranks = Layout.of(plan)
    if table is None:
        table = plan_group_table(plan, split_refs(graph))
    transfers = [d for _, d in graph.nodes(data=True) if d["type"] == "transfer"]
    return {
        "title": title, "plan": plan.name, "geometry": GEOMETRY,
        "axisColors": AXIS_COLORS, "phaseFills": PHASE_FILLS,
        "counts": {"nodes": graph.number_of_nodes(), "transfers": len(transfers),
                   "axes": {a: sum(1 for d in transfers if str(d["axis"]) == a)
                            for a in sorted({str(d["axis"]) for d in transfers})}},
        "strings": strings.items, "nodes": nodes, "groups": out_groups,
        "edges": [[index[u], index[v], 1 if d.get("kind") == "saved" else 0]
                  for u, v, d in graph.edges(data=True)],
        "tedges": [[index[u], index[v]] for u, v in transfer_view.edges],
        "lanes": {str(s): lines for s, lines in
                  lane_labels(plan, sorted({g.stage for g in groups})).items()},
        "expanded": sorted(expanded),
        "placed": {p.group.key: [p.x, p.y] for p in first.groups},
        "mesh": {"sizes": plan.mesh.sizes, "strides": ranks.strides,
                 "world": plan.world, "devicesPerNode": plan.topology.devices_per_node},
        "rules": [r.to_json() for r in table.rules],
    }


def to_html(graph: nx.DiGraph, title: str, plan: Plan, table: GroupTable | None = None) -> str:
    data = json.dumps(payload(graph, title, plan, table), separators=(",", ":"))
    page = _asset("graph_page.html")
    for name in ASSETS:
        page = page.replace(f"/*{name}*/", _asset(name))
    return page.replace("__TITLE__", html_escape.escape(title)).replace(
        "__DATA__", data.replace("<", "\\u003c"))  # no text inside can end the script
