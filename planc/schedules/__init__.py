"""Pipeline schedules: the order of each stage's blocks, the activations it holds, and
what a schedule needs of a plan, one registered value per schedule.

To add a schedule: write a module with its ``order``, ``in_flight`` and ``problems``
rules and a :class:`PipelineSchedule` constant, and add that constant to
:data:`SCHEDULES`. The language's allowed ``pipeline`` words, the checker, the memory
estimate, the graph and lowering all read this registry. Nothing here imports torch or
the rest of planc.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

from planc.schedules.actions import Action, ActionKind, Block
from planc.schedules.dualpipev import DUALPIPEV
from planc.schedules.gpipe import GPIPE
from planc.schedules.interleaved import INTERLEAVED
from planc.schedules.one_f_one_b import ONE_F_ONE_B
from planc.schedules.schedule import (LOOP, V, PipelineSchedule, PipelineShape, ChunkPlacement,
                                      ScheduleProblem)
from planc.schedules.timeline import Timeline, simulate
from planc.schedules.zero_bubble import INTERLEAVED_ZB, ZB1P
from planc.schedules.zbv import ZBV

__all__ = ["Action", "ActionKind", "Block", "LOOP", "V", "PipelineSchedule", "PipelineShape",
           "ChunkPlacement",
           "ScheduleProblem", "SCHEDULES", "DEFAULT_SCHEDULE", "Timeline", "named", "names",
           "order", "peak_order", "problems", "simulate"]

# Name -> schedule, in the order the language lists them; read-only.
SCHEDULES = MappingProxyType({s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB1P,
                                                  INTERLEAVED_ZB, ZBV, DUALPIPEV)})
DEFAULT_SCHEDULE = ONE_F_ONE_B.name


def names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def named(name: str) -> PipelineSchedule:
    """The schedule called ``name``; ValueError naming the known ones if none is."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of "
                         f"{', '.join(SCHEDULES)}") from None


def order(name: str, stage: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    """Stage ``stage``'s actions under the schedule ``name``."""
    return named(name).order(stage, pp, microbatches, virtual)


@functools.lru_cache(maxsize=1 << 12)
def peak_order(name: str, stage: int, pp: int, microbatches: int, virtual: int = 1
               ) -> tuple[Action, ...]:
    """Stage ``stage``'s actions over :meth:`PipelineSchedule.peak_microbatches`: an order
    that reaches the same peaks of what it holds, as the memory estimate replays it
    (planc tune estimates thousands of layouts of a few pipeline shapes)."""
    schedule = named(name)
    return tuple(schedule.order(stage, pp, schedule.peak_microbatches(pp, microbatches,
                                                                      virtual), virtual))


def problems(name: str, shape: PipelineShape) -> list[ScheduleProblem]:
    """What the plan must change to run schedule ``name``: the schedule's own rule, and
    for a schedule of one chunk per stage, virtual = 1."""
    schedule = named(name)
    if schedule.chunks_per_stage or shape.virtual == 1:
        return schedule.problems(shape)
    several = [s.name for s in SCHEDULES.values() if s.chunks_per_stage]
    one_chunk = ScheduleProblem(
        f"virtual = {shape.virtual} needs pipeline = {_either(several)}",
        ("shard.pp.virtual",), f"set schedule {{ pipeline = {several[0]} }}")
    return [one_chunk] + schedule.problems(shape)


def _either(words: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(filter(None, (", ".join(words[:-1]), words[-1])))
