"""What a pipeline schedule is to the rest of planc: one value per schedule.

A schedule gives, for one stage, the order of its blocks (:attr:`PipelineSchedule.order`),
how many microbatch-chunks' activations the stage holds at its peak
(:attr:`PipelineSchedule.in_flight`: what the memory estimate multiplies by), and what it
needs of the plan (:attr:`PipelineSchedule.problems`: the checker reports each at the
first of its keys that the plan file wrote). The rules see plain numbers, never a Plan,
so this package stands below the language and the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planc.schedules.actions import Action


@dataclass(frozen=True)
class PipelineShape:
    """The numbers a schedule depends on."""

    pp: int  # pipeline stages
    virtual: int  # model chunks per stage
    microbatches: int
    layers: int


@dataclass(frozen=True)
class ScheduleProblem:
    """Something a plan must change to run a schedule, in the checker's words."""

    message: str
    keys: tuple[str, ...]  # dotted plan keys; the first one written places the message
    hint: str | None = None


@dataclass(frozen=True)
class PipelineSchedule:
    """One pipeline schedule, as the registry holds it.

    ``order(stage, pp, microbatches, virtual)``: the stage's actions, in order.
    ``in_flight(stage, pp, microbatches, virtual)``: microbatch-chunks whose activations
    the stage holds at its peak.
    ``problems(shape)``: what the plan must change for this schedule, [] if nothing.
    ``chunks_per_stage``: whether it runs several model chunks on a stage (virtual > 1).
    ``splits_backward``: whether its backward runs as two blocks per chunk, the input
    gradient (``I``, which the previous chunk waits for) and the weight gradient (``W``,
    which nobody waits for), as zero-bubble schedules do (Qi et al., ICLR 2024).
    """

    name: str
    order: Callable[[int, int, int, int], list[Action]]
    in_flight: Callable[[int, int, int, int], int]
    problems: Callable[[PipelineShape], list[ScheduleProblem]]
    chunks_per_stage: bool = False
    splits_backward: bool = False


def no_problems(shape: PipelineShape) -> list[ScheduleProblem]:
    """The rule of a schedule that runs with any pp and microbatches."""
    return []
