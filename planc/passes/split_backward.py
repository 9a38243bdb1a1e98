"""split_backward: under a schedule that splits the backward (``zb1p``,
``interleaved_zb``), every backward step with parameters becomes two steps: the input
gradient, which the previous chunk waits for, and the weight gradient (``W/...``), which
nobody on the pipeline waits for, so that the schedule can defer it into a bubble (Qi et
al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2).

The lowering puts the weight-gradient steps, and the gradient reductions that read what
they write, in the chunk's ``W`` block; the once-per-step reductions and the optimizer
therefore wait for the last W of their parameters. Under every other schedule the pass
changes nothing and records nothing. Results do not change: the two halves compute the
same gradients as the whole backward (:meth:`planc.runtime.engine.kernels.Kernels.backward`).
"""

from __future__ import annotations

import networkx as nx

from planc import schedules
from planc.graph.ir import EdgeKind, NodeType, Op, Phase, Port
from planc.program.names import Stream
from planc.passes.context import PassContext, PassRecord, record


def splittable(data: dict) -> bool:
    """A backward step of the model (not a recomputation) with parameters, not split yet,
    and no collective inside: a mixture over ep whose all-to-alls run within its step
    (``experts_over``; not cut by split_dispatch) stays whole, since its experts' weight
    gradients are reached only back through the combine's all-to-all, which a weight step
    would issue a second time, and not at all on a rank whose experts got no rows that
    microbatch (its ep group then mismatches or hangs). A cut mixture's route stays whole
    too: its weight half would keep the gradient of every dispatched row (top_k rows a
    token, each as wide as the stream) for the router's small GEMM."""
    return data["type"] == NodeType.COMPUTE and data["phase"] == Phase.BACKWARD and \
        not data["recompute"] and bool(data["params"]) and "forward_of" in data and \
        "weight_grad" not in data and not data.get("experts_over") and \
        data.get("op") != Op.MOE_ROUTE


def split_step(graph: nx.DiGraph, node: str) -> str:
    """Split ``node`` in place: it keeps the input gradient and half its flops; a new
    ``W`` step, fed by what the node saved, computes the parameters' gradients and takes
    over the edges to the gradient buckets and from the input gathered again for them.
    Returns the new step's name."""
    data = graph.nodes[node]
    weight = "W" + node[1:] if node.startswith("B/") else f"W:{node}"
    graph.add_node(weight, **{**data, "flops": data["flops"] / 2, "weight_grad_of": node,
                              "stream": Stream.COMPUTE})
    data.update(flops=data["flops"] / 2, weight_grad=weight)
    graph.add_edge(node, weight, kind=EdgeKind.SAVED)
    for source, _, edge in list(graph.in_edges(node, data=True)):
        # the forward's input gathered again (gathered_inputs = regather): the weight
        # gradient reads it, the input gradient does not
        if edge.get("port") == Port.GATHERED:
            graph.remove_edge(source, node)
            graph.add_edge(source, weight, **edge)
    for _, target, edge in list(graph.out_edges(node, data=True)):
        # the parameter gradients' path, and the gradient norm that reads them
        if "bucket" in graph.nodes[target] or graph.nodes[target].get("op") == Op.GRAD_NORM:
            graph.remove_edge(node, target)
            graph.add_edge(weight, target, **edge)
    return weight


def _after_weight_halves(graph: nx.DiGraph, regather: str) -> None:
    """An input gathered again for a weight step (gathered_inputs = regather) starts after
    the weight halves of the steps it was ordered after, not after their input halves:
    the schedule defers the W steps, and a gather started with the input halves would
    hold every input of the chunk whole until its W block."""
    for source, _, edge in list(graph.in_edges(regather, data=True)):
        weight = graph.nodes[source].get("weight_grad")
        if edge.get("kind") == EdgeKind.ORDER and weight is not None:
            graph.remove_edge(source, regather)
            graph.add_edge(weight, regather, **edge)


def split_backward(graph: nx.DiGraph, ctx: PassContext) -> nx.DiGraph:
    pipeline = ctx.plan.schedule.pipeline
    if not schedules.named(pipeline).splits_backward:
        return graph
    out = ctx.working_copy(graph)
    chosen = [node for node, data in out.nodes(data=True) if splittable(data)]
    weights = [split_step(out, node) for node in chosen]
    for node in [n for n, data in out.nodes(data=True) if "regathers" in data]:
        _after_weight_halves(out, node)
    decisions = [{"node": node, "weight_step": weight}
                 for node, weight in zip(chosen, weights)]
    return record(out, PassRecord(
        "split_backward", True,
        f"split_backward: {len(chosen)} backward steps split into their input gradient "
        f"and a weight-gradient step in the chunk's W block (pipeline = {pipeline})",
        [{"what": "weight-gradient steps", "before": 0, "after": len(chosen)}], decisions))
