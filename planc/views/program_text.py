"""``planc programs``: one rank's program as a listing a person can read."""

from __future__ import annotations

import networkx as nx

from planc.graph.ir import Axis
from planc.plan.layout import Layout
from planc.program import expansion
from planc.program.program import EVENT_NAMING_OPS, Instruction, Opcode, Program, RankTable
from planc.plan.plan import Plan
from planc import schedules
from planc.schedules import Block
from planc.schedules.layers import chunk_text


STAGE_GROUPS = tuple(a.value for a in Axis if a.within_stage and a != Axis.STAGE)
# --expand lists at most this many instructions (a plan at planc's limits can issue
# billions in one step: layers x microbatches); --microbatch K lists all of one
# microbatch, which planc's limit on layers bounds.
EXPAND_LIMIT = 100_000
GUARD_TEXT = {"last": "  (last microbatch only)", "first": "  (first microbatch only)"}


def _instruction(i: Instruction, graph: nx.DiGraph) -> str:
    guard = GUARD_TEXT.get(i.guard, "")
    if i.op in EVENT_NAMING_OPS:
        scope = "" if i.per_microbatch else " (once per step)"
        return f"{i.stream:<10} {i.op} {i.event}{scope}{guard}"
    if i.op is Opcode.SYNC:
        return f"{i.stream:<10} sync (every stream drained)"
    data = graph.nodes[i.node] if i.node in graph else {}
    extra = ""
    if data.get("type") == "transfer":
        kept = ", keeps its shard" if data.get("keeps_shard") else ""  # grad_reduce
        extra = f"  [{data['axis']}, {data['bytes']:,} B{kept}]"
    reads = f"  <- {', '.join(i.reads)}" if i.reads else ""
    return f"{i.stream:<10} {i.op:<14} {i.node}{extra}{reads}{guard}"


def _schedule_text(plan: Plan, program: Program) -> str:
    """The program's schedule, each overlapped pair of the plan's schedule in brackets."""
    texts = [f"{b}.{mb}" for b, mb in program.schedule]
    pairs = schedules.named(plan.schedule.pipeline).program_overlapped(
        program.stage, plan.mesh.pp, plan.schedule.microbatches, plan.shard.pp.virtual)
    if pairs and max(k + n for k, n in pairs.items()) <= len(texts):  # else another plan's
        for k, n in pairs.items():
            texts[k], texts[k + n - 1] = "[" + texts[k], texts[k + n - 1] + "]"
    for k in program.paired + program.weighted:  # interleaved (planc.program.pairs)
        end = k + program.together(k) - 1
        if end < len(texts):
            opened = texts[k].startswith("[")
            texts[k] = ("[<" if opened else "<") + texts[k].lstrip("[")
            closed = any(text.endswith("]") for text in texts[k + 1:end + 1])
            for at in range(k + 1, end + 1):
                texts[at] = texts[at].rstrip("]")
            texts[end] = texts[end] + (">]" if closed else ">")
    return " ".join(texts)


def _block_title(name: str, plan: Plan) -> str:
    block = Block.parse_or_none(name)
    chunks = plan.shard.pp.chunks
    if block is None or block.chunk >= len(chunks):  # a build is untrusted input
        return f"block {name}, once per microbatch"
    layers = chunk_text(chunks, block.chunk)
    return (f"block {name}: {block.kind.words} of chunk {block.chunk} ({layers}), once per "
            f"microbatch")


def _block_order(name: str) -> tuple[int, int, str]:
    """Chunk by chunk, each forward before its backward (a build lists them by name,
    which puts every B before every F)."""
    block = Block.parse_or_none(name)
    if block is None:
        return 10**9, 0, name
    return block.chunk, not block.kind.is_forward, name


def render(plan: Plan, graph: nx.DiGraph, programs: dict[str, Program], table: RankTable,
           rank: int, expand: bool = False, microbatch: int | None = None) -> str:
    layout = Layout.of(plan)
    name = table.program_of(rank)
    program = programs[name]
    coords = layout.coords(rank)
    others = [r for r in table.ranks(name) if r != rank]
    shown = ", ".join(map(str, others[:8])) + (f", ... ({len(others)})" if len(others) > 8
                                               else "")
    lines = [f"rank {rank}: stage {coords['pp']} (tp {coords['tp']}, cp {coords['cp']}, "
             f"dp {coords['dp']}) runs {name}" + (f", shared with ranks {shown}" if others
                                                  else ""),
             "groups: " + "  ".join(f"{axis} {list(layout.group(rank, axis))}"
                                    for axis in STAGE_GROUPS
                                    if len(layout.group(rank, axis)) > 1) or "groups: none",
             f"streams: {', '.join(program.streams)}"]
    actions = _schedule_text(plan, program)
    lines.append(f"schedule ({len(program.schedule)} blocks, block.microbatch): "
                 + (actions if len(actions) < 400 else actions[:400] + " ..."))
    if "[" in actions and not program.paired:
        lines.append("  [F... B...]: a forward run overlapped with another microbatch's "
                     "backward (DualPipe): back to back, the backward's sends on their own "
                     "stream")
    if program.paired:
        lines.append("  <F... B...>: two microbatches' blocks interleaved instruction by "
                     "instruction, each giving way to the other while one of its mixture's "
                     "all-to-alls travels (schedule { overlap_all_to_all })"
                     + ("; <F... I... W...>: with the input gradient's weight gradients, "
                        "run as soon as what they read is there" if program.paired_weights
                        else ""))
    if program.weighted:
        lines.append("  <I... W...>: an input gradient outside the pairs with the weight "
                     "gradients after it, which fill its waits for its all-to-alls")
    if program.pair_orders:
        lines.append("  in the order the compiler's cost model chose (a list schedule, "
                     "not the default merge): " + ", ".join(
                         f"<{key}>" for key in sorted(program.pair_orders)))
    if expand:
        lines.append("")
        lines.append("issue order of one step" + (f", microbatch {microbatch}"
                                                  if microbatch is not None else "") + ":")
        shown = 0
        for item in expansion.expand(program, microbatch):
            if shown == EXPAND_LIMIT and microbatch is None:
                rest = expansion.expanded_length(program) - item.index
                lines.append(f"  ... and {rest:,} more: --expand lists the first "
                             f"{EXPAND_LIMIT:,} instructions of a step; --microbatch K lists "
                             f"all of microbatch K")
                break
            shown += 1
            what = item.event if item.op in EVENT_NAMING_OPS else item.node
            mb = f"  (mb {item.microbatch})" if item.microbatch is not None else ""
            lines.append(f"  {item.index:>6}  {item.stream:<10} {item.op:<14} {what}{mb}")
        return "\n".join(lines) + "\n"
    if program.prologue:
        lines.append("")
        lines.append("prologue, once per step before the first block:")
        for k, instruction in enumerate(program.prologue):
            lines.append(f"  {k:>4}  {_instruction(instruction, graph)}")
    for block in sorted(program.blocks, key=_block_order):
        instructions = program.blocks[block]
        lines.append("")
        lines.append(_block_title(block, plan))
        for k, instruction in enumerate(instructions):
            lines.append(f"  {k:>4}  {_instruction(instruction, graph)}")
    for stream, items in program.receives.items():
        lines.append("")
        lines.append(f"receives on {stream}, in the order the peer sends them:")
        text = ", ".join(f"{node} mb {mb}" for node, mb in items)
        lines.append("  " + (text if len(text) < 600 else text[:600] + " ..."))
    lines.append("")
    lines.append("epilogue, once per step after the last block:")
    for k, instruction in enumerate(program.epilogue):
        lines.append(f"  {k:>4}  {_instruction(instruction, graph)}")
    return "\n".join(lines) + "\n"
