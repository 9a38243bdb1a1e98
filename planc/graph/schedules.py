"""Pipeline schedules as the graph writes them; the schedules themselves live in the
registry, :mod:`planc.schedules`.

``graph.graph["schedule"]`` holds, per stage, its actions as text: ``F3`` for the
forward of microbatch 3, ``B3.c1`` for the backward of microbatch 3 on chunk 1 when
each stage has several chunks (:meth:`planc.schedules.Action.text`).
"""

from __future__ import annotations

from planc.schedules import Action, Timeline, named, simulate

__all__ = ["Action", "Timeline", "schedule", "schedule_text", "simulate"]


def schedule(pipeline: str, stage: int, pp: int, microbatches: int,
             virtual: int = 1) -> list[Action]:
    """Stage ``stage``'s actions under the schedule named ``pipeline``, as its program
    runs them (a whole backward of a schedule that splits the others is its I then W)."""
    return named(pipeline).program_order(stage, pp, microbatches, virtual)


def schedule_text(pipeline: str, stage: int, pp: int, microbatches: int, virtual: int) -> str:
    """The stage's actions as the graph's ``schedule`` attribute writes them."""
    return " ".join(a.text(virtual) for a in schedule(pipeline, stage, pp, microbatches,
                                                      virtual))
