"""Chrome trace (Perfetto) of a run: a process per rank, a thread per program stream,
and a flow arrow from every pipeline send to its receive and from every ring shift to
the one it feeds on the next context-parallel rank.

The flows come with the events, as the instructions' operands name their peers
(:func:`flows_of`): nothing here reads the graph or the mesh.
"""

from __future__ import annotations

import json
import zlib

from planc.host.files import write_atomically
from planc.program.names import STREAM_ORDER
from planc.program.program import Opcode
from planc.host.output_kinds import RUN_TRACE

# A flow end: ("s" start or "f" finish, sending rank, receiving rank, the receive's
# node, whether it is drawn at the end of the event rather than its start).
Flow = tuple[str, int, int, str, bool]


def _flow_id(*parts) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def flows_of(op: str, node: str, rank: int, peer: int | None, partner: str | None,
             members: tuple[int, ...] = (), index: int = 0) -> tuple[Flow, ...]:
    """The flow ends of one transfer instruction on ``rank``: a pipeline send starts the
    flow to ``peer``'s receive ``partner``, a receive finishes the one from ``peer``; ring
    attention (a compute step over the cp ring) starts one to the next member of its
    group and finishes the one from the previous member."""
    if op is Opcode.SEND and peer is not None and partner is not None:
        return (("s", rank, peer, partner, False),)
    if op is Opcode.RECV and peer is not None:
        return (("f", peer, rank, node, False),)
    if op is Opcode.COMPUTE and members:
        after = members[(index + 1) % len(members)]
        before = members[(index - 1) % len(members)]
        return (("s", rank, after, node, False), ("f", before, rank, node, True))
    return ()


def write(path: str, labels: dict[int, str],
          events_by_rank: list[list[tuple]] | dict[int, list[tuple]],
          generator: str = RUN_TRACE.generator) -> None:
    """``generator``: the command named in the trace's metadata, first in the file, which
    tells planc's own traces (planc.host.output_kinds). ``events_by_rank[r]``: (step,
    stream, node, start, end, microbatch, op, flows[, route]) of rank r (a list of every
    rank's, or a dict of some ranks'); times in seconds of one clock shared by the ranks
    (CLOCK_MONOTONIC on one machine, or the simulator's);
    ``labels[r]``: the name of rank r's process."""
    by_rank = events_by_rank if isinstance(events_by_rank, dict) else \
        dict(enumerate(events_by_rank))
    origin = min((e[3] for events in by_rank.values() for e in events), default=0.0)
    trace: list[dict] = []
    tid = {str(stream): i for i, stream in enumerate(STREAM_ORDER)}
    for events in by_rank.values():  # lanes of no stream (the simulator's blocks) after
        for event in events:
            tid.setdefault(str(event[1]), len(tid))
    for rank, events in sorted(by_rank.items()):
        trace.append({"ph": "M", "name": "process_name", "pid": rank,
                      "args": {"name": labels.get(rank, f"rank {rank}")}})
        for stream, i in tid.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i,
                          "args": {"name": stream}})
        for step, stream, node, start, end, microbatch, op, flows, *route in events:
            where = {"pid": rank, "tid": tid.get(stream, len(tid)),
                     "ts": (start - origin) * 1e6}
            args = {"step": step, "microbatch": microbatch, "op": op}
            if route and route[0]:  # a run's collective that ran a recipe's steps
                args["route"] = route[0]
            trace.append({"ph": "X", "name": node, **where,
                          "dur": max((end - start) * 1e6, 0.01), "args": args})
            for phase, sender, receiver, name, at_end in flows:
                flow = {"ph": phase, "id": _flow_id(sender, receiver, name, microbatch, step),
                        "name": "ring" if op is Opcode.COMPUTE else "send",
                        "cat": "cp" if op is Opcode.COMPUTE else "pp", **where}
                if phase == "f":
                    flow["bp"] = "e"
                if at_end:
                    flow["ts"] = (end - origin) * 1e6
                trace.append(flow)
    write_atomically(path, json.dumps({"otherData": {"generator": generator},
                                       "traceEvents": trace,
                                       "displayTimeUnit": "ms"}).encode())
