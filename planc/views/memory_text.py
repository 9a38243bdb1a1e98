"""The memory estimate as a table: one row per pipeline stage."""

from __future__ import annotations

from planc.vocabulary.units import format_bytes
from planc.estimate.memory import MemoryEstimate
from planc.views.tables import table


MAX_ROWS = 8
# Why planc's runtime holds more than the estimate (planc.estimate.memory.gathered_inputs_bytes)
PLANC_RUN_HOLDS = ("sequence parallelism: planc keeps the gathered inputs of q/k/v, fc1 "
                   "(gate/up) and the head whole, where Megatron-LM keeps shards and "
                   "gathers them again in the backward (shard { tp { gathered_inputs = "
                   "regather } })")


def _stages_shown(estimate: MemoryEstimate) -> set[int]:
    """All stages of a short pipeline; of a long one the first three, the last two and
    the peak."""
    count = len(estimate.stages)
    if count <= MAX_ROWS:
        return set(range(count))
    return {0, 1, 2, count - 2, count - 1, estimate.peak.stage}


def render(estimate: MemoryEstimate) -> str:
    rows = []
    shown = _stages_shown(estimate)
    # ZeRO-3: a column for the largest unit held whole (planc.estimate.memory)
    units = any(s.unsharded_bytes for s in estimate.stages)
    for s in estimate.stages:
        if s.stage not in shown:
            if s.stage - 1 in shown:
                rows.append(["...", *[""] * (8 if units else 7)])
            continue
        rows.append([s.stage, f"{s.parameters:,}", format_bytes(s.parameter_bytes),
                     format_bytes(s.gradient_bytes), format_bytes(s.optimizer_bytes),
                     format_bytes(s.activation_bytes), s.microbatches_in_flight,
                     *([format_bytes(s.unsharded_bytes)] if units else []),
                     format_bytes(s.total_bytes)])
    capacity = ("unknown capacity (no topology memory given)" if estimate.capacity is None
                else f"device memory {format_bytes(estimate.capacity)}")
    peak = estimate.peak
    share = 100 * peak.total_bytes / estimate.capacity if estimate.capacity else 0.0
    used = ("" if estimate.capacity is None else
            f", peak {'<0.1' if share < 0.1 else f'{share:.1f}'}% on stage {peak.stage}")
    lines = [f"memory per device (estimate; {capacity}{used})",
             table(["stage", "params", "weights", "grads", "optimizer", "activations",
                    "in flight", *(["unit whole"] if units else []), "total"], rows)]
    notes = [text for text in (planc_run_text(estimate), worst_routing_text(estimate))
             if text]
    return "\n".join(lines + notes)


def planc_run_text(estimate: MemoryEstimate) -> str | None:
    """A line on what planc's runtime holds beyond the estimate, or None."""
    held = estimate.planc_run_peak
    if held is None:
        return None
    return (f"as planc run holds it stage {held.stage} would need "
            f"{format_bytes(held.planc_run_total_bytes)} ({PLANC_RUN_HOLDS})")


def worst_routing_text(estimate: MemoryEstimate) -> str | None:
    """A line on what the estimate's routing assumption leaves out, or None."""
    worst = estimate.worst_routing_peak
    if worst is None:
        return None
    return (f"under the worst routing (a dropless mixture's every row of the ep group on "
            f"one rank's experts) stage {worst.stage} would need "
            f"{format_bytes(worst.worst_routing_total_bytes)}; "
            f"the estimate prices the routing's imbalance, and model {{ capacity }} bounds "
            f"the worst case")
