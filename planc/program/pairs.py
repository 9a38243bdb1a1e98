"""Two blocks of two microbatches run as one overlapped pair, interleaved instruction by
instruction (schedule { overlap_all_to_all } under a schedule with overlapped pairs:
DualPipeV's forward of one microbatch with the backward of another, the DeepSeek-V3
report's section 3.2.1).

The order is a merge of the two blocks' instructions that keeps each block's own order:
the backward starts (DualPipe's pair starts with the backward's MLP: its combine's
gradient is the first all-to-all either block can issue, where the forward's dispatch
waits for its attention) and runs until its compute stream is about to wait for one of
its own all-to-alls on the ep stream; the forward runs meanwhile, until it in turn waits
for one of its all-to-alls; and so on. Each such wait gives way once: when its block
comes back to it, it is taken. So a mixture's dispatch or combine of one microbatch
travels while the other microbatch computes, as DualPipe's pairs hide them. A block with
fewer all-to-alls (a dense chunk, a chunk of fewer layers) gives each of the other's
waits an equal share of its compute (by its instructions' flops), rather than all of it
at the first, and gives way only at a compute step: an all-to-all it can issue goes out
first, to travel beside the other's compute.

A pair may also take the weight-gradient block that follows it (zero-bubble's W of the
backward's microbatch, which DualPipe computes inside the pair): its instructions run
wherever a block is about to take a wait it already gave way on, a share of them at
each, as soon as what they read is written and no transfer still reads what they free.

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


def _conflict(a, b) -> bool:
    """Whether instructions ``a`` and ``b`` touch a buffer in an order that matters: one
    writes or frees what the other reads, writes or frees."""
    changed_a, changed_b = set(a.writes) | set(a.frees), set(b.writes) | set(b.frees)
    return bool(changed_a & (set(b.reads) | changed_b) or changed_b & set(a.reads))


def weight_dependencies(second: Sequence, weights: Sequence
                         ) -> tuple[list[int], list[tuple[int, ...]]]:
    """For each instruction of ``weights`` (the weight-gradient block of ``second``'s
    microbatch, DualPipe's W inside its pair): the last instruction of ``second`` it
    must follow (-1: none), and the earlier ones of ``weights``. It follows whatever it
    conflicts with on a buffer (it reads the input gradients' stashes ``second``
    writes), and where that is a transfer, the wait that tells its stream the transfer
    is done; a record of a compute's completion follows that compute; a wait follows
    the record of its event; on a stream other than compute, or after a wait on the
    compute stream, it keeps its place."""
    # where x's stream learns that an instruction of another stream has finished: x must
    # not free or overwrite what a transfer still reads, nor read what it still writes
    learnt = {(i.stream, node_of_done(i.event)): k for k, i in enumerate(second)
              if i.op is Opcode.WAIT and node_of_done(i.event or "")}
    after_second = [max((k if y.stream == x.stream else
                         learnt.get((x.stream, y.node), len(second))
                         for k, y in enumerate(second) if _conflict(x, y)), default=-1)
                    for x in weights]
    for k, x in enumerate(weights):  # a wait for an event the input gradient records
        if x.op is Opcode.WAIT:
            after_second[k] = max([after_second[k]] + [
                j for j, y in enumerate(second) if y.op is Opcode.RECORD and y.event == x.event])
    after_weights = []
    for k, x in enumerate(weights):
        done = node_of_done(x.event or "") if x.op is Opcode.RECORD else None
        needs = []
        for j in range(k):
            y = weights[j]
            if _conflict(x, y) or (
                    done is not None and y.node == done) or (
                    x.op is Opcode.WAIT and y.op is Opcode.RECORD and x.event == y.event) or (
                    x.stream == y.stream and (x.stream != Stream.COMPUTE or
                                              y.op is Opcode.WAIT)):
                needs.append(j)
        after_weights.append(tuple(needs))
    return after_second, after_weights


def interleave(first: Sequence, second: Sequence, weights: Sequence = ()
               ) -> list[tuple[int, int]]:
    """The merged order of blocks ``first`` and ``second`` (their instructions, guards
    applied) and of ``weights``, the weight-gradient block of ``second``'s microbatch
    when the pair takes it: (0, 1 or 2, the instruction's position in its block), each
    block's positions in increasing order but ``weights``', which run as soon as what
    they read is written (:func:`weight_dependencies`), wherever the compute stream
    would otherwise wait for an all-to-all it has already given way to once."""
    blocks = (first, second)
    exchanges = (_all_to_alls(first), _all_to_alls(second))
    sends_left = sum(1 for i in first if i.op is Opcode.SEND)
    at, side, given_way = [0, 0], _leading(exchanges), set()
    after_second, after_weights = weight_dependencies(second, weights)
    placed = [False] * len(weights)
    out: list[tuple[int, int]] = []

    waits = [sum(1 for i in blocks[k] if _waits_for_all_to_all(i, exchanges[k]))
             for k in (0, 1)]
    # the weights' work is shared out over the waits of both blocks, as a filler's is
    weight_share = sum(_flops(i) for i in weights) / max(1, sum(waits))
    filled = [0.0, 0]  # flops placed, waits filled

    def fill(whole: bool = False) -> None:
        """The weight-gradient instructions that can run now, in their block's order, up
        to this wait's share of their work (all of them at the end)."""
        filled[1] += 1
        progress = True
        while progress:
            progress = False
            for k in range(len(weights)):
                if not whole and filled[0] >= weight_share * filled[1]:
                    return
                if not placed[k] and (after_second[k] < at[1] or whole) and \
                        all(placed[j] for j in after_weights[k]):
                    placed[k] = progress = True
                    filled[0] += _flops(weights[k])
                    out.append((2, k))

    # A block with fewer all-to-alls than the other (a dense block, or fewer layers)
    # fills each of the other's waits with an equal share of its work (its compute's
    # flops), rather than all it can do at the first.
    filler = 0 if waits[0] < waits[1] else 1 if waits[1] < waits[0] else None
    if filler is not None:
        share = sum(_flops(i) for i in blocks[filler]) / waits[1 - filler]
    gave = [0, 0]
    done_flops = 0.0
    while at[0] < len(first) or at[1] < len(second):
        other = 1 - side
        if at[side] >= len(blocks[side]):
            side = other
            continue
        instruction = blocks[side][at[side]]
        if side == 1 and instruction.op is Opcode.SEND and sends_left:
            side = 0  # the first block's sends go first
            continue
        if side == filler and at[other] < len(blocks[other]) and \
                done_flops >= share * gave[other] and _computes(instruction) and not (
                    other == 1 and blocks[1][at[1]].op is Opcode.SEND and sends_left):
            side = other  # its share of this wait is done (what it can issue, issued)
            continue
        if _waits_for_all_to_all(instruction, exchanges[side]):
            if (side, at[side]) not in given_way and at[other] < len(blocks[other]):
                given_way.add((side, at[side]))
                gave[side] += 1
                side = other
                continue
            fill()  # the compute stream may wait here: give it the weights' work
        if side == 0 and instruction.op is Opcode.SEND:
            sends_left -= 1
        if side == filler:
            done_flops += _flops(instruction)
        out.append((side, at[side]))
        at[side] += 1
    fill(whole=True)
    return out


def _computes(instruction) -> bool:
    """A compute step on the compute stream: where a filler may give way, once the
    transfers it can start (a record, the ep stream's wait and all-to-all) are issued."""
    return instruction.op is Opcode.COMPUTE and instruction.stream == Stream.COMPUTE


def _flops(instruction) -> float:
    operands = instruction.operands
    return (operands.flops or 0.0) if operands is not None else 0.0


def _leading(exchanges: tuple[frozenset[str], frozenset[str]]) -> int:
    """The block that starts: the backward (``second``) where both hold all-to-alls, as
    DualPipe's pair starts with the backward's MLP (DeepSeek-AI 2024, Figure 4), whose
    combine's gradient is the first all-to-all either can issue (the forward's dispatch
    waits for its attention); else the block with all-to-alls, which the other fills."""
    return 1 if exchanges[1] else 0
