"""``planc report``: one self-contained HTML page (inline CSS and SVG, no script, nothing
fetched) with what a person asks of a plan before launching it: what it is, where each
rank sits, memory per stage against the device, what moves over which axis, the
simulated timeline of a step, and, given a ``planc run`` metrics file, predicted against
measured."""

from __future__ import annotations

import html
import re
import statistics

from planc.estimate import memory
from planc.graph.summary import busiest_stage_transfers, summarize
from planc.plan.presets import PRESETS
from planc.vocabulary.units import (COMPUTE, TIME, format_bytes, format_flop_rate, format_quantity,
                              format_share)
from planc.plan.mesh import AXES
from planc.schedules import Block
from planc.views.plan_summary import settings
from planc.views.rank_picture import layout_svg
from planc.views.summary_text import INNER_ALL_TO_ALLS
from planc.diagnostics import counted

PHASE_COLOURS = {"F": "#4e79a7", "B": "#e15759", "prologue": "#bab0ac",
                 "epilogue": "#59a14f"}
MAX_LANES = 16  # stages drawn in the timeline
WIDTH = 960

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1000px;
       padding: 0 12px; color: #222; }
svg { max-width: 100%; height: auto; }
.table { overflow-x: auto; } td:not(:first-child) { white-space: nowrap; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 130px; }
.card b { display: block; font-size: 20px; }
code { font-size: 12px; }
.plan { background: #f6f6f6; padding: 10px; font: 12px/1.5 ui-monospace, monospace;
        white-space: pre-wrap; overflow-wrap: anywhere; }
.plan .line { padding-left: var(--key); text-indent: calc(-1 * var(--key)); }
.note { color: #666; font-size: 12px; }
.curve svg { max-width: 100%; height: auto; }
.hint { background: #fff6dc; border-left: 3px solid #e0a800; padding: 6px 10px;
        font-size: 13px; }
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
    # a number beside its unit on one line; on a narrow screen the table scrolls alone
    return f'<div class="table"><table><tr>{head}</tr>{body}</table></div>'


MEMORY_KINDS = (("parameters", "parameter_bytes", "#4e79a7"),
                ("gradients", "gradient_bytes", "#f28e2b"),
                ("optimizer", "optimizer_bytes", "#59a14f"),
                ("activations", "activation_bytes", "#e15759"),
                ("ZeRO-3 unit whole", "unsharded_bytes", "#b07aa1"))
BAR_START, BAR_SPACE = 80, WIDTH - 80 - 100  # the bars' left edge; room for the longest
# The device's capacity is a line up to this many times the largest bar (the bars then
# fill at least a quarter of the axis); beyond, a sentence.
CAPACITY_DRAWN = 4.0


def _share(part: float, whole: float) -> str:
    share = 100 * part / whole
    return "<0.1%" if share < 0.1 else f"{share:.1f}%"


def _memory_svg(plan) -> str:
    """Bars scaled to the largest stage, so that a small model's are as visible as a large
    one's; the device's capacity is a line where it is near the bars (or under them: the
    plan does not fit), else a sentence."""
    estimate = memory.estimate(plan)
    stages = estimate.stages[:MAX_LANES * 4]
    capacity, peak = estimate.capacity, max(s.total_bytes for s in stages)
    near = capacity is not None and capacity <= CAPACITY_DRAWN * peak
    top = max(peak, capacity if near else 0) or 1
    bar = 16
    scale = BAR_SPACE / top
    bottom = len(stages) * (bar + 4) + 10
    height = bottom + (22 if near else 0)
    parts = [f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
             f'role="img" aria-label="memory per device of each stage">']
    for i, stage in enumerate(stages):
        y = 10 + i * (bar + 4)
        parts.append(f'<text x="0" y="{y + 12}" font-size="12">stage {stage.stage}</text>')
        # Edges from the running total, so that the last one ends exactly at the total.
        held, left = 0.0, float(BAR_START)
        for label, attribute, colour in MEMORY_KINDS:
            if not getattr(stage, attribute) and attribute == "unsharded_bytes":
                continue  # not ZeRO-3
            held += getattr(stage, attribute)
            right = round(BAR_START + held * scale, 1)
            parts.append(f'<rect x="{left}" y="{y}" width="{round(right - left, 1)}" '
                         f'height="{bar}" fill="{colour}" data-stage="{stage.stage}" '
                         f'data-kind="{label}"><title>stage {stage.stage}, {label}: '
                         f'{format_bytes(getattr(stage, attribute))}</title></rect>')
            left = right
        parts.append(f'<text x="{left + 6}" y="{y + 12}" font-size="12">'
                     f'{format_bytes(stage.total_bytes)}</text>')
    if near:
        x = round(BAR_START + capacity * scale, 1)
        parts.append(f'<line x1="{x}" x2="{x}" y1="0" y2="{bottom}" stroke="#000" '
                     f'stroke-dasharray="4 3"/><text x="{x}" y="{bottom + 14}" '
                     f'font-size="12" text-anchor="end">device: {format_bytes(capacity)}'
                     f'</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {label}'
                      for label, attribute, c in MEMORY_KINDS
                      if any(getattr(stage, attribute) for stage in stages)
                      or attribute != "unsharded_bytes")
    if capacity is None:
        against = "The topology gives no device memory to compare with."
    elif near:
        against = f"The dashed line is the device's memory, {format_bytes(capacity)}."
    else:
        against = (f"The device has {format_bytes(capacity)}; the largest stage uses "
                   f"{_share(peak, capacity)} of it, too small a share to draw on the "
                   f"device's scale.")
    return "".join(parts) + (f'<p class="note">{legend}. Per device of each stage, as '
                             f'<code>planc check -v</code> prints it; bars are scaled to the '
                             f'largest. {_e(against)}</p>')


def _transfers(summary: dict) -> str:
    rows = [[t["axis"], t["kind"], t["phase"], f"{int(t['count']):,}",
             format_bytes(t["bytes"]), format_bytes(t["bus_bytes"]), t["stage"]]
            for t in busiest_stage_transfers(summary)]
    several = len(summary["stages"]) > 1
    return _table(["axis", "kind", "phase", "per step", "bytes", "bus bytes", "stage"],
                  rows) + (
        '<p class="note">What one device moves in one step, as <code>planc compile</code> '
        'prints it for its stage' + (': each row is a device of the stage that moves the '
                                     'most for it (the stage column).' if several else '.')
        + (f" <code>ep all_to_all</code>{_e(INNER_ALL_TO_ALLS.removeprefix('ep all_to_all'))}."
           if any(
               row[0] == "ep" and row[1] == "all_to_all" for row in rows) else "")
        + '</p>')


def _phase_letter(name: str) -> str:
    """``F`` or ``B``: the kind of block ``name``, which picks its colour."""
    block = Block.parse_or_none(name)
    return block.kind.letter if block is not None else name


def _timeline_svg(result) -> str:
    lanes = result.timeline[:MAX_LANES]
    step = result.step_seconds or 1
    lane = 22
    scale = (WIDTH - 90) / step
    height = len(lanes) * (lane + 6) + 34
    parts = [f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
             f'role="img" aria-label="simulated timeline per stage">']
    for i, time in enumerate(lanes):
        y = 10 + i * (lane + 6)
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">stage {time.stage}</text>')
        parts.append(f'<rect x="80" y="{y}" width="{step * scale:.1f}" height="{lane}" '
                     f'fill="#f3f3f3"><title>idle: pipeline bubble</title></rect>')
        spans = []
        if time.prologue is not None and time.prologue.end > 0:
            spans.append(("prologue", "prologue", 0.0, time.prologue.compute_end))
        spans += [(_phase_letter(block), f"{block} microbatch {mb}", start,
                   start + replayed.compute_end) for block, mb, start, replayed in time.blocks]
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


FAR_OFF = 2.0  # a prediction this many times off the measurement either way needs a why


def _far_off(plan, predicted: float, measured: float) -> str:
    """Why the simulation can be far from a run, and how to make it predict this machine."""
    ratio = predicted / measured
    if predicted <= 0 or 1 / FAR_OFF <= ratio <= FAR_OFF:
        return ""
    topology = plan.topology
    if topology.preset and topology.preset not in PRESETS:
        described = f"the machine measured into {topology.preset}"
    else:
        described = (f"the topology the plan names ({topology.preset}: " if topology.preset
                     else "the plan's topology (") + \
            f"{format_quantity(topology.device.flops, COMPUTE)} per device at efficiency " \
            f"{topology.device.efficiency:g})"
    how = "slower" if ratio < 1 else "faster"
    return (f'<p class="hint">The prediction is {max(ratio, 1 / ratio):,.0f} times off: '
            f'planc simulates a step on {_e(described)}, and the run that wrote the metrics '
            f'was on a {how} machine. To predict the machine you ran on, measure it with '
            f'<code>planc calibrate -o FILE</code> and name the result in the plan with '
            f'<code>topology {{ preset = "FILE" }}</code> (docs/routes.md).</p>')


def _error(predicted: float, measured: float) -> str:
    """The prediction's error against the measurement: a percentage, or, past FAR_OFF
    times either way (where a percentage reads -100% whatever the miss), the ratio."""
    if measured <= 0 or predicted <= 0:
        return "" if predicted == measured else "n/a"
    ratio = predicted / measured
    if 1 / FAR_OFF <= ratio <= FAR_OFF:
        return f"{ratio - 1:+.0%}"
    return f"{ratio:,.0f}x too high" if ratio > 1 else f"{1 / ratio:,.0f}x too low"


def _measured(plan, result, metrics: list[dict] | None, warmup: int,
              unchecked: str | None) -> str:
    if not metrics:
        return ('<p class="note">Run <code>planc run DIR --metrics m.jsonl</code> and pass '
                '<code>--metrics m.jsonl</code> to compare with a measured run.</p>')
    kept = metrics[warmup:] or metrics
    measured = statistics.median(r["time_s"] for r in kept)
    rows = [["step time", format_quantity(result.step_seconds, TIME),
             format_quantity(measured, TIME), _error(result.step_seconds, measured)]]
    exposed = statistics.median(r.get("exposed_comm_s", 0.0) for r in kept)
    predicted_exposed = max(sum(s.exposed_seconds.values()) for s in result.stages)
    rows.append(["exposed communication", format_quantity(predicted_exposed, TIME),
                 format_quantity(exposed, TIME), _error(predicted_exposed, exposed)])
    # planc run since issue 26 writes both (planc.data.metrics_file checked them where present)
    if all(r.get("mfu") is not None and r.get("tflops_per_device") is not None for r in kept):
        rate = statistics.median(r["tflops_per_device"] for r in kept)
        rows.append(["FLOP/s per device", format_flop_rate(result.tflops_per_gpu * 1e12),
                     format_flop_rate(rate * 1e12), _error(result.tflops_per_gpu, rate)])
        mfu = statistics.median(r["mfu"] for r in kept)
        rows.append(["MFU", format_share(result.mfu), format_share(mfu),
                     _error(result.mfu, mfu)])
    caveat = f'<p class="hint">{_e(unchecked)}</p>' if unchecked else ""
    return _table(["", "simulated", "measured", "error"], rows) + \
        f'<p class="note">Measured: median over {counted(len(kept), "step")} of the slowest rank ' \
        f'(after {min(warmup, len(metrics))} warm-up steps).</p>' + \
        _far_off(plan, result.step_seconds, measured) + caveat


def _loss_curve(plan, metrics: list[dict] | None) -> list[str]:
    """The measured loss against the step, as planc plot draws it (planc.views.curves),
    where every step's record has one."""
    from planc.views.curves import CurveError, curve, inline_svg

    try:
        measured = curve(metrics or [], "loss", plan.name)  # labelled with the plan's name
    except CurveError:
        return []
    if not measured.steps:
        return []
    try:
        image = inline_svg([measured], "loss")
    except ImportError:
        image = ('<p class="note">The loss curve needs matplotlib: <code>pip install '
                 '&#x27;planc[run]&#x27;</code>.</p>')
    return ["<h2>Loss per step (measured)</h2>", f'<div class="curve">{image}</div>']


def _plan_text(plan) -> str:
    """The resolved settings, every line wrapped inside the box (nothing clipped, nothing
    to scroll), a wrapped line hanging under its value column."""
    lines = settings(plan).splitlines()
    key = re.match(r"\S.*?\s{2,}", lines[0]) if lines else None
    indent = len(key.group(0)) if key else 0
    return (f'<div class="plan" style="--key: {indent}ch">'
            + "".join(f'<div class="line">{_e(line) or "&nbsp;"}</div>' for line in lines)
            + "</div>")


def _ranked(plan, ranked: list[dict]) -> str:
    """The layouts ``planc tune`` ranked (its --json candidates), this plan's marked."""
    from planc.tune.space import of_plan

    mine = of_plan(plan).to_json()
    mine.pop("stages")  # a plan file writes "even" ranges out: compare the rest
    rows = []
    for k, c in enumerate(ranked, 1):
        mesh = ", ".join(f"{a} {c['mesh'][a]}" for a in ("tp", "cp", "pp", "dp", "ep")
                         if c["mesh"][a] > 1 or a == "dp")
        this = all(c.get(key) == value for key, value in mine.items())
        rows.append([f"{k}{' (this plan)' if this else ''}", mesh, ", ".join(c["order"]),
                     f"{c['pipeline']}" + (f" v{c['virtual']}" if c["virtual"] > 1 else ""),
                     c["microbatches"], c["zero"], "on" if c["sequence_parallel"] else "off",
                     c["recompute"], format_quantity(c["step_seconds"], TIME),
                     f"{c['tflops_per_gpu']:.1f}", format_share(c["mfu"]),
                     f"{c['bubble']:.1%}", format_bytes(c["memory_bytes"])])
    return _table(["#", "mesh", "order", "pipeline", "microbatches", "zero", "sp",
                   "recompute", "step", "TFLOP/s", "MFU", "bubble", "memory"], rows)


def render(build, result, metrics: list[dict] | None = None, warmup: int = 2,
           unchecked: str | None = None, ranked: list[dict] | None = None) -> str:
    """The page. ``unchecked``: why the metrics could not be checked against the build;
    ``ranked``: the candidates of a planc tune --json, shown beside this plan."""
    plan = build.plan
    peak = max(result.stages, key=lambda s: s.memory_bytes)
    cards = _cards([
        ("step (simulated)", format_quantity(result.step_seconds, TIME)),
        ("FLOP/s per device", format_flop_rate(result.tflops_per_gpu * 1e12)),
        ("MFU", format_share(result.mfu)),
        ("pipeline bubble", f"{result.bubble:.1%}"),
        ("memory at peak", format_bytes(peak.memory_bytes)
         + (f" / {format_bytes(result.memory_capacity)}" if result.memory_capacity else "")),
    ])
    mesh = " x ".join(f"{a} {plan.mesh.size(a)}" for a in AXES)
    sections = [
        f"<h1>planc report: {_e(plan.name)}</h1>",
        f'<p>{counted(plan.world, "rank", grouped=True)} ({_e(mesh)}) on '
        f'{plan.topology.nodes:,} '
        f'{"node" if plan.topology.nodes == 1 else "nodes"} of '
        f'{counted(plan.topology.devices_per_node, "device")}</p>',
        cards,
        "<h2>Layout</h2>", layout_svg(plan),
        "<h2>Memory per stage</h2>", _memory_svg(plan),
        # From the verified graph, as planc compile derives it: summary.json is not checked.
        "<h2>Transfers per axis and kind</h2>", _transfers(summarize(plan, build.graph)),
        "<h2>Timeline of one step (simulated)</h2>", _timeline_svg(result),
        "<h2>Predicted and measured</h2>", _measured(plan, result, metrics, warmup,
                                                     unchecked),
        *_loss_curve(plan, metrics),
        *(["<h2>Layouts planc tune ranked</h2>", _ranked(plan, ranked)] if ranked else []),
        "<h2>The plan</h2>", _plan_text(plan),
    ]
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>planc '
            f'report: {_e(plan.name)}</title><style>{STYLE}</style></head><body>'
            + "\n".join(sections) + "</body></html>\n")
