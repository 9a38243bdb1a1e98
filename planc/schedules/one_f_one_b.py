"""1F1B, as PipeDream-Flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021): stage s runs pp - s - 1 warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards."""

from __future__ import annotations

from planc.schedules.actions import Action, ActionKind
from planc.schedules.schedule import PipelineSchedule, no_problems

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD


def order(stage: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    warmup = min(pp - stage - 1, microbatches)
    actions = [Action(FORWARD, i, stage) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions.append(Action(FORWARD, warmup + i, stage))
        actions.append(Action(BACKWARD, i, stage))
    actions += [Action(BACKWARD, i, stage) for i in range(microbatches - warmup, microbatches)]
    return actions


def in_flight(stage: int, pp: int, microbatches: int, virtual: int = 1) -> int:
    """The warm-up forwards and the first steady one hold their activations."""
    return min(pp - stage, microbatches)


ONE_F_ONE_B = PipelineSchedule("1f1b", order, in_flight, no_problems)
