"""Two blocks of two microbatches run as one overlapped pair, interleaved instruction by
instruction (schedule { overlap_all_to_all } under a schedule with overlapped pairs:
DualPipeV's forward of one microbatch with the backward of another, the DeepSeek-V3
report's section 3.2.1).

The order is a merge of the two blocks' instructions that keeps each block's own order:
the first block runs until its compute stream is about to wait for one of its own
all-to-alls on the ep stream; the second block runs meanwhile, until it in turn waits
for one of its all-to-alls; and so on. Each such wait gives way once: when its block
comes back to it, it is taken. So a mixture's dispatch or combine of one microbatch
travels while the other microbatch computes, as DualPipe's pairs hide them.

The second block's pipeline sends wait until the first block has issued all of its own:
each receive stream of a peer stage expects them in the schedule's order
(planc.lower.lower's receive order), and the verifier proves the merged order cannot
deadlock like any other (planc.verify.progress).
"""

from __future__ import annotations

from typing import Sequence

from planc.program.instruction_set import Opcode, node_of_done
from planc.program.names import Stream


def _all_to_alls(block: Sequence) -> frozenset[str]:
    """The nodes of a block's all-to-alls on the ep stream."""
    return frozenset(i.node for i in block if i.op is Opcode.ALL_TO_ALL and
                     i.stream == Stream.EP)


def _waits_for_all_to_all(instruction, exchanges: frozenset[str]) -> bool:
    return instruction.op is Opcode.WAIT and instruction.stream == Stream.COMPUTE and \
        node_of_done(instruction.event or "") in exchanges


def interleave(first: Sequence, second: Sequence) -> list[tuple[int, int]]:
    """The merged order of blocks ``first`` and ``second`` (their instructions, guards
    applied): (0 or 1, the instruction's position in its block), each block's positions
    in increasing order."""
    blocks = (first, second)
    exchanges = (_all_to_alls(first), _all_to_alls(second))
    sends_left = sum(1 for i in first if i.op is Opcode.SEND)
    at, side, given_way = [0, 0], 0, set()
    out: list[tuple[int, int]] = []
    while at[0] < len(first) or at[1] < len(second):
        other = 1 - side
        if at[side] >= len(blocks[side]):
            side = other
            continue
        instruction = blocks[side][at[side]]
        if side == 1 and instruction.op is Opcode.SEND and sends_left:
            side = 0  # the first block's sends go first
            continue
        if _waits_for_all_to_all(instruction, exchanges[side]) and \
                (side, at[side]) not in given_way and at[other] < len(blocks[other]):
            given_way.add((side, at[side]))
            side = other
            continue
        if side == 0 and instruction.op is Opcode.SEND:
            sends_left -= 1
        out.append((side, at[side]))
        at[side] += 1
    return out
