"""What each instruction operates on, decided from the graph when it is lowered.

One function, :func:`operands_of`, turns a node of the graph (its attributes and its
incoming edges) into the instruction's :class:`planc.program.operands.Operands`: which
buffer feeds which port, which gradient a backward step's output carries, where the
consumer takes its own tp slice of a replicated value, the group, route and peer stage
of a transfer. The lowering writes them into the programs; the verifier calls it again
and compares, so that a program's operands are always the graph's. Within one compile
both read one :class:`Binding`, which derives each instruction's operands once.
"""

from __future__ import annotations

import networkx as nx

from planc.graph.grad_norm import norm_ranges
from planc.graph.ir import Axis, EdgeKind, Kind, NodeType, Op, Payload, Phase, Port
from planc.graph.sharding import parse as parse_layout
from planc.graph.sharding import R, S
from planc.program.groups import EXPERTS, SEQUENCE
from planc.program.operands import FEATURE_AXIS, SEQ_AXIS, Input, Operands, StepKind
from planc.program.program import Opcode


ROUTED = (Payload.COUNTS, Payload.DISPATCH, Payload.COMBINE)  # a cut mixture's all-to-alls


def _value(item):
    """An attribute as JSON holds it (enums by value)."""
    return None if item is None else getattr(item, "value", item)


def inputs_of(graph: nx.DiGraph, node: str, stage: int, position: dict[str, int]
              ) -> tuple[Input, ...]:
    """The values ``node`` reads from steps of its own stage (a peer stage's value comes
    through this stage's receive; parameters through their buckets), in the graph's node
    order of their producers (``position``): the order graph.json lists the edges in, so
    that gradients are summed in one order however the graph was built."""
    out = []
    edges = sorted(graph.in_edges(node, data=True), key=lambda e: position[e[0]])
    for source, _, edge in edges:
        if edge.get("kind", EdgeKind.DATA) != EdgeKind.DATA:
            continue
        source_data = graph.nodes[source]
        if source_data["stage"] != stage or edge.get("port") == Port.PARAM:
            continue
        local = None
        if edge.get("slice"):
            dim = parse_layout(edge["slice"]).dim
            local = (dim, SEQ_AXIS if dim == "seq" else FEATURE_AXIS)
        tokens, piece = edge.get("tokens"), edge.get("piece")
        out.append(Input(source, str(edge.get("port", Port.X)),
                         bool(source_data["per_microbatch"]), _value(edge.get("grad_of")),
                         local, None if tokens is None else tuple(tokens),
                         None if piece is None else tuple(piece), edge.get("piece_of")))
    return tuple(out)


def _kept_for_recomputation(graph: nx.DiGraph, node: str, data: dict,
                            position: dict[str, int]) -> tuple[str, ...] | None:
    """A forward whose step is recomputed keeps, of its inputs, only those its
    recomputation does not get from the program again (under full recomputation the
    layer's input, not the outputs of the layer's own steps, which are recomputed): the
    ports, sorted; None for any other step (it keeps what autograd needs)."""
    if data["phase"] != Phase.FORWARD or data["recompute"] or not data.get("recomputed"):
        return None
    again = [v for _, v, edge in graph.out_edges(node, data=True)
             if edge.get("kind") == EdgeKind.SAVED and graph.nodes[v]["recompute"]]
    if not again:
        return ()

    def ports(step: str) -> set[str]:
        return {i.port for i in inputs_of(graph, step, data["stage"], position)}

    return tuple(sorted(ports(node) - set().union(*map(ports, again))))


def _compute(graph: nx.DiGraph, node: str, data: dict, position: dict[str, int]
             ) -> Operands:
    if data["op"] == Op.OPTIMIZER:
        step = StepKind.OPTIMIZER
    elif data["op"] in (Op.GRAD_NORM, Op.GRAD_CLIP):
        step = StepKind.CLIP  # train { grad_clip }: the gradient norm's share, and the clip
    elif data["op"] in (Op.ROUTER_LOAD, Op.ROUTER_BIAS):
        step = StepKind.ROUTER  # model moe { bias_update }: the loads, and the update
    elif data.get("weight_grad_of") is not None:
        step = StepKind.WEIGHT  # the parameter half of a split backward
    elif data["recompute"]:
        step = StepKind.RECOMPUTE
    elif data["phase"] == Phase.BACKWARD:
        step = StepKind.BACKWARD
    else:
        step = StepKind.FORWARD
    tp_input = parse_layout(data.get("tp_input", "R"))
    gathered = tuple(sorted((graph.nodes[u]["bucket"], u) for u, _, e in
                            graph.in_edges(node, data=True) if e.get("port") == Port.PARAM))
    return Operands(
        inputs=inputs_of(graph, node, data["stage"], position), kernel=_value(data["op"]),
        step=step,
        layer=data.get("layer"), params=tuple(data.get("params", ())),
        param_slices=tuple(sorted((k, (v[0], int(v[1])))
                                  for k, v in data.get("param_slices", {}).items())),
        bias=data.get("bias"), vocab_parallel=bool(data.get("vocab_parallel", False)),
        seq_sharded=tp_input == S("seq"), replicated=tp_input == R,
        forward_of=data.get("forward_of"),
        saved_from=data.get("recompute_of") or data.get("forward_of"),
        keeps_graph=bool(data["recompute"] or not data.get("recomputed", False)),
        keeps_inputs=_kept_for_recomputation(graph, node, data, position),
        weight_step=data.get("weight_grad"), gathered=gathered,
        tokens=tuple(data["token_piece"]) if "token_piece" in data else None,
        flops=data["flops"], output_bytes=data["bytes"],
        bucket=data.get("bucket") if data["op"] == Op.OPTIMIZER else None,
        sharded=bool(data.get("sharded", False)) if data["op"] == Op.OPTIMIZER else False,
        # ring attention: its steps over the cp group, and the block one shift moves
        ring_steps=data.get("ring_steps"),
        # ... or a mixture of experts' all-to-alls over the ep group
        group=Axis.CP.value if data.get("ring_steps") else
        EXPERTS if data.get("experts_over") else None,
        bytes=data.get("ring_bytes") or data.get("dispatch_bytes"),
        # ... and its balance loss's counts, summed over the ranks holding each sequence
        counts_group=SEQUENCE if data.get("counts_over") else None,
        counts_bytes=data.get("counts_bytes"), capacity_bytes=data.get("capacity_bytes"),
        norm_ranges=norm_ranges(graph, data["stage"]) if data["op"] == Op.GRAD_NORM else (),
        max_norm=data.get("max_norm"),
        router_layers=tuple(data.get("router_layers", ())),
        bias_update=data.get("bias_update"), drops_rows=bool(data.get("drops_rows", False)))


def _transfer(graph: nx.DiGraph, node: str, data: dict, op: Opcode,
              position: dict[str, int]) -> Operands:
    source = node
    payload = data["payload"]
    pipeline = payload == Payload.STREAM
    level = _value(data.get("level", "whole"))
    group = None if pipeline else (
        _value(data["axis"]) if level == "whole" else f"{_value(data['axis'])}/{level}")
    source_dim = target_dim = None
    if payload == Payload.ACTIVATION and data["kind"] != Kind.ALL_REDUCE:
        source_dim = parse_layout(data["source_layout"]).dim
        target_dim = parse_layout(data["target_layout"]).dim
    return Operands(
        inputs=inputs_of(graph, source, data["stage"], position), payload=_value(payload),
        group=group, route=None if pipeline else data.get("route"),
        reduce_op=data.get("reduce_op"), source_dim=source_dim, target_dim=target_dim,
        ring_steps=data.get("ring_steps"),
        peer_stage=data.get("peer_stage") if pipeline else None,
        # a pipeline transfer's group, or which way a mixture's all-to-all moves its rows
        direction=_value(Phase.FORWARD if data.get("recomputes") else data["phase"])
        if pipeline or payload in ROUTED else None,
        partner=next(iter(graph.successors(node)), None)
        if pipeline and data["kind"] == Kind.SEND else None,
        shape=tuple(data["shape"]) if pipeline and data["kind"] == Kind.RECV else (),
        bucket=data.get("bucket"), elements=tuple(data.get("elements", ())),
        tensor=data.get("tensor") if payload == Payload.GRAD else None,
        dim=data.get("dim") if payload == Payload.GRAD else None,
        slice_axis=data.get("slice_axis") if payload == Payload.GRAD else None,
        into_bucket=payload == Payload.PARAM and data["phase"] == Phase.OPTIMIZER,
        into_shard=bool(data.get("keeps_shard")),
        bytes=data.get("bytes"), hops=data.get("hops"))


def operands_of(graph: nx.DiGraph, node: str, op: Opcode, position: dict[str, int]
                ) -> Operands:
    """The operands of the instruction ``op`` that runs ``node``; ``position``: each
    node's index in the graph's node order."""
    data = graph.nodes[node]
    if data["type"] == NodeType.COMPUTE:
        return _compute(graph, node, data, position)
    return _transfer(graph, node, data, op, position)


class Binding:
    """The operands of a graph's instructions, each derived once (:func:`operands_of`):
    the compiler's lowering and its verifier share one, so the verifier checks that every
    instruction carries its own node's operands without deriving them a second time. The
    graph must not change while a binding is in use."""

    def __init__(self, graph: nx.DiGraph):
        self.graph = graph
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self._derived: dict[tuple[str, str], Operands] = {}

    def operands(self, node: str, op: Opcode | str) -> Operands:
        key = (op, node)  # an Opcode is a StrEnum: its text finds the same entry
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = operands_of(self.graph, node, op, self.position)
        return found
