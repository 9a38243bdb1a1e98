"""``model moe { bias_update = g }``: DeepSeek-V3's balancing bias, updated by steps and a
transfer of the graph.

DeepSeek-V3 (DeepSeek-AI 2024, section 2.1.2) balances its experts without an auxiliary
loss: a bias ``b_i`` per expert is added to the scores that choose each token's experts
(not to the weights), and after every step ``b_i += g * sign(mean - load_i)``, ``load_i``
the number of the step's (token, slot) pairs that chose expert ``i``, over the whole
global batch. Megatron-Core (``moe_router_enable_expert_bias``) sums the loads over the
stage's tensor, context and data-parallel ranks and updates the bias, a buffer of the
router, once per step with the optimizer; planc does the same with three once-per-step
nodes on each stage that holds mixture blocks:

- ``N/router_load#sS`` (compute, :attr:`Op.ROUTER_LOAD`): the loads this rank's forwards
  counted in the step, for each of the stage's mixture blocks (``router_layers``), as one
  fp64 vector (integers: exact in any order of summation);
- ``N/router_load:all_reduce@stage#sS`` (transfer over the ``stage`` group): summed over
  every rank of the stage. A token the mixture runs on every tp rank (no sequence
  parallelism) is counted tp times, the same factor for every expert of the block: the
  update reads only the sign of ``mean - load``, which a positive factor leaves alone;
- ``N/router_bias#sS`` (compute, :attr:`Op.ROUTER_BIAS`): every block's bias updated.

They follow every forward of the stage's mixtures (the ones recomputed in the backward
route with the bias their forward used) and run in the epilogue, so that the next
step's forwards route with the new bias.
"""

from __future__ import annotations

import networkx as nx

from planc.graph import reasons
from planc.graph.ir import Axis, EdgeKind, Kind, Level, NodeType, Op, Payload, Phase
from planc.plan.plan import Plan

LOAD_BYTES = 8  # one fp64 count per (block, expert)


def bias_nodes(stage: int) -> tuple[str, str, str]:
    """The names of ``stage``'s three nodes: its loads, their all-reduce, the update."""
    return (f"N/router_load#s{stage}", f"N/router_load:all_reduce@stage#s{stage}",
            f"N/router_bias#s{stage}")


def mixture_layers(plan: Plan, stage: int) -> list[int]:
    """The mixture blocks of ``stage``, in order: those whose bias it counts and updates."""
    return [layer for layer in plan.layers_of_stage(stage)
            if layer >= plan.model.first_dense]


def add_router_bias(plan: Plan, graph: nx.DiGraph) -> nx.DiGraph:
    """Add the balancing bias's nodes to the derived ``graph`` of ``plan`` (in place) when
    the model sets ``bias_update``; returns the graph."""
    m = plan.model
    rate = m.options.get("bias_update")
    if rate is None:
        return graph
    mixtures: dict[int, list[str]] = {}
    for node, data in graph.nodes(data=True):
        if data["type"] == NodeType.COMPUTE and data["op"] == Op.MOE and \
                data["phase"] == Phase.FORWARD:
            mixtures.setdefault(data["stage"], []).append(node)
    for stage in range(plan.mesh.pp):
        layers = mixture_layers(plan, stage)
        if not layers:
            continue
        load, reduce, update = bias_nodes(stage)
        common = dict(phase=Phase.OPTIMIZER, stage=stage,
                      chunk=plan.chunks_of_stage(stage)[0], layer=None, repeat=1,
                      microbatch=None, per_microbatch=False, router_layers=layers)
        counts = len(layers) * m.experts
        graph.add_node(load, type=NodeType.COMPUTE, op=Op.ROUTER_LOAD, flops=float(counts),
                       bytes=LOAD_BYTES * counts, recompute=False, params=[], **common)
        graph.add_node(reduce, type=NodeType.TRANSFER, kind=Kind.ALL_REDUCE, axis=Axis.STAGE,
                       level=Level.WHOLE, payload=Payload.ROUTER_LOAD,
                       group_size=plan.mesh.tp * plan.mesh.cp * plan.mesh.dp,
                       bytes=LOAD_BYTES * counts, dtype="fp64",
                       reason=reasons.router_load(plan, len(layers)), reduce_op="sum",
                       tensor="router_load", **common)
        graph.add_node(update, type=NodeType.COMPUTE, op=Op.ROUTER_BIAS,
                       flops=3.0 * counts, bytes=12 * counts, recompute=False, params=[],
                       bias_update=float(rate), **common)
        for mixture in sorted(mixtures.get(stage, ())):
            graph.add_edge(mixture, load, kind=EdgeKind.ORDER)
        graph.add_edge(load, reduce, kind=EdgeKind.DATA)
        graph.add_edge(reduce, update, kind=EdgeKind.DATA)
    return graph
