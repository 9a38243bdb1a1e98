"""Graph to rank programs: one program per pipeline stage, shared by its ranks.

The lowering decides nothing about speed: it follows the ``stream`` and ``placement``
the overlap pass wrote on each node (:mod:`planc.passes.overlap`; without them every
collective runs on ``compute`` and once-per-step work after the last block).

- Per-microbatch nodes go into the block of their chunk and phase; pipeline receives
  into their receive stream, in the order the sending stage sends (its schedule).
- Once-per-step nodes go where their placement says: into the block (guarded to run on
  the last microbatch), the prologue or the epilogue.
- Wherever a value (or an order edge) crosses streams, the producer's stream records
  ``done:NODE`` after the producer and the consumer's stream waits for it right before
  the consumer (docs/semantics.md, overlap). A once-per-step consumer outside the
  blocks waits for the record its producer makes on the last microbatch.
- Without overlap, the epilogue starts with a ``sync`` of its streams, so once-per-step
  work sees every microbatch's results.
- A per-microbatch buffer that only per-microbatch work reads is freed after its last
  reader (the forward block for activations, or the backward block of the same chunk):
  planc.lower.block_buffers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import networkx as nx

from planc.graph.ir import (EdgeKind, Kind, NodeType, Op, Payload, Phase, buckets,
                            is_pipeline_receive)
from planc.lower.bind import Binding
from planc.lower.block_buffers import close_state, with_frees
from planc.lower.evaluation import evaluation_of, forward_only
from planc.lower.paired import overlapped_blocks
from planc.program.names import STREAM_ORDER
from planc.program.program import (
    STATE,
    Guard,
    Instruction,
    Opcode,
    Program,
    RankTable,
    done_event,
    saved_for_weights,
)
from planc.program.ranks import AXES
from planc.passes.overlap import COMPUTE, stream_of
from planc.plan.plan import Plan
from planc import schedules
from planc.schedules import Action, ActionKind, Block

PROLOGUE, EPILOGUE = "prologue", "epilogue"


def _kind_of(phase: Phase, split: bool = False) -> ActionKind:
    """The block a node of ``phase`` runs in: the forward's, or else the backward's (which
    also holds what runs once, after the chunk's last backward); under a schedule that
    splits the backward, the backward's is its input-gradient block."""
    if phase == Phase.FORWARD:
        return ActionKind.FORWARD
    return ActionKind.BACKWARD_INPUT if split else ActionKind.BACKWARD


def _in_weight_block(data: dict) -> bool:
    """Under a schedule that splits the backward: a weight-gradient step, and what moves
    the gradients it makes (ZeRO's per-microbatch reductions, the once-per-step bucket
    reductions, guarded to the chunk's last W), go to the chunk's ``W`` block."""
    return data.get("weight_grad_of") is not None or \
        data["type"] == NodeType.TRANSFER and data["payload"] == Payload.GRAD


def gradient_buffers(bucket: str, info: dict) -> tuple[str, ...]:
    """The state buffers of a bucket's gradient, as instructions name them: the leading
    range of partial sums over tp (``:sum``) and the rest are disjoint, so a tp sum may
    run while backward steps still add into the rest."""
    if not info.get("tp_sum_numel") or info["tp_sum_numel"] == info["numel"]:
        return (f"{STATE}grad:{bucket}",)
    return (f"{STATE}grad:{bucket}:sum", f"{STATE}grad:{bucket}:rest")


def accumulated_into(buckets: dict[str, dict]) -> dict[str, str]:
    """Each parameter of ``buckets`` -> the gradient buffer its backward steps add into:
    the tp sum's leading range or the rest (:func:`gradient_buffers`)."""
    owner = {}
    for bucket, info in buckets.items():
        names = gradient_buffers(bucket, info)
        for member in info.get("members", ()):  # (a build's, read back: the verifier)
            summed = member["offset"] < info.get("tp_sum_numel", 0)
            owner[member["param"]] = names[0] if summed else names[-1]
    return owner


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


def _issue_rank(lowering: "_StageLowering", rank: dict[str, int], nodes: set[str]) -> dict:
    """The prologue's ZeRO-1/2 gathers in the order the forward first reads their buckets
    (Megatron-LM's ``overlap_param_gather`` dispatches the bucket the next layer needs
    first): the buckets fill in backward order, so graph order would gather the
    embedding's bucket last and hold the first forward step until every gather is done.
    Keys of ``nodes`` alone: a stage's part, not the whole graph, or lowering a thousand
    stages would be quadratic."""
    first = {gather: min(rank[u] for u in users)
             for gather, users in lowering.first_users.items()}
    return {n: (first.get(n, len(rank)), rank[n]) for n in nodes}


def _regathers_first(graph: nx.DiGraph, rank: dict[str, int], nodes: set[str]) -> dict:
    """A block's order: the graph's, except that an input gathered again for a backward
    (gathered_inputs = regather) is issued as soon as its order edges allow, a step
    ahead of the step that reads it (planc.graph.axes.AxisRules.regather), so that it
    travels while that step's predecessor computes rather than after it. Keys of
    ``nodes`` alone (:func:`_issue_rank`'s reason)."""
    return {n: (0 if "regathers" in graph.nodes[n] else 1, rank[n]) for n in nodes}


@dataclass(frozen=True)
class _Where:
    part: str  # a block name, "prologue", "epilogue" or a receive stream
    stream: str
    per_microbatch: bool
    guarded: bool  # a once-per-step node inside a block


class _StageLowering:
    def __init__(self, plan: Plan, graph: nx.DiGraph, stage: int, binding: Binding,
                 nodes: list[str], buckets: dict[str, dict], overlap: bool):
        """``nodes`` and ``buckets``: the stage's; ``overlap``: whether the overlap pass
        placed the graph's nodes (computed once for all stages: lowering stays linear)."""
        self.plan, self.graph, self.stage = plan, graph, stage
        self.binding, self.rank = binding, binding.position
        self.buckets = buckets
        self._sources: dict[str, list[tuple[str, bool]]] = {}
        self.overlap = overlap
        self.split = schedules.named(plan.schedule.pipeline).splits_backward
        self.where: dict[str, _Where] = {}
        self.buffer_of: dict[str, str] | None = None  # parameter -> its gradient buffer
        mine = [(n, graph.nodes[n]) for n in nodes]
        # ZeRO-1/2 gathers issued at the start of the step: the forward steps reading
        # one of their bucket's parameters wait for them (across the step boundary, so
        # the graph has no edge for it).
        self.gathered_first: dict[str, str] = {}
        for node, data in mine:
            if data.get("placement") == PROLOGUE and self.overlap:
                for member in graph.graph["buckets"][data["bucket"]]["members"]:
                    self.gathered_first[member["param"]] = node
        self.first_users: dict[str, list[str]] = {}  # such a gather -> the steps waiting
        if self.gathered_first:
            for node, data in mine:
                if data["type"] == NodeType.COMPUTE and data["phase"] == Phase.FORWARD:
                    for gather in {self.gathered_first[p] for p in data["params"]
                                   if p in self.gathered_first}:
                        self.first_users.setdefault(gather, []).append(node)

    def _gathers_for_weight_step(self, node: str, data: dict) -> bool:
        """An input gathered again for a weight step (gathered_inputs = regather) runs
        in the W block with the step that reads it (planc.passes.split_backward)."""
        return "regathers" in data and any(
            self.graph.nodes[v].get("weight_grad_of") is not None
            for v in self.graph.successors(node))

    def place(self, node: str) -> _Where:
        data = self.graph.nodes[node]
        stream = data.get("stream") or stream_of(data, self.plan.optimize.overlap)
        if is_pipeline_receive(data):
            return _Where(stream, stream, True, False)
        kind = ActionKind.BACKWARD_WEIGHT if self.split and (
            _in_weight_block(data) or self._gathers_for_weight_step(node, data)) else \
            _kind_of(data["phase"], self.split)
        block = Block(kind, data["chunk"]).name
        if data["per_microbatch"]:
            return _Where(block, stream, True, False)
        placement = data.get("placement", EPILOGUE) if self.overlap else EPILOGUE
        if placement == "block":
            return _Where(block, stream, False, True)
        return _Where(placement, stream, False, False)

    def state_buffers(self, node: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(reads, writes) of the bucket gradient buffers: backward steps accumulate into
        the buckets of the parameters they use, reductions read and rewrite theirs, the
        optimizer reads its own."""
        data = self.graph.nodes[node]
        table = self.graph.graph["buckets"]
        if data["type"] == NodeType.COMPUTE:
            if data["op"] == Op.OPTIMIZER:
                return gradient_buffers(data["bucket"], table[data["bucket"]]), ()
            if data["op"] in (Op.GRAD_NORM, Op.GRAD_CLIP):  # every gradient of the stage
                held = tuple(n for b, info in sorted(self.buckets.items())
                             for n in gradient_buffers(b, info))
                return held, held if data["op"] == Op.GRAD_CLIP else ()
            if data["phase"] == Phase.BACKWARD and not data["recompute"] and \
                    "weight_grad" not in data:  # a split step leaves them to its W step
                owner = self.buffer_of
                if owner is None:
                    owner = self.buffer_of = accumulated_into(self.buckets)
                return (), tuple(sorted({owner[p] for p in data["params"] if p in owner}))
            return (), ()
        if data["payload"] == Payload.GRAD:
            names = gradient_buffers(data["bucket"], table[data["bucket"]])
            touched = names[:1] if "elements" in data else names  # a tp sum: its range
            return touched, touched
        return (), ()

    def sources(self, node: str) -> list[tuple[str, bool]]:
        """(node, carries data) of everything ``node`` depends on. Found once per node
        (waits and instructions both ask)."""
        if node not in self._sources:
            self._sources[node] = self._find_sources(node)
        return self._sources[node]

    def _find_sources(self, node: str) -> list[tuple[str, bool]]:
        data = self.graph.nodes[node]
        # Gradients and parameters move through the buckets' buffers, not the producers'.
        through_state = data["type"] == NodeType.COMPUTE and data["op"] == Op.OPTIMIZER or \
            data["type"] == NodeType.TRANSFER and data["payload"] in (Payload.GRAD,
                                                                     Payload.PARAM)
        out = [(u, d.get("kind") != EdgeKind.ORDER and not through_state
                and keeps_for(self.graph, u, node, d)) for u, _, d in
               self.graph.in_edges(node, data=True)]
        if self.gathered_first and data["type"] == NodeType.COMPUTE and \
                data["phase"] == Phase.FORWARD:
            out += [(g, False) for g in {self.gathered_first[p] for p in data["params"]
                                         if p in self.gathered_first}]
        return sorted(out, key=lambda item: self.rank[item[0]])

    def needs_event(self, source: str, consumer: str) -> str | None:
        """How ``consumer`` must wait for ``source``: None (same stream, another stage,
        or across the step boundary), "mb" (the same microbatch's record) or "step" (the
        record the source makes once per step)."""
        have, want = self.where.get(source), self.where[consumer]
        if have is None:
            return None  # a pipeline peer's node: reached through a receive
        if have.part == EPILOGUE and want.part == PROLOGUE:
            return None  # the next step's prologue: every stream drained in between
        if want.part == EPILOGUE and have.part != EPILOGUE and not self.overlap:
            return None  # behind the epilogue's sync
        if have.stream == want.stream:
            return None  # one stream runs in issue order
        if have.per_microbatch and (want.per_microbatch or want.guarded):
            return "mb"
        return "step"


def _waits(lowering: _StageLowering, parts: dict[str, list[str]]
           ) -> dict[str, list[tuple[str, str]]]:
    """The events each node waits for, as (source, "mb" or "step"). Of several sources on
    one stream in one part, only the latest is waited for: that stream ran the others
    before it."""
    position = {n: (part, i) for part, nodes in parts.items() for i, n in enumerate(nodes)}
    out: dict[str, list[tuple[str, str]]] = {}
    for nodes in parts.values():
        for node in nodes:
            latest: dict[tuple, tuple[int, str]] = {}
            for source, _ in lowering.sources(node):
                how = lowering.needs_event(source, node)
                if how is None:
                    continue
                part, index = position.get(source, (None, -1))
                key = (lowering.where[source].stream, how, part)
                if key not in latest or latest[key][0] < index:
                    latest[key] = (index, source)
            out[node] = sorted(((source, how) for (_, how, _), (_, source) in latest.items()),
                               key=lambda item: lowering.rank[item[0]])
    return out


def keeps_for(graph: nx.DiGraph, source: str, node: str, edge: dict) -> bool:
    """Whether the edge ``source`` -> ``node`` hands over anything: not the SAVED edge from
    a forward whose step is recomputed to its backward, which differentiates the
    recomputation (``recompute_of``) and takes nothing the forward kept; that forward
    so keeps only what its recomputation reads from it (the layer's input), as full
    recomputation means (Chen et al. 2016; Korthikanti et al. 2022, section 4)."""
    if edge.get("kind") != EdgeKind.SAVED:
        return True
    data = graph.nodes[node]
    return data.get("recompute_of") in (None, source) or source != data.get("forward_of")


def _instructions(lowering: _StageLowering, nodes: list[str],
                  waits: dict[str, list[tuple[str, str]]], recorded: set[tuple[str, str]]
                  ) -> list[Instruction]:
    """Instructions for ``nodes`` in order: each with its waits before it and the records
    others wait for after it."""
    graph = lowering.graph
    out: list[Instruction] = []
    waited: set[tuple[str, str, str]] = set()
    for node in nodes:
        where = lowering.where[node]
        data = graph.nodes[node]
        guard = Guard.LAST if where.guarded else None
        for source, how in waits.get(node, ()):
            if (where.stream, source, how) in waited:
                continue  # later instructions of the stream follow the first wait
            waited.add((where.stream, source, how))
            out.append(Instruction(Opcode.WAIT, where.stream, event=done_event(source),
                                   per_microbatch=how == "mb", guard=guard))
        op = Opcode.COMPUTE if data["type"] == NodeType.COMPUTE else Opcode(data["kind"].value)
        # What a step kept for a later one (its backward, recomputation or W step) is a
        # buffer apart from its value: the value is freed once the steps reading it have
        # run (the logits, once the loss has read them), what it kept once its backward
        # has (planc.lower.block_buffers.with_frees).
        kept_from = {u for u, _, d in graph.in_edges(node, data=True)
                     if d.get("kind") == EdgeKind.SAVED}
        reads = tuple(saved_for_weights(source) if source in kept_from else source
                      for source, carries in lowering.sources(node) if carries)
        state_reads, state_writes = lowering.state_buffers(node)
        saved = (saved_for_weights(node),) if any(
            d.get("kind") == EdgeKind.SAVED and keeps_for(graph, node, v, d)
            for _, v, d in graph.out_edges(node, data=True)) else ()
        out.append(Instruction(op, where.stream, node, reads=reads + state_reads,
                               writes=(node,) + saved + state_writes,
                               per_microbatch=data["per_microbatch"], guard=guard,
                               operands=lowering.binding.operands(node, op)))
        if (node, "mb") in recorded:
            out.append(Instruction(Opcode.RECORD, where.stream, event=done_event(node),
                                   per_microbatch=True, guard=guard))
        if (node, "step") in recorded:  # once, on the last microbatch of a block
            out.append(Instruction(Opcode.RECORD, where.stream, event=done_event(node),
                                   per_microbatch=False,
                                   guard=Guard.LAST if where.per_microbatch or guard else None))
    return out


def lower(plan: Plan, graph: nx.DiGraph, binding: Binding | None = None
          ) -> tuple[dict[str, Program], RankTable]:
    """One program per pipeline stage, and the table of which rank runs which;
    ``binding``: the graph's operands, shared with the compiler's verifier."""
    from planc.plan.layout import Layout

    binding = binding or Binding(graph)
    rank = binding.position
    pp, virtual = plan.mesh.pp, plan.shard.pp.virtual
    m = plan.schedule.microbatches
    programs: dict[str, Program] = {}
    by_stage: dict[int, list[str]] = {s: [] for s in range(pp)}
    for node, data in graph.nodes(data=True):
        by_stage[data["stage"]].append(node)
    # The order in which each stage sends to each neighbour: its schedule.
    pipeline = schedules.named(plan.schedule.pipeline)
    actions = {s: pipeline.program_order(s, pp, m, virtual) for s in range(pp)}
    forward_actions = {s: forward_only(plan, s) for s in range(pp)} \
        if evaluation_of(plan) is not None else None
    table = buckets(graph)
    buckets_of: dict[int, dict] = {}
    for b, info in table.items():
        buckets_of.setdefault(info["stage"], {})[b] = info
    overlap = plan.optimize.overlap and any("placement" in d for _, d in graph.nodes(data=True))
    for stage in range(pp):
        stage_buckets = buckets_of.get(stage, {})
        lowering = _StageLowering(plan, graph, stage, binding, by_stage[stage], stage_buckets,
                                  overlap)
        parts: dict[str, set[str]] = {}
        receive_nodes: dict[str, str] = {}  # recv node -> stream
        for node in by_stage[stage]:
            where = lowering.place(node)
            lowering.where[node] = where
            if where.part == where.stream and where.part.startswith("recv_"):
                receive_nodes[node] = where.stream
            else:
                parts.setdefault(where.part, set()).add(node)
        ordered = {name: _ordered(graph, nodes, _issue_rank(lowering, rank, nodes)
                                  if name == PROLOGUE else _regathers_first(graph, rank, nodes))
                   for name, nodes in parts.items()}
        waits = _waits(lowering, ordered)
        recorded = {item for items in waits.values() for item in items}
        listed = {name: _instructions(lowering, nodes, waits, recorded)
                  for name, nodes in ordered.items()}
        for name in listed:
            if name not in (PROLOGUE, EPILOGUE):
                listed[name] = close_state(listed[name])
        blocks = with_frees({name: listed[name] for name in sorted(listed)
                              if name not in (PROLOGUE, EPILOGUE)}, graph,
                             listed.get(PROLOGUE, []) + listed.get(EPILOGUE, []))
        body = listed.get(EPILOGUE, [])
        if not lowering.overlap:
            # Every stream of the epilogue starts once every stream has drained the blocks.
            used = [st for st in STREAM_ORDER if st == COMPUTE or
                    any(i.stream == st for i in body)]
            body = [Instruction(Opcode.SYNC, st, per_microbatch=False) for st in used] + body
        plan_schedule = tuple((a.block.name, a.microbatch) for a in actions[stage])
        receives = _receive_order(graph, receive_nodes, actions, lowering.split)
        evaluation, evaluation_receives = (), {}
        if forward_actions is not None:
            evaluation = tuple((a.block.name, a.microbatch) for a in forward_actions[stage])
            evaluation_receives = {stream: items for stream, items in _receive_order(
                graph, receive_nodes, forward_actions, lowering.split).items() if items}
        used_streams = {w.stream for n, w in lowering.where.items()} | set(receives)
        streams = tuple(s for s in STREAM_ORDER if s in used_streams or s == COMPUTE)
        paired, paired_weights, weighted = overlapped_blocks(plan, pipeline, stage, blocks)
        programs[f"stage{stage}.json"] = Program(
            stage, streams, blocks, plan_schedule, receives, tuple(body), m,
            prologue=tuple(listed.get(PROLOGUE, ())), buckets=stage_buckets,
            received={node: binding.operands(node, Kind.RECV.value)
                      for node in receive_nodes},
            evaluation=evaluation, evaluation_receives=evaluation_receives,
            paired=paired, paired_weights=paired_weights, weighted=weighted)
    layout = Layout.of(plan)
    ranks = RankTable(plan.world, pp, layout.strides["pp"],
                      {f"stage{s}.json": s for s in range(pp)},
                      axes={axis: (layout.mesh.size(axis), layout.strides[axis])
                            for axis in AXES},
                      leader=layout.first_rank_of_stage(plan.head_stage))
    return programs, ranks


def _receive_order(graph: nx.DiGraph, receive_nodes: dict[str, str],
                   actions: dict[int, list[Action]], split: bool = False
                   ) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each receive stream in the order its peer sends: the peer's schedule."""
    sender_of: dict[str, tuple[int, Block]] = {}  # recv -> (peer stage, the sending block)
    for node in receive_nodes:
        data = graph.nodes[node]
        (send,) = list(graph.predecessors(node))
        sender_of[node] = (data["peer_stage"],
                           Block(_kind_of(data["phase"], split), graph.nodes[send]["chunk"]))
    streams: dict[str, list[tuple[str, int]]] = {s: [] for s in receive_nodes.values()}
    for stream in streams:
        mine = {sender_of[n]: n for n, s in receive_nodes.items() if s == stream}
        for peer in sorted({key[0] for key in mine}):
            for action in actions[peer]:
                node = mine.get((peer, action.block))
                if node is not None:
                    streams[stream].append((node, action.microbatch))
    return {stream: tuple(items) for stream, items in streams.items()}
