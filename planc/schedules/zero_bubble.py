"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024): the backward of a chunk is split into its input gradient (``I``: the previous
chunk waits for it) and its weight gradient (``W``: nobody waits for it), and the W
blocks are deferred into the bubbles that 1F1B leaves.

- ``zb1p`` is ZB-H1 (section 3.1): one chunk per stage, 1F1B's warm-up of pp - s - 1
  forwards, then F I pairs; stage s holds its first s weight gradients back, so that the
  W blocks fill the drain, where 1F1B's stages wait for backwards to come back.
- ``interleaved_zb`` is the same rule over the interleaved order of Narayanan et al.
  (SC'21): stage s runs (virtual - 1) x pp + pp - s - 1 warm-up forwards, forwards walk
  a stage's chunks in rounds of pp microbatches and backwards walk them in reverse.
  torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble`` generates the same
  per-stage order (tests/test_zero_bubble.py compares them); with one chunk
  per stage it gives ZB-H1.
"""

from __future__ import annotations

from collections import defaultdict

from planc.schedules import interleaved
from planc.schedules.actions import Action, ActionKind
from planc.schedules.schedule import PipelineSchedule, PipelineShape, ScheduleProblem

FORWARD, INPUT, WEIGHT = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, \
    ActionKind.BACKWARD_WEIGHT


def _per_round(pp: int, microbatches: int) -> int:
    """Microbatches that walk through a stage's chunks together: pp (microbatches divide
    by pp, see :func:`interleaved.problems`), or all of them when there are fewer."""
    rounds = max(1, microbatches // pp)
    return microbatches // rounds


def _warmup(stage: int, pp: int, microbatches: int, virtual: int) -> int:
    """Forwards before the first backward: one fewer per hop towards the last stage, and
    a round of pp more per extra chunk; never more than the stage has."""
    return min((virtual - 1) * _per_round(pp, microbatches) + pp - stage - 1,
               microbatches * virtual)


def order(stage: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    total = microbatches * virtual  # the stage's (microbatch, chunk) pairs
    per_round = _per_round(pp, microbatches)
    warmup = _warmup(stage, pp, microbatches, virtual)
    held_back = stage  # weight gradients the stage defers into its drain

    def forward_chunk(k: int) -> int:  # of the stage's k-th forward
        return (k // per_round) % virtual * pp + stage

    def backward_chunk(k: int) -> int:  # of its k-th backward: the chunks in reverse
        return (virtual - 1 - (k // per_round) % virtual) * pp + stage

    taken: dict[tuple[ActionKind, int], int] = defaultdict(int)

    def next_of(kind: ActionKind, chunk: int) -> Action:
        """Each chunk sees its microbatches in order, for each kind of block."""
        microbatch = taken[(kind, chunk)]
        taken[(kind, chunk)] += 1
        return Action(kind, microbatch, chunk)

    actions = [next_of(FORWARD, forward_chunk(k)) for k in range(warmup)]
    backwards: list[int] = []  # chunks of the input gradients run so far
    for k in range(total):
        if warmup + k < total:
            actions.append(next_of(FORWARD, forward_chunk(warmup + k)))
        backwards.append(backward_chunk(k))
        actions.append(next_of(INPUT, backwards[-1]))
        if k >= held_back:
            actions.append(next_of(WEIGHT, backwards[k - held_back]))
    actions += [next_of(WEIGHT, chunk) for chunk in backwards[max(total - held_back, 0):]]
    return actions


def held_at_peak(actions: list[Action]) -> int:
    """Microbatch-chunks begun and not finished at the peak: a forward keeps its
    activations until its weight gradient, which reads the layers' inputs and the
    output gradients (the input gradient frees only part of them; counted whole)."""
    held = peak = 0
    for action in actions:
        held += {FORWARD: 1, WEIGHT: -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def in_flight(stage: int, pp: int, microbatches: int, virtual: int = 1) -> int:
    """min(virtual x pp, virtual x microbatches) on every stage: the warm-up's forwards
    and the stage's held-back weight gradients add up to pp per chunk (ZB-H1: pp, 1F1B's
    peak, on its first stage), as :func:`held_at_peak` reads off the order."""
    return min(virtual * pp, virtual * microbatches)


def _needs_pipeline(name: str, shape: PipelineShape) -> list[ScheduleProblem]:
    if shape.pp == 1:
        return [ScheduleProblem(
            f"pipeline = {name} needs pp > 1: with one stage there is no bubble for the "
            f"weight gradients to fill", ("schedule.pipeline",),
            "use pipeline = 1f1b with pp = 1, or set mesh { pp = 2 }")]
    return []


def zb1p_problems(shape: PipelineShape) -> list[ScheduleProblem]:
    return _needs_pipeline("zb1p", shape)


def interleaved_zb_problems(shape: PipelineShape) -> list[ScheduleProblem]:
    found = _needs_pipeline("interleaved_zb", shape)
    if found:
        return found
    if shape.virtual == 1:
        return [ScheduleProblem("pipeline = interleaved_zb needs virtual > 1",
                                ("schedule.pipeline",),
                                "set shard { pp { virtual = 2 } }, or use pipeline = zb1p")]
    # The interleaved order's own needs: its chunks and its rounds of pp microbatches.
    return interleaved.problems(shape)


ZB1P = PipelineSchedule("zb1p", order, in_flight, zb1p_problems, splits_backward=True)
INTERLEAVED_ZB = PipelineSchedule("interleaved_zb", order, in_flight,
                                  interleaved_zb_problems, chunks_per_stage=True,
                                  splits_backward=True)
