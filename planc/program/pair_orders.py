"""The order an overlapped pair runs in (planc.program.pairs): the default merge, or one
the compiler chose on the cost model and wrote into the program (``pair_orders``).

:func:`interleave`'s merge follows the blocks' waits, not their times. Where a pair's
blocks hold unequal all-to-alls (a chunk of two mixtures with a chunk of one: DeepSeek-V3's
last stage under DualPipeV), the smaller block's compute goes to the other's waits in
equal shares, whatever each wait lasts, and the compute stream can be left waiting for
an all-to-all with nothing beside it. :func:`scheduled` is a list scheduler over
the pair's instructions (Hu 1961; Kwok and Ahmad 1999, "HLFET": among the steps the
compute stream can start earliest, the one with the longest path to its block's end
first), each priced by the cost model; a record is issued as soon as its block reaches
it, and the weight gradients fill what the two blocks leave. A variant looks ahead: it
leaves the compute stream idle a moment rather than start a step that would hold back a
more critical one whose all-to-all is about to land. The lowering
(:func:`planc.lower.paired.ordered_by_cost`) keeps its order where the cost model
prices it faster, and the runtime, the simulator and the verifier run what it wrote.
"""

from __future__ import annotations

from typing import Callable, Sequence

from planc.program.instruction_set import Opcode
from planc.program.names import Stream
from planc.program.pairs import weight_dependencies, interleave

COMPUTE = Stream.COMPUTE
EVENT_ONLY = (Opcode.RECORD, Opcode.WAIT, Opcode.SYNC)


def pair_key(entries: Sequence[tuple[str, int]]) -> str:
    """The key of a pair's blocks in ``pair_orders``: their names, space-separated."""
    return " ".join(block for block, _ in entries)


def merged(program, entries: Sequence[tuple[str, int]]) -> list[tuple[int, object]]:
    """The instructions of the pair ``entries`` ((block, microbatch) of each block) in the
    order they run, as (which block, instruction): the order the compiler wrote for the
    blocks less what does not run on those microbatches (guards), or else
    :func:`interleave`'s merge of what runs. An input gradient with weight gradients
    of its chunk (``program.weighted``) is :func:`interleave`'s merge with no first
    block: the weight gradients fill the input gradient's waits for its all-to-alls."""
    if program.is_weighted(entries):
        blocks = [(), *(program.running(*entry) for entry in entries)]
        return [(side - 1, blocks[side][at]) for side, at in interleave(*blocks)]
    order = program.pair_orders.get(pair_key(entries))
    if order is None:
        blocks = [program.running(*entry) for entry in entries]
        return [(side, blocks[side][at]) for side, at in interleave(*blocks)]
    blocks = [program.blocks[block] for block, _ in entries]
    return [(side, blocks[side][at]) for side, at in order
            if program.runs(blocks[side][at], entries[side][1])]


def _levels(block: Sequence, duration: Callable) -> list[float]:
    """Each instruction's longest path to the block's end: its own time, then the
    longer of its stream's next instruction's and (a record) its event's waiters'."""
    levels = [0.0] * len(block)
    following: dict[str, int] = {}
    waiting: dict[str, list[int]] = {}
    for k in range(len(block) - 1, -1, -1):
        instruction = block[k]
        after = [levels[following[instruction.stream]]] \
            if instruction.stream in following else []
        if instruction.op is Opcode.RECORD:
            after += [levels[j] for j in waiting.get(instruction.event, ())]
        own = 0.0 if instruction.op in EVENT_ONLY else duration(instruction)
        levels[k] = own + max(after, default=0.0)
        following[instruction.stream] = k
        if instruction.op is Opcode.WAIT:
            waiting.setdefault(instruction.event, []).append(k)
    return levels


def scheduled(first: Sequence, second: Sequence, weights: Sequence,
              duration: Callable, lookahead: bool = False) -> list[tuple[int, int]]:
    """A list schedule of the pair, in :func:`interleave`'s terms ((0, 1 or 2, position)),
    under the same constraints: each block's own order, the weight gradients after what
    they need (:func:`planc.program.pairs.weight_dependencies`), the second block's
    pipeline sends after the first's. ``duration(instruction)``: its seconds.
    ``lookahead``: a compute step is held back where a step with a longer path, whose
    transfer lands while it would run, would otherwise wait for it (:func:`_held_for`)."""
    blocks = (first, second, weights)
    after_second, after_weights = weight_dependencies(second, weights)
    levels = (_levels(first, duration), _levels(second, duration))
    at, placed = [0, 0], [False] * len(weights)
    clock: dict[str, float] = {}
    events: dict[str, float] = {}
    sends_left = sum(1 for i in first if i.op is Opcode.SEND)
    out: list[tuple[int, int]] = []

    def start(instruction) -> float:
        now = clock.get(instruction.stream, 0.0)
        if instruction.op is Opcode.WAIT:
            return max(now, events.get(instruction.event, now))
        if instruction.op is Opcode.SYNC:
            return max([now, *clock.values()])
        return now

    def candidate(instruction, side: int, k: int, level: float) -> tuple:
        """Its sort key: a record at once (it marks what its stream ran last), then the
        earliest start; at a tie, another stream's instruction (it costs the compute
        stream nothing), then the input and output gradients' steps by level, then
        the weights'."""
        when = -1.0 if instruction.op is Opcode.RECORD else start(instruction)
        kind = 0 if instruction.stream != COMPUTE else 2 if side == 2 else 1
        return when, kind, -level, side, k

    while len(out) < len(first) + len(second) + len(weights):
        candidates = []
        for side in (0, 1):
            if at[side] < len(blocks[side]):
                instruction = blocks[side][at[side]]
                if not (side == 1 and instruction.op is Opcode.SEND and sends_left):
                    candidates.append(candidate(instruction, side, at[side],
                                                levels[side][at[side]]))
        for k, instruction in enumerate(weights):
            # after_second: len(second) where only the whole block's end says it may run
            if not placed[k] and (after_second[k] < at[1] or at[1] == len(second)) and \
                    all(placed[j] for j in after_weights[k]):
                candidates.append(candidate(instruction, 2, k, 0.0))
        best = min(candidates)
        if lookahead:
            best = _held_for(best, candidates, blocks, duration)
        side, k = best[3:]
        instruction = blocks[side][k]
        began = start(instruction)
        if side == 2:
            placed[k] = True
        else:
            at[side] += 1
            if side == 0 and instruction.op is Opcode.SEND:
                sends_left -= 1
        out.append((side, k))
        if instruction.op is Opcode.RECORD:
            events[instruction.event] = clock.get(instruction.stream, 0.0)
        elif instruction.op in EVENT_ONLY:
            clock[instruction.stream] = began
        else:
            clock[instruction.stream] = began + duration(instruction)
    return out


def _held_for(best: tuple, candidates: list[tuple], blocks, duration) -> tuple:
    """The candidate to issue instead of ``best``, a compute step: a wait on the
    compute stream for a step with a longer path to its end, whose transfer lands
    before ``best`` would finish, nearer its start than its end (the stream idles the
    shorter while)."""
    when, kind, level, side, k = best
    instruction = blocks[side][k]
    if kind == 0 or instruction.op is not Opcode.COMPUTE:
        return best
    end = when + duration(instruction)
    held = [c for c in candidates if c[1] == 1 and c[2] < level and
            blocks[c[3]][c[4]].op is Opcode.WAIT and when < c[0] < end and
            c[0] - when < end - c[0]]
    return min(held) if held else best


def order_problem(blocks: Sequence[Sequence], order: Sequence[tuple[int, int]]
                  ) -> str | None:
    """What is wrong with ``order`` as an order of the pair ``blocks`` (None: nothing):
    each instruction once; the first two blocks' own orders kept; a weight-gradient
    instruction after what it needs; the second block's sends after the first's."""
    if sorted(order) != [(side, k) for side, block in enumerate(blocks)
                         for k in range(len(block))]:
        return "it does not name each of the blocks' instructions once"
    for side in (0, 1):
        if [k for s, k in order if s == side] != list(range(len(blocks[side]))):
            return f"it reorders block {side + 1}'s own instructions"
    sends = [n for n, (side, k) in enumerate(order)
             if side < 2 and blocks[side][k].op is Opcode.SEND]
    if any(order[n][0] == 1 and any(order[m][0] == 0 for m in sends[j + 1:])
           for j, n in enumerate(sends)):
        return "the second block sends before the first has sent"
    if len(blocks) == 3:
        where = {entry: n for n, entry in enumerate(order)}
        after_second, after_weights = weight_dependencies(blocks[1], blocks[2])
        for k in range(len(blocks[2])):
            needs = min(after_second[k], len(blocks[1]) - 1)  # past the end: after all
            if needs >= 0 and where[(2, k)] < where[(1, needs)] or \
                    any(where[(2, k)] < where[(2, j)] for j in after_weights[k]):
                return (f"weight-gradient instruction {k} runs before what it needs "
                        f"(what it reads is written, the transfers reading what it frees "
                        f"are done)")
    return None
