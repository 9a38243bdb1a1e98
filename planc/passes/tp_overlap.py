"""tp_overlap: collective matmul, the tp collectives of a layer's GEMMs split into chunks.

Wang et al., "Overlap Communication with Dependent Computation via Decomposition in
Large Deep Learning Models" (ASPLOS 2023); Megatron-LM's ``--tp-comm-overlap``
(TransformerEngine's split pipelined all-gather and reduce-scatter overlap);
torchtitan's async TP (``torch._inductor``'s ``micro_pipeline_tp``).

A linear of a layer (qkv, proj, fc1, fc2) whose input or output, forward or backward,
goes through a collective over tp is cut along the tokens into ``k`` pieces:

- the all-gather before a column-parallel GEMM (sequence parallelism) becomes ``k``
  all-gathers of a ``1/k`` slice of each rank's tokens, and the GEMM ``k`` partial GEMMs,
  each waiting only for its own slice: slice ``j + 1`` travels on the comm stream while
  GEMM ``j`` computes;
- the reduce-scatter (sequence parallelism) or all-reduce after a row-parallel GEMM
  becomes ``k`` collectives, each issued as soon as its partial GEMM is done;
- the backward likewise: the all-gather of the output gradient before a row-parallel
  input-gradient GEMM, the reduce-scatter or all-reduce after a column-parallel one. The
  weight gradient is one step after the last piece (``W/...``), which sums the pieces'
  gradients, and runs while the last piece's collective is in flight. An input gathered
  again for it (``gathered_inputs = regather``) stays one all-gather, into the weight
  step, which takes each piece's tokens of it.

Piece ``j`` of ``k`` over a tensor of ``n`` tokens spread over ``s`` tp ranks is, for every
rank ``r < s``, the tokens ``r n/s + j n/(s k)`` up to ``r n/s + (j+1) n/(s k)``
(:func:`planc.program.operands.token_ranges`): the all-gather of each rank's ``j``-th slice
yields exactly those tokens in that order, and the reduce-scatter of them gives each rank
back its own ``j``-th slice. A linear acts on each token by itself, so the pieces compute
what the whole GEMM computes.

The chunk count, with ``tp_overlap = on``: the least predicted time of the two-stage
pipeline ``c(B/k) + g(k) + (k - 1) (max(c, g) + (1 - o) min(c, g))`` (``c`` a chunk
collective over its route by the cost model, ``g(k)`` the GEMM of one piece, by the
simulator's kernel model on a known GPU, :mod:`planc.estimate.kernel_cost`, where a piece runs
less efficiently and pays a launch; ``o`` the device's ``overlap``, the share of a
collective that hides behind a GEMM), summed over the linear's chunked collectives,
among the counts 1, 2, 4 and 8 that divide the tokens; 1 (no split) when nothing beats
it: always where ``o = 0``, as with gloo on CPUs whose cores the GEMM fills (the ``cpu``
preset; ``planc calibrate`` measures ``o``), where ``k`` pieces cost ``k`` collectives'
fixed costs and hide nothing. An integer forces that count.
"""

from __future__ import annotations

import networkx as nx

from planc.estimate.cost import Placement, Route
from planc.estimate.kernel_cost import KernelModel
from planc.graph.ir import Axis, EdgeKind, Kind, NodeType, Op, Phase, Port
from planc.passes.context import PassContext, PassRecord, record
from planc.passes.route import group_placements

LINEARS = (Op.QKV, Op.PROJ, Op.FC1, Op.FC2)
COUNTS = (1, 2, 4, 8)
RECOMPUTED = "recomputed in the backward: left whole"
# Megatron-LM's placements, which collective matmul is built on (its column-parallel
# GEMMs take an all-gather, its row-parallel ones give a reduction); under any other,
# chunks of tokens split what another layout's collectives hold whole, and a random
# plan trained another model (fc1 = replicate with sequence parallelism), so every GEMM
# is left whole
MEGATRON = {"qkv": "column", "proj": "row", "fc1": "column", "fc2": "row"}
NOT_MEGATRON = "placements other than Megatron's (column qkv and fc1, row proj and fc2)"
NO_GAIN = ("the cost model predicts no gain: a chunk collective costs about as much as the "
           "whole one (its fixed cost dominates), or the device hides no collective "
           "behind a GEMM (overlap = 0)")
# The pass line's words for a reason no GEMM was split.
NO_SPLIT = {RECOMPUTED: "each is recomputed in the backward (not chunked yet)",
            NO_GAIN: "the cost model predicts no gain from chunking on this topology",
            NOT_MEGATRON: NOT_MEGATRON}


def piece_name(node: str, index: int) -> str:
    return f"{node}#t{index}"


def _tp_collective(graph: nx.DiGraph, node: str, kinds) -> bool:
    """A per-microbatch tp collective of ``kinds`` that pieces of tokens can split: an
    all-reduce, or an all-gather or reduce-scatter along the tokens (sequence
    parallelism's). One along the features (``fc2 = replicate`` gathers ``ffn``, ``proj =
    column`` ``hidden``) holds every token on every rank: a rank's j-th slice of tokens
    is not a piece of it, so such a linear stays whole."""
    data = graph.nodes[node]
    return data["type"] == NodeType.TRANSFER and data.get("axis") == Axis.TP and \
        data["kind"] in kinds and data["per_microbatch"] and \
        (data["kind"] == Kind.ALL_REDUCE or data.get("dim") == "seq")


def _sides(graph: nx.DiGraph, forward: str, backward: str) -> dict[str, str]:
    """The collectives around a linear that get chunked: in and out, forward and back."""
    sides = {}
    for name, step in (("forward", forward), ("backward", backward)):
        for u, _, e in graph.in_edges(step, data=True):
            if e["kind"] == EdgeKind.DATA and _tp_collective(graph, u, (Kind.ALL_GATHER,)) \
                    and graph.out_degree(u) == 1 and e.get("port") != Port.GATHERED:
                sides[f"{name} in"] = u
        for _, v, e in graph.out_edges(step, data=True):
            if e["kind"] == EdgeKind.DATA and \
                    _tp_collective(graph, v, (Kind.REDUCE_SCATTER, Kind.ALL_REDUCE)) and \
                    graph.in_degree(v) == 1:
                sides[f"{name} out"] = v
    return sides


def collective_seconds(ctx: PassContext, placements: dict, data: dict, nbytes: float
                       ) -> float:
    """A collective's time over the route the route pass chose, on its slowest group, as
    the route pass and the simulator time it."""
    groups = placements.get((data["axis"].value, data["stage"])) or \
        (Placement.within_node(data["group_size"]),)
    return max(ctx.cost.route_time(data.get("route") or Route.RING.value,
                                   str(data["kind"]), nbytes, p) for p in groups)


def gemm_seconds(ctx: PassContext, kernels: KernelModel | None, op: str, phase: str,
                 flops: float) -> float:
    """A piece's GEMM (the forward's, or the backward's input gradient, as many FLOPs):
    by the simulator's kernel model on a known GPU, where a smaller piece runs less
    efficiently and pays its launch; else at the device's one efficiency."""
    if kernels is None:
        return ctx.cost.compute_seconds(flops)
    return kernels.linear_seconds(op, phase, flops, split=True)


def _predicted(ctx: PassContext, kernels: KernelModel | None, graph: nx.DiGraph,
               sides: dict[str, str], op: str, flops: float, k: int,
               placements: dict) -> float:
    total, hidden = 0.0, ctx.cost.topology.device.overlap
    for side, collective in sides.items():
        data = graph.nodes[collective]
        c = collective_seconds(ctx, placements, data, data["bytes"] // k)
        g = gemm_seconds(ctx, kernels, op, side.split()[0], flops / k)
        total += c + g + (k - 1) * (max(c, g) + (1 - hidden) * min(c, g))
    return total


def _chunk_count(ctx: PassContext, kernels: KernelModel | None, graph: nx.DiGraph, sides,
                 op: str, flops: float, tokens: int, placements: dict
                 ) -> tuple[int, dict]:
    setting = ctx.plan.optimize.tp_overlap
    # chunks split a rank's tokens evenly; where they cannot (17 tokens over tp 2) the
    # GEMM stays whole
    fits = [k for k in COUNTS if tokens % (ctx.plan.mesh.tp * k) == 0] or [1]
    seconds = {k: _predicted(ctx, kernels, graph, sides, op, flops, k, placements)
               for k in fits}
    if setting is not True:
        return int(setting), seconds
    best = min(fits, key=lambda k: (seconds[k] - 1e-12 * (k == 1), k))
    return best, seconds


def tp_overlap(graph: nx.DiGraph, ctx: PassContext) -> nx.DiGraph:
    out = ctx.working_copy(graph)
    plan = ctx.plan
    setting = plan.optimize.tp_overlap
    if plan.mesh.tp == 1 or setting is False or setting is not True and setting == 1:
        why = "tp = 1: no tp collectives" if plan.mesh.tp == 1 else "tp_overlap = off"
        return record(out, PassRecord("tp_overlap", False, f"tp_overlap: off ({why})"))
    tokens = plan.model.seq // plan.mesh.cp
    placements = group_placements(ctx)
    kernels = KernelModel.of(plan)
    backward_of = {d["forward_of"]: n for n, d in out.nodes(data=True)
                   if d["type"] == NodeType.COMPUTE and d["phase"] == Phase.BACKWARD and
                   "forward_of" in d and "weight_grad_of" not in d and not d["recompute"]}
    recomputed = {d.get("forward_of") for _, d in out.nodes(data=True) if d.get("recompute")}
    linears = [n for n, d in out.nodes(data=True)
               if d["type"] == NodeType.COMPUTE and d["phase"] == Phase.FORWARD and
               d.get("op") in LINEARS and not d["recompute"] and d["per_microbatch"]]
    megatron = all(getattr(plan.shard.tp, slot) == placement
                   for slot, placement in MEGATRON.items())
    decisions, split, pieces = [], 0, set()
    for forward in linears:
        backward = backward_of.get(forward)
        if backward is None:
            continue
        sides = _sides(out, forward, backward)
        if not sides:
            continue
        k, seconds = _chunk_count(ctx, kernels, out, sides, str(out.nodes[forward]["op"]),
                                  out.nodes[forward]["flops"], tokens, placements)
        decision = {"node": forward, "collectives": sorted(sides.values()), "chunks": k,
                    "predicted_seconds": {str(c): s for c, s in seconds.items()}}
        if forward in recomputed:
            decision.update(chunks=1, reason=RECOMPUTED)
        elif not megatron:
            decision.update(chunks=1, reason=NOT_MEGATRON)
        elif k == 1:
            decision["reason"] = NO_GAIN
        else:
            decision["reason"] = "forced by tp_overlap" if setting is not True else \
                f"least predicted time of 1, 2, 4, 8 chunks dividing {tokens} tokens"
            _split_linear(out, forward, backward, sides, k, plan.mesh.tp)
            for collective in sides.values():  # each chunk timed as the simulator will
                for j in range(k):
                    data = out.nodes[piece_name(collective, j)]
                    data["route_seconds"] = collective_seconds(ctx, placements, data,
                                                               data["bytes"])
            split += 1
            pieces.add(k)
        decisions.append(decision)
    by_op: dict[str, set[int]] = {}
    for d in decisions:
        by_op.setdefault(d["node"].rsplit("/", 1)[-1], set()).add(d["chunks"])
    chosen = ", ".join(f"{op} {'/'.join(map(str, sorted(ks)))}" for op, ks in by_op.items())
    if split:
        line = (f"tp_overlap: {split} of {len(decisions)} tp GEMMs split into "
                f"{'/'.join(map(str, sorted(pieces)))} chunks ({chosen}), each chunk's "
                f"collective overlapped with another chunk's GEMM")
    else:
        reasons = sorted({NO_SPLIT.get(d["reason"], d["reason"]) for d in decisions})
        line = f"tp_overlap: 0 of {len(decisions)} tp GEMMs split: " + "; ".join(reasons)
    changes = [{"category": "tp collectives", "before": len({c for d in decisions
                                                              for c in d["collectives"]}),
                "after": sum(len(d["collectives"]) * d["chunks"] for d in decisions)}]
    return record(out, PassRecord("tp_overlap", True, line, changes, decisions))


def _copy(graph: nx.DiGraph, node: str, index: int, k: int, tp: int) -> str:
    """Piece ``index`` of ``node``: it works on piece [index, k, tp] of the tokens (every
    chunk collective's full-token side, every partial GEMM's rows)."""
    data = graph.nodes[node]
    name = piece_name(node, index)
    attrs = {**data, "token_piece": [index, k, tp]}
    if "flops" in data:
        attrs["flops"] = data["flops"] / k
    attrs["bytes"] = data["bytes"] // k
    graph.add_node(name, **attrs)
    return name


def _split_linear(graph: nx.DiGraph, forward: str, backward: str, sides: dict[str, str],
                  k: int, tp: int) -> None:
    weight = graph.nodes[backward].get("weight_grad")
    if weight is None:  # a weight step of its own, after the last piece
        weight = "W" + backward[1:]
        data = graph.nodes[backward]
        graph.add_node(weight, **{**data, "flops": data["flops"] / 2,
                                  "weight_grad_of": backward})
        graph.nodes[backward].update(flops=data["flops"] / 2, weight_grad=weight)
        for _, target, edge in list(graph.out_edges(backward, data=True)):
            # (an input gathered again starts once this step's input gradient is done,
            # not its weight gradient: that order stays, on the last piece)
            if "bucket" in graph.nodes[target] or edge["kind"] == EdgeKind.ORDER and \
                    "regathers" not in graph.nodes[target]:
                graph.remove_edge(backward, target)
                graph.add_edge(weight, target, **edge)
        for source, _, edge in list(graph.in_edges(backward, data=True)):
            if edge.get("port") == Port.GATHERED:  # the input gathered again, whole
                graph.remove_edge(source, backward)
                graph.add_edge(source, weight, **edge)
    for step in (forward, backward):
        phase = "forward" if step == forward else "backward"
        _split_step(graph, step, sides.get(f"{phase} in"), sides.get(f"{phase} out"), k, tp,
                    forward if step == backward else None, weight)
    # The weight step sums every piece's gradients: it follows the last piece.
    graph.nodes[weight].update(forward_of=piece_name(forward, k - 1),
                               weight_grad_of=piece_name(backward, k - 1))


def _split_step(graph, step, gather, reduce, k, tp, forward, weight) -> None:
    """``step`` (and its collectives) into ``k`` pieces; ``forward``: the forward step
    whose pieces a backward step's pieces take their saved tensors from."""
    names = [_copy(graph, step, j, k, tp) for j in range(k)]
    for j, name in enumerate(names):
        if forward is not None:
            graph.nodes[name]["forward_of"] = piece_name(forward, j)
            graph.add_edge(piece_name(forward, j), name, kind=EdgeKind.SAVED)
            graph.add_edge(name, weight, kind=EdgeKind.SAVED)
        if j:
            graph.add_edge(names[j - 1], name, kind=EdgeKind.ORDER)
    for source, _, edge in list(graph.in_edges(step, data=True)):
        if edge["kind"] == EdgeKind.SAVED:
            continue
        if source == gather:  # each piece waits for its own slice of the gather
            gathers = [_copy(graph, gather, j, k, tp) for j in range(k)]
            for (producer, _, e) in graph.in_edges(gather, data=True):
                for j, g in enumerate(gathers):
                    graph.add_edge(producer, g, **({**e, "tokens": [j, k, 1]}
                                                   if e["kind"] == EdgeKind.DATA else e))
            for j, g in enumerate(gathers):
                graph.add_edge(g, names[j], **edge)
                if j:
                    graph.add_edge(gathers[j - 1], g, kind=EdgeKind.ORDER)
            graph.remove_node(gather)
        elif edge["kind"] == EdgeKind.DATA and edge.get("port") != "param":
            for j, name in enumerate(names):
                graph.add_edge(source, name, **{**edge, "tokens": [j, k, tp]})
        elif edge["kind"] == EdgeKind.DATA:
            for name in names:
                graph.add_edge(source, name, **edge)
        else:  # an order: before the first piece, hence before them all
            graph.add_edge(source, names[0], **edge)
    for _, target, edge in list(graph.out_edges(step, data=True)):
        if edge["kind"] == EdgeKind.SAVED:
            continue
        if target == reduce:  # each piece's collective issued as soon as it is done
            reduces = [_copy(graph, reduce, j, k, tp) for j in range(k)]
            spread = 1 if graph.nodes[reduce]["kind"] == Kind.REDUCE_SCATTER else tp
            for j, r in enumerate(reduces):
                graph.add_edge(names[j], r, **edge)
                if j:
                    graph.add_edge(reduces[j - 1], r, kind=EdgeKind.ORDER)
            for (_, consumer, e) in list(graph.out_edges(reduce, data=True)):
                for j, r in enumerate(reduces):
                    graph.add_edge(r, consumer, **(
                        {**e, "piece": [j, k, spread], "piece_of": reduce}
                        if e["kind"] == EdgeKind.DATA else e))
            graph.remove_node(reduce)
        elif edge["kind"] == EdgeKind.DATA:
            for j, name in enumerate(names):
                graph.add_edge(name, target, **{**edge, "piece": [j, k, tp],
                                                "piece_of": step})
        else:
            graph.add_edge(names[-1], target, **edge)
    graph.remove_node(step)
