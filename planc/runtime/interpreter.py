"""What each instruction does, whatever stream it runs on.

Every node a program names is bound once, when the run starts, to a compute kernel
(:mod:`planc.runtime.kernels`) or a transfer (:mod:`planc.runtime.transfers`), with its
inputs resolved from the graph's edges: which buffer feeds which port, which gradient a
backward step's output carries, and where the consumer takes its own slice of a
replicated value. Running an instruction is then a table lookup and a call; nothing
about the plan is decided here.

Buffers of a step are keyed by (node, microbatch), microbatch None for once-per-step
values. Parameter gradients do not go through buffers: backward steps add them into
their bucket's gradient buffer (planc.runtime.store).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch

from planc.graph.ir import EdgeKind, Kind, NodeType, Op, Payload, Phase, Port
from planc.graph.layouts import parse as parse_layout
from planc.lower.program import Program
from planc.runtime.context import RankContext, pp_group_key
from planc.runtime.kernels import Kernels, Saved, Spec
from planc.runtime.model import split_feature
from planc.runtime.reference import make_optimizer
from planc.runtime.store import ParamStore
from planc.runtime.routes import resolve
from planc.runtime.transfers import SENDRECV, Call, Transfers


@dataclass
class StepState:
    step: int
    buffers: dict[tuple[str, int | None], object] = field(default_factory=dict)
    saved: dict[tuple[str, int | None], Saved] = field(default_factory=dict)
    loss: float | None = None


@dataclass(frozen=True)
class Input:
    source: str
    per_microbatch: bool  # the source runs every microbatch
    port: str
    grad_of: str | None  # a backward step's output: which input's gradient
    local_slice: tuple[str, int] | None  # (dim, tensor axis) of a local slice


def combine(values: list[torch.Tensor]) -> torch.Tensor:
    """Sum gradient contributions; a K/V gradient (narrower) adds to the k and v heads at
    the end of a [q | k | v] gradient."""
    if len(values) == 1:
        return values[0]
    widest = max(values, key=lambda v: v.shape[-1])
    total = torch.zeros_like(widest)
    for value in values:
        if value.shape == total.shape:
            total = total + value
        else:
            total[..., total.shape[-1] - value.shape[-1]:] += value
    return total


class _Compute:
    def __init__(self, node: str, data: dict, inputs: list[Input], gathered: dict[str, str]):
        self.node, self.spec, self.inputs = node, Spec.of(data), inputs
        self.gathered = gathered  # bucket -> the ZeRO-3 gather that filled it
        self.per_microbatch = data["per_microbatch"]
        self.backward = data["phase"] == Phase.BACKWARD and not data["recompute"]
        self.forward_of = data.get("forward_of")
        self.saved_from = data.get("recompute_of") or self.forward_of
        self.recompute = data["recompute"]
        self.keep_graph = self.recompute or not data.get("recomputed", False)
        self.optimizer = data["op"] == Op.OPTIMIZER
        self.bucket = data.get("bucket")
        self.weight_grad = data.get("weight_grad")  # B: its W step computes param grads
        self.weight_grad_of = data.get("weight_grad_of")  # W: the B step it completes


class _Transfer:
    def __init__(self, node: str, data: dict, inputs: list[Input], handler, call: Call):
        self.node, self.data, self.inputs, self.handler, self.call = node, data, inputs, \
            handler, call
        self.per_microbatch = data["per_microbatch"]
        self.sums_microbatches = data["payload"] == Payload.LOSS
        self.reads_values = data["payload"] not in (Payload.GRAD, Payload.PARAM)
        self.reports_loss = data["payload"] == Payload.LOSS


class Interpreter:
    def __init__(self, ctx: RankContext, graph: nx.DiGraph, program: Program,
                 store: ParamStore):
        self.ctx, self.graph, self.program, self.store = ctx, graph, program, store
        self.kernels = Kernels(ctx)
        self.transfers = Transfers(ctx, store)
        self.microbatches = program.microbatches
        self.optimizers = {}
        self.bound: dict[tuple[str, str], _Compute | _Transfer] = {}
        for part in (program.prologue, *program.blocks.values(), program.epilogue):
            for instruction in part:
                if instruction.node is not None:
                    self._bind(instruction.op, instruction.node)
        for stream, items in program.receives.items():
            for node, _ in items:
                self._bind(Kind.RECV.value, node)

    # --- binding ---------------------------------------------------------------------------

    def _inputs(self, node: str) -> list[Input]:
        out = []
        for source, _, edge in self.graph.in_edges(node, data=True):
            if edge.get("kind", EdgeKind.DATA) != EdgeKind.DATA:
                continue
            source_data = self.graph.nodes[source]
            if source_data["stage"] != self.ctx.stage or edge.get("port") == Port.PARAM:
                continue  # a peer stage's node is reached through this stage's receive
            local = None
            if edge.get("slice"):
                dim = parse_layout(edge["slice"]).dim
                local = (dim, 1 if dim == "seq" else 2)
            out.append(Input(source, source_data["per_microbatch"],
                             str(edge.get("port", Port.X)), edge.get("grad_of"), local))
        return out

    def _bind(self, op: str, node: str) -> None:
        if (op, node) in self.bound:
            return
        data = self.graph.nodes[node]
        if data["type"] == NodeType.COMPUTE:
            gathered = {self.graph.nodes[u]["bucket"]: u for u, _, e in
                        self.graph.in_edges(node, data=True) if e.get("port") == Port.PARAM}
            self.bound[(op, node)] = _Compute(node, data, self._inputs(node), gathered)
            if data["op"] == Op.OPTIMIZER:
                bucket = data["bucket"]
                tensor = self.store.shard[bucket] if data["sharded"] else \
                    self.store.full[bucket]
                self.optimizers[node] = make_optimizer(self.ctx.plan, [tensor], fused=True)
            return
        source = node
        if op == SENDRECV:  # a ring shift sends what its send half reads
            source = next(p for p in self.graph.predecessors(node)
                          if self.graph.nodes[p]["kind"] == Kind.SEND)
        key = (SENDRECV if op == SENDRECV else data["kind"], data["payload"])
        handler = self.transfers.table[key]
        self.bound[(op, node)] = _Transfer(node, data, self._inputs(source), handler,
                                           self._call(data))

    def _call(self, data: dict) -> Call:
        groups, ctx = self.ctx.groups, self.ctx
        if data["payload"] == Payload.STREAM:  # pipeline: a group per pair and direction
            peer = ctx.peer(data["peer_stage"])
            pair = (ctx.rank, peer) if data["kind"] == Kind.SEND else (peer, ctx.rank)
            return Call(data, groups.handles[pp_group_key(data["phase"].value, *pair)],
                        tuple(sorted(pair)), 0)
        ref = data["axis"] if data.get("level", "whole") == "whole" else \
            f"{data['axis']}/{data['level']}"
        members = groups.members.get(ref, (ctx.rank,))
        route = resolve(ctx.routes, data, ref, members, ctx.rank, groups,
                        ctx.layout.devices_per_node)
        return Call(data, groups.handles.get(ref), members, members.index(ctx.rank), route)

    # --- reading buffers ---------------------------------------------------------------

    def _value(self, state: StepState, item: Input, microbatch: int | None,
               all_microbatches: bool = False):
        if item.per_microbatch and (microbatch is None or all_microbatches):
            values = [self._pick(state.buffers[(item.source, k)], item)
                      for k in range(self.microbatches)]
            values = [v for v in values if v is not None]
            return sum(values[1:], values[0]) if values else None
        key = (item.source, microbatch if item.per_microbatch else None)
        return self._pick(state.buffers[key], item)

    def _pick(self, value, item: Input):
        if isinstance(value, dict):  # a backward step's gradients, by input port
            value = value.get(item.grad_of)
        if value is not None and item.local_slice is not None and self.ctx.tp > 1:
            dim, axis = item.local_slice
            value = split_feature(value, dim, self.ctx.tp, self.ctx.tp_rank, self.ctx.model,
                                  axis)
        return value

    def _ports(self, state: StepState, inputs: list[Input], microbatch: int | None,
               all_microbatches: bool = False) -> dict[str, list]:
        out: dict[str, list] = {}
        for item in inputs:
            value = self._value(state, item, microbatch, all_microbatches)
            if value is not None:
                out.setdefault(item.port, []).append(value)
        return out

    # --- running an instruction ------------------------------------------------------------

    def run(self, state: StepState, op: str, node: str, microbatch: int | None) -> None:
        bound = self.bound[(op, node)]
        mb = microbatch if bound.per_microbatch else None
        if isinstance(bound, _Compute):
            result = self._compute(state, bound, microbatch)
        else:
            result = self._transfer(state, bound, microbatch)
        if result is not None:
            state.buffers[(node, mb)] = result

    def _params(self, state: StepState, step: _Compute, microbatch: int | None) -> dict:
        params = {}
        for name in step.spec.params:
            bucket = self.store.members[name].bucket
            gather = step.gathered.get(bucket)
            if gather is not None:
                params[name] = self.store.view(state.buffers[(gather, microbatch)], name)
            else:
                params[name] = self.store.param(name)
        return params

    def _compute(self, state: StepState, step: _Compute, mb: int | None):
        if step.optimizer:
            return self._optimizer(step)
        if step.weight_grad_of is not None:  # the parameter half of a split backward
            saved, grad = state.saved.pop((step.node, mb))
            _, named = self.kernels.backward(step.spec, saved, grad, inputs=False)
            for name, value in named.items():
                self.store.grad_of(name).add_(value)
            return None
        if step.backward:
            saved = state.saved.pop((step.saved_from, mb))
            if step.saved_from != step.forward_of:
                state.saved.pop((step.forward_of, mb), None)
            grads = self._ports(state, step.inputs, mb).get("grad", [])
            grad = combine(grads) if grads else None
            if step.weight_grad is not None:  # the input half: its W step comes later
                ports, _ = self.kernels.backward(step.spec, saved, grad, params=False)
                state.saved[(step.weight_grad, mb)] = (saved, grad)
                return ports
            ports, named = self.kernels.backward(step.spec, saved, grad)
            for name, value in named.items():
                self.store.grad_of(name).add_(value)
            return ports
        inputs = {port: combine(values) for port, values in
                  self._ports(state, step.inputs, mb).items()}
        if step.recompute:  # inputs from outside the layer: what the forward kept
            kept = state.saved.get((step.forward_of, mb))
            if kept is not None:
                for port, tensor in kept.inputs.items():
                    inputs.setdefault(port, tensor.detach())
        output, saved = self.kernels.forward(step.spec, inputs, self._params(state, step, mb),
                                             state.step, mb, keep_graph=step.keep_graph)
        if step.spec.op not in (Op.LOSS_MAX, Op.LOSS_SUM_EXP):
            state.saved[(step.node, mb)] = saved  # what this step's backward will need
        return output

    def _optimizer(self, step: _Compute) -> None:
        bucket = step.bucket
        sharded = self.store.buckets[bucket]["sharded"]
        tensor = self.store.shard[bucket] if sharded else self.store.full[bucket]
        tensor.grad = self.store.grad_shard[bucket] if sharded else self.store.grad[bucket]
        self.optimizers[step.node].step()
        tensor.grad = None
        return None

    def _transfer(self, state: StepState, step: _Transfer, mb: int | None):
        value = None
        if step.reads_values:
            ports = self._ports(state, step.inputs, mb, step.sums_microbatches)
            values = [v.detach() for v in ports.get("x", []) + ports.get("grad", [])]
            value = combine(values) if values else None
        result = step.handler(step.call, value)
        if step.reports_loss:
            state.loss = float(result)
        return result
