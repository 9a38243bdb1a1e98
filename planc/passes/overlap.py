"""overlap: put communication on its own streams and issue it as early as it can go.

Decisions, each an attribute the lowering follows (:mod:`planc.lower.lower`):

- ``stream``: compute on ``compute``; tp, cp and loss collectives on ``comm``; dp x cp
  and tied-embedding collectives on ``dp``, so that a large gradient bucket never
  holds up an activation collective queued behind it (each group is still used by a
  single stream, so its members issue its collectives in the same order); pipeline
  transfers on a stream per direction. With ``overlap = off`` every collective runs
  on ``compute`` and blocks it.
- ``placement``: where once-per-step work goes. A bucket's gradient reduction is
  issued inside the backward block of its chunk, guarded to run on the last
  microbatch only, right after the last backward step that writes one of its members
  (PyTorch DDP, Megatron-LM ``overlap_grad_reduce``); the step's loss report likewise
  after the last forward. The tied embedding's all-reduce stays in the epilogue, after
  the pipeline has drained, as Megatron-LM's ``finalize_model_grads`` runs it: its group
  joins two stages, and issued inside a block it would hold the dp stream (and the
  ZeRO-3 gathers queued behind it) until the other stage finished its own backward,
  which may wait for this one. The optimizer steps stay in the epilogue, each waiting only
  for its own bucket. ZeRO-1/2 parameter all-gathers move to the prologue of the next
  step, and each forward step waits only for the bucket it reads (Megatron-LM
  ``overlap_param_gather``); the lowering adds those waits, since an edge from this
  step's gather to the next step's forward would close a cycle in the step's graph.
- ZeRO-3 prefetch: within a block, the gather of the next unit is issued while the
  current unit computes, and the gather of unit k + 2 waits until unit k is done, so
  at most two units are gathered at once (FSDP's forward and backward prefetch); in a
  backward block the next unit's gather comes before the current unit's gradient
  reduction on the dp stream, as FSDP2 orders its backward prefetch.
- Split backward (``optimize { weight_grad_overlap }``, on by default): a backward step
  whose input gradient feeds a collective computes that gradient first; its weight
  gradient becomes a step of its own (``W/...``) that runs while the collective is in
  flight, before the step that waits for it (Megatron-LM's asynchronous tensor-parallel
  all-reduce overlaps it with the weight gradient the same way; zero-bubble pipelines
  split B and W likewise).

Waits are placed by the lowering right before the consumer that needs them, so each
is as late as its consumer allows. Results do not change.
"""

from __future__ import annotations

from collections import defaultdict

import networkx as nx

from planc.graph.ir import Axis, EdgeKind, Kind, NodeType, Op, Payload, Phase
from planc.program.names import Stream
from planc.passes.context import PassContext, PassRecord, record
from planc.passes.fuse import kept_for_backward
from planc.passes.split_backward import split_step, splittable

COMPUTE, COMM, DP = Stream.COMPUTE, Stream.COMM, Stream.DP
SEND = {Phase.FORWARD: Stream.SEND_NEXT, Phase.BACKWARD: Stream.SEND_PREV}
RECEIVE = {Phase.FORWARD: Stream.RECV_PREV, Phase.BACKWARD: Stream.RECV_NEXT}
PREFETCH_DEPTH = 2  # units gathered at once under ZeRO-3


def stream_of(data: dict, overlap: bool) -> str:
    if data["type"] == NodeType.COMPUTE:
        return COMPUTE
    if data["axis"] == Axis.PP:
        # The way the tensor travels picks the stream (a V's way back sends a forward
        # to the previous stage); a graph without it goes by phase.
        toward = data.get("toward") or ("next" if data["phase"] == Phase.FORWARD else "prev")
        ahead = Phase.FORWARD if toward == "next" else Phase.BACKWARD
        return SEND[ahead] if data["kind"] == Kind.SEND else RECEIVE[ahead]
    if not overlap:
        return COMPUTE
    if data["axis"] == Axis.EP:  # a mixture's dispatch and combine: a stream of their own
        return Stream.EP
    return DP if data["axis"] in (Axis.DP_CP, Axis.EDP, Axis.TIED) else COMM


def overlap(graph: nx.DiGraph, ctx: PassContext) -> nx.DiGraph:
    out = ctx.working_copy(graph)
    on = ctx.plan.optimize.overlap
    for _, data in out.nodes(data=True):
        data["stream"] = stream_of(data, on)
        if not data["per_microbatch"]:
            data["placement"] = "epilogue"
    if not on:
        _zero3_prefetch(out, depth=1)  # each unit gathered just before its first use
        return record(out, PassRecord(
            "overlap", False, "overlap: off (overlap = off): every collective runs on the "
            "compute stream, once-per-step work after the last microbatch"))
    guarded = prologue = 0
    for node, data in out.nodes(data=True):
        if data["per_microbatch"] or data["type"] == NodeType.COMPUTE:
            continue
        if data["payload"] in (Payload.GRAD, Payload.LOSS) and data["axis"] != Axis.TIED:
            data.update(placement="block", guard="last")
            guarded += data["payload"] == Payload.GRAD
        elif data["payload"] == Payload.PARAM and data["phase"] == Phase.OPTIMIZER:
            data["placement"] = "prologue"
            prologue += 1
    prefetched = _zero3_prefetch(out, PREFETCH_DEPTH)
    split = _split_weight_gradients(out) if ctx.plan.optimize.weight_grad_overlap else 0
    parts = [f"{guarded} once-per-step gradient reductions issued in the last "
             f"microbatch's backward as soon as their inputs are final"]
    if prologue:
        parts.append(f"{prologue} ZeRO parameter all-gathers moved to the start of the next "
                     f"step, each waited for by its first forward use")
    if prefetched:
        parts.append(f"{prefetched} ZeRO-3 all-gathers prefetched one unit ahead (at most "
                     f"{PREFETCH_DEPTH} units gathered at once)")
    if split:
        parts.append(f"{split} weight gradients computed while the collective of their "
                     f"input gradient is in flight")
    decisions = [{"node": n, "stream": d["stream"], "placement": d.get("placement", "block"),
                  "guard": d.get("guard")} for n, d in out.nodes(data=True)
                 if d["type"] == NodeType.TRANSFER and not d["per_microbatch"]]
    return record(out, PassRecord("overlap", True, "overlap: " + "; ".join(parts), [],
                                  decisions))


def unit_of(graph: nx.DiGraph, gather: str) -> str:
    """The FSDP unit a ZeRO-3 gather serves: the layer of the step reading it, or the
    embedding or the head (one unit may need several gathers, one per bucket)."""
    readers = [c for _, c, d in graph.out_edges(gather, data=True)
               if d["kind"] == EdgeKind.DATA]
    layers = {graph.nodes[c]["layer"] for c in readers}
    if layers != {None}:
        return f"layer {min(x for x in layers if x is not None)}"
    ops = {graph.nodes[c]["op"] for c in readers}
    return "embedding" if ops & {Op.EMBEDDING, Op.POSITION} else "head"


def _zero3_prefetch(graph: nx.DiGraph, depth: int) -> int:
    """Order each block's ZeRO-3 gathers by first use; the gathers of unit k + depth wait
    for the last step that reads unit k, so at most ``depth`` units are gathered at once."""
    blocks: dict[tuple, list[str]] = defaultdict(list)
    for node, data in graph.nodes(data=True):
        if data["type"] == NodeType.TRANSFER and data["payload"] == Payload.PARAM and \
                data["per_microbatch"]:
            blocks[(data["chunk"], data["phase"])].append(node)
    if not blocks:
        return 0
    reductions: dict[tuple, list[str]] = defaultdict(list)
    for node, data in graph.nodes(data=True):
        if data["type"] == NodeType.TRANSFER and data["payload"] == Payload.GRAD and \
                data.get("bucket") is not None:
            reductions[(data["chunk"], data["bucket"])].append(node)
    position = {n: i for i, n in enumerate(nx.lexicographical_topological_sort(
        graph, key={n: i for i, n in enumerate(graph.nodes)}.__getitem__))}
    # the units their forward gathers keep for the backward (the head's and the last
    # block's, under 1F1B): the backward's first units, with no gather in its block
    kept_units: dict[int, dict[str, list[str]]] = defaultdict(dict)
    for (chunk, phase), gathers in blocks.items():
        for g in gathers:
            if phase == Phase.FORWARD and kept_for_backward(graph, (g,)):
                kept_units[chunk].setdefault(unit_of(graph, g), []).append(g)

    def first_backward_read(unit: list[str]) -> int:
        return min(position[c] for g in unit for c in graph.successors(g)
                   if graph.nodes[c]["phase"] == Phase.BACKWARD)

    # the kept units (the head's, then the last block's) in the order the backward reads
    kept = {chunk: sorted(units.values(), key=first_backward_read)
            for chunk, units in kept_units.items()}
    count = 0
    for (chunk, phase), gathers in blocks.items():
        # its readers in this block (a kept unit's backward reads it in another)
        readers = {g: [c for _, c, d in graph.out_edges(g, data=True)
                       if d["kind"] == EdgeKind.DATA and graph.nodes[c]["phase"] == phase]
                   for g in gathers}
        gathers.sort(key=lambda g: min(position[c] for c in readers[g]))
        units: dict[str, list[str]] = {}
        for gather in gathers:
            units.setdefault(unit_of(graph, gather), []).append(gather)
        order = list(units.values())
        for k, gather in enumerate(gathers[1:], start=1):  # issued in order of first use
            graph.add_edge(gathers[k - 1], gather, kind=EdgeKind.ORDER)
        if phase == Phase.BACKWARD:  # the kept unit is whole first, and counts as one
            for unit in kept.get(chunk, []):
                readers.update({g: [c for _, c, d in graph.out_edges(g, data=True)
                                    if d["kind"] == EdgeKind.DATA and
                                    graph.nodes[c]["phase"] == Phase.BACKWARD]
                                for g in unit})
            order = kept.get(chunk, []) + order
        for k, unit in enumerate(order[depth:], start=depth):
            if graph.nodes[unit[0]]["phase"] != phase:
                continue  # kept from its forward: gathered there, long before
            last = max((c for g in order[k - depth] for c in readers[g]),
                       key=position.__getitem__)
            graph.add_edge(last, unit[0], kind=EdgeKind.ORDER)
        if depth > 1 and phase == Phase.BACKWARD:
            _gather_before_reduction(graph, order, reductions)
        count += len(gathers)
    return count


def _gather_before_reduction(graph: nx.DiGraph, order: list[list[str]],
                             reductions: dict[tuple, list[str]]) -> None:
    """In a backward block, the next unit's gather is issued before the reduction of the
    unit at hand's gradients, which waits for that unit's whole backward: on one dp
    stream the gather would queue behind it, and the next unit's backward would wait for
    both (FSDP2's backward prefetch issues the next all-gather before the current
    reduce-scatter). No cycle: the next gather waits only for the gathers before it and
    for the readers of the unit two back. ``order``: a backward block's units by first
    use; ``reductions``: the gradient transfers by (chunk, bucket)."""
    # the units the backward gathers itself: not those kept from their forward (the
    # head's, the last block's), gathered long before
    gathered = [k for k, unit in enumerate(order)
                if graph.nodes[unit[0]]["phase"] == Phase.BACKWARD]
    for k, unit in enumerate(order):
        following = next((order[j] for j in gathered if j > k), None)
        if following is None:
            break
        first = graph.nodes[unit[0]]
        for reduction in reductions.get((first["chunk"], first["bucket"]), ()):
            graph.add_edge(following[0], reduction, kind=EdgeKind.ORDER)


def _split_weight_gradients(graph: nx.DiGraph) -> int:
    """Split each backward step with parameters whose input gradient goes straight into a
    collective (per microbatch, same stage) into the input-gradient step and a weight-
    gradient step ordered before whatever waits for that collective."""
    chosen = []
    for node, data in graph.nodes(data=True):
        if not splittable(data):  # (split_backward split every one under zb schedules)
            continue
        collectives = [t for _, t, d in graph.out_edges(node, data=True)
                       if d["kind"] == EdgeKind.DATA and
                       graph.nodes[t]["type"] == NodeType.TRANSFER and
                       graph.nodes[t]["per_microbatch"] and
                       graph.nodes[t]["payload"] not in (Payload.GRAD, Payload.PARAM) and
                       graph.nodes[t]["kind"].is_collective]
        if collectives:
            chosen.append((node, collectives))
    for node, collectives in chosen:
        weight = split_step(graph, node)
        stage = graph.nodes[node]["stage"]
        for collective in collectives:
            for _, consumer in graph.out_edges(collective):
                if graph.nodes[consumer]["type"] == NodeType.COMPUTE and \
                        graph.nodes[consumer]["stage"] == stage:
                    graph.add_edge(weight, consumer, kind=EdgeKind.ORDER)
    return len(chosen)
