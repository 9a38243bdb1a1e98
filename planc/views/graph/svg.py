"""The communication graph as SVG, laid out and written by planc: no Graphviz, any size.

The drawing is planc.views.graph.positions's: a lane per pipeline stage, the stage's groups
left to right, a group's nodes top to bottom. Graphs of more than ``EXPAND_LIMIT``
nodes draw their big groups as cards with counts (choose layers for their nodes), so
that even a 1,024-rank plan's whole step is a picture a person can read, in a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

import networkx as nx

from planc.views.graph.facts import AXIS_COLORS, COMPUTE_STROKE, PHASE_FILLS, colours, \
    node_lines
from planc.views.graph.groups import Group, groups_of, summary_lines
from planc.views.graph.positions import (LANE_LABEL_W, LINE_H, NODE_H, NODE_W, PAD, TITLE_H,
                                      Positions, inner_layout, initially_expanded, place)

EXPAND_LIMIT = 300  # planc.graph.select.DEFAULT_NODE_LIMIT: a default view shows every node
HEADER_H = 58
FONT = "Helvetica, Arial, sans-serif"


@dataclass
class Drawing:
    """A graph's groups, laid out, with the box every edge end attaches to."""

    graph: nx.DiGraph
    groups: list[Group]
    owner: dict[str, str]  # node -> group key
    lines: dict[str, list[str]]  # group key -> its card's summary
    placement: Positions


def lay_out(graph: nx.DiGraph, limit: int = EXPAND_LIMIT) -> Drawing:
    groups = groups_of(graph)
    owner = {n: g.key for g in groups for n in g.nodes}
    inner_edges: dict[str, list[tuple[str, str]]] = {g.key: [] for g in groups}
    for u, v in graph.edges:
        if owner[u] == owner[v]:
            inner_edges[owner[u]].append((u, v))
    inners = {g.key: inner_layout(g.nodes, inner_edges[g.key]) for g in groups}
    lines = {g.key: summary_lines(graph, g.nodes) for g in groups}
    expanded = initially_expanded(groups, graph.number_of_nodes(), limit)
    placement = place(groups, inners, {k: len(v) for k, v in lines.items()}, expanded)
    return Drawing(graph, groups, owner, lines, placement)


def edge_path(a: tuple, b: tuple, relation: str, gap: float = 0.0) -> str:
    """A path between two boxes (x, y, w, h): a curve down inside a group, sideways along
    a lane; between lanes, down (or up) to ``gap``, the edge of the target's lane, along
    it and into the target, so that it crosses no group of either lane (the page's
    edgePath draws the same)."""
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    if relation == "lane":
        x1, y1, x2, y2 = ax + aw, ay + ah / 2, bx, by + bh / 2
        d = max(30.0, abs(x2 - x1) / 2)
        return f"M{x1:.1f},{y1:.1f} C{x1 + d:.1f},{y1:.1f} {x2 - d:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"
    if relation == "inner":
        x1, y1, x2, y2 = ax + aw / 2, ay + ah, bx + bw / 2, by
        my = (y1 + y2) / 2
        return f"M{x1:.1f},{y1:.1f} C{x1:.1f},{my:.1f} {x2:.1f},{my:.1f} {x2:.1f},{y2:.1f}"
    down = by > ay
    x1, y1 = ax + aw / 2, ay + ah if down else ay
    x2, y2 = bx + bw / 2, by if down else by + bh
    g = gap - 5 if down else gap + 5
    r = min(8.0, abs(x2 - x1) / 2, abs(g - y1), abs(y2 - g))
    sx, sy = (1 if x2 > x1 else -1), (1 if down else -1)
    return (f"M{x1:.1f},{y1:.1f} V{g - sy * r:.1f} Q{x1:.1f},{g:.1f} {x1 + sx * r:.1f},{g:.1f} "
            f"H{x2 - sx * r:.1f} Q{x2:.1f},{g:.1f} {x2:.1f},{g + sy * r:.1f} V{y2:.1f}")


def drawn_edges(drawing: Drawing) -> list[tuple]:
    """(kind, relation, from, box a, box b, gap) of every edge to draw, each pair once. Inside
    an open group, node to node; along a lane, one arrow from a group to the next one
    that depends on it (the order of the lane says the rest); between lanes, node to
    node (a collapsed group's card stands for its nodes). Saved edges (a backward step's
    stash) are left out between groups: they would cross the lane."""
    boxes = {p.group.key: (p.x, p.y, p.width, p.height) for p in drawing.placement.groups}
    stage = {g.key: g.stage for g in drawing.groups}
    lanes = {lane.stage: lane for lane in drawing.placement.lanes}
    following, previous = {}, {}
    for g in drawing.groups:
        if g.stage in previous:
            following[previous[g.stage]] = g.key
        previous[g.stage] = g.key
    nodes = drawing.placement.nodes
    seen, out = set(), []
    for u, v, data in drawing.graph.edges(data=True):
        gu, gv = drawing.owner[u], drawing.owner[v]
        kind = str(data.get("kind", "data"))
        if gu != gv and (kind == "saved" or (stage[gu] == stage[gv]
                                             and following.get(gu) != gv)):
            continue
        relation = "inner" if gu == gv else "lane" if stage[gu] == stage[gv] else "cross"
        a = u if u in nodes and relation != "lane" else gu
        b = v if v in nodes and relation != "lane" else gv
        if a == b or (a, b) in seen:
            continue
        seen.add((a, b))
        box_a = (*nodes[a], NODE_W, NODE_H) if a in nodes else boxes[a]
        box_b = (*nodes[b], NODE_W, NODE_H) if b in nodes else boxes[b]
        target = lanes[stage[gv]]
        gap = target.y if stage[gv] > stage[gu] else target.y + target.height
        out.append((kind, relation, a, box_a, box_b, gap))
    return out


def _text(x: float, y: float, text: str, **attrs) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{escape(text)}</text>'


def to_svg(graph: nx.DiGraph, title: str, lane_labels: dict[int, list[str]],
           limit: int = EXPAND_LIMIT) -> str:
    drawing = lay_out(graph, limit)
    placement = drawing.placement
    width, height = max(placement.width, 900), placement.height + HEADER_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
           f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
           f'font-family="{FONT}" font-size="11">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#7b8794"/>'
           '</marker></defs>', '<rect width="100%" height="100%" fill="#ffffff"/>',
           _text(12, 22, title, font_size="15", font_weight="bold", fill="#1f2933")]
    legend = ["transfers by axis:"] + [f"\u25a0 {axis}" for axis in AXIS_COLORS]
    x = 12.0
    for i, item in enumerate(legend):
        colour = "#52606d" if i == 0 else AXIS_COLORS[item[2:]]
        out.append(_text(x, 42, item, fill=colour))
        x += 7 * len(item) + 10
    out.append(_text(x + 10, 42, "compute: blue forward, orange backward, green optimizer; "
                                 "a card is a collapsed group (its counts)", fill="#52606d"))
    out.append(f'<g transform="translate(0,{HEADER_H})">')
    for i, lane in enumerate(placement.lanes):
        out.append(f'<rect x="0" y="{lane.y:.1f}" width="{width:.0f}" height="{lane.height:.1f}"'
                   f' fill="{"#f7f9fb" if i % 2 == 0 else "#eef2f6"}"/>')
        for j, line in enumerate(lane_labels.get(lane.stage, [f"stage {lane.stage}"])):
            out.append(_text(12, lane.y + 24 + 15 * j, line, fill="#334e68",
                             font_weight="bold" if j == 0 else "normal",
                             font_size="13" if j == 0 else "11"))
    for p in placement.groups:
        if not p.group.boxed:
            continue
        fill = "#ffffff" if p.expanded else PHASE_FILLS.get(p.group.phase, "#ffffff")
        out.append(f'<rect x="{p.x:.1f}" y="{p.y:.1f}" width="{p.width:.1f}" '
                   f'height="{p.height:.1f}" rx="8" fill="{fill}" stroke="#9aa5b1" '
                   f'stroke-dasharray="{"5 3" if p.expanded else "none"}"/>')
        mark = "\u25be " if p.expanded else "\u25b8 "
        out.append(_text(p.x + PAD, p.y + 17, mark + p.group.title, font_weight="bold",
                         font_size="12", fill="#334e68"))
        if not p.expanded:
            for j, line in enumerate(drawing.lines[p.group.key]):
                out.append(_text(p.x + PAD, p.y + TITLE_H + LINE_H * j + 8, line,
                                 fill="#3e4c59"))
    for kind, relation, _, a, b, gap in drawn_edges(drawing):
        dash = ' stroke-dasharray="4 3"' if kind in ("saved", "order", "path") else ""
        colour = AXIS_COLORS["pp"] if relation == "cross" else "#8a96a3"
        out.append(f'<path d="{edge_path(a, b, relation, gap)}" fill="none" stroke="{colour}" '
                   f'stroke-width="{1.6 if relation == "cross" else 1.1}"{dash} '
                   f'marker-end="url(#arrow)"/>')
    for node, (x, y) in placement.nodes.items():
        data = graph.nodes[node]
        fill, stroke = colours(data)
        wide = 2.2 if data["type"] == "transfer" else 1.2
        dash = ' stroke-dasharray="4 3"' if data.get("recompute") else ""
        out.append(f'<g><title>{escape(node + ": " + str(data.get("reason", "")))}</title>'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="6" '
                   f'fill="{fill}" stroke="{stroke}" stroke-width="{wide}"{dash}/>')
        colour = stroke if data["type"] == "transfer" and stroke != COMPUTE_STROKE \
            else "#1f2933"
        for j, line in enumerate(node_lines(data)):
            clipped = line if len(line) <= 30 else line[:29] + "\u2026"
            out.append(_text(x + NODE_W / 2, y + 15 + 14 * j, clipped, text_anchor="middle",
                             fill=colour, font_weight="bold" if j == 0 else "normal"))
        out.append("</g>")
    out.append("</g></svg>")
    return "\n".join(out) + "\n"
