"""What the V schedules (zbv, dualpipev) share: their validity rule and their
in-flight count, read off the order itself."""

from __future__ import annotations

from collections.abc import Sequence

from planc.schedules.actions import Action
from planc.schedules.schedule import PipelineShape, ScheduleProblem


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most microbatch-chunks held at once: a forward keeps its activations until
    the last backward part of the same microbatch and chunk (W when the backward is
    split, which needs the layers' inputs; else B)."""
    last = {}
    for k, action in enumerate(actions):
        if not action.kind.is_forward:
            last[(action.microbatch, action.chunk)] = k
    ends = set(last.values())
    held = peak = 0
    for k, action in enumerate(actions):
        if action.kind.is_forward:
            held += 1
            peak = max(peak, held)
        elif k in ends:
            held -= 1
    return peak


def v_problems(name: str, shape: PipelineShape, fills_both_arms: bool = False
               ) -> list[ScheduleProblem]:
    """A V has two chunks per stage on at least two stages; a schedule that
    ``fills_both_arms`` before its steady state (DualPipeV) needs a microbatch per chunk,
    2pp of them."""
    if shape.pp == 1:
        return [ScheduleProblem(f"pipeline = {name} needs pp > 1", ("schedule.pipeline",),
                                "a V runs two chunks on each of at least two stages; use "
                                "pipeline = 1f1b with pp = 1")]
    found = []
    if shape.virtual != 2:
        found.append(ScheduleProblem(
            f"pipeline = {name} needs virtual = 2 (two chunks per stage, in a V), not "
            f"{shape.virtual}", ("shard.pp.virtual", "schedule.pipeline"),
            "set shard { pp { virtual = 2 } }"))
    least = 2 * shape.pp
    if fills_both_arms and shape.microbatches < least:
        found.append(ScheduleProblem(
            f"pipeline = {name} needs at least 2 x pp = {least} microbatches, not "
            f"{shape.microbatches}", ("schedule.microbatches", "schedule.pipeline"),
            f"set schedule {{ microbatches = {least} }}"))
    return found
