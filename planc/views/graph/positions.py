"""Where ``planc graph`` draws every group and node: one layout for the page and the SVG.

A lane per pipeline stage, top to bottom; in a lane, the stage's groups left to right
in the order it runs them (planc.views.graph.groups); inside an expanded group, its
nodes top to bottom by longest path, so that a layer reads as a column, as Netron
draws a model. Columns inside a group are ordered by the barycentre heuristic (Sugiyama
et al. 1981) and each node sits under the mean of its parents, so chains stay straight.
A collapsed group is a card with its counts. The page embeds the inner layouts
computed here and places groups with the same rule (graph_page.js, ``placeGroups``)
whenever one is expanded or collapsed; the SVG and the page's first view agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import networkx as nx

from planc.views.graph.groups import Group

NODE_W, NODE_H, COL_GAP, ROW_GAP = 184, 50, 18, 24
TITLE_H, PAD, CARD_W, LINE_H = 26, 10, 214, 15
LANE_LABEL_W, LANE_PAD, GROUP_GAP = 150, 18, 30
SWEEPS = 4
# Constants the page's script needs to place groups exactly as place() does.
GEOMETRY = {"nodeW": NODE_W, "nodeH": NODE_H, "titleH": TITLE_H, "pad": PAD, "cardW": CARD_W,
            "lineH": LINE_H, "laneLabelW": LANE_LABEL_W, "lanePad": LANE_PAD,
            "groupGap": GROUP_GAP}


@dataclass
class Inner:
    """An expanded group's nodes, relative to its content's top-left corner."""

    positions: dict[str, tuple[float, float]]
    width: float
    height: float


def inner_layout(nodes: list[str], edges: list[tuple[str, str]]) -> Inner:
    """Levels by longest path over ``edges`` (those among ``nodes``), top to bottom."""
    if not nodes:
        return Inner({}, 0, 0)
    preds, succs = defaultdict(list), defaultdict(list)
    for u, v in edges:
        preds[v].append(u)
        succs[u].append(v)
    order = {n: i for i, n in enumerate(nodes)}
    inner = nx.DiGraph()
    inner.add_nodes_from(nodes)
    inner.add_edges_from(edges)
    level: dict[str, int] = {}
    for node in nx.lexicographical_topological_sort(inner, key=order.__getitem__):
        level[node] = max((level[p] + 1 for p in preds[node]), default=0)
    rows: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for node in nodes:
        rows[level[node]].append(node)
    index = {n: i for row in rows for i, n in enumerate(row)}
    for sweep in range(SWEEPS):
        down = sweep % 2 == 0
        for row in (rows[1:] if down else rows[-2::-1]):
            near = preds if down else succs

            def centre(node: str) -> float:
                found = [index[m] for m in near[node]]
                return sum(found) / len(found) if found else index[node]

            row.sort(key=lambda n: (centre(n), order[n]))
            index.update((n, i) for i, n in enumerate(row))
    column: dict[str, float] = {}
    for row in rows:  # each node under the mean of its parents, never left of its neighbour
        previous = None
        for node in row:
            parents = [column[p] for p in preds[node]]
            want = sum(parents) / len(parents) if parents else 0.0
            column[node] = want if previous is None else max(want, previous + 1)
            previous = column[node]
    left = min(column.values())
    positions = {n: ((column[n] - left) * (NODE_W + COL_GAP), level[n] * (NODE_H + ROW_GAP))
                 for n in nodes}
    width = max(x for x, _ in positions.values()) + NODE_W
    height = len(rows) * (NODE_H + ROW_GAP) - ROW_GAP
    return Inner(positions, width, height)


def group_size(group: Group, inner: Inner, expanded: bool, lines: int) -> tuple[float, float]:
    """A group's frame: a bare pipeline transfer, an expanded box, or a collapsed card."""
    if not group.boxed:
        return NODE_W, NODE_H
    if expanded:
        return max(inner.width, CARD_W - 2 * PAD) + 2 * PAD, TITLE_H + inner.height + 2 * PAD
    return CARD_W, TITLE_H + lines * LINE_H + PAD


@dataclass
class Placed:
    group: Group
    x: float
    y: float
    width: float
    height: float
    expanded: bool


@dataclass
class Lane:
    stage: int
    y: float
    height: float


@dataclass
class Positions:
    lanes: list[Lane]
    groups: list[Placed]
    nodes: dict[str, tuple[float, float]]  # absolute, of the nodes of expanded groups
    width: float
    height: float


def place(groups: list[Group], inners: dict[str, Inner], lines: dict[str, int],
          expanded: set[str]) -> Positions:
    """Lanes stacked in stage order; each lane's groups side by side in ``groups``'
    order; the same rule as the page's placeGroups."""
    sizes = {g.key: group_size(g, inners[g.key], g.key in expanded, lines[g.key])
             for g in groups}
    stages = sorted({g.stage for g in groups})
    lane_end = {s: LANE_LABEL_W + GROUP_GAP for s in stages}
    x_of = {}
    for g in groups:
        x_of[g.key] = lane_end[g.stage]
        lane_end[g.stage] += sizes[g.key][0] + GROUP_GAP
    lanes, y = [], 0.0
    for stage in stages:
        height = max(sizes[g.key][1] for g in groups if g.stage == stage) + 2 * LANE_PAD
        lanes.append(Lane(stage, y, height))
        y += height
    lane_y = {lane.stage: lane.y for lane in lanes}
    placed, nodes = [], {}
    for g in groups:
        width, height = sizes[g.key]
        x, top = x_of[g.key], lane_y[g.stage] + LANE_PAD
        is_open = g.key in expanded or not g.boxed
        placed.append(Placed(g, x, top, width, height, is_open))
        if is_open:
            dx, dy = (x + PAD, top + TITLE_H + PAD) if g.boxed else (x, top)
            for node, (nx_, ny) in inners[g.key].positions.items():
                nodes[node] = (dx + nx_, dy + ny)
    width = max(lane_end.values(), default=LANE_LABEL_W) + GROUP_GAP
    return Positions(lanes, placed, nodes, width, y)


def initially_expanded(groups: list[Group], total_nodes: int, limit: int,
                       small: int = 6) -> set[str]:
    """Every group when the graph has at most ``limit`` nodes; else the small ones."""
    return {g.key for g in groups if total_nodes <= limit or len(g.nodes) <= small}
