"""One training step of every pipeline stage, replayed block by block.

A stage's representative rank runs its program's schedule in order. A block starts when
the compute stream has finished the previous block and its input has arrived: the
forward of model chunk ``g`` needs what chunk ``g - 1`` sent for the same microbatch,
the backward of chunk ``g`` what chunk ``g + 1`` sent back, the send finishing
:attr:`BlockTime.sends` after the sending block began (the pipeline transfer's own time
included). Every block instance of one (block, guard) is the same replay, done once
(:mod:`planc.estimate.block_replay`), so a step of the 1-trillion-parameter plan (64 stages,
1,024 blocks each) costs 65,536 schedule steps, not millions of instructions. Work a block
leaves on communication streams (a bucket's reduction) runs on past the block's end and
delays only the epilogue that waits for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from planc.program.pair_orders import merged
from planc.program.program import Opcode, Program
from planc.program.names import Stream
from planc.schedules import Block
from planc.estimate.block_replay import BlockTime, replay

# The axis whose transfers a program stream carries (planc.passes.overlap's streams).
STREAM_AXIS = {Stream.DP: "dp_cp", Stream.COMM: "tp", Stream.EP: "ep", Stream.SEND_NEXT: "pp",
               Stream.SEND_PREV: "pp", Stream.RECV_PREV: "pp", Stream.RECV_NEXT: "pp"}


NORM_AXIS = "world"  # the gradient norm's group (planc.graph.grad_norm)


@dataclass
class StageTime:
    stage: int
    end: float = 0.0  # the stage's step ends (its epilogue done)
    busy: float = 0.0  # compute stream computing
    waiting: float = 0.0  # compute stream idle, waiting for the pipeline
    exposed: dict[str, float] = field(default_factory=dict)  # axis -> compute waiting
    blocks: list[tuple[str, int, float, BlockTime]] = field(default_factory=list)
    prologue: BlockTime | None = None
    epilogue: tuple[float, BlockTime] | None = None


def _prologue_bound(prologue: BlockTime | None, block: BlockTime
                    ) -> tuple[float, str]:
    """The earliest start of ``block`` that its waits for the prologue's events allow (each
    event's time less when the block reaches its wait), and the axis they are charged to."""
    bound, axis = 0.0, STREAM_AXIS[Stream.DP]
    if prologue is None:
        return bound, axis
    for event, reached in block.external_at.items():
        if event in prologue.recorded:
            when, marks = prologue.recorded[event]
            if when - reached > bound:
                bound, axis = when - reached, marks or axis
    return bound, axis


def _pair_time(program: Program, entries, duration, keep_spans: bool
               ) -> tuple[BlockTime, tuple[BlockTime, ...]]:
    """An overlapped pair (with its weight gradients, when it takes them) replayed in the
    order it runs (planc.program.pair_orders): the whole, and each block's part of it
    (its spans, its compute's end, its sends' end)."""
    order = merged(program, entries)
    whole = replay([instruction for _, instruction in order], duration, keep_spans=True)
    parts = []
    for side in range(len(entries)):
        nodes = {i.node for s, i in order if s == side and i.node is not None}
        mine = [span for span in whole.spans if span.node in nodes]
        sends = [span.end for span in mine if span.op is Opcode.SEND]
        parts.append(BlockTime(
            compute_end=max((span.end for span in mine if span.stream == Stream.COMPUTE),
                            default=0.0),
            sends=max(sends) if sends else None, spans=mine if keep_spans else []))
    if not keep_spans:
        whole.spans = []
    return whole, tuple(parts)


def _key(program: Program, block: str, microbatch: int) -> tuple[str, bool, bool]:
    """Block instances that run the same instructions share a replay."""
    last = program.microbatches - 1
    return block, microbatch == 0, microbatch == last


def step(programs: dict[int, Program], durations, keep_spans: bool = False
         ) -> list[StageTime]:
    """Replay one step; ``programs`` by stage; ``durations(stage)``: the function giving
    the seconds of a compute or transfer instruction of that stage's program
    (:meth:`planc.estimate.instruction_cost.InstructionCosts.of_stage`)."""
    replays: dict[tuple[int, tuple], BlockTime] = {}
    times = {s: StageTime(s) for s in programs}
    typed = {stage: {name: Block.parse(name) for name in p.blocks}
             for stage, p in programs.items()}
    # Which stage runs each model chunk: the one whose program has the chunk's blocks.
    chunk_stage = {block.chunk: stage for stage, blocks in typed.items()
                   for block in blocks.values()}
    last_chunk = max(chunk_stage)
    timings = {stage: durations(stage) for stage in programs}

    def timed(stage: int, block: str, microbatch: int) -> BlockTime:
        key = (stage, _key(programs[stage], block, microbatch))
        if key not in replays:
            replays[key] = replay(programs[stage].running(block, microbatch),
                                  timings[stage], keep_spans)
        return replays[key]

    pair_replays: dict[tuple, tuple[BlockTime, tuple[BlockTime, ...]]] = {}

    def timed_pair(stage: int, entries) -> tuple[BlockTime, tuple[BlockTime, ...]]:
        program = programs[stage]
        key = (stage, *(_key(program, block, mb) for block, mb in entries))
        if key not in pair_replays:
            pair_replays[key] = _pair_time(program, entries, timings[stage], keep_spans)
        return pair_replays[key]

    ready: dict[int, float] = {}
    tails: dict[int, dict[str, float]] = {}
    tail_axes: dict[int, dict[str, str | None]] = {}  # the axis of each stream's last transfer
    for stage, program in programs.items():
        prologue = replay(program.prologue, timings[stage], keep_spans)
        times[stage].prologue = prologue
        # The prologue's gathers run on their own stream (overlap on): the compute stream
        # starts at once, and each block waits only for the gathers it reads (below).
        ready[stage] = prologue.compute_end
        tails[stage] = dict(prologue.stream_ends)
        tail_axes[stage] = dict(prologue.stream_axes)
    arrivals: dict[tuple[int, int, int], float] = {}
    position = {stage: 0 for stage in programs}
    pending = sum(len(p.schedule) for p in programs.values())
    # A stage waits only for an arrival from a neighbouring chunk's stage: a work list
    # wakes it when one comes, so each block is visited once, not once per sweep.
    work, queued = deque(programs), set(programs)
    while work:
        stage = work.popleft()
        queued.discard(stage)
        program = programs[stage]
        schedule, time = program.schedule, times[stage]
        while position[stage] < len(schedule):
            k = position[stage]
            # an overlapped pair (planc.program.pairs) runs as one interleaved replay; the
            # blocks of one that ran apart (below) run alone
            entries = schedule[k:k + max(1, program.together(k))]
            inputs = []
            for block, microbatch in entries:
                kind, chunk = typed[stage][block]
                # Arrivals are keyed by direction (+1 forward, -1 backward) and receiving
                # chunk.
                flow = kind.flow
                needs_input = flow != 0 and 0 <= chunk - flow <= last_chunk
                inputs.append((flow, chunk, microbatch, needs_input))
            missing = [needs and (flow, chunk, mb) not in arrivals
                       for flow, chunk, mb, needs in inputs]
            if missing[0]:
                break
            if any(missing):  # the pair's second input is not on its way yet: the first
                # block runs alone (on the runtime its compute waits in the middle)
                entries, inputs = entries[:1], inputs[:1]
            arrival = max(arrivals.get((flow, chunk, mb), 0.0)
                          for flow, chunk, mb, _ in inputs)
            if len(entries) > 1:
                replayed, parts = timed_pair(stage, entries)
            else:
                replayed = timed(stage, *entries[0])
                parts = (replayed,)
            start = max(ready[stage], arrival)
            time.waiting += start - ready[stage]
            gathered, axis = _prologue_bound(time.prologue, replayed)
            if gathered > start:  # the compute stream waits for a gather of the prologue
                time.exposed[axis] = time.exposed.get(axis, 0.0) + gathered - start
                start = gathered
            ready[stage] = start + replayed.compute_end
            time.busy += replayed.compute_busy
            for axis, seconds in replayed.exposed.items():
                time.exposed[axis] = time.exposed.get(axis, 0.0) + seconds
            for stream, end in replayed.stream_ends.items():
                if start + end >= tails[stage].get(stream, 0.0):
                    tails[stage][stream] = start + end
                    tail_axes[stage][stream] = replayed.stream_axes.get(stream)
            for (flow, chunk, microbatch, _), part, (block, _) in zip(inputs, parts,
                                                                    entries):
                sent = start + (part.sends if part.sends is not None else part.compute_end)
                if flow:
                    arrivals[(flow, chunk + flow, microbatch)] = sent
                    waiting = chunk_stage.get(chunk + flow)
                    if waiting is not None and waiting in programs and waiting not in queued:
                        work.append(waiting)
                        queued.add(waiting)
                if keep_spans:
                    time.blocks.append((block, microbatch, start, part))
            position[stage] += len(entries)
            pending -= len(entries)
    if pending:
        raise RuntimeError("the pipeline schedule cannot progress (the verifier should "
                           "have caught this)")
    starts = {}
    for stage, program in programs.items():
        time = times[stage]
        epilogue = replay(program.epilogue, timings[stage], keep_spans)
        # Work left on a communication stream after the last block (a bucket's
        # reduction, the last pipeline send) holds the epilogue back: exposed.
        stream, tail = max(tails[stage].items(), key=lambda item: item[1],
                           default=("compute", 0.0))
        if tail > ready[stage]:
            axis = tail_axes[stage].get(stream) or STREAM_AXIS.get(stream, stream)
            time.exposed[axis] = time.exposed.get(axis, 0.0) + tail - ready[stage]
        start = max(ready[stage], tail)
        for axis, seconds in epilogue.exposed.items():
            time.exposed[axis] = time.exposed.get(axis, 0.0) + seconds
        time.busy += epilogue.compute_busy + (time.prologue.compute_busy
                                              if time.prologue else 0.0)
        time.epilogue = (start, epilogue)
        time.end = start + epilogue.end
        starts[stage] = start
    _join_at_norm(programs, timings, times, starts)
    return [times[s] for s in sorted(times)]


def _join_at_norm(programs: dict[int, Program], timings, times: dict[int, StageTime],
                  starts: dict[int, float]) -> None:
    """train { grad_clip }: the gradient norm's all-reduce over every rank
    (planc.graph.grad_norm) ends for all stages together, once the last one reaches it;
    what a stage's epilogue runs after it (the clip, the optimizer steps) starts then.
    A stage that arrives earlier waits, exposed as ``world`` communication."""
    arrivals = {}
    for stage, program in programs.items():
        at = next((k for k, i in enumerate(program.epilogue) if i.operands is not None and
                   i.operands.payload == "grad_norm"), None)
        if at is not None:
            arrivals[stage] = starts[stage] + replay(program.epilogue[:at], timings[stage]).end
    if len(arrivals) < 2:
        return
    last = max(arrivals.values())
    for stage, arrived in arrivals.items():
        waited = last - arrived
        time = times[stage]
        time.end += waited
        time.exposed[NORM_AXIS] = time.exposed.get(NORM_AXIS, 0.0) + waited
