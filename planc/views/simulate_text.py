"""The text of ``planc simulate``: the step, its throughput, and each stage's share."""

from __future__ import annotations

from planc.vocabulary.units import (TIME, format_bytes, format_flop_rate, format_quantity,
                              format_share)
from planc.views.memory_text import PLANC_RUN_HOLDS
from planc.views.tables import table

SHOWN = 10  # stages listed; the rest are in --json


def render(result, accuracy=None) -> str:
    """``accuracy``: the error to expect (planc.simulate.accuracy), None where the
    simulator was not held to published runs of the plan's device."""
    step = result.step_seconds
    stages = result.stages
    worst = max(stages, key=lambda s: s.memory_bytes)
    capacity = (f" of {format_bytes(result.memory_capacity)}"
                if result.memory_capacity else "")
    exposed: dict[str, float] = {}
    for stage in stages:
        for axis, seconds in stage.exposed_seconds.items():
            exposed[axis] = max(exposed.get(axis, 0.0), seconds)
    exposed_text = ", ".join(f"{axis} {format_quantity(s, TIME)}"
                             for axis, s in sorted(exposed.items())) or "none"
    lines = [
        f"{result.plan}: {result.world:,} rank{'s' * (result.world != 1)}, "
        f"{len(stages)} pipeline "
        f"stage{'s' * (len(stages) != 1)}: one step takes {format_quantity(step, TIME)}",
        "  expected error: " + (accuracy.text() if accuracy is not None else
                                "not measured on this device (the simulator is held to "
                                "published runs on the dgx-a100 and dgx-h100 presets)"),
        f"  throughput: {format_flop_rate(result.tflops_per_gpu * 1e12)} per device, MFU "
        f"{format_share(result.mfu)}{' of the FP8 peak' * result.mfu_of_fp8} "
        f"(model FLOPs of Narayanan et al. 2021, recomputation not counted)",
        f"  pipeline bubble: {result.bubble:.1%} of the step (stage 0)",
        f"  exposed communication (worst stage, per axis): {exposed_text}",
        f"  memory: {format_bytes(worst.memory_bytes)}{capacity} at peak (stage {worst.stage})",
    ]
    if result.worst_routing_memory is not None:
        stage, held = result.worst_routing_memory
        lines.append(f"  memory under the worst routing: {format_bytes(held)} (stage {stage}; "
                     f"a dropless mixture's every row of the ep group on one rank's experts)")
    if result.planc_run_memory is not None:
        stage, held = result.planc_run_memory
        lines.append(f"  memory as planc run holds it: {format_bytes(held)} (stage {stage}; "
                     f"{PLANC_RUN_HOLDS})")
    if result.fp8_at_the_dtype_rate:
        lines.append("  fp8: its GEMMs are priced at the dtype's rate: the simulator knows an "
                     "FP8 rate only on a GPU preset that has one (dgx-h100)")
    lines.append("")
    axes = sorted(exposed)
    rows = []
    shown = stages if len(stages) <= SHOWN else (*stages[:SHOWN // 2], None,
                                                 *stages[-(SHOWN // 2):])
    for s in shown:
        if s is None:
            rows.append(["..."] + [""] * (4 + len(axes)))
            continue
        rows.append([str(s.stage), format_quantity(s.step_seconds, TIME),
                     format_quantity(s.busy_seconds, TIME), f"{s.bubble_seconds / step:.1%}",
                     *[format_quantity(s.exposed_seconds.get(a, 0.0), TIME) for a in axes],
                     format_bytes(s.memory_bytes)])
    lines.append(table(["stage", "ends", "computing", "bubble",
                        *[f"exposed {a}" for a in axes], "memory"], rows, indent="  "))
    if len(stages) > SHOWN:
        lines.append(f"  ({len(stages) - SHOWN} stages not shown; --json lists every one)")
    return "\n".join(lines) + "\n"
