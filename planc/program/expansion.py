"""A program run out over its microbatches: every instruction of one step in the order
a rank issues it (planc.program.program's docstring), as the runtime's executor, the
verifier's progress proof, ``planc programs --expand`` and the Chakra export read it."""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

from planc.program.pair_orders import merged
from planc.program.program import (
    EVENT_NAMING_OPS,
    STATE,
    Instruction,
    Opcode,
    Program,
    done_event,
    node_of_done,
)


class Expanded(NamedTuple):
    """One instruction of an expanded program, microbatch resolved. A named tuple, not a
    frozen dataclass: a step at scale expands to millions of them (the progress proof),
    and a frozen dataclass's constructor sets each field through object.__setattr__."""

    index: int  # position in the rank's issue order
    op: Opcode
    stream: str
    node: str | None
    microbatch: int | None
    event: str | None
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    where: str  # "F0 mb 2", "recv_prev", "prologue", "epilogue"
    frees: tuple[str, ...] = ()
    source: Instruction | None = None  # the folded instruction

    def text(self) -> str:
        mb = f" mb {self.microbatch}" if self.microbatch is not None else ""
        what = self.event if self.op in EVENT_NAMING_OPS else self.node
        return f"#{self.index} {self.stream}: {self.op} {what}{mb}"


def expand(program: Program, only: int | None = None, operands: bool = True,
           keep: Callable[[Instruction], bool] | None = None) -> Iterator[Expanded]:
    """Every instruction of one step, in issue order.

    Issue order: the prologue; for each scheduled block, first the receives it waits
    for (and any queued before them on the same receive stream; each receive records
    the event ``done:NODE``), then the block's instructions (guarded ones only on the
    last microbatch); after the schedule, any receive left, then the epilogue.

    ``only``: yield only what belongs to that microbatch or to none (once-per-step
    instructions), with the same indices, without expanding the other microbatches'
    blocks (``planc programs --expand --microbatch K`` on a long schedule).
    ``operands=False``: without the buffers each reads, writes and frees (empty), for
    a reader that needs only the order (the progress proof over millions of them).
    ``keep``: yield only the instructions it accepts, with the same indices (the
    progress proof leaves out what completes at once), tested once per block.
    """
    index = 0
    position = {stream: 0 for stream in program.receives}
    needed = receives_needed(program)
    last = program.last_microbatch()

    def emit(instruction: Instruction, microbatch: int | None, where: str) -> Expanded:
        nonlocal index
        mb = microbatch if instruction.per_microbatch else None
        suffix = f"#{mb}" if mb is not None else ""

        def named(names):
            if not operands:
                return ()
            if not suffix:
                return names
            return tuple(r if r.startswith(STATE) else f"{r}{suffix}" for r in names)

        index += 1
        return Expanded(index - 1, instruction.op, instruction.stream,
                        instruction.node, mb,
                        f"{instruction.event}{suffix}" if instruction.event else None,
                        named(instruction.reads), named(instruction.writes), where,
                        named(instruction.frees), instruction)

    def kept(instructions) -> Iterator[tuple[int, Instruction]]:
        return ((offset, i) for offset, i in enumerate(instructions)
                if keep is None or keep(i))

    pairs: dict[tuple[str, str], tuple[tuple[int, Instruction], ...]] = {}

    def receive(stream: str) -> Iterator[Expanded]:
        nonlocal index
        node, mb = program.receives[stream][position[stream]]
        position[stream] += 1
        if only is not None and mb != only:
            index += 2
            return
        pair = pairs.get((stream, node))
        if pair is None:  # a stream receives a node once per microbatch: made once
            pair = pairs[(stream, node)] = tuple(kept((
                program.receive(stream, node),
                Instruction(Opcode.RECORD, stream, event=done_event(node)))))
        start = index
        for offset, instruction in pair:
            index = start + offset
            yield emit(instruction, mb, stream)
        index = start + 2

    def run(instructions: tuple[tuple[int, Instruction], ...], length: int,
            microbatch: int | None, where: str) -> Iterator[Expanded]:
        nonlocal index
        start = index
        for offset, instruction in instructions:
            index = start + offset
            yield emit(instruction, microbatch, where)
        index = start + length

    yield from run(tuple(kept(program.prologue)), len(program.prologue), None, "prologue")
    # (block, first?, last?, whole?) -> the instructions yielded with their offsets, and
    # how many run; not whole: a microbatch other than ``only``, its once-per-step ones
    selected: dict[tuple[str, bool, bool, bool],
                   tuple[tuple[tuple[int, Instruction], ...], int]] = {}
    # a pair's merged order, by its blocks and which of them run a guarded instruction
    # (the first or the last microbatch): the same for every other microbatch
    merges: dict[tuple, list[tuple[int, Instruction]]] = {}
    schedule = program.schedule
    for k, (block, microbatch) in enumerate(schedule):
        count = program.together(k)
        if not count:  # runs inside the pair before it
            continue
        together = schedule[k:k + count]
        for entry in together:
            for stream, end in needed.get(entry, {}).items():
                while position[stream] <= end:
                    yield from receive(stream)
        if count > 1:
            start = index
            for offset, (side, (instruction, mb)) in enumerate(
                    _merged(program, merges, *together)):
                if (keep is None or keep(instruction)) and (
                        only is None or mb == only or not instruction.per_microbatch):
                    index = start + offset
                    yield emit(instruction, mb, f"{together[side][0]} mb {mb}")
            index = start + offset + 1
            continue
        whole = only is None or microbatch == only
        key = (block, microbatch == 0, microbatch == last, whole)
        if key not in selected:
            running = program.running(block, microbatch)
            selected[key] = (tuple((offset, i) for offset, i in kept(running)
                                   if whole or not i.per_microbatch), len(running))
        yield from run(*selected[key], microbatch, f"{block} mb {microbatch}")
    for stream in program.receives:
        while position[stream] < len(program.receives[stream]):
            yield from receive(stream)
    yield from run(tuple(kept(program.epilogue)), len(program.epilogue), None, "epilogue")


def _merged(program: Program, merges: dict, *together: tuple[str, int]
            ) -> list[tuple[int, tuple[Instruction, int]]]:
    """An overlapped pair's instructions (and its weight gradients', when it takes them)
    in the order they run (planc.program.pair_orders): (which block, (the instruction,
    its microbatch)); ``merges``: the orders found so far (a pair's order depends on its
    microbatches only through the guards, which run on the first or the last)."""
    last = program.last_microbatch()
    key = (tuple((block, mb == 0, mb == last) for block, mb in together),
           program.is_weighted(together))
    order = merges.get(key)
    if order is None:
        order = merges[key] = merged(program, together)
    return [(side, (instruction, together[side][1])) for side, instruction in order]


def expanded_length(program: Program) -> int:
    """How many instructions :func:`expand` yields, without expanding."""
    counts: dict[tuple[str, bool, bool], int] = {}
    last = program.last_microbatch()
    total = len(program.prologue) + len(program.epilogue) + \
        2 * sum(len(items) for items in program.receives.values())
    for block, microbatch in program.schedule:
        key = (block, microbatch == 0, microbatch == last)
        if key not in counts:
            counts[key] = len(program.running(block, microbatch))
        total += counts[key]
    return total


def receives_needed(program: Program) -> dict[tuple[str, int], dict[str, int]]:
    """For each scheduled (block, microbatch): per receive stream, the position of the
    last receive whose event the block waits for."""
    where = {(node, mb): (stream, i) for stream, items in program.receives.items()
             for i, (node, mb) in enumerate(items)}
    received = {node for node, _ in where}
    waits = {name: [node for node in (node_of_done(i.event) for i in block
                                      if i.op is Opcode.WAIT)
                    if node in received]
             for name, block in program.blocks.items()}
    out: dict[tuple[str, int], dict[str, int]] = {}
    for block, microbatch in program.schedule:
        need: dict[str, int] = {}
        for node in waits.get(block, ()):
            if (node, microbatch) in where:
                stream, i = where[(node, microbatch)]
                need[stream] = max(need.get(stream, -1), i)
        out[(block, microbatch)] = need
    return out
