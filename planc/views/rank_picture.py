"""The layout picture of ``planc report``: where each rank sits, coloured by pipeline stage.

A world small enough to read rank by rank is drawn as nodes x devices, one cell per rank.
A larger one (gpt3-175b's 1,024 ranks, llama3-405b's 16,384) is drawn as pipeline stages
x data-parallel replicas, one block per stage of a replica (its tp x cp ranks), with the
ranks and nodes each block holds; long axes are elided in the middle. Colours come from
:func:`stage_colours`, which never gives two stages of one picture the same colour."""

from __future__ import annotations

import colorsys
import html

from planc.plan.layout import Layout
from planc.plan.mesh import GROUPS
from planc.diagnostics import counted

DATA_AXES = GROUPS["dp"].axes
# The ranks of one stage of one data-parallel replica differ along the stage's other axes.
REPLICA_STAGE_AXES = tuple(a for a in GROUPS["stage"].axes if a not in DATA_AXES)

# Tableau 10, in order: the first ten stages; beyond ten, hues spread evenly.
TABLEAU_10 = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
              "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
MAX_RANK_CELLS = 512  # worlds up to this many ranks (and nodes below) get a cell per rank
MAX_NODE_ROWS = 64
MIN_CELL = 18  # px: a node with more devices than fit the width at this size is summarised
MAX_STAGE_ROWS = 16  # stage rows of the summary; a longer pipeline is elided
MAX_REPLICA_COLUMNS = 8  # replica columns of the summary, the ellipsis included
WIDTH = 960
LABEL = 80  # the width of the row labels
GLYPH_WIDTH = 0.64  # a digit's advance in em in common sans-serif fonts (DejaVu: 0.636)


def _e(text) -> str:
    return html.escape(str(text))


def stage_colours(count: int) -> list[str]:
    """``count`` colours, no two alike: Tableau 10 for up to ten stages, else hues spread
    over the circle, neighbours alternating between a dark and a light tone so that
    adjacent stages differ in lightness as well as hue."""
    if count <= len(TABLEAU_10):
        return list(TABLEAU_10[:count])
    colours = []
    for i in range(count):
        lightness = 0.42 if i % 2 == 0 else 0.62
        red, green, blue = colorsys.hls_to_rgb(i / count, lightness, 0.65)
        colours.append(f"#{round(red * 255):02x}{round(green * 255):02x}"
                       f"{round(blue * 255):02x}")
    if len(set(colours)) < count:  # thousands of stages: hex rounding could merge two
        colours = [f"hsl({360 * i / count:.3f},65%,{42 if i % 2 == 0 else 62}%)"
                   for i in range(count)]
    return colours


def _text_on(colour: str) -> str:
    """Black or white, whichever contrasts more with ``colour`` (a #rrggbb or an hsl()) by
    WCAG 2's relative luminance: one of the two always reaches 4.5:1, the AA ratio for
    text of this size."""
    return "#000" if contrast(colour, "#000") >= contrast(colour, "#fff") else "#fff"


def contrast(one: str, other: str) -> float:
    """WCAG 2's contrast ratio of two colours, 1 to 21."""
    lighter, darker = sorted((_luminance(one), _luminance(other)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def _luminance(colour: str) -> float:
    """WCAG 2's relative luminance of a #rrggbb, #rgb or hsl(H,S%,L%) colour."""
    if colour.startswith("hsl("):
        hue, saturation, lightness = (float(v.rstrip("%")) for v in colour[4:-1].split(","))
        channels = colorsys.hls_to_rgb(hue / 360, lightness / 100, saturation / 100)
    else:  # #rrggbb, or #rgb
        digits = colour[1:] if len(colour) == 7 else "".join(c * 2 for c in colour[1:4])
        channels = tuple(int(digits[i:i + 2], 16) / 255 for i in (0, 2, 4))
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def _shown(count: int, limit: int, tail: int) -> list[int | None]:
    """Indices 0..count-1, or the first ones, None for the elided middle, and the last
    ``tail`` when there are more than ``limit``."""
    if count <= limit:
        return list(range(count))
    return list(range(limit - tail - 1)) + [None] + list(range(count - tail, count))


def _span(values: list[int], noun: str) -> str:
    low, high = min(values), max(values)
    if low == high:
        return f"{noun} {low}"
    distinct = sorted(set(values))
    if len(distinct) == high - low + 1:
        return f"{noun}s {low}-{high}"
    if len(distinct) <= 3:
        return f"{noun}s " + ", ".join(map(str, distinct))
    return f"{len(distinct)} {noun}s from {low} to {high}"


def layout_svg(plan) -> str:
    """The picture and its note."""
    layout = Layout.of(plan)
    if plan.world <= MAX_RANK_CELLS and layout.nodes <= MAX_NODE_ROWS and \
            plan.topology.devices_per_node * MIN_CELL <= WIDTH - LABEL:
        return _rank_cells(plan, layout)
    return _stage_blocks(plan, layout)


def _coordinate_line(plan, coords: dict) -> str:
    return " ".join(f"{axis[0]}{coords[axis]}" for axis in GROUPS["stage"].axes
                    if plan.mesh.size(axis) > 1)


def _rank_cells(plan, layout: Layout) -> str:
    per_node, nodes = plan.topology.devices_per_node, layout.nodes
    colours = stage_colours(plan.mesh.pp)
    cell = max(MIN_CELL, min(60, (WIDTH - LABEL) // per_node))
    width, height = LABEL + per_node * cell, nodes * (cell + 6) + 14
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="ranks on nodes, coloured by pipeline stage">']
    for node in range(nodes):
        y = 8 + node * (cell + 6)
        parts.append(f'<text x="0" y="{y + cell / 2 + 4}" font-size="12">node {node}</text>')
        for local in range(per_node):
            rank = node * per_node + local
            if rank >= plan.world:
                break
            coords = layout.coords(rank)
            colour, x = colours[coords["pp"]], LABEL - 10 + local * cell
            tip = (f"rank {rank}: stage {coords['pp']}, tp {coords['tp']}, cp {coords['cp']}, "
                   f"dp {coords['dp']}")
            parts.append(f'<rect x="{x}" y="{y}" width="{cell - 3}" height="{cell}" '
                         f'fill="{colour}" data-stage="{coords["pp"]}"><title>{_e(tip)}'
                         f'</title></rect>')
            if cell >= 30:
                ink = _text_on(colour)
                parts.append(f'<text x="{x + 4}" y="{y + 15}" font-size="12" fill="{ink}">'
                             f'{rank}</text><text x="{x + 4}" y="{y + cell - 7}" '
                             f'font-size="10" fill="{ink}">'
                             f'{_e(_coordinate_line(plan, coords))}</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="color:{colours[s]}">&#9632;</span> stage {s}'
                      for s in range(plan.mesh.pp))
    coordinates = ", ".join(f"{axis[0]}: {axis}" for axis in GROUPS["stage"].axes
                            if plan.mesh.size(axis) > 1)
    under = (f" Under each rank its coordinates ({coordinates})." if coordinates and
             cell >= 30 else "")
    return "".join(parts) + (f'<p class="note">Colour: pipeline stage ({legend}).{under} '
                             f'Hover a cell for all its coordinates.</p>')


def _block(plan, layout: Layout, stage: int, replica: int) -> tuple[str, str, str]:
    """The ranks of one stage of one replica: (first line, second line, tooltip)."""
    mesh = layout.ranks
    first = mesh.members(mesh.first_rank_of_stage(stage), DATA_AXES)[replica]
    ranks = mesh.members(first, REPLICA_STAGE_AXES)
    ranks_text = _span(ranks, "rank")
    nodes_text = _span([layout.node(r) for r in ranks], "node")
    tip = (f"stage {stage} of data-parallel replica {replica}: "
           f"{counted(len(ranks), 'rank')} (tp {plan.mesh.tp} x cp {plan.mesh.cp}), "
           f"{ranks_text}, on {nodes_text}")
    return ranks_text, nodes_text, tip


def _stage_blocks(plan, layout: Layout) -> str:
    pp, dp = plan.mesh.pp, plan.mesh.dp
    stages = _shown(pp, MAX_STAGE_ROWS, 3)
    replicas = _shown(dp, MAX_REPLICA_COLUMNS, 1)
    colours = dict(zip([s for s in stages if s is not None],
                       stage_colours(sum(s is not None for s in stages))))
    column = (WIDTH - LABEL) // len(replicas)
    row = 36
    width, height = LABEL + len(replicas) * column, 22 + len(stages) * (row + 4)
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="pipeline stages by data-parallel replicas, coloured '
             f'by stage">']
    for j, replica in enumerate(replicas):
        x = LABEL + j * column
        label = (f"dp {replica}" if replica is not None else
                 f"... {dp - len(replicas) + 1} more")
        parts.append(f'<text x="{x + 2}" y="12" font-size="12">{_e(label)}</text>')
    blocks = {(stage, replica): _block(plan, layout, stage, replica)
              for stage in stages if stage is not None
              for replica in replicas if replica is not None}
    longest = max(len(text) for first, second, _ in blocks.values() for text in (first, second))
    # Shrink the text of every block alike until the longest line fits its block.
    font = round(min(11.0, (column - 10) / (GLYPH_WIDTH * longest)), 1)
    for i, stage in enumerate(stages):
        y = 20 + i * (row + 4)
        if stage is None:
            hidden = pp - len(stages) + 1
            parts.append(f'<text x="0" y="{y + row / 2 + 4}" font-size="12">... {hidden} '
                         f'more stages</text>')
            continue
        parts.append(f'<text x="0" y="{y + row / 2 + 4}" font-size="12">stage {stage}</text>')
        colour = colours[stage]
        ink = _text_on(colour)
        for j, replica in enumerate(replicas):
            x = LABEL + j * column
            if replica is None:
                parts.append(f'<text x="{x + column / 2 - 8}" y="{y + row / 2 + 4}" '
                             f'font-size="14">...</text>')
                continue
            first, second, tip = blocks[stage, replica]
            parts.append(f'<rect x="{x}" y="{y}" width="{column - 4}" height="{row}" '
                         f'fill="{colour}" data-stage="{stage}"><title>{_e(tip)}</title>'
                         f'</rect><text x="{x + 4}" y="{y + 14}" font-size="{font}" '
                         f'fill="{ink}">{_e(first)}</text><text x="{x + 4}" y="{y + 29}" '
                         f'font-size="{font}" fill="{ink}">{_e(second)}</text>')
    parts.append("</svg>")
    inner = plan.mesh.tp * plan.mesh.cp
    elided = [f"{sum(i is not None for i in shown)} of {count} {noun}"
              for shown, count, noun in ((stages, pp, "stages"), (replicas, dp, "replicas"))
              if None in shown]
    drawn = f" {' and '.join(elided)} are drawn." if elided else ""
    return "".join(parts) + (
        f'<p class="note">{plan.world:,} ranks on {layout.nodes:,} nodes are too many to '
        f'draw one by one: each block is one pipeline stage (row, and colour) of one '
        f'data-parallel replica (column), its {counted(inner, "rank")} (tp {plan.mesh.tp} '
        f'x cp {plan.mesh.cp}) and the nodes they sit on; {pp} x {dp} = {pp * dp:,} '
        f'blocks.{drawn} Hover a block for its ranks. <code>planc layout --json</code> '
        f'lists every rank.</p>')
