"""split_dispatch: under ``schedule { overlap_all_to_all = on }``, every mixture of experts
over ep is cut at its all-to-alls, so that they become transfers of the graph on a stream
of their own, which another microbatch's compute (or the shared experts) can run beside,
as DeepSeek-V3's DualPipe and Megatron-Core's combined 1F1B overlap hide them (DeepSeek-AI
2024, section 3.2.1; Megatron-Core's ``--overlap-moe-expert-parallel-comm``).

A forward ``F/L/moe`` becomes, in order of its data:

- ``F/L/moe`` (``moe_route``): the router, the choice of each token's experts, their
  (token, expert) rows sorted by expert with the routing weight as a last column, and
  the rows of each expert counted;
- ``F/L/moe:shared`` (``moe_shared``): the shared experts on the same tokens, free to run
  while the dispatch travels;
- ``F/L/moe:counts``: an all-to-all of those counts over ep (each rank learns how many
  rows each peer sends each of its experts, Megatron-Core's
  ``num_global_tokens_per_local_expert``);
- ``F/L/moe:dispatch``: an all-to-all of the rows to the ranks of their experts;
- ``F/L/moe:experts`` (``moe_experts``): this rank's experts on the rows received, each
  output scaled by its routing weight;
- ``F/L/moe:combine``: an all-to-all of the outputs back to their tokens' ranks;
- ``F/L/moe:sum`` (``moe_combine``): each token's outputs added up, plus the shared
  experts'.

The backward runs the same cut reversed: ``B/L/moe:sum``, the combine's all-to-all of
the gradients (``B/L/moe:combine``), ``B/L/moe:experts``, the dispatch's
(``B/L/moe:dispatch``), then ``B/L/moe:shared`` and ``B/L/moe``. Results do not change:
the rows, their order and every sum are the ones the uncut mixture computes
(planc.runtime.families.moe).
"""

from __future__ import annotations

import networkx as nx

from planc.graph.ir import Axis, EdgeKind, Kind, NodeType, Op, Payload, Phase, Port
from planc.models import moe
from planc.passes.context import PassContext, PassRecord, record
from planc.plan.plan import Plan
from planc.vocabulary.model_options import fp8_tile

# (suffix, operator, which parameters of the block) of each compute piece
PIECES = (("", Op.MOE_ROUTE, ("router.",)), (":shared", Op.MOE_SHARED, ("shared.",)),
          (":experts", Op.MOE_EXPERTS, ("experts.",)), (":sum", Op.MOE_COMBINE, ()))


def cut(data: dict) -> bool:
    """A mixture's forward over ep, not cut yet (its recomputation, under recompute =
    full, is cut with it)."""
    return data["type"] == NodeType.COMPUTE and data.get("op") == Op.MOE and \
        data["phase"] == Phase.FORWARD and bool(data.get("experts_over")) and \
        not data["recompute"]


def _flop_shares(plan: Plan) -> dict[Op, float]:
    """Each piece's share of the mixture's forward FLOPs (planc.models.moe.part_flops)."""
    parts = moe.part_flops(plan.model, plan.model.hidden)
    total = sum(parts.values())
    return {Op(op): flops / total for op, flops in parts.items()}


def _reason(payload: Payload, phase: Phase, plan: Plan, two_hops: bool) -> str:
    what = {(Payload.COUNTS, Phase.FORWARD): "each rank learns how many rows each peer "
            "sends each of its experts, which change with every step (Megatron-Core's "
            "num_global_tokens_per_local_expert)",
            (Payload.DISPATCH, Phase.FORWARD): "each (token, expert) row, with its routing "
            "weight, goes to the rank of the ep group holding its expert",
            (Payload.COMBINE, Phase.FORWARD): "each expert's weighted output goes back to "
            "the rank holding its token",
            (Payload.COMBINE, Phase.BACKWARD): "the outputs' gradients go to the ranks of "
            "the experts that made them",
            (Payload.DISPATCH, Phase.BACKWARD): "the rows' gradients go back to the ranks "
            "holding their tokens"}[(payload, phase)]
    if two_hops:  # DeepSeek-V3's dispatch, section 3.2.2; DeepEP
        what += (", in two hops: a row per (token, node) between nodes, then a row per "
                 "(token, rank) inside the node (DeepSeek-V3's dispatch; DeepEP)")
    # the key that cut the mixture: the overlap, else the two hops alone
    key = "schedule { overlap_all_to_all }" if plan.schedule.overlap_all_to_all else \
        "optimize { moe_dispatcher = two_hop }"
    return (f"{what} (expert parallelism over {plan.mesh.ep} ranks: GShard; an all-to-all of "
            f"its own on the ep stream with {key}, so that compute can run beside it)")


def _hops(ctx: PassContext) -> dict[int, int]:
    """Stage -> 2 where its ep groups have more than one member and the same number on
    each node they span (where a token can cross the network once per node, then NVLink
    once per rank: optimize { moe_dispatcher = two_hop }; on one node only the second
    hop moves rows, with one rank a node only the first)."""
    out = {}
    per_node = ctx.plan.topology.devices_per_node
    for stage in range(ctx.plan.mesh.pp):
        members = ctx.layout.group(ctx.layout.first_rank_of_stage(stage), "ep")
        on_node: dict[int, int] = {}
        for member in members:
            on_node[member // per_node] = on_node.get(member // per_node, 0) + 1
        if len(members) > 1 and len(set(on_node.values())) == 1:
            out[stage] = 2
    return out


class _Cutter:
    def __init__(self, graph: nx.DiGraph, plan: Plan, hops: dict[int, int]):
        self.graph, self.plan, self.hops = graph, plan, hops
        self.shares = _flop_shares(plan)
        self.buckets = graph.graph.get("buckets", {})

    def _bucket_params(self, bucket: str) -> set[str]:
        return {member["param"] for member in self.buckets[bucket]["members"]}

    def _piece(self, node: str, data: dict, suffix: str, op: Op, prefixes: tuple[str, ...]
               ) -> str:
        """The piece ``node + suffix`` of the mixture whose attributes were ``data``."""
        graph = self.graph
        name = node + suffix
        params = [p for p in data["params"] if any(p.split(".", 2)[-1].startswith(x)
                                                   for x in prefixes)]
        attrs = {key: value for key, value in data.items()
                 if key not in ("experts_over", "dispatch_bytes", "counts_over",
                                "counts_bytes", "capacity_bytes")}
        attrs.update(op=op, params=params, flops=data["flops"] * self.shares[op])
        if op == Op.MOE_ROUTE:  # the balance loss's and the capacity's exchanges
            attrs.update({key: data[key] for key in ("counts_over", "counts_bytes",
                                                     "capacity_bytes") if key in data})
        if op == Op.MOE_EXPERTS and fp8_tile(self.plan.model) is not None and \
                (data["phase"] == Phase.FORWARD or data["recompute"]):
            # with FP8 the experts keep what their backward reads as FP8 copies, and
            # after them the combine and the sum read the routing alone: the received
            # rows, decoded into the dtype, can go (DeepSeek-V3 keeps a mixture's
            # dispatched activations in FP8 alone, section 3.3.4)
            attrs["drops_rows"] = True
        if suffix:
            graph.add_node(name, **attrs)
        else:
            graph.nodes[name].clear()
            graph.nodes[name].update(attrs)
        return name

    def _pieces(self, node: str, data: dict) -> dict[Op, str]:
        """The compute pieces of mixture ``node`` (attributes ``data``), by operator."""
        return {op: self._piece(node, data, suffix, op, prefixes)
                for suffix, op, prefixes in PIECES
                if op != Op.MOE_SHARED or self.plan.model.shared_experts}

    def _transfer(self, node: str, payload: Payload, phase: Phase) -> str:
        """All-to-all ``payload`` of mixture ``node``, moving its rows the way of ``phase``,
        in the mixture's own phase (a recomputed mixture's move the forward's way, in the
        backward)."""
        data = self.graph.nodes[node]
        m = self.plan.model
        # the rows of its (token, expert) pairs at uniform routing, and the dispatch's
        # routing weights (one more column)
        rows = data["dispatch_bytes"] // m.hidden
        columns = m.hidden + (1 if payload == Payload.DISPATCH else 0)
        if payload == Payload.COUNTS:  # one int64 per expert
            rows, columns = 1, moe.expert_counts_bytes(m.experts)
        name = f"{node}:{payload.value}"
        reason = _reason(payload, phase, self.plan, bool(self.hops.get(data["stage"])))
        if data["recompute"]:  # the recomputed forward's, run in the backward
            reason += "; again, for the recomputed mixture (recompute = full)"
        self.graph.add_node(
            name, type=NodeType.TRANSFER, kind=Kind.ALL_TO_ALL, axis=Axis.EP,
            level="whole", payload=payload, group_size=self.plan.mesh.ep,
            phase=data["phase"],
            stage=data["stage"], chunk=data["chunk"], layer=data.get("layer"),
            repeat=data["repeat"], per_microbatch=True, microbatch=None,
            bytes=int(rows * columns), dtype=m.dtype,
            tensor={Payload.COUNTS: "expert_counts", Payload.DISPATCH: "expert_rows",
                    Payload.COMBINE: "expert_outputs"}[payload],
            reason=reason)
        if data["recompute"]:
            self.graph.nodes[name]["recomputes"] = True
        hops = self.hops.get(data["stage"])
        if hops:
            self.graph.nodes[name]["hops"] = hops
        return name

    def forward(self, node: str) -> dict[str, str]:
        graph = self.graph
        data = dict(graph.nodes[node])
        moved_out = [(v, e) for _, v, e in graph.out_edges(node, data=True)
                     if e.get("kind", EdgeKind.DATA) != EdgeKind.SAVED]
        inputs = [(u, e) for u, _, e in graph.in_edges(node, data=True)]
        # two hops exchange their own sizes inside the dispatch (moe_two_hop.dispatch)
        counts = None if self.hops.get(data["stage"]) else \
            self._transfer(node, Payload.COUNTS, Phase.FORWARD)
        dispatch = self._transfer(node, Payload.DISPATCH, Phase.FORWARD)
        combine = self._transfer(node, Payload.COMBINE, Phase.FORWARD)
        shared = bool(self.plan.model.shared_experts)
        names = {"dispatch": dispatch, "combine": combine, **self._pieces(node, data)}
        route, experts, total = names[Op.MOE_ROUTE], names[Op.MOE_EXPERTS], \
            names[Op.MOE_COMBINE]
        for target, edge in moved_out:
            graph.remove_edge(node, target)
            graph.add_edge(total, target, **edge)
        for source, edge in inputs:
            if edge.get("port") == Port.PARAM:  # ZeRO-3's gathered parameters
                graph.add_edge(source, experts, **edge)
            if shared:  # the tokens, and the parameters
                graph.add_edge(source, names[Op.MOE_SHARED], **edge)
        if counts is None:
            graph.add_edge(route, dispatch, kind=EdgeKind.DATA, port=Port.X)
        else:
            graph.add_edge(route, counts, kind=EdgeKind.DATA, port=Port.X)
            graph.add_edge(counts, dispatch, kind=EdgeKind.DATA, port=Port.X)
        graph.add_edge(dispatch, experts, kind=EdgeKind.DATA, port=Port.X)
        graph.add_edge(experts, combine, kind=EdgeKind.DATA, port=Port.X)
        graph.add_edge(dispatch, combine, kind=EdgeKind.DATA, port=Port.ROUTING)
        graph.add_edge(combine, total, kind=EdgeKind.DATA, port=Port.X)
        # the rows the combine returns, and their tokens: the dispatch's
        graph.add_edge(dispatch, total, kind=EdgeKind.DATA, port=Port.ROUTING)
        if shared:
            graph.add_edge(names[Op.MOE_SHARED], total, kind=EdgeKind.DATA, port=Port.SHARED)
        return names

    def _uses(self, piece: str, target: str) -> bool:
        """Whether backward piece ``piece`` writes a gradient ``target`` (a bucket's
        reduction or optimizer, a tp fix-up, the gradient norm) reads."""
        params = set(self.graph.nodes[piece]["params"])
        data = self.graph.nodes[target]
        if not params:
            return False
        if data.get("bucket") is not None:
            return bool(params & self._bucket_params(data["bucket"]))
        if data.get("tensor") in params:
            return True
        return data.get("op") == Op.GRAD_NORM or data.get("tensor") is None

    def recompute(self, node: str, forward: dict[str, str]) -> dict[str, str]:
        """Cut recomputed mixture ``node`` as its forward was: each piece redoes the
        forward's piece (``forward``), from what that kept, which is then its input alone."""
        names = self.forward(node)
        for op, piece in names.items():
            if isinstance(op, Op):
                self.graph.nodes[piece]["forward_of"] = forward[op]
                self.graph.nodes[forward[op]]["recomputed"] = True
                # what the forward kept, its rows among them, is the recomputation's input
                self.graph.nodes[forward[op]].pop("drops_rows", None)
                self.graph.add_edge(forward[op], piece, kind=EdgeKind.SAVED)
        return names

    def backward(self, node: str, forward: dict[str, str],
                 again: dict[str, str] | None = None) -> None:
        """Cut backward ``node`` of the mixture whose pieces are ``forward``, or, when it
        was recomputed, ``again`` (its backward differentiates those)."""
        graph = self.graph
        data = dict(graph.nodes[node])
        out_edges = [(v, e) for _, v, e in graph.out_edges(node, data=True)]
        grads_in = [(u, e) for u, _, e in graph.in_edges(node, data=True)
                    if e.get("port") == Port.GRAD]
        params_in = [(u, e) for u, _, e in graph.in_edges(node, data=True)
                     if e.get("port") == Port.PARAM]
        dispatch = self._transfer(node, Payload.DISPATCH, Phase.BACKWARD)
        combine = self._transfer(node, Payload.COMBINE, Phase.BACKWARD)
        shared = bool(self.plan.model.shared_experts)
        names = self._pieces(node, data)
        for op, piece in names.items():
            graph.nodes[piece]["forward_of"] = forward[op]
            if again is not None:
                graph.nodes[piece]["recompute_of"] = again[op]
            graph.add_edge((again or forward)[op], piece, kind=EdgeKind.SAVED)
        route, experts, total = names[Op.MOE_ROUTE], names[Op.MOE_EXPERTS], \
            names[Op.MOE_COMBINE]
        for source, edge in grads_in:
            graph.remove_edge(source, node)
            graph.add_edge(source, total, **edge)
        for source, edge in params_in:
            for piece in names.values():
                if graph.nodes[piece]["params"] and piece != route:
                    graph.add_edge(source, piece, **edge)
        routing = (again or forward)["dispatch"]
        graph.add_edge(total, combine, kind=EdgeKind.DATA, port=Port.GRAD, grad_of=Port.X)
        graph.add_edge(routing, combine, kind=EdgeKind.DATA, port=Port.ROUTING)
        graph.add_edge(combine, experts, kind=EdgeKind.DATA, port=Port.GRAD)
        graph.add_edge(experts, dispatch, kind=EdgeKind.DATA, port=Port.GRAD,
                       grad_of=Port.X)
        graph.add_edge(routing, dispatch, kind=EdgeKind.DATA, port=Port.ROUTING)
        graph.add_edge(dispatch, route, kind=EdgeKind.DATA, port=Port.GRAD)
        for target, edge in out_edges:
            if edge.get("grad_of") == Port.X:  # the tokens' gradient: route's and shared's
                if shared:
                    graph.add_edge(names[Op.MOE_SHARED], target, **edge)
                continue
            if target in names.values():
                continue
            graph.remove_edge(node, target)
            for piece in names.values():
                if self._uses(piece, target):
                    graph.add_edge(piece, target, **edge)
        if shared:
            graph.add_edge(total, names[Op.MOE_SHARED], kind=EdgeKind.DATA, port=Port.GRAD,
                           grad_of=Port.SHARED)


def split_dispatch(graph: nx.DiGraph, ctx: PassContext) -> nx.DiGraph:
    plan = ctx.plan
    two_hop = plan.optimize.moe_dispatcher == "two_hop"
    if not moe.cut_at_all_to_alls(plan):
        return graph
    out = ctx.working_copy(graph)
    chosen = [node for node, data in out.nodes(data=True) if cut(data)]
    backward_of = {data["forward_of"]: node for node, data in out.nodes(data=True)
                   if data["type"] == NodeType.COMPUTE and data.get("op") == Op.MOE and
                   data["phase"] == Phase.BACKWARD and "forward_of" in data and
                   not data["recompute"]}
    cutter = _Cutter(out, plan, _hops(ctx) if two_hop else {})
    again_of = {}  # a recomputed mixture (recompute = full) -> its recomputation
    for node in chosen:
        names = cutter.forward(node)
        backward = backward_of.get(node)
        again = out.nodes[backward].get("recompute_of") if backward else None
        if again is not None:
            again_of[node] = again
            cutter.backward(backward, names, cutter.recompute(again, names))
        elif backward is not None:
            cutter.backward(backward, names)
    decisions = [{"node": node, "transfers": [f"{mixture}:{what}"
                                              for mixture in (node, again_of.get(node))
                                              if mixture for what in
                                              ("counts", "dispatch", "combine")
                                              if f"{mixture}:{what}" in out]}
                 for node in chosen]
    # per mixture 5, or 4 where two hops size their own dispatch; a recomputed one's
    # forward all-to-alls again
    made = sum(len(d["transfers"]) for d in decisions) + \
        2 * len(backward_of.keys() & set(chosen))
    keys = (["overlap_all_to_all = on"] if plan.schedule.overlap_all_to_all else []) + \
        (["moe_dispatcher = two_hop"] if two_hop else [])
    return record(out, PassRecord(
        "split_dispatch", True,
        f"split_dispatch: {len(chosen)} mixture{'s' if len(chosen) != 1 else ''} of "
        f"experts cut at {'their' if len(chosen) != 1 else 'its'} dispatch and combine, "
        f"{made} all-to-alls over ep on a stream of their own ({', '.join(keys)})",
        [{"what": "ep all-to-all transfers", "before": 0, "after": made}],
        decisions))
