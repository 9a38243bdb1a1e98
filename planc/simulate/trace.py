"""A simulated step as a Chrome trace (Perfetto), with the tracks of ``planc run --trace``:
a process per representative rank (the first rank of each stage), a thread per stream,
and send-to-receive flow arrows, so that a measured and a simulated run of one build open
side by side. Peers come from the instructions' operands, the rank table (a pipeline
peer) and the group table (a ring shift's group), as the runtime finds them."""

from __future__ import annotations

from planc.program.operands import Operands
from planc.program.program import TRANSFER_OPS, Opcode, node_of_done
from planc.plan.mesh import RankMesh
from planc.host.output_kinds import SIMULATED_TRACE
from planc.data.trace import flows_of
from planc.data.trace import write as write_events


# The lane that shows which block of the schedule runs when (F, B, or a split backward's
# I and W), above the streams' operations.
BLOCK_LANE = "blocks"


def rank_label(mesh: RankMesh, rank: int) -> str:
    coords = mesh.coords(rank)
    return (f"rank {rank} (stage {coords['pp']}, tp {coords['tp']}, cp {coords['cp']}, "
            f"dp {coords['dp']})")


def _flows(build, rank: int, node: str, op: str, operands: Operands | None) -> tuple:
    """The flow ends of a simulated transfer (or ring attention step) on ``rank``."""
    if operands is None:
        return ()
    if op in TRANSFER_OPS and operands.peer_stage is not None:
        peer = build.table.peer(rank, operands.peer_stage)
        return flows_of(op, node, rank, peer, operands.partner if op is Opcode.SEND else None)
    if op is Opcode.COMPUTE and operands.ring_steps:  # ring attention: its shifts
        members = build.groups.members(rank, build.groups.rule(operands.group))
        return flows_of(op, node, rank, None, None, members, members.index(rank))
    return ()


def _senders(programs) -> dict[str, str]:
    """Each pipeline receive's send, from the sends' operands (their ``partner``)."""
    out = {}
    for program in programs:
        for item in program.written():
            if item.op is Opcode.SEND and item.operands is not None and \
                    item.operands.partner is not None:
                out[item.operands.partner] = item.node
    return out


def write(path: str, build, result) -> None:
    mesh = build.groups.ranks
    programs = {program.stage: program for name, program in build.programs.items()
                if build.table.stages.get(name) == program.stage}
    sender_of = _senders(programs.values())
    events: dict[int, list[tuple]] = {}
    sends: dict[tuple[str, int], float] = {}
    for time in result.timeline:
        rank = mesh.first_rank_of_stage(time.stage)
        program = programs[time.stage]
        stream_of = {node: stream for stream, items in program.receives.items()
                     for node, _ in items}
        out = events.setdefault(rank, [])
        parts = [("prologue", None, 0.0, time.prologue)]
        parts += [(block, mb, start, replayed) for block, mb, start, replayed in time.blocks]
        if time.epilogue is not None:
            parts.append(("epilogue", None, time.epilogue[0], time.epilogue[1]))
        for block, microbatch, start, replayed in parts:
            if replayed is None:
                continue
            if microbatch is not None:  # the schedule's block, on a lane of its own
                out.append((0, BLOCK_LANE, f"{block}.{microbatch}", start,
                            start + replayed.compute_end, microbatch, "block", ()))
            for span in replayed.spans:
                out.append((0, span.stream, span.node, start + span.start, start + span.end,
                            microbatch, span.op,
                            _flows(build, rank, span.node, span.op, span.operands)))
                if span.op is Opcode.SEND:
                    sends[(span.node, microbatch)] = start + span.start
            for event in replayed.external:  # a pipeline receive, drawn until it is used
                node = node_of_done(event)
                if node in stream_of:
                    begin = sends.get((sender_of.get(node), microbatch), start)
                    out.append((0, stream_of[node], node, min(begin, start), start,
                                microbatch, Opcode.RECV,
                                _flows(build, rank, node, Opcode.RECV, program.received[node])))
    write_events(path, {rank: rank_label(mesh, rank) for rank in events}, events,
                 SIMULATED_TRACE.generator)
