"""GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism", NeurIPS 2019): every forward, then every backward."""

from __future__ import annotations

from planc.schedules.actions import Action, ActionKind
from planc.schedules.schedule import PipelineSchedule, no_problems


def order(stage: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    return ([Action(ActionKind.FORWARD, i, stage) for i in range(microbatches)]
            + [Action(ActionKind.BACKWARD, i, stage) for i in range(microbatches)])


def in_flight(stage: int, pp: int, microbatches: int, virtual: int = 1) -> int:
    """Every microbatch's activations wait for the first backward."""
    return microbatches


GPIPE = PipelineSchedule("gpipe", order, in_flight, no_problems, steady=False)
