"""``planc report``: one self-contained HTML page (inline CSS and SVG, no script, nothing
fetched) with what a person asks of a plan before launching it: what it is, where each
rank sits, memory per stage against the device, what moves over which axis, the
simulated timeline of a step, and, given a ``planc run`` metrics file, predicted against
measured."""

from __future__ import annotations

import html
import statistics
from collections import defaultdict

from planc import memory
from planc.lang.units import TIME, format_bytes, format_quantity
from planc.layout import Layout
from planc.views.plan_text import settings

STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                 "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
PHASE_COLOURS = {"F": "#4e79a7", "B": "#e15759", "prologue": "#bab0ac",
                 "epilogue": "#59a14f"}
MAX_CELLS = 512  # ranks drawn in the layout picture
MAX_LANES = 16  # stages drawn in the timeline
WIDTH = 960

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1000px;
       color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 130px; }
.card b { display: block; font-size: 20px; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; font-size: 12px; }
.note { color: #666; font-size: 12px; }
"""


def _e(text) -> str:
    return html.escape(str(text))


def _cards(items) -> str:
    return '<div class="cards">' + "".join(
        f'<div class="card">{_e(label)}<b>{_e(value)}</b></div>' for label, value in items
    ) + "</div>"


def _table(header, rows) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _layout_svg(plan) -> str:
    layout = Layout.of(plan)
    per_node, nodes = plan.topology.devices_per_node, layout.nodes
    shown_nodes = min(nodes, max(1, MAX_CELLS // per_node))
    cell = max(18, min(60, (WIDTH - 80) // per_node))
    height = shown_nodes * (cell + 6) + 30
    parts = [f'<svg width="{80 + per_node * cell}" height="{height}" role="img" '
             f'aria-label="ranks on nodes, coloured by pipeline stage">']
    for node in range(shown_nodes):
        y = 10 + node * (cell + 6)
        parts.append(f'<text x="0" y="{y + cell / 2 + 4}" font-size="12">node {node}</text>')
        for local in range(per_node):
            rank = node * per_node + local
            if rank >= plan.world:
                break
            coords = layout.coords(rank)
            colour = STAGE_COLOURS[coords["pp"] % len(STAGE_COLOURS)]
            x = 70 + local * cell
            tip = (f"rank {rank}: stage {coords['pp']}, tp {coords['tp']}, cp {coords['cp']}, "
                   f"dp {coords['dp']}")
            parts.append(f'<rect x="{x}" y="{y}" width="{cell - 3}" height="{cell}" '
                         f'fill="{colour}" opacity="{0.55 + 0.45 * (coords["tp"] == 0)}">'
                         f'<title>{_e(tip)}</title></rect>')
            if cell >= 30:
                parts.append(f'<text x="{x + 3}" y="{y + 14}" font-size="11" fill="#fff">'
                             f'{rank}</text>')
    parts.append("</svg>")
    note = (f'<p class="note">{shown_nodes} of {nodes} nodes drawn.</p>'
            if shown_nodes < nodes else "")
    legend = " ".join(
        f'<span style="color:{STAGE_COLOURS[s % len(STAGE_COLOURS)]}">&#9632;</span> '
        f'stage {s}' for s in range(min(plan.mesh.pp, len(STAGE_COLOURS))))
    return "".join(parts) + f'<p class="note">Colour: pipeline stage ({legend}); lighter ' \
        f'cells are tp ranks other than 0. Hover a cell for its coordinates.</p>' + note


def _memory_svg(plan) -> str:
    estimate = memory.estimate(plan)
    capacity = estimate.capacity
    top = max([s.total_bytes for s in estimate.stages] + [capacity or 0]) or 1
    stages = estimate.stages[:MAX_LANES * 4]
    bar = 16
    scale = (WIDTH - 220) / top
    parts = [f'<svg width="{WIDTH}" height="{len(stages) * (bar + 4) + 30}" role="img" '
             f'aria-label="memory per stage">']
    kinds = (("parameters", "parameter_bytes", "#4e79a7"), ("gradients", "gradient_bytes",
             "#f28e2b"), ("optimizer", "optimizer_bytes", "#59a14f"),
             ("activations", "activation_bytes", "#e15759"))
    for i, stage in enumerate(stages):
        y, x = 10 + i * (bar + 4), 80
        parts.append(f'<text x="0" y="{y + 12}" font-size="12">stage {stage.stage}</text>')
        for label, attribute, colour in kinds:
            width = getattr(stage, attribute) * scale
            parts.append(f'<rect x="{x}" y="{y}" width="{width:.1f}" height="{bar}" '
                         f'fill="{colour}"><title>{label}: '
                         f'{format_bytes(getattr(stage, attribute))}</title></rect>')
            x += width
        parts.append(f'<text x="{x + 6}" y="{y + 12}" font-size="12">'
                     f'{format_bytes(stage.total_bytes)}</text>')
    if capacity:
        x = 80 + capacity * scale
        parts.append(f'<line x1="{x}" x2="{x}" y1="0" y2="{len(stages) * (bar + 4) + 10}" '
                     f'stroke="#000" stroke-dasharray="4 3"/><text x="{x + 4}" '
                     f'y="{len(stages) * (bar + 4) + 24}" font-size="12">device: '
                     f'{format_bytes(capacity)}</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {label}'
                      for label, _, c in kinds)
    return "".join(parts) + f'<p class="note">{legend}</p>'


def _transfers(summary: dict) -> str:
    totals: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for stage in summary["stages"]:
        for t in stage["transfers"]:
            key = (t["axis"], t["kind"], t["phase"])
            totals[key][0] += t["count"]
            totals[key][1] += t["bytes"]
    rows = [[axis, kind, phase, f"{int(c):,}", format_bytes(b)]
            for (axis, kind, phase), (c, b) in sorted(totals.items())]
    return _table(["axis", "kind", "phase", "per step", "bytes per step"], rows) + \
        '<p class="note">Per device, summed over the pipeline stages.</p>'


def _timeline_svg(result) -> str:
    lanes = result.timeline[:MAX_LANES]
    step = result.step_seconds or 1
    lane = 22
    scale = (WIDTH - 90) / step
    parts = [f'<svg width="{WIDTH}" height="{len(lanes) * (lane + 6) + 34}" role="img" '
             f'aria-label="simulated timeline per stage">']
    for i, time in enumerate(lanes):
        y = 10 + i * (lane + 6)
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">stage {time.stage}</text>')
        parts.append(f'<rect x="80" y="{y}" width="{step * scale:.1f}" height="{lane}" '
                     f'fill="#f3f3f3"><title>idle: pipeline bubble</title></rect>')
        spans = []
        if time.prologue is not None and time.prologue.end > 0:
            spans.append(("prologue", "prologue", 0.0, time.prologue.compute_end))
        spans += [(block[0], f"{block} microbatch {mb}", start, start + replayed.compute_end)
                  for block, mb, start, replayed in time.blocks]
        if time.epilogue is not None:
            start, replayed = time.epilogue
            spans.append(("epilogue", "epilogue (optimizer)", start, start + replayed.end))
        for kind, label, start, end in spans:
            colour = PHASE_COLOURS.get(kind, "#999")
            parts.append(f'<rect x="{80 + start * scale:.2f}" y="{y}" '
                         f'width="{max((end - start) * scale, 0.5):.2f}" height="{lane}" '
                         f'fill="{colour}" stroke="#fff" stroke-width="0.3"><title>'
                         f'{_e(label)}: {format_quantity(end - start, TIME)}</title></rect>')
    axis_y = len(lanes) * (lane + 6) + 24
    parts.append(f'<text x="80" y="{axis_y}" font-size="12">0</text><text x="{WIDTH - 60}" '
                 f'y="{axis_y}" font-size="12">{format_quantity(step, TIME)}</text></svg>')
    legend = (f'<span style="color:{PHASE_COLOURS["F"]}">&#9632;</span> forward '
              f'<span style="color:{PHASE_COLOURS["B"]}">&#9632;</span> backward '
              f'<span style="color:{PHASE_COLOURS["epilogue"]}">&#9632;</span> optimizer '
              f'<span style="color:#ccc">&#9632;</span> bubble')
    more = (f" {len(result.timeline) - MAX_LANES} more stages are not drawn."
            if len(result.timeline) > MAX_LANES else "")
    return "".join(parts) + f'<p class="note">{legend}. The compute stream of the first ' \
        f'rank of each stage; hover a block for its time.{more}</p>'


def _measured(result, metrics: list[dict] | None, warmup: int) -> str:
    if not metrics:
        return ('<p class="note">Run <code>planc run DIR --metrics m.jsonl</code> and pass '
                '<code>--metrics m.jsonl</code> to compare with a measured run.</p>')
    kept = metrics[warmup:] or metrics
    measured = statistics.median(r["time_s"] for r in kept)
    rows = [["step time", format_quantity(result.step_seconds, TIME),
             format_quantity(measured, TIME), f"{result.step_seconds / measured - 1:+.0%}"]]
    exposed = statistics.median(r.get("exposed_comm_s", 0.0) for r in kept)
    predicted_exposed = max(sum(s.exposed_seconds.values()) for s in result.stages)
    rows.append(["exposed communication", format_quantity(predicted_exposed, TIME),
                 format_quantity(exposed, TIME), ""])
    return _table(["", "simulated", "measured", "error"], rows) + \
        f'<p class="note">Measured: median over {len(kept)} steps of the slowest rank ' \
        f'(after {min(warmup, len(metrics))} warm-up steps).</p>'


def render(build, result, metrics: list[dict] | None = None, warmup: int = 2) -> str:
    plan = build.plan
    peak = max(result.stages, key=lambda s: s.memory_bytes)
    cards = _cards([
        ("step (simulated)", format_quantity(result.step_seconds, TIME)),
        ("TFLOP/s per GPU", f"{result.tflops_per_gpu:,.1f}"),
        ("MFU", f"{result.mfu:.1%}"),
        ("pipeline bubble", f"{result.bubble:.1%}"),
        ("memory at peak", format_bytes(peak.memory_bytes)
         + (f" / {format_bytes(result.memory_capacity)}" if result.memory_capacity else "")),
    ])
    mesh = " x ".join(f"{a} {plan.mesh.size(a)}" for a in ("tp", "cp", "pp", "dp"))
    sections = [
        f"<h1>planc report: {_e(plan.name)}</h1>",
        f'<p>{plan.world:,} ranks ({_e(mesh)}) on {plan.topology.nodes} nodes of '
        f'{plan.topology.devices_per_node} devices</p>',
        cards,
        "<h2>Layout</h2>", _layout_svg(plan),
        "<h2>Memory per stage</h2>", _memory_svg(plan),
        "<h2>Transfers per axis and kind</h2>", _transfers(build.summary),
        "<h2>Timeline of one step (simulated)</h2>", _timeline_svg(result),
        "<h2>Predicted and measured</h2>", _measured(result, metrics, warmup),
        "<h2>The plan</h2>", f"<pre>{_e(settings(plan))}</pre>",
    ]
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>planc '
            f'report: {_e(plan.name)}</title><style>{STYLE}</style></head><body>'
            + "\n".join(sections) + "</body></html>\n")
