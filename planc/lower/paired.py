"""Which of a stage's scheduled blocks run as interleaved pairs (planc.program.pairs):
decided once, when the programs are lowered, from the plan and the stage's blocks; and
in what order each pair runs, once the group table places the ranks: the default merge,
or the list schedule where the cost model prices it faster (planc.program.pair_orders)."""

from __future__ import annotations

from dataclasses import replace

from planc.estimate.block_replay import replay
from planc.estimate.instruction_cost import InstructionCosts
from planc.graph.ir import Payload
from planc.plan.plan import Plan
from planc.program.groups import GroupTable
from planc.program.pair_orders import pair_key, scheduled
from planc.program.pairs import interleave
from planc.program.program import Opcode, Program, paired_positions
from planc.schedules import ActionKind

# The list schedule replaces the default merge where it saves more than this share of
# the pair's time: below it, the two are the same within the cost model's own error.
CHEAPER_BY = 0.01


def overlapped_blocks(plan: Plan, pipeline, stage: int, blocks: dict
                      ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(:func:`paired_blocks`, :func:`paired_weight_blocks`, :func:`weighted_blocks`) of
    a stage: none without schedule { overlap_all_to_all }, or where the stage's blocks
    hold no mixture's all-to-alls for the interleave to hide."""
    if not plan.schedule.overlap_all_to_all or not any(
            _exchanges(block) for block in blocks.values()):
        return (), (), ()
    shape = (stage, plan.mesh.pp, plan.schedule.microbatches, plan.shard.pp.virtual)
    order = pipeline.program_order(*shape)
    paired = paired_blocks(pipeline, shape, order)
    weights = paired_weight_blocks(order, paired)
    return paired, weights, weighted_blocks(order, paired, weights, blocks)


def _exchanges(block) -> bool:
    """Whether a block holds a mixture's dispatch or combine."""
    return any(i.op is Opcode.ALL_TO_ALL and i.operands is not None and
               i.operands.payload in (Payload.DISPATCH, Payload.COMBINE) for i in block)


def weighted_blocks(order, paired: tuple[int, ...], paired_weights: tuple[int, ...],
                    blocks: dict) -> tuple[int, ...]:
    """The input-gradient blocks outside the pairs (a warm-up's or a cool-down's, which
    have no forward beside them) that hold all-to-alls and that the schedule follows at
    once with weight gradients of their chunk (their own microbatch's, or in a
    cool-down an earlier one's, whose input gradient has run): each runs with them
    interleaved, the weight gradients filling the compute stream while its all-to-alls
    travel (Megatron-Core's delayed weight-gradient computation, which runs the experts'
    weight gradients beside the dispatch's backward all-to-all). A weight gradient of
    another microbatch reads only its own stash (``B/...:saved``), which the runtime
    keeps by microbatch; the merge orders it by buffer names all the same."""
    taken = paired_positions(paired, paired_weights)
    out: list[int] = []
    for k in range(len(order) - 1):
        backward, after = order[k], order[k + 1]
        if {k, k + 1} & taken or (out and out[-1] == k - 1):
            continue
        if backward.kind is ActionKind.BACKWARD_INPUT and \
                after.kind is ActionKind.BACKWARD_WEIGHT and after.chunk == backward.chunk and \
                _exchanges(blocks.get(backward.block.name, ())):
            out.append(k)
    return tuple(out)


def paired_weight_blocks(order, paired: tuple[int, ...]) -> tuple[int, ...]:
    """Of the pairs, those whose backward is an input gradient whose weight gradient the
    schedule runs right after the pair: that block runs inside the pair, filling the
    compute stream while the all-to-alls travel (DualPipe's pair holds the backward's W
    steps: DeepSeek-AI 2024, Figure 4)."""
    taken = set(paired)
    out = []
    for k in paired:
        if k + 2 >= len(order) or k + 2 in taken:
            continue
        backward, after = order[k + 1], order[k + 2]
        if backward.kind is ActionKind.BACKWARD_INPUT and \
                after.kind is ActionKind.BACKWARD_WEIGHT and \
                (after.chunk, after.microbatch) == (backward.chunk, backward.microbatch):
            out.append(k)
    return tuple(out)


def paired_blocks(pipeline, shape: tuple[int, int, int, int], order) -> tuple[int, ...]:
    """The schedule's overlapped pairs (a forward, and the backward or input-gradient
    block of another microbatch after it) that run interleaved (planc.program.pairs);
    ``shape``: (stage, pp, microbatches, virtual), ``order``: the stage's program order."""
    pairs = pipeline.program_overlapped(*shape)
    if pairs:  # the schedule's own (DualPipeV's)
        return tuple(sorted(pairs))
    if not pipeline.steady:
        # GPipe: its one forward followed by a backward is the last forward before the
        # first backward, which waits, through the next stage, for that very forward's
        # output: interleaved with it, the two stages would wait for each other
        return ()
    # Megatron-Core's combined 1F1B: every forward followed at once by another
    # microbatch's backward (1F1B's and interleaved's steady state)
    out = []
    later = _later_positions(pipeline, shape)
    for k, (action, after) in enumerate(zip(order, order[1:])):
        if action.kind is ActionKind.FORWARD and after.microbatch != action.microbatch and \
                after.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and \
                (not out or out[-1] != k - 1) and \
                not _waits_for_itself(later, action.microbatch, after.microbatch):
            out.append(k)
    return tuple(out)


def _later_positions(pipeline, shape: tuple[int, int, int, int]) -> list[dict]:
    """For each stage after this one, where its order runs each microbatch's forward
    ((True, mb)) and backward ((False, mb)); none with several chunks a stage (they
    interleave across the stages otherwise; the verifier's stream-by-stream proof holds
    those pairs)."""
    stage, pp, microbatches, virtual = shape
    if virtual != 1:
        return []
    positions = []
    for later in range(stage + 1, pp):
        order = pipeline.program_order(later, pp, microbatches, virtual)
        positions.append({(a.kind is ActionKind.FORWARD, a.microbatch): k
                          for k, a in enumerate(order)
                          if a.kind is not ActionKind.BACKWARD_WEIGHT})
    return positions


def _waits_for_itself(later: list[dict], forward: int, backward: int) -> bool:
    """Whether a stage's backward of microbatch ``backward`` waits, through a later stage,
    for its own forward of microbatch ``forward``: a later stage that runs that forward
    before that backward (1F1B with fewer microbatches than stages, whose warm-up is all
    of them, as GPipe's is) holds the backward's gradient behind the forward's output,
    and the pair would wait for itself. ``later``: :func:`_later_positions`."""
    return any(at.get((True, forward), float("inf")) < at.get((False, backward), -1)
               for at in later)


def ordered_by_cost(plan: Plan, programs: dict[str, Program], groups: GroupTable
                    ) -> dict[str, Program]:
    """Each program with pairs, with ``pair_orders``: for each pair of blocks whose
    list schedule (planc.program.pair_orders.scheduled, the faster of its two: with and
    without holding a step for a more critical one about to be ready) the cost model
    prices more than :data:`CHEAPER_BY` faster than the default merge
    (planc.program.pairs.interleave), that order; the runtime, the simulator and the
    verifier run it. The orders are timed on the blocks whole (what a guard leaves to
    one microbatch included), once per pair of blocks: the order is written for every
    microbatch's instance."""
    if not any(program.paired for program in programs.values()):
        return programs
    costs = InstructionCosts(plan, groups)
    out = dict(programs)
    for name, program in programs.items():
        if not program.paired:
            continue
        duration, orders, tried = costs.of_stage(program.stage), {}, set()
        for k in program.paired:
            entries = program.schedule[k:k + program.together(k)]
            key = pair_key(entries)
            if key in tried:
                continue
            tried.add(key)
            blocks = [program.blocks[block] for block, _ in entries]
            weights = blocks[2] if len(blocks) > 2 else ()
            default, *listed = (interleave(*blocks), *(
                scheduled(blocks[0], blocks[1], weights, duration, lookahead)
                for lookahead in (False, True)))
            default_seconds, *seconds = (
                replay([blocks[side][at] for side, at in order], duration).compute_end
                for order in (default, *listed))
            fastest = min(range(len(listed)), key=lambda j: (seconds[j], j))
            if seconds[fastest] < default_seconds * (1 - CHEAPER_BY):
                orders[key] = tuple(listed[fastest])
        if orders:
            out[name] = replace(program, pair_orders=orders)
    return out
