"""One block of a rank program, replayed on the cost model: where each instruction starts
and ends, relative to the block's start.

The semantics are the runtime's and the verifier's (docs/semantics.md, the rank
program): instructions of one stream run in order; ``record`` marks the end of the
stream's previous instruction; ``wait`` holds its stream until that moment; ``sync``
holds a stream until every stream has finished its earlier work. Collectives inside a
stage are rendezvous of ranks running the same program at the same moment, so a
collective takes its cost-model time from the moment its stream reaches it. A wait on
an event recorded outside the block (a pipeline receive, a gather in the prologue) is
the pipeline's business (:mod:`planc.simulate.pipeline`): here it is already satisfied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planc.program.operands import Operands
from planc.program.program import Instruction, Opcode
from planc.program.names import Stream
from planc.estimate.instruction_cost import axis_of, group_of

COMPUTE = Stream.COMPUTE
MARKS = (Opcode.RECORD, Opcode.WAIT, Opcode.SYNC)  # instructions that take no time
CONTENTION_REPLAYS = 4
SETTLED = 1e-9  # seconds a transfer may move between two replays and count as settled


@dataclass(frozen=True)
class Span:
    stream: str
    node: str
    op: str
    start: float
    end: float
    operands: Operands | None = None  # what a trace needs to draw a transfer's flows


@dataclass
class BlockTime:
    """A block replayed from time 0."""

    compute_end: float = 0.0  # when the compute stream has finished the block
    stream_ends: dict[str, float] = field(default_factory=dict)
    # the axis of the transfer each stream ran last (None: compute), to which a wait for
    # that stream's tail is charged
    stream_axes: dict[str, str | None] = field(default_factory=dict)
    sends: float | None = None  # when the block's last pipeline send has finished
    compute_busy: float = 0.0  # time the compute stream spent computing
    exposed: dict[str, float] = field(default_factory=dict)  # axis -> compute waiting
    external: tuple[str, ...] = ()  # events waited for that the block does not record
    # When the waiting stream reached each external wait, from the block's start: a
    # block that waits for a gather of the prologue can start before the prologue ends.
    external_at: dict[str, float] = field(default_factory=dict)
    # Each event the block records: (when, the axis of the transfer it marks the end of).
    recorded: dict[str, tuple[float, str | None]] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)

    @property
    def end(self) -> float:
        return max(self.stream_ends.values(), default=0.0)


def replay(instructions: tuple[Instruction, ...] | list[Instruction], duration,
           keep_spans: bool = False) -> BlockTime:
    """``duration(instruction)``: seconds of a compute or transfer instruction. A compute
    stream's wait for a transfer is charged, as exposed communication, to the axis of the
    transfer its event marks the end of (the stream's instruction before the record).
    When ``duration`` also prices the all-to-alls inside a compute instruction
    (:class:`planc.estimate.instruction_cost.StageCosts`'s ``exchange``: a mixture of
    experts'), that part of it is charged to the axis of its group, not to computing.

    When ``duration`` also says which transfers hold SMs while they run (``held_sms``)
    and what a compute step takes on the SMs they leave (``contended``), a compute step
    beside such transfers does its work at the slower rate for as long as they run (a
    CTA of a communication kernel does not share its SM: NVIDIA/nccl issue 689). Where
    the transfers run depends on when the compute ends, so the block is replayed again on
    the previous replay's transfers until they stop moving (at most
    :data:`CONTENTION_REPLAYS` times).
    """
    instructions = tuple(instructions)
    held_sms = getattr(duration, "held_sms", None)
    holders = {index: held for index, item in enumerate(instructions)
               if held_sms is not None and item.op not in MARKS
               and (held := held_sms(item))}
    held: list[tuple[float, float, int]] = []
    for _ in range(CONTENTION_REPLAYS if holders else 1):
        out, timeline = _replay(instructions, duration, keep_spans, held)
        again = [(*timeline[index], sms) for index, sms in holders.items()
                 if index in timeline]
        if len(again) == len(held) and all(
                abs(x[0] - y[0]) <= SETTLED and abs(x[1] - y[1]) <= SETTLED
                for x, y in zip(again, held)):
            break
        held = again
    return out


def _finish(start: float, item: Instruction, duration,
            held: list[tuple[float, float, int]]) -> float:
    """When a compute step started at ``start`` ends, its work done at the rate of the
    SMs left it at each moment by the transfers of ``held`` (start, end, SMs held)."""
    alone = duration(item)
    end = start + alone
    if not held or not any(s < end and e > start for s, e, _ in held):
        return end
    cuts = sorted({t for s, e, _ in held for t in (s, e) if t > start})
    at, left = start, 1.0  # the share of its work still to do
    for cut in cuts:
        sms = sum(n for s, e, n in held if s <= at < e)
        seconds = duration.contended(item, sms) if sms else alone
        if (cut - at) / seconds >= left:
            return at + left * seconds
        left -= (cut - at) / seconds
        at = cut
    return at + left * alone


def _replay(instructions: tuple[Instruction, ...], duration, keep_spans: bool,
            held: list[tuple[float, float, int]]
            ) -> tuple[BlockTime, dict[int, tuple[float, float]]]:
    """One replay, the compute steps slowed by the transfers ``held`` (start, end, SMs
    held: the previous replay's). Also returns each timed instruction's (start, end), by
    its index."""
    exchange = getattr(duration, "exchange", None)
    timeline: dict[int, tuple[float, float]] = {}
    clock: dict[str, float] = {}
    latest: dict[str, Instruction] = {}  # stream -> the last instruction it ran
    events: dict[str, tuple[float, Instruction | None]] = {}  # -> (when, what it marks)
    out = BlockTime()
    external = []
    for index, item in enumerate(instructions):
        stream = item.stream
        now = clock.get(stream, 0.0)
        if item.op is Opcode.RECORD:
            events[item.event] = (now, latest.get(stream))
            continue
        if item.op is Opcode.WAIT:
            if item.event not in events:
                external.append(item.event)
                out.external_at.setdefault(item.event, now)
                continue
            ready, marked = events[item.event]
            if ready > now and stream == COMPUTE and marked is not None:
                axis = axis_of(marked.operands)
                if axis:
                    out.exposed[axis] = out.exposed.get(axis, 0.0) + ready - now
            clock[stream] = max(now, ready)
            continue
        if item.op is Opcode.SYNC:
            clock[stream] = max([now, *clock.values()])
            continue
        if held and stream == COMPUTE and item.op is Opcode.COMPUTE:
            end = _finish(now, item, duration, held)
        else:
            end = now + duration(item)
        seconds = end - now
        timeline[index] = (now, end)
        clock[stream] = end
        latest[stream] = item
        if stream == COMPUTE and item.op is Opcode.COMPUTE:
            waiting = exchange(item) if exchange is not None else 0.0
            if waiting:
                axis = group_of(item.operands).partition("/")[0]
                out.exposed[axis] = out.exposed.get(axis, 0.0) + waiting
            out.compute_busy += max(seconds - waiting, 0.0)  # rounding, at long exchanges
        elif stream == COMPUTE:  # a transfer the compute stream runs itself (overlap off):
            axis = axis_of(item.operands)  # all of it exposed, on its axis
            if axis:
                out.exposed[axis] = out.exposed.get(axis, 0.0) + seconds
        if item.op is Opcode.SEND:
            out.sends = max(out.sends or 0.0, end)
        if keep_spans:
            out.spans.append(Span(stream, item.node, item.op, now, end, item.operands))
    out.compute_end = clock.get(COMPUTE, 0.0)
    out.stream_ends = clock
    out.stream_axes = {stream: axis_of(item.operands) for stream, item in latest.items()}
    out.external = tuple(external)
    out.recorded = {event: (when, axis_of(marked.operands) if marked is not None else None)
                    for event, (when, marked) in events.items()}
    return out, timeline
