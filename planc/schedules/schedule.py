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

from planc.schedules.actions import Action, ActionKind


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
    ``placement``: where each model chunk lives (:class:`ChunkPlacement`): round-robin
    (:data:`LOOP`, Megatron's interleaving) unless the schedule says otherwise (:data:`V`).
    ``overlapped(stage, pp, microbatches, virtual)``: the positions i in the stage's order
    whose action i (a forward) runs overlapped with action i + 1 (another microbatch's
    backward), as DualPipe pairs them; empty for most schedules.
    ``splits_backward``: whether its backward runs as two blocks per chunk, the input
    gradient (``I``, which the previous chunk waits for) and the weight gradient (``W``,
    which nobody waits for), as zero-bubble schedules do (Qi et al., ICLR 2024).
    ``steady``: whether, past its warm-up, the order repeats itself every 2 pp virtual
    microbatches, each repetition running a forward and a backward of every chunk, so
    that its peak of live activations is reached within the first 4 pp virtual
    microbatches (true of every schedule but GPipe, whose forwards all come first).
    """

    name: str
    order: Callable[[int, int, int, int], list[Action]]
    in_flight: Callable[[int, int, int, int], int]
    problems: Callable[[PipelineShape], list[ScheduleProblem]]
    chunks_per_stage: bool = False
    splits_backward: bool = False
    placement: "ChunkPlacement" = None  # type: ignore[assignment]  # LOOP unless given
    overlapped: Callable[[int, int, int, int], frozenset[int]] = None  # type: ignore
    steady: bool = True

    def __post_init__(self):
        if self.placement is None:
            object.__setattr__(self, "placement", LOOP)
        if self.overlapped is None:
            object.__setattr__(self, "overlapped", no_overlap)

    def peak_microbatches(self, pp: int, microbatches: int, virtual: int) -> int:
        """Fewer microbatches whose order reaches the same peak of live activations on
        every stage (and of any chunk sizes) as ``microbatches``: for a :attr:`steady`
        schedule, the count less whole repetitions of its steady state, keeping its
        residue modulo 2 pp virtual (so the schedule's divisibility rules still hold)
        and at least 4 pp virtual. planc tune replays thousands of orders of up to
        thousands of microbatches; tests/test_schedules.py checks the equality."""
        floor, period = 4 * pp * virtual, 2 * pp * virtual
        if not self.steady or microbatches < floor + period:
            return microbatches
        return microbatches - period * ((microbatches - floor) // period)

    def program_order(self, stage: int, pp: int, microbatches: int, virtual: int
                      ) -> list[Action]:
        """The blocks the stage's program runs, in order: :attr:`order`, except that under
        a schedule that splits the backward a whole backward (``B``, which DualPipeV
        still runs) is its input-gradient block then its weight-gradient block, since the
        backward steps of such a program live in those two blocks."""
        return self._program(stage, pp, microbatches, virtual)[0]

    def program_overlapped(self, stage: int, pp: int, microbatches: int, virtual: int
                           ) -> dict[int, int]:
        """The overlapped pairs of :attr:`overlapped` in :meth:`program_order`'s
        positions: the forward's position -> how many blocks the pair spans (the forward,
        and the backward's one or two blocks)."""
        return self._program(stage, pp, microbatches, virtual)[1]

    def _program(self, stage: int, pp: int, microbatches: int, virtual: int
                 ) -> tuple[list[Action], dict[int, int]]:
        actions = self.order(stage, pp, microbatches, virtual)
        pairs = self.overlapped(stage, pp, microbatches, virtual)
        out: list[Action] = []
        at: dict[int, int] = {}  # position in the order -> in the program
        for k, action in enumerate(actions):
            at[k] = len(out)
            if self.splits_backward and action.kind is ActionKind.BACKWARD:
                out.append(action._replace(kind=ActionKind.BACKWARD_INPUT))
                out.append(action._replace(kind=ActionKind.BACKWARD_WEIGHT))
            else:
                out.append(action)
        at[len(actions)] = len(out)
        return out, {at[k]: at[k + 2] - at[k] for k in sorted(pairs)}

    def stage_of_chunk(self, chunk: int, pp: int, virtual: int) -> int:
        return self.placement.stage_of_chunk(chunk, pp, virtual)

    def chunks_of_stage(self, stage: int, pp: int, virtual: int) -> tuple[int, ...]:
        """The model chunks stage ``stage`` holds, in chunk order."""
        return tuple(c for c in range(pp * virtual) if self.stage_of_chunk(c, pp, virtual)
                     == stage)


def no_problems(shape: PipelineShape) -> list[ScheduleProblem]:
    """The rule of a schedule that runs with any pp and microbatches."""
    return []


@dataclass(frozen=True)
class ChunkPlacement:
    """Where model chunks live. ``stage_of_chunk(chunk, pp, virtual)``: the chunk's stage;
    ``descends(chunk, pp)``: whether the activation chunk ``chunk`` hands to the next
    chunk travels to a lower stage (the second arm of a V) rather than to the next one,
    which decides the pipeline stream (``send_prev`` rather than ``send_next``)."""

    name: str
    stage_of_chunk: Callable[[int, int, int], int]
    descends: Callable[[int, int], bool]


def _loop_stage(chunk: int, pp: int, virtual: int) -> int:
    return chunk % pp


def _v_stage(chunk: int, pp: int, virtual: int) -> int:
    lap, place = divmod(chunk, pp)
    return place if lap % 2 == 0 else pp - 1 - place


# Chunk c on stage c mod pp: the chunks go round the stages ``virtual`` times, the last
# stage sending on to the first (Narayanan et al., SC'21, section 2.2).
LOOP = ChunkPlacement("loop", _loop_stage, lambda chunk, pp: False)
# The V of ZB-V and DualPipeV (Qi et al., ICLR 2024, section 6; DeepSeek-AI, DeepSeek-V3
# technical report, 2024, section 3.2.1): chunk c on stage c for c < pp and on 2pp - 1 - c
# after, so stage 0 holds the first and the last chunk (the embedding and the loss) and
# the last stage the two middle ones, which hand over without a transfer.
V = ChunkPlacement("v", _v_stage, lambda chunk, pp: (chunk // pp) % 2 == 1)


def no_overlap(stage: int, pp: int, microbatches: int, virtual: int) -> frozenset[int]:
    return frozenset()
