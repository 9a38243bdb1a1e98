"""What a stage's blocks do with their buffers, once lowered: the gradient buffers a
block must not rewrite while another stream still reads them, and the per-microbatch
buffers each block frees after their last reader (docs/semantics.md, overlap; the
lowering's last steps, planc.lower.lower)."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from planc.program.program import (
    EVENT_NAMING_OPS,
    STATE,
    Instruction,
    Opcode,
    done_event,
)
from planc.program.happens_before import finished_before, vector_clocks
from planc.schedules import ActionKind, Block

# The order in which a chunk's blocks run for one microbatch: what a buffer's last
# reader is.
_BLOCK_RANK = {ActionKind.FORWARD: 0, ActionKind.BACKWARD: 1, ActionKind.BACKWARD_INPUT: 1,
               ActionKind.BACKWARD_WEIGHT: 2}


def close_state(block: list[Instruction]) -> list[Instruction]:
    """The next microbatch's instance of the block writes the buckets' gradient buffers
    again: before the block ends, every stream that writes one waits for each
    per-microbatch instruction of another stream that reads it (ZeRO-2/3 reductions), so
    that no buffer is rewritten while a reduction still reads it."""
    writers: dict[str, set[str]] = {}
    for i in block:
        if i.per_microbatch:
            for w in i.writes:
                if w.startswith(STATE):
                    writers.setdefault(w, set()).add(i.stream)
    closing: dict[tuple[str, Instruction], None] = {}  # (waiting stream, reader), in order
    for i in block:
        if not i.per_microbatch or i.op in EVENT_NAMING_OPS:
            continue
        for stream in sorted({s for r in i.reads if r in writers for s in writers[r]}):
            if stream != i.stream:
                closing.setdefault((stream, i), None)
    if not closing:
        return block
    readers = {i for _, i in closing}
    recorded = {(i.event, i.stream) for i in block
                if i.op is Opcode.RECORD and i.per_microbatch}
    out = []
    for instruction in block:
        out.append(instruction)
        if instruction not in readers:
            continue
        done = (done_event(instruction.node), instruction.stream)
        if done not in recorded:
            out.append(Instruction(Opcode.RECORD, instruction.stream, event=done[0]))
            recorded.add(done)
    out += [Instruction(Opcode.WAIT, stream, event=done_event(i.node))
            for stream, i in closing]
    return out


def with_frees(blocks: dict[str, list[Instruction]], graph: nx.DiGraph,
                outside: list[Instruction]) -> dict[str, tuple[Instruction, ...]]:
    """Mark each per-microbatch buffer that no once-per-step work reads (in a block, or in
    ``outside``: the prologue and epilogue) as freed by its last reader, when that reader
    finishes after every other reader: later on the same stream, after a wait for it, or
    in the backward block of the same chunk (which runs after the forward block for the
    same microbatch) when the other readers finished before the forward block ended on
    its stream. A buffer read on streams that never wait for each other is kept for the
    step."""
    readers: dict[str, list[tuple[str, int]]] = {}
    writers: dict[str, tuple[str, int]] = {}
    kept: set[str] = {buffer for i in outside for buffer in i.reads}
    clocks = {name: vector_clocks(block) for name, block in blocks.items()}
    streams = {name: [i.stream for i in block] for name, block in blocks.items()}
    for name, block in blocks.items():
        for k, instruction in enumerate(block):
            if instruction.op in EVENT_NAMING_OPS or not instruction.per_microbatch:
                for buffer in instruction.reads:
                    kept.add(buffer)
                continue
            for buffer in instruction.reads:
                readers.setdefault(buffer, []).append((name, k))
            for buffer in instruction.writes:
                writers[buffer] = (name, k)
    # The backward block of a chunk runs after its forward block for the same microbatch.
    typed = {name: Block.parse(name) for name in blocks}

    def covered(other: tuple[str, int], last: tuple[str, int]) -> bool:
        (ob, ok), (lb, lk) = other, last
        if ob == lb:
            return finished_before(clocks[lb][0], streams[lb], ok, lk)
        final = clocks[ob][1].get(streams[lb][lk], {})  # the last reader's stream, at
        return final.get(streams[ob][ok], -1) >= ok  # the end of the earlier block

    frees: dict[tuple[str, int], list[str]] = {}
    for buffer, (name, k) in writers.items():
        if buffer in kept or buffer.startswith(STATE) or \
                graph.nodes.get(buffer, {}).get("per_microbatch") is False:
            continue
        places = readers.get(buffer, [(name, k)])
        if any(typed[block].chunk != typed[name].chunk for block, _ in places):
            continue  # read by another chunk's block: keep it for the step
        last = max(places, key=lambda p: (_BLOCK_RANK[typed[p[0]].kind], p[1]))
        if all(covered(p, last) for p in places if p != last):
            frees.setdefault(last, []).append(buffer)
    out = {}
    for name, block in blocks.items():
        out[name] = tuple(replace(i, frees=tuple(sorted(frees[(name, k)])))
                          if (name, k) in frees else i for k, i in enumerate(block))
    return out
