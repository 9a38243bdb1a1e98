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
    experts'), that
    part of it is charged to the axis of its group, not to computing."""
    exchange = getattr(duration, "exchange", None)
    clock: dict[str, float] = {}
    latest: dict[str, Instruction] = {}  # stream -> the last instruction it ran
    events: dict[str, tuple[float, Instruction | None]] = {}  # -> (when, what it marks)
    out = BlockTime()
    external = []
    for item in instructions:
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
        seconds = duration(item)
        end = now + seconds
        clock[stream] = end
        latest[stream] = item
        if stream == COMPUTE and item.op is Opcode.COMPUTE:
            waiting = exchange(item) if exchange is not None else 0.0
            if waiting:
                axis = group_of(item.operands).partition("/")[0]
                out.exposed[axis] = out.exposed.get(axis, 0.0) + waiting
            out.compute_busy += seconds - waiting
        if item.op is Opcode.SEND:
            out.sends = max(out.sends or 0.0, end)
        if keep_spans:
            out.spans.append(Span(stream, item.node, item.op, now, end, item.operands))
    out.compute_end = clock.get(COMPUTE, 0.0)
    out.stream_ends = clock
    out.external = tuple(external)
    out.recorded = {event: (when, axis_of(marked.operands) if marked is not None else None)
                    for event, (when, marked) in events.items()}
    return out
