"""Chrome trace (Perfetto) of a run: a process per rank, a thread per program stream,
and a flow arrow from every pipeline send to its receive and from every ring shift to
the one it feeds on the next context-parallel rank."""

from __future__ import annotations

import json
import zlib

import networkx as nx

from planc.files import write_atomically
from planc.layout import Layout

STREAMS = ("compute", "comm", "dp", "send_next", "send_prev", "recv_prev", "recv_next")


def _flow_id(*parts) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def write(path: str, layout: Layout, graph: nx.DiGraph,
          events_by_rank: list[list[tuple]] | dict[int, list[tuple]]) -> None:
    """``events_by_rank[r]``: (step, stream, node, start, end, microbatch, op) of rank r
    (a list of every rank's, or a dict of some ranks'); times in seconds of one clock
    shared by the ranks (CLOCK_MONOTONIC on one machine, or the simulator's)."""
    by_rank = events_by_rank if isinstance(events_by_rank, dict) else \
        dict(enumerate(events_by_rank))
    origin = min((e[3] for events in by_rank.values() for e in events), default=0.0)
    trace: list[dict] = []
    tid = {stream: i for i, stream in enumerate(STREAMS)}
    for rank, events in sorted(by_rank.items()):
        coords = layout.coords(rank)
        trace.append({"ph": "M", "name": "process_name", "pid": rank,
                      "args": {"name": f"rank {rank} (stage {coords['pp']}, tp {coords['tp']}, "
                                       f"cp {coords['cp']}, dp {coords['dp']})"}})
        for stream, i in tid.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i,
                          "args": {"name": stream}})
        for step, stream, node, start, end, microbatch, op in events:
            where = {"pid": rank, "tid": tid.get(stream, len(tid)),
                     "ts": (start - origin) * 1e6}
            trace.append({"ph": "X", "name": node, **where,
                          "dur": max((end - start) * 1e6, 0.01),
                          "args": {"step": step, "microbatch": microbatch, "op": op}})
            trace.extend(_flows(graph, layout, rank, coords, step, node, microbatch, op,
                                where, (end - origin) * 1e6))
    write_atomically(path, json.dumps({"traceEvents": trace,
                                       "displayTimeUnit": "ms"}).encode())


def _flows(graph, layout, rank, coords, step, node, microbatch, op, where, end) -> list:
    """Flow events: a start on the sender's slice, a finish on the receiver's."""
    data = graph.nodes[node]
    out = []
    if op == "send":
        peer = layout.rank({**coords, "pp": data["peer_stage"]})
        receive = next(iter(graph.successors(node)))
        out.append({"ph": "s", "id": _flow_id(rank, peer, receive, microbatch, step),
                    "name": "send", "cat": "pp", **where})
    elif op == "recv" and data["axis"] == "pp":
        peer = layout.rank({**coords, "pp": data["peer_stage"]})
        out.append({"ph": "f", "bp": "e", "id": _flow_id(peer, rank, node, microbatch, step),
                    "name": "send", "cat": "pp", **where})
    elif op == "sendrecv":
        cp = layout.mesh.cp
        after = layout.rank({**coords, "cp": (coords["cp"] + 1) % cp})
        before = layout.rank({**coords, "cp": (coords["cp"] - 1) % cp})
        out.append({"ph": "s", "id": _flow_id(rank, after, node, microbatch, step),
                    "name": "ring", "cat": "cp", **where})
        out.append({"ph": "f", "bp": "e", "id": _flow_id(before, rank, node, microbatch, step),
                    "name": "ring", "cat": "cp", **{**where, "ts": end}})
    return out
