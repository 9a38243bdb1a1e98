"""A simulated step as a Chrome trace (Perfetto), with the tracks of ``planc run --trace``:
a process per representative rank (the first rank of each stage), a thread per stream,
and send-to-receive flow arrows, so that a measured and a simulated run of one build open
side by side."""

from __future__ import annotations

from planc.layout import Layout
from planc.runtime.trace import flows_of
from planc.runtime.trace import write as write_events


def rank_label(layout: Layout, rank: int) -> str:
    coords = layout.coords(rank)
    return (f"rank {rank} (stage {coords['pp']}, tp {coords['tp']}, cp {coords['cp']}, "
            f"dp {coords['dp']})")


def _flows(graph, layout: Layout, rank: int, node: str, op: str) -> tuple:
    """The flow ends of a simulated transfer, found from the graph and the mesh."""
    data = graph.nodes[node] if node in graph else {}
    if op in ("send", "recv") and data.get("axis") == "pp":
        peer = layout.rank({**layout.coords(rank), "pp": data["peer_stage"]})
        partner = next(iter(graph.successors(node)), None) if op == "send" else None
        return flows_of(op, node, rank, peer, partner)
    if op == "sendrecv":
        members = layout.group(rank, "cp")
        return flows_of(op, node, rank, None, None, members, members.index(rank))
    return ()


def write(path: str, build, result) -> None:
    layout = Layout.of(build.plan)
    graph = build.graph
    events: dict[int, list[tuple]] = {}
    sends: dict[tuple[str, int], float] = {}
    for time in result.timeline:
        rank = layout.rank({"tp": 0, "cp": 0, "pp": time.stage, "dp": 0})
        out = events.setdefault(rank, [])
        parts = [("prologue", None, 0.0, time.prologue)]
        parts += [(block, mb, start, replayed) for block, mb, start, replayed in time.blocks]
        if time.epilogue is not None:
            parts.append(("epilogue", None, time.epilogue[0], time.epilogue[1]))
        for _, microbatch, start, replayed in parts:
            if replayed is None:
                continue
            for span in replayed.spans:
                out.append((0, span.stream, span.node, start + span.start, start + span.end,
                            microbatch, span.op, _flows(graph, layout, rank, span.node,
                                                        span.op)))
                if span.op == "send":
                    sends[(span.node, microbatch)] = start + span.start
            for event in replayed.external:  # a pipeline receive, drawn until it is used
                node = event.partition(":")[2]
                if node in graph and graph.nodes[node].get("kind") == "recv":
                    sender = next(iter(graph.predecessors(node)), None)
                    begin = sends.get((sender, microbatch), start)
                    stream = "recv_prev" if graph.nodes[node]["phase"] == "forward" \
                        else "recv_next"
                    out.append((0, stream, node, min(begin, start), start, microbatch,
                                "recv", _flows(graph, layout, rank, node, "recv")))
    write_events(path, {rank: rank_label(layout, rank) for rank in events}, events)
