"""Happens-before among the instructions of a block on CUDA streams, by vector clocks
(Lamport 1978; Mattern 1989): which instruction is known finished before another starts,
for the lowering's buffer frees (planc.lower.block_buffers) and the verifier
(planc.verify.across_blocks)."""

from __future__ import annotations

from planc.program.instruction_set import Opcode


def vector_clocks(instructions) -> tuple[list[dict[str, int]], dict[str, dict[str, int]]]:
    """Happens-before among instructions on streams (Lamport 1978; Mattern 1989), with
    CUDA's semantics: a stream runs in order; ``wait`` makes its stream follow the
    matching ``record``; ``sync`` follows every stream. Returns each instruction's clock
    (clock[s] = position of the last instruction of stream s known finished before it
    starts) and each stream's clock at the end."""
    clock: dict[str, dict[str, int]] = {}
    events: dict[tuple, dict[str, int]] = {}
    out = []
    for position, instruction in enumerate(instructions):
        mine = clock.setdefault(instruction.stream, {})
        out.append(dict(mine))
        key = (instruction.event, instruction.per_microbatch)
        if instruction.op is Opcode.SYNC:
            everything = {s: max(c.get(s, -1) for c in clock.values()) for s in clock}
            for c in clock.values():
                c.update(everything)
        elif instruction.op is Opcode.WAIT:
            for s, value in events.get(key, {}).items():
                mine[s] = max(mine.get(s, -1), value)
        elif instruction.op is Opcode.RECORD:
            events[key] = dict(mine)
        else:
            mine[instruction.stream] = position
    return out, clock


def finished_before(clocks: list[dict[str, int]], streams: list[str], a: int, b: int) -> bool:
    """Whether instruction ``a`` finished before instruction ``b`` starts."""
    return a < b and (streams[a] == streams[b] or clocks[b].get(streams[a], -1) >= a)
