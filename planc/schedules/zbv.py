"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): two model
chunks per stage in a V (chunk s and chunk 2pp - 1 - s on stage s, :data:`V`), and each
backward split into its input gradient (``I``, which the previous chunk waits for) and
its weight gradient (``W``, which nobody waits for and so fills the bubbles). With equal
forward, input-gradient and weight-gradient times its bubble vanishes at 1F1B's
activation memory.

The order is the one torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` generates:
stage s first runs 2(pp - s) - 1 forwards of its first chunk, then s pairs of forwards
(second chunk, first chunk), then pp - s rounds of (forward, I, W) on the second chunk;
the steady state alternates (F, I, W) on the first chunk with (F, I, W) on the second,
and the drain runs the remaining input gradients before the weight gradients they
deferred. The rounds are planned for at least 2pp - 1 microbatches, and the actions of
microbatches the step does not have are dropped (torch leaves them idle).
"""

from __future__ import annotations

from planc.schedules.actions import Action, ActionKind
from planc.schedules.schedule import PipelineSchedule, PipelineShape, ScheduleProblem, V
from planc.schedules.v_rules import peak_in_flight, v_problems

F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def order(stage: int, pp: int, microbatches: int, virtual: int = 2) -> list[Action]:
    down, up = stage, 2 * pp - 1 - stage  # the stage's chunk on each arm of the V
    planned = max(2 * pp - 1, microbatches)
    done = {(kind, chunk): 0 for kind in (F, I, W) for chunk in (down, up)}
    actions: list[Action] = []

    def run(*steps: tuple[ActionKind, int]) -> None:
        """Each (kind, chunk) on the chunk's next microbatch for that kind."""
        for kind, chunk in steps:
            actions.append(Action(kind, done[(kind, chunk)], chunk))
            done[(kind, chunk)] += 1

    for _ in range(2 * (pp - stage) - 1):
        run((F, down))
    for _ in range(stage):
        run((F, up), (F, down))
    for _ in range(pp - stage):
        run((F, up), (I, up), (W, up))
    while done[(F, up)] < done[(F, down)] or done[(F, down)] < planned:
        if done[(F, down)] < planned:
            run((F, down))
        run((I, down), (W, down), (F, up), (I, up), (W, up))
    for _ in range(stage):
        run((I, down), (I, up))
    for _ in range(pp - stage):
        run((I, down), (W, down))
    for chunk in (up, down):  # the deferred weight gradients, second arm first
        while done[(W, chunk)] < done[(I, chunk)]:
            run((W, chunk))
    return [a for a in actions if a.microbatch < microbatches]


def in_flight(stage: int, pp: int, microbatches: int, virtual: int = 2) -> int:
    """Microbatch-chunks from a forward to its weight gradient, at the peak of the order."""
    return peak_in_flight(order(stage, pp, microbatches, virtual))


def problems(shape: PipelineShape) -> list[ScheduleProblem]:
    return v_problems("zbv", shape)


ZBV = PipelineSchedule("zbv", order, in_flight, problems, chunks_per_stage=True,
                       placement=V, splits_backward=True)
