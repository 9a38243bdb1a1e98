"""The communication graph under construction, and the one way its nodes and edges are
made: what the derivation and its rules for the axes (:mod:`planc.graph.axes`) and the
parameters (:mod:`planc.graph.parameters`) share."""

from __future__ import annotations

import networkx as nx

from planc.estimate.model import Shapes
from planc.graph.ir import Axis, EdgeKind, Kind, Level, NodeType, Op, Payload, Phase, Port
from planc.graph.sharding import Layout
from planc.graph.tensor_parallel import OpLayout, plan_tensor_parallel
from planc.plan.plan import Plan


class GraphBuilder:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.graph = nx.DiGraph()
        self.tpp = plan_tensor_parallel(plan)
        self.shapes = Shapes.of(plan)
        self.m = plan.schedule.microbatches
        self.tp, self.cp, self.pp = plan.mesh.tp, plan.mesh.cp, plan.mesh.pp
        self.replicas = plan.mesh.dp * plan.mesh.cp
        self.chunks = plan.shard.pp.chunks
        self.stage_of = [plan.stage_of_chunk(c) for c in range(len(self.chunks))]

    def _node(self, node_id: str, *, per_microbatch: bool = True, **attrs) -> str:
        """``per_microbatch``: runs ``repeat / microbatches`` times for each microbatch;
        otherwise ``repeat`` times per step."""
        assert node_id not in self.graph, f"duplicate node {node_id}"
        self.graph.add_node(node_id, microbatch=None, per_microbatch=per_microbatch, **attrs)
        return node_id

    def compute(self, node_id: str, *, op: Op, phase: Phase, chunk: int, layer: int | None,
                flops: float, nbytes: float, repeat: int, **extra) -> str:
        extra.setdefault("recompute", False)
        return self._node(node_id, type=NodeType.COMPUTE, op=op, phase=phase,
                          stage=self.stage_of[chunk], chunk=chunk, layer=layer, repeat=repeat,
                          flops=float(flops), bytes=int(nbytes), **extra)

    def transfer(self, node_id: str, *, kind: Kind, axis: Axis, payload: Payload,
                 phase: Phase, chunk: int, layer: int | None, nbytes: float, repeat: int,
                 reason: str, stage: int | None = None, dtype: str | None = None,
                 **extra) -> str:
        return self._node(node_id, type=NodeType.TRANSFER, kind=kind, axis=axis,
                          level=Level.WHOLE, payload=payload,
                          group_size=self.group_size(axis), phase=phase,
                          stage=self.stage_of[chunk] if stage is None else stage, chunk=chunk,
                          layer=layer, repeat=repeat, bytes=int(round(nbytes)),
                          dtype=dtype or self.plan.model.dtype, reason=reason, **extra)

    def group_size(self, axis: Axis) -> int:
        stage = self.tp * self.replicas
        return {Axis.TP: self.tp, Axis.CP: self.cp, Axis.PP: 2, Axis.DP_CP: self.replicas,
                Axis.TIED: 2, Axis.STAGE: stage, Axis.EDP: stage // self.plan.mesh.ep}[axis]

    def edge(self, u: str, v: str, *, kind: EdgeKind = EdgeKind.DATA, port: Port | None = None,
             grad_of: Port | None = None, local_slice: Layout | None = None) -> None:
        """``port``: the input of v this edge feeds; ``grad_of``: on an edge out of a
        backward node, whose gradient it carries (the forward input's port);
        ``local_slice``: v takes its own slice of u's replicated value (R -> S(d), which
        moves no data)."""
        attrs: dict = {"kind": kind}
        if port is not None:
            attrs["port"] = port
        if grad_of is not None:
            attrs["grad_of"] = grad_of
        if local_slice is not None:
            attrs["slice"] = str(local_slice)
        self.graph.add_edge(u, v, **attrs)

    def layout(self, op: str) -> OpLayout:
        return self.tpp.ops[op]

    @staticmethod
    def prefix(letter: str, layer: int | None) -> str:
        """The start of the id of a step of ``layer`` (None: outside the layers)."""
        return f"{letter}/L{layer}/" if layer is not None else f"{letter}/"

    def local_bytes(self, tensor: str, layout: Layout) -> float:
        """One rank's bytes of ``tensor`` laid out as ``layout`` over tp."""
        return self.shapes.bytes(tensor) / (self.tp if layout.is_sharded else 1)
