"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", SC'21, section 2.2): each stage holds ``virtual`` model
chunks, chunk c on stage c mod pp; microbatches go through a stage's chunks in groups of
pp, forwards in chunk order and backwards in reverse; stage s runs
(pp - s - 1) * 2 + (virtual - 1) * pp warm-up forwards before its first backward."""

from __future__ import annotations

from planc.schedules.actions import Action, ActionKind
from planc.schedules.schedule import PipelineSchedule, PipelineShape, ScheduleProblem

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD


def _warmup(stage: int, pp: int, virtual: int) -> int:
    return (pp - stage - 1) * 2 + (virtual - 1) * pp


def order(stage: int, pp: int, microbatches: int, virtual: int) -> list[Action]:
    """Needs microbatches divisible by pp (see :func:`problems`)."""
    total = microbatches * virtual  # the stage's (microbatch, chunk) pairs
    group = pp * virtual

    def action(kind: ActionKind, k: int) -> Action:
        """The k-th forward or backward of the stage."""
        in_group = k % group
        local_chunk = in_group // pp
        if kind is BACKWARD:
            local_chunk = virtual - local_chunk - 1
        microbatch = (k // group) * pp + in_group % pp
        return Action(kind, microbatch, local_chunk * pp + stage)

    warmup = min(_warmup(stage, pp, virtual), total)
    actions = [action(FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        actions.append(action(FORWARD, warmup + i))
        actions.append(action(BACKWARD, i))
    actions += [action(BACKWARD, k) for k in range(total - warmup, total)]
    return actions


def in_flight(stage: int, pp: int, microbatches: int, virtual: int) -> int:
    """The warm-up forwards, then one more before the first backward."""
    return min(_warmup(stage, pp, virtual) + 1, microbatches * virtual)


def problems(shape: PipelineShape) -> list[ScheduleProblem]:
    pp, virtual, microbatches = shape.pp, shape.virtual, shape.microbatches
    if pp == 1:
        return [ScheduleProblem("pipeline = interleaved needs pp > 1", ("schedule.pipeline",),
                                "use pipeline = 1f1b with pp = 1")]
    if virtual == 1:
        return [ScheduleProblem("pipeline = interleaved needs virtual > 1",
                                ("schedule.pipeline",),
                                "set shard { pp { virtual = 2 } }, or use pipeline = 1f1b")]
    # Uneven chunks are fine (planc.schedules.layers): the checker asks for a layer per
    # chunk, bar the embedding-only first and head-only last chunk.
    found = []
    if microbatches % pp:
        found.append(ScheduleProblem(
            f"the interleaved schedule needs microbatches ({microbatches}) to divide by "
            f"pp ({pp})", ("schedule.microbatches", "schedule.pipeline"),
            "Megatron's interleaved 1F1B runs microbatches in groups of pp"))
    return found


INTERLEAVED = PipelineSchedule("interleaved", order, in_flight, problems,
                               chunks_per_stage=True)
