"""``planc layout`` for a person: the nodes and devices with coordinates, the groups."""

from __future__ import annotations

from planc.plan.layout import EXPERT_GROUPS, Layout
from planc.plan.mesh import AXES, LAYOUT_GROUPS
from planc.views.tables import table
from planc.diagnostics import counted

DEVICES_PER_ROW = 8
NODES_SHOWN_AT_EACH_END = 2


def _coord_label(layout: Layout, rank: int) -> str:
    coords = layout.coords(rank)
    shown = [f"{axis}{coords[axis]}" for axis in layout.mesh.order if layout.mesh.size(axis) > 1]
    return " ".join(shown)


def render_nodes(layout: Layout) -> str:
    """One block per node, devices in rows of eight; middle nodes elided for big worlds."""
    nodes = list(range(layout.nodes))
    if len(nodes) > 2 * NODES_SHOWN_AT_EACH_END + 1:
        nodes = nodes[:NODES_SHOWN_AT_EACH_END] + [None] + nodes[-NODES_SHOWN_AT_EACH_END:]
    cell_width = max(len(_coord_label(layout, r)) for r in (0, layout.world - 1)) + 2
    cell_width = max(cell_width, len(f"r{layout.world - 1}") + 2, 8)
    lines = []
    for node in nodes:
        if node is None:
            hidden = layout.nodes - 2 * NODES_SHOWN_AT_EACH_END
            lines.append(f"... {hidden} more nodes, laid out the same way ...")
            continue
        first = node * layout.devices_per_node
        last = min(first + layout.devices_per_node, layout.world)
        ranks = list(range(first, last))
        lines.append(f"node {node}")
        if len(ranks) > 2 * DEVICES_PER_ROW:  # a huge node: its first and last devices
            ranks = ranks[:DEVICES_PER_ROW] + ranks[-DEVICES_PER_ROW:]
        for start in range(0, len(ranks), DEVICES_PER_ROW):
            if start == DEVICES_PER_ROW and last - first > 2 * DEVICES_PER_ROW:
                lines.append(f"  ... {last - first - 2 * DEVICES_PER_ROW} more devices ...")
            row = ranks[start:start + DEVICES_PER_ROW]
            lines.append("  " + "".join(f"dev {r - first}".ljust(cell_width) for r in row).rstrip())
            lines.append("  " + "".join(f"r{r}".ljust(cell_width) for r in row).rstrip())
            labels = "".join(_coord_label(layout, r).ljust(cell_width) for r in row).rstrip()
            if labels:
                lines.append("  " + labels)
    return "\n".join(lines)


def _example(members: tuple[int, ...]) -> str:
    if len(members) <= 8:
        return "[" + ", ".join(map(str, members)) + "]"
    return "[" + ", ".join(map(str, members[:4])) + f", ... {members[-1]}] ({len(members)})"


def render_groups(layout: Layout) -> str:
    rows = []
    experts = EXPERT_GROUPS if layout.mesh.ep > 1 else ()
    for axis in (*LAYOUT_GROUPS, "stage", *experts):
        placement = layout.placement(axis)
        if placement.size == 1:
            where = "-"
        elif len(placement.kinds) == 1:
            where = placement.kind
        else:
            where = ", ".join(f"{n} {kind}" for kind, n in placement.kinds)
        per_node = "/".join(map(str, placement.ranks_per_node))
        rows.append([axis, placement.size, placement.count, where,
                     per_node if placement.size > 1 else "-", _example(layout.group(0, axis))])
    note = STAGE_NOTE + (EXPERTS_NOTE if experts else "")
    return table(["group", "size", "groups", "placement", "ranks/node", "group of rank 0"],
                 rows) + "\n" + note


# "stage" is not a mesh axis: say what the row above and the memory table's column mean.
STAGE_NOTE = ("stage: every rank of one pipeline stage (tp x cp x dp), a row of the memory "
              "table; compile and explain name the loss's all-reduce over it")
EXPERTS_NOTE = ("\nep: a run of ep ranks of a stage, each keeping experts / ep of the experts "
                "(their all-to-alls); edp: the ranks holding the same experts, over which "
                "their gradients are reduced")


def render(layout: Layout, title: str) -> str:
    mesh = layout.mesh
    sizes = " x ".join(f"{axis} {mesh.size(axis)}" for axis in AXES)
    head = [f"{title}: {counted(layout.world, 'rank')} = {sizes}",
            f"order [{', '.join(mesh.order)}] (first varies fastest); "
            f"{counted(layout.nodes, 'node')} x "
            f"{layout.devices_per_node} devices"]
    return "\n".join(head + ["", render_nodes(layout), "", render_groups(layout)])
