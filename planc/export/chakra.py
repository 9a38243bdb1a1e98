"""One step of a build as MLCommons Chakra execution traces, for ASTRA-sim.

For each representative rank (the first rank of each pipeline stage; the others run the
same program) the file ``PREFIX.RANK.et`` holds, as Chakra's ``et_def.proto`` says, a
length-delimited ``GlobalMetadata`` message and then one length-delimited ``Node`` per
instruction of the step that does work: compute nodes (``COMP_NODE``, with ``num_ops``
and ``tensor_size``), collectives (``COMM_COLL_NODE``, with ``comm_type`` and
``comm_size``), pipeline and ring transfers (``COMM_SEND_NODE``/``COMM_RECV_NODE`` with
``comm_src``, ``comm_dst``, ``comm_size`` and ``comm_tag``). A node's control
dependencies are the previous node on its stream and the node whose end an event marks
for every wait before it, so the graph keeps the program's stream semantics. Everything
is the programs': sizes and groups from each instruction's operands, peers from the rank
table (a pipeline peer) and the group table's mesh (a ring shift's neighbours), durations
the simulator's cost of the instruction (:mod:`planc.estimate.instruction_cost`).

protobuf is written by hand (varints and length-delimited fields, proto3 encoding): the
format is a few dozen lines, and planc does not depend on the protobuf package.
"""

from __future__ import annotations

import struct
from pathlib import Path

from planc.estimate.cost import Route
from planc.program.operands import Operands
from planc.program.expansion import expand, expanded_length
from planc.program.program import TRANSFER_OPS, Opcode
from planc.host.output_kinds import CHAKRA
from planc.estimate.instruction_cost import InstructionCosts

CHAKRA_VERSION = "0.0.4"
# et_def.proto's enums.
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7
COMM_TYPE = {"all_reduce": 0, "all_gather": 2, "broadcast": 5, "all_to_all": 6,
             "reduce_scatter": 7}
VARINT, FIXED64, LENGTH = 0, 1, 2


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # proto3 int64: negative numbers as 10-byte two's complement
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, LENGTH) + _varint(len(data)) + data


def _string(field: int, text: str) -> bytes:
    return _bytes(field, text.encode()) if text else b""


def _uint(field: int, value: int) -> bytes:
    return _key(field, VARINT) + _varint(value) if value else b""


def _packed(field: int, values: list[int]) -> bytes:
    return _bytes(field, b"".join(_varint(v) for v in values)) if values else b""


def attribute(name: str, value) -> bytes:
    """An ``AttributeProto``: int64_val (9), double_val (3), bool_val (27),
    string_val (29)."""
    body = _string(1, name)
    if isinstance(value, bool):
        body += _key(27, VARINT) + _varint(int(value))
    elif isinstance(value, int):
        body += _key(9, VARINT) + _varint(value)
    elif isinstance(value, float):
        body += _key(3, FIXED64) + struct.pack("<d", value)
    else:
        body += _bytes(29, str(value).encode())
    return body


def node_message(node_id: int, name: str, node_type: int, ctrl_deps: list[int],
                 start_us: int, duration_us: int, attributes: list[tuple[str, object]]
                 ) -> bytes:
    return (_uint(1, node_id) + _string(2, name) + _uint(3, node_type)
            + _packed(4, ctrl_deps) + _uint(6, start_us) + _uint(7, duration_us)
            + b"".join(_bytes(10, attribute(k, v)) for k, v in attributes))


def metadata_message(attributes: list[tuple[str, object]]) -> bytes:
    return _string(1, CHAKRA_VERSION) + b"".join(_bytes(2, attribute(k, v))
                                                 for k, v in attributes)


def _delimited(message: bytes) -> bytes:
    return _varint(len(message)) + message


def _peer(build, rank: int, operands: Operands) -> int:
    """Whom ``rank`` talks to in a pipeline transfer: its peer stage's rank (the rank
    table's)."""
    return build.table.peer(rank, operands.peer_stage)


def _nodes(build, program, rank: int, costs: InstructionCosts) -> list[bytes]:
    out: list[bytes] = []
    last_on_stream: dict[str, int] = {}
    pending_waits: dict[str, list[int]] = {}
    event_node: dict[str, int] = {}
    ends: dict[int, float] = {}  # node id -> when it ends (the simulator's durations)
    next_id = 0
    for item in expand(program):
        if item.op is Opcode.RECORD:
            if item.stream in last_on_stream:
                event_node[item.event] = last_on_stream[item.stream]
            continue
        if item.op is Opcode.WAIT:
            if item.event in event_node:
                pending_waits.setdefault(item.stream, []).append(event_node[item.event])
            continue
        if item.op is Opcode.SYNC:
            pending_waits.setdefault(item.stream, []).extend(last_on_stream.values())
            continue
        instruction = item.source
        operands = instruction.operands
        seconds = costs(instruction, program.stage)
        deps = sorted(set(pending_waits.pop(item.stream, []))
                      | ({last_on_stream[item.stream]} if item.stream in last_on_stream
                         else set()))
        begin = max([ends[d] for d in deps], default=0.0)
        label = item.node + (f"#{item.microbatch}" if item.microbatch is not None else "")
        common: list[tuple[str, object]] = [("is_cpu_op", False)]
        if item.op is Opcode.COMPUTE:
            parts = [(COMP_NODE, label, [("num_ops", int(operands.flops)),
                                         ("tensor_size", operands.output_bytes)])]
        elif item.op in TRANSFER_OPS:
            parts = []
            halves = (item.op,)
            for half in halves:
                peer = _peer(build, rank, operands)
                source, target = (rank, peer) if half == "send" else (peer, rank)
                parts.append((COMM_SEND_NODE if half == "send" else COMM_RECV_NODE,
                              f"{label}:{half}" if len(halves) > 1 else label,
                              [("comm_src", source), ("comm_dst", target),
                               ("comm_size", operands.bytes),
                               ("comm_tag", item.microbatch or 0)]))
        else:
            parts = [(COMM_COLL_NODE, label,
                      [("comm_type", COMM_TYPE.get(item.op, 0)),
                       ("comm_size", operands.bytes), ("pg_name", operands.group),
                       ("route", operands.route or Route.RING.value)])]
        for kind, name, attributes in parts:
            out.append(node_message(next_id, name, kind, deps, int(begin * 1e6),
                                    max(int(round(seconds * 1e6)), 1),
                                    common + attributes))
            ends[next_id] = begin + seconds
            last_on_stream[item.stream] = next_id
            next_id += 1
    return out


def trace_file(name: str, prefix: str) -> bool:
    """Whether ``name`` is one of the files an export with ``prefix`` writes."""
    rank = name[len(prefix) + 1:-3] if name.startswith(f"{prefix}.") and \
        name.endswith(".et") else ""
    return rank.isdigit()


class ExportTooLarge(Exception):
    """The traces would hold more instructions than an export writes (MAX_TRACE_NODES)."""


# Each node is encoded in Python, some 70 us apiece on one core: a million is about a
# minute and 100 MB of traces; a plan at planc's limits would issue billions.
MAX_TRACE_NODES = 1_000_000


def export(build, directory: str | Path, prefix: str = "planc") -> list[Path]:
    """Write one ``.et`` file per representative rank (the first of each stage, from the
    group table's mesh); the paths written. Every trace is encoded before any is written,
    so that a plan too large (ExportTooLarge) changes nothing (what lies in a trace's
    place, the command's output rule refused first: planc.host.outputs); the files are
    then replaced together (a full disk part way changes nothing)."""
    from planc.host.files import real_path, write_together

    plan = build.plan
    mesh = build.groups.ranks
    costs = InstructionCosts(plan, build.groups)
    programs = {program.stage: program for name, program in build.programs.items()
                if build.table.stages.get(name) == program.stage}
    instructions = sum(expanded_length(programs[stage]) for stage in range(plan.mesh.pp))
    if instructions > MAX_TRACE_NODES:
        raise ExportTooLarge(f"the traces would hold {instructions:,} instructions, more "
                             f"than planc export writes ({MAX_TRACE_NODES:,}, about a "
                             f"minute); export a plan with fewer microbatches or layers (a plan "
                             f"file takes --set schedule.microbatches=N)")
    directory = Path(directory)
    bodies = {}
    for stage in range(plan.mesh.pp):
        rank = mesh.first_rank_of_stage(stage)
        metadata = metadata_message([("schema", "planc"), ("generator", CHAKRA.generator),
                                     ("plan", plan.name),
                                     ("rank", rank), ("stage", stage),
                                     ("world", plan.world)])
        bodies[directory / f"{prefix}.{rank}.et"] = _delimited(metadata) + b"".join(
            _delimited(n) for n in _nodes(build, programs[stage], rank, costs))
    made = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    try:  # a full disk leaves no trace and replaces none (trace_file's names)
        write_together({real_path(path): body for path, body in bodies.items()})
    except BaseException:
        for made_directory in made:  # the directories this export made, if left empty
            try:
                made_directory.rmdir()
            except OSError:
                break
        raise
    return list(bodies)
