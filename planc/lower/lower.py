"""Graph to rank programs: one program per pipeline stage, shared by its ranks.

Streams. Compute runs on ``compute``. Collectives run on ``comm`` when the plan asks
for overlap (``optimize { overlap = on }``) and on ``compute`` otherwise. Pipeline
transfers get a stream per direction (``send_next``, ``send_prev``, ``recv_prev``,
``recv_next``), so that each stream talks to one peer stream in first-in first-out
order and a transfer in one direction never waits behind one in the other: Megatron
pairs its pipeline sends and receives for the same reason. Receives are queued in the
order the sending stage sends, ahead of their use.

Events. Wherever a value crosses streams, the producer's stream records ``done:NODE``
after the producer and the consumer's stream waits for it right before the consumer
(semantics.md section 4). The epilogue starts with a ``sync`` on each of its streams
(every stream drained), so once-per-step work sees every microbatch's results.
"""

from __future__ import annotations

import heapq

import networkx as nx

from planc.lower.program import Instruction, Program, RankTable
from planc.plan import Plan

COMPUTE, COMM = "compute", "comm"
SEND = {"forward": "send_next", "backward": "send_prev"}
RECEIVE = {"forward": "recv_prev", "backward": "recv_next"}
STREAM_ORDER = ("compute", "comm", "send_next", "send_prev", "recv_prev", "recv_next")


def _stream(data: dict, overlap: bool) -> str:
    if data["type"] == "compute":
        return COMPUTE
    if data["axis"] == "pp":
        return SEND[data["phase"]] if data["kind"] == "send" else RECEIVE[data["phase"]]
    return COMM if overlap else COMPUTE


def _ordered(graph: nx.DiGraph, nodes: set[str], rank: dict[str, int]) -> list[str]:
    """Topological order of ``nodes`` (edges among them), ties by graph order."""
    indegree = {n: 0 for n in nodes}
    for n in nodes:
        for m in graph.successors(n):
            if m in nodes:
                indegree[m] += 1
    ready = [(rank[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in graph.successors(n):
            if m in nodes:
                indegree[m] -= 1
                if indegree[m] == 0:
                    heapq.heappush(ready, (rank[m], m))
    assert len(order) == len(nodes), "the graph has a cycle"
    return order


class _StageLowering:
    def __init__(self, plan: Plan, graph: nx.DiGraph, stage: int, rank: dict[str, int]):
        self.plan, self.graph, self.stage, self.rank = plan, graph, stage, rank
        self.overlap = plan.optimize.overlap
        self.streams: dict[str, str] = {}

    def stream_of(self, node: str) -> str:
        if node not in self.streams:
            self.streams[node] = _stream(self.graph.nodes[node], self.overlap)
        return self.streams[node]

    def _is_ring_recv(self, node: str) -> bool:
        data = self.graph.nodes[node]
        return data["type"] == "transfer" and data["axis"] == "cp" and data["kind"] == "recv"

    def _is_ring_send(self, node: str) -> bool:
        data = self.graph.nodes[node]
        return data["type"] == "transfer" and data["axis"] == "cp" and data["kind"] == "send"

    def instructions(self, nodes: list[str]) -> list[Instruction]:
        """Instructions for ``nodes`` in order, with the events that cross streams."""
        out: list[Instruction] = []
        recorded: set[str] = set()
        waited: dict[str, set[str]] = {}  # stream -> events it already waited for
        needed = self._recorded_events(nodes)
        for node in nodes:
            data = self.graph.nodes[node]
            if self._is_ring_send(node):
                continue  # issued together with its receive as one ring shift
            stream = self.stream_of(node)
            sources = self._sources(node)
            for source in sources:
                if self._crosses(source, node) and source not in waited.setdefault(stream,
                                                                                    set()):
                    waited[stream].add(source)  # later instructions of the stream follow
                    out.append(Instruction("wait", stream, event=f"done:{source}",
                                           per_microbatch=self._per_microbatch(source)))
            op = "compute" if data["type"] == "compute" else data["kind"]
            if self._is_ring_recv(node):
                op = "sendrecv"
            out.append(Instruction(op, stream, node, reads=tuple(sources), writes=(node,),
                                   per_microbatch=data["per_microbatch"]))
            if node in needed and node not in recorded:
                out.append(Instruction("record", stream, event=f"done:{node}",
                                       per_microbatch=data["per_microbatch"]))
                recorded.add(node)
        return out

    def _per_microbatch(self, node: str) -> bool:
        return self.graph.nodes[node]["per_microbatch"]

    def _sources(self, node: str) -> list[str]:
        """The nodes whose buffers ``node`` reads (a ring receive reads what its send
        sends)."""
        if self._is_ring_recv(node):
            (send,) = [p for p in self.graph.predecessors(node) if self._is_ring_send(p)]
            return sorted(self.graph.predecessors(send), key=self.rank.__getitem__)
        return sorted(self.graph.predecessors(node), key=self.rank.__getitem__)

    def _crosses(self, source: str, consumer: str) -> bool:
        """Whether ``consumer`` reading ``source`` needs an event: ``source`` runs on
        another stream of this stage in the same part of the step (once-per-step work
        reads per-microbatch results behind the epilogue's sync)."""
        data = self.graph.nodes[source]
        if data["stage"] != self.stage:
            return False  # a pipeline peer's node: reached through a receive
        if data["per_microbatch"] and not self.graph.nodes[consumer]["per_microbatch"]:
            return False
        target = consumer
        if self._is_ring_send(consumer):
            target = next(c for c in self.graph.successors(consumer) if self._is_ring_recv(c))
        return self.stream_of(source) != self.stream_of(target)

    def _recorded_events(self, nodes: list[str]) -> set[str]:
        """Nodes of this list that another stream reads (they record ``done:NODE``)."""
        needed = set()
        for node in nodes:
            if self._is_ring_send(node):
                continue
            for consumer in self.graph.successors(node):
                if self.graph.nodes[consumer]["stage"] == self.stage and \
                        self._crosses(node, consumer):
                    needed.add(node)
        return needed


def lower(plan: Plan, graph: nx.DiGraph) -> tuple[dict[str, Program], RankTable]:
    """One program per pipeline stage, and the table of which rank runs which."""
    rank = {node: i for i, node in enumerate(graph.nodes)}
    from planc.graph.schedules import schedule
    from planc.layout import Layout

    pp, virtual = plan.mesh.pp, plan.shard.pp.virtual
    m = plan.schedule.microbatches
    programs: dict[str, Program] = {}
    by_stage: dict[int, list[str]] = {s: [] for s in range(pp)}
    for node, data in graph.nodes(data=True):
        by_stage[data["stage"]].append(node)
    # The order in which each stage sends to each neighbour: its schedule.
    actions = {s: schedule(plan.schedule.pipeline, s, pp, m, virtual) for s in range(pp)}
    for stage in range(pp):
        lowering = _StageLowering(plan, graph, stage, rank)
        blocks_nodes: dict[str, set[str]] = {}
        epilogue_nodes: set[str] = set()
        receive_nodes: dict[str, str] = {}  # recv node -> stream
        for node in by_stage[stage]:
            data = graph.nodes[node]
            if data["type"] == "transfer" and data["axis"] == "pp" and data["kind"] == "recv":
                receive_nodes[node] = lowering.stream_of(node)
            elif data["per_microbatch"]:
                letter = "F" if data["phase"] == "forward" else "B"
                blocks_nodes.setdefault(f"{letter}{data['chunk']}", set()).add(node)
            else:
                epilogue_nodes.add(node)
        blocks = {name: tuple(lowering.instructions(_ordered(graph, nodes, rank)))
                  for name, nodes in sorted(blocks_nodes.items())}
        epilogue_body = lowering.instructions(_ordered(graph, epilogue_nodes, rank))
        # Every stream of the epilogue starts once every stream has drained the blocks.
        epilogue_streams = [st for st in STREAM_ORDER
                            if st == COMPUTE or any(i.stream == st for i in epilogue_body)]
        epilogue = tuple(Instruction("sync", st, per_microbatch=False)
                         for st in epilogue_streams) + tuple(epilogue_body)
        plan_schedule = tuple((f"{kind}{chunk}", mb) for kind, mb, chunk in actions[stage])
        receives = _receive_order(graph, receive_nodes, actions, pp)
        streams = tuple(s for s in STREAM_ORDER if s in set(lowering.streams.values())
                        or s in receives or s == COMPUTE)
        programs[f"stage{stage}.json"] = Program(stage, streams, blocks, plan_schedule,
                                                 receives, epilogue, m)
    table = RankTable(plan.world, pp, Layout.of(plan).strides["pp"],
                      {f"stage{s}.json": s for s in range(pp)})
    return programs, table


def _receive_order(graph: nx.DiGraph, receive_nodes: dict[str, str],
                   actions: dict[int, list], pp: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each receive stream in the order its peer sends: the peer's schedule."""
    sender_of: dict[str, tuple[int, str, int]] = {}  # recv -> (peer stage, phase, chunk)
    for node in receive_nodes:
        data = graph.nodes[node]
        (send,) = list(graph.predecessors(node))
        sender_of[node] = (data["peer_stage"], data["phase"], graph.nodes[send]["chunk"])
    streams: dict[str, list[tuple[str, int]]] = {s: [] for s in receive_nodes.values()}
    for stream in streams:
        mine = {(sender_of[n][0], sender_of[n][1][0].upper(), sender_of[n][2]): n
                for n, s in receive_nodes.items() if s == stream}
        peers = {key[0] for key in mine}
        for peer in sorted(peers):
            for kind, mb, chunk in actions[peer]:
                node = mine.get((peer, kind, chunk))
                if node is not None:
                    streams[stream].append((node, mb))
    return {stream: tuple(items) for stream, items in streams.items()}
