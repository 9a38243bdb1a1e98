"""The text of ``planc diff``: what differs between two plans, and what it costs."""

from __future__ import annotations

from planc.graph.summary import busiest_stage_by_axis, summarize
from planc.vocabulary.units import TIME, format_bytes, format_flop_rate, format_quantity, format_share
from planc.plan.mesh import AXES
from planc.views.tables import table


def _mesh(plan) -> str:
    m = plan.mesh
    return " x ".join(f"{axis} {m.size(axis)}" for axis in AXES
                      if m.size(axis) > 1) or "one rank"


def _moved(moved: dict | None, stages: int) -> str:
    if moved is None:
        return "0, 0 B"
    where = f" (stage {moved['stage']})" if stages > 1 else ""
    return f"{int(moved['count']):,}, {format_bytes(moved['bytes'])}{where}"


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}x" if a else ""


def render(sides) -> str:
    (path_a, a, sim_a, _), (path_b, b, sim_b, overrides) = sides
    rows = [
        ["plan", a.plan.name, b.plan.name, ""],
        *([["overrides", "", ", ".join(overrides), ""]] if overrides else []),
        ["world", f"{a.plan.world:,}", f"{b.plan.world:,}", _ratio(a.plan.world, b.plan.world)],
        ["mesh", _mesh(a.plan), _mesh(b.plan), ""],
        ["nodes", f"{a.plan.topology.nodes} x {a.plan.topology.devices_per_node}",
         f"{b.plan.topology.nodes} x {b.plan.topology.devices_per_node}", ""],
        ["schedule", f"{a.plan.schedule.pipeline}, {a.plan.schedule.microbatches} mb",
         f"{b.plan.schedule.pipeline}, {b.plan.schedule.microbatches} mb", ""],
        ["step (simulated)", format_quantity(sim_a.step_seconds, TIME),
         format_quantity(sim_b.step_seconds, TIME), _ratio(sim_a.step_seconds,
                                                            sim_b.step_seconds)],
        ["FLOP/s per device", format_flop_rate(sim_a.tflops_per_gpu * 1e12),
         format_flop_rate(sim_b.tflops_per_gpu * 1e12),
         _ratio(sim_a.tflops_per_gpu, sim_b.tflops_per_gpu)],
        ["MFU", format_share(sim_a.mfu), format_share(sim_b.mfu), ""],
        ["pipeline bubble", f"{sim_a.bubble:.1%}", f"{sim_b.bubble:.1%}", ""],
    ]
    peak_a = max(sim_a.stages, key=lambda s: s.memory_bytes)
    peak_b = max(sim_b.stages, key=lambda s: s.memory_bytes)
    rows.append(["memory at peak", f"{format_bytes(peak_a.memory_bytes)} (stage "
                 f"{peak_a.stage})", f"{format_bytes(peak_b.memory_bytes)} (stage "
                 f"{peak_b.stage})", _ratio(peak_a.memory_bytes, peak_b.memory_bytes)])
    if a.plan.mesh.pp == b.plan.mesh.pp <= 16:
        for s_a, s_b in zip(sim_a.stages, sim_b.stages):
            rows.append([f"  memory, stage {s_a.stage}", format_bytes(s_a.memory_bytes),
                         format_bytes(s_b.memory_bytes), _ratio(s_a.memory_bytes,
                                                                s_b.memory_bytes)])
    # From the verified graphs, as planc compile derives them: summary.json is not checked.
    moved_a, moved_b = (busiest_stage_by_axis(summarize(side.plan, side.graph))
                        for side in (a, b))
    for axis in sorted(set(moved_a) | set(moved_b)):
        one_a, one_b = moved_a.get(axis), moved_b.get(axis)
        rows.append([f"transfers over {axis}", _moved(one_a, a.plan.mesh.pp),
                     _moved(one_b, b.plan.mesh.pp),
                     _ratio(one_a["bytes"] if one_a else 0, one_b["bytes"] if one_b else 0)])
    exposed_a = {k: v for s in sim_a.stages for k, v in s.exposed_seconds.items()}
    exposed_b = {k: v for s in sim_b.stages for k, v in s.exposed_seconds.items()}
    for axis in sorted(set(exposed_a) | set(exposed_b)):
        rows.append([f"exposed {axis} (worst stage)",
                     format_quantity(max((s.exposed_seconds.get(axis, 0.0)
                                          for s in sim_a.stages), default=0.0), TIME),
                     format_quantity(max((s.exposed_seconds.get(axis, 0.0)
                                          for s in sim_b.stages), default=0.0), TIME), ""])
    header = ["", f"A: {path_a}", f"B: {path_b}", "B / A"]
    return (table(header, rows) + "\nper device and step; transfers over an axis: a device "
            "of the stage that moves the most over it, as planc compile prints that stage; "
            "times simulated on each plan's topology (docs/simulate.md)\n")
