"""A communication graph as Graphviz DOT, written by planc itself.

The same grouping as the page and the SVG (planc.views.graph.groups): a cluster per
pipeline stage, and in it a cluster per group (a layer's forward or backward, the
embedding, the head and loss, the gradient buckets, the optimizer), left to right in
the order the stage runs them (``rankdir=LR``). A graph of more than ``EXPAND_LIMIT``
nodes draws each big group as one card node with its counts, as the SVG does, so that
Graphviz lays out even ``--all`` of a 96-layer plan in seconds; choose layers
(``--layers``) or use ``--format json`` for every node. Compute steps are boxes tinted
by phase, transfers are coloured by mesh axis and labelled with their kind, layer and
size; a transfer's tooltip is ``planc explain``'s reason.
"""

from __future__ import annotations

import networkx as nx

from planc.views.graph.facts import AXIS_COLORS, COMPUTE_STROKE, PHASE_FILLS, colours, \
    node_lines
from planc.views.graph.groups import groups_of, summary_lines
from planc.views.graph.positions import initially_expanded

EXPAND_LIMIT = 300  # as the SVG: every node of a default view, big groups of more as cards


def _quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attributes(attrs: dict) -> str:
    return ", ".join(f"{key}={_quote(value)}" for key, value in attrs.items())


def _node_attributes(data: dict) -> str:
    fill, stroke = colours(data)
    if data["type"] == "compute":
        style = "rounded,filled" + (",dashed" if data.get("recompute") else "")
        attrs = {"shape": "box", "style": style, "fillcolor": fill, "color": COMPUTE_STROKE}
    else:
        attrs = {"shape": "box", "style": "rounded,filled,bold", "fillcolor": fill,
                 "color": stroke, "penwidth": "2", "fontcolor": stroke,
                 "tooltip": data.get("reason", "")}
    attrs["label"] = "\n".join(node_lines(data))
    return _attributes(attrs)


def _card_attributes(title: str, phase: str, lines: list[str]) -> str:
    return _attributes({"shape": "box", "style": "rounded,filled",
                        "fillcolor": PHASE_FILLS.get(phase, "#ffffff"), "color": "#9aa5b1",
                        "label": "\n".join([title, *lines])})


def to_dot(graph: nx.DiGraph, title: str = "", lane_labels: dict | None = None,
           limit: int = EXPAND_LIMIT) -> str:
    groups = groups_of(graph)
    expanded = initially_expanded(groups, graph.number_of_nodes(), limit)
    stands_for = {}  # node -> what the drawing shows for it: itself or its group's card
    for g in groups:
        for node in g.nodes:
            stands_for[node] = node if g.key in expanded or not g.boxed else f"group:{g.key}"
    legend = ", ".join(AXIS_COLORS)
    lines = ["digraph planc {",
             f"  graph [rankdir=LR, fontname=\"Helvetica\", fontsize=11, labelloc=t, "
             f"labeljust=l, newrank=true, nodesep=0.2, ranksep=0.3, "
             f"label={_quote(f'{title}  (transfers coloured by axis: {legend})')}];",
             "  node [fontname=\"Helvetica\", fontsize=9, margin=\"0.08,0.04\"];",
             "  edge [color=\"#8a96a3\", arrowsize=0.6];"]
    stages = sorted({g.stage for g in groups})
    for stage in stages:
        label = "\n".join((lane_labels or {}).get(stage, [f"stage {stage}"]))
        lines.append(f"  subgraph cluster_stage_{stage} {{")
        lines.append(f"    label={_quote(label)}; style=\"rounded,filled\"; "
                     f"fillcolor=\"#f7f9fb\"; color=\"#9aa5b1\"; fontcolor=\"#334e68\";")
        for index, g in enumerate(x for x in groups if x.stage == stage):
            if not g.boxed:
                for node in g.nodes:
                    lines.append(f"    {_quote(node)} [{_node_attributes(graph.nodes[node])}];")
                continue
            if g.key not in expanded:
                lines.append(f"    {_quote('group:' + g.key)} ["
                             f"{_card_attributes(g.title, g.phase, summary_lines(graph, g.nodes))}];")
                continue
            lines.append(f"    subgraph cluster_stage_{stage}_{index} {{")
            lines.append(f"      label={_quote(g.title)}; style=\"rounded,dashed,filled\"; "
                         f"fillcolor=\"#ffffff\"; color=\"#c3cbd3\"; fontcolor=\"#52606d\";")
            for node in g.nodes:
                lines.append(f"      {_quote(node)} [{_node_attributes(graph.nodes[node])}];")
            lines.append("    }")
        lines.append("  }")
    following, previous = {}, {}
    for g in groups:
        if g.stage in previous:
            following[previous[g.stage]] = g.key
        previous[g.stage] = g.key
    owner = {n: g.key for g in groups for n in g.nodes}
    whole = len(expanded) == len(groups)
    seen = set()
    for u, v, data in graph.edges(data=True):
        a, b = stands_for[u], stands_for[v]
        kind = data.get("kind", "data")
        across = graph.nodes[u]["stage"] != graph.nodes[v]["stage"]
        if a == b or (a, b) in seen:
            continue
        if not whole and owner[u] != owner[v] and (kind == "saved" or (
                not across and following.get(owner[u]) != owner[v])):
            continue  # as the SVG: a lane's order says the rest, a stash crosses it
        seen.add((a, b))
        style = {"saved": " [style=dashed, color=\"#c3cbd3\", constraint=false]",
                 "path": " [style=dotted]"}.get(kind, "")
        if not style and across:  # lanes are laid out alone, one under the other
            style = f" [color=\"{AXIS_COLORS['pp']}\", penwidth=1.6, constraint=false]"
        lines.append(f"  {_quote(a)} -> {_quote(b)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"
