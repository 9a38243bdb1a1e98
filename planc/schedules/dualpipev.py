"""DualPipeV: DeepSeek's DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024,
section 3.2.1) folded into a V (the two chunks of stage s are s and 2pp - 1 - s,
:data:`V`), as torch.distributed.pipelining's ``ScheduleDualPipeV`` orders it after
deepseek-ai/DualPipe's ``DualPipeV``.

Its steady state runs the forward of one microbatch on one chunk overlapped with the
whole backward (``B``) of another microbatch on the other chunk: the pair is two
adjacent actions, F then B, whose positions :func:`overlapped` lists. The warm-up fills
both arms of the V (so it needs 2pp microbatches), and the stages nearest the turn
split some backwards into an input gradient (``I``) and a weight gradient (``W``) that
runs later, in the order the input gradients ran, to fill the drain's bubbles.

Stage s of pp: (1) 2(pp - s - 1) forwards of its first chunk; (2) s + 1 pairs of
forwards, first chunk then second; (3) pp - s - 1 rounds of (I second chunk, a
deferred W if any, F second chunk); (4) m - 2pp + s + 1 rounds of two overlapped pairs,
(F first, B second) then (F second, B first), except that the last stage's first pair
runs as plain F then B; (5) pp - s - 1 rounds of (B second, overlapped (F second, B
first)); (6) s + 1 rounds of backwards of both chunks, the second half of them split
(I, its W deferred); (7) pp - s - 1 rounds of (a deferred W, a backward of the first
chunk); (8) the remaining deferred Ws.
"""

from __future__ import annotations

from collections import deque

from planc.schedules.actions import Action, ActionKind
from planc.schedules.schedule import PipelineSchedule, PipelineShape, ScheduleProblem, V
from planc.schedules.v_rules import peak_in_flight, v_problems

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def _plan(stage: int, pp: int, microbatches: int) -> tuple[list[Action], frozenset[int]]:
    """The stage's actions and the positions of the forwards that open an overlapped
    pair."""
    first, second = stage, 2 * pp - 1 - stage
    forwards = {first: 0, second: 0}  # the next microbatch to run forward, per chunk
    backwards = {first: 0, second: 0}  # ... to run backward (whole, or its I)
    deferred: deque[tuple[int, int]] = deque()  # (chunk, microbatch) of Is awaiting W
    actions: list[Action] = []
    pairs: set[int] = set()

    def forward(chunk: int) -> None:
        actions.append(Action(F, forwards[chunk], chunk))
        forwards[chunk] += 1

    def backward(chunk: int, split: bool = False) -> None:
        microbatch = backwards[chunk]
        actions.append(Action(I if split else B, microbatch, chunk))
        backwards[chunk] += 1
        if split:
            deferred.append((chunk, microbatch))

    def weight() -> None:
        if deferred:
            chunk, microbatch = deferred.popleft()
            actions.append(Action(W, microbatch, chunk))

    def overlapped_pair(forward_chunk: int, backward_chunk: int) -> None:
        pairs.add(len(actions))
        forward(forward_chunk)
        backward(backward_chunk)

    for _ in range(2 * (pp - stage - 1)):
        forward(first)
    for _ in range(stage + 1):
        forward(first)
        forward(second)
    for _ in range(pp - stage - 1):
        backward(second, split=True)
        weight()
        forward(second)
    for k in range(microbatches - 2 * pp + stage + 1):
        if k == 0 and stage == pp - 1:  # the turn of the V: not overlapped, a shorter bubble
            forward(first)
            backward(second)
        else:
            overlapped_pair(first, second)
        overlapped_pair(second, first)
    for _ in range(pp - stage - 1):
        backward(second)
        overlapped_pair(second, first)
    rounds, split = stage + 1, False
    for k in range(rounds):  # from the middle round on, backwards are split
        split = split or (k == rounds // 2 and stage % 2 == 1)
        backward(second, split)
        split = split or (k == rounds // 2 and stage % 2 == 0)
        backward(first, split)
    for _ in range(pp - stage - 1):
        weight()
        backward(first, split)
    while deferred:
        weight()
    return actions, frozenset(pairs)


def order(stage: int, pp: int, microbatches: int, virtual: int = 2) -> list[Action]:
    return _plan(stage, pp, microbatches)[0]


def overlapped(stage: int, pp: int, microbatches: int, virtual: int = 2) -> frozenset[int]:
    """Positions i at which action i (a forward) and action i + 1 (another microbatch's
    backward, on the other chunk) run as one overlapped pair."""
    return _plan(stage, pp, microbatches)[1]


def in_flight(stage: int, pp: int, microbatches: int, virtual: int = 2) -> int:
    """Microbatch-chunks from a forward to the end of its backward, at the peak."""
    return peak_in_flight(order(stage, pp, microbatches, virtual))


def problems(shape: PipelineShape) -> list[ScheduleProblem]:
    return v_problems("dualpipev", shape, fills_both_arms=True)


DUALPIPEV = PipelineSchedule("dualpipev", order, in_flight, problems, chunks_per_stage=True,
                             placement=V, splits_backward=True, overlapped=overlapped)
