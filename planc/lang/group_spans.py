"""Warnings about where a valid plan puts its groups: a tensor-parallel group that spans
nodes.

Tensor parallelism all-reduces the activations of every layer, twice in the forward and
twice in the backward of each microbatch (Shoeybi et al., Megatron-LM, 2019), so
Megatron-LM keeps each tp group inside a node, on NVLink. A plan may do otherwise (the
mesh order or a node smaller than tp), and then pays for it with the inter-node link on
the critical path of every layer; planc says so, with the estimated cost per step.
"""

from __future__ import annotations

from math import lcm

from planc.diagnostics import Diagnostic, warning
from planc.vocabulary.units import TIME, format_bytes, format_quantity
from planc.plan.layout import Layout
from planc.plan.plan import Plan
from planc.diagnostics import counted

ALL_REDUCES_PER_LAYER = 4  # per microbatch: 2 in the forward, 2 in the backward


def crossing_tp_group(layout: Layout) -> tuple[int, ...] | None:
    """The first tp group whose members lie on more than one node, or None. The groups'
    placement repeats every lcm(tp stride x tp, devices_per_node) ranks, so only the
    groups that start within one such period are looked at."""
    stride, size, per_node = layout.strides["tp"], layout.mesh.tp, layout.devices_per_node
    period = min(layout.world, lcm(stride * size, per_node))
    for block in range(0, period, stride * size):
        for first in range(block, block + stride):  # the members at tp coordinate 0
            if first // per_node != (first + (size - 1) * stride) // per_node:
                return layout.group(first, "tp")
    return None


def tp_placement_warnings(plan: Plan) -> list[Diagnostic]:
    """A warning at the mesh's tp when a tp group spans nodes, with the estimated time of
    the tp all-reduces per step between nodes and inside one, and how to keep tp inside
    a node."""
    mesh, topology = plan.mesh, plan.topology
    if mesh.tp == 1 or topology.nodes == 1:
        return []
    layout = Layout.of(plan)
    members = crossing_tp_group(layout)
    if members is None:
        return []
    from planc.estimate.cost import CostModel, Placement  # imported only for a plan that needs it

    per_node = topology.devices_per_node
    nodes = sorted({layout.node(r) for r in members})
    shown = (", ".join(map(str, members)) if len(members) <= 8 else
             ", ".join(map(str, members[:4])) + f", ... {members[-1]}")
    where = (f"nodes {', '.join(map(str, nodes[:-1]))} and {nodes[-1]}" if len(nodes) <= 4
             else f"{len(nodes)} nodes")
    model = plan.model
    activation = plan.microbatch_size * (model.seq // mesh.cp) * model.hidden * \
        model.dtype_bytes
    layers = max(len(plan.layers_of_stage(stage))
                 for stage in range(mesh.pp))
    count = ALL_REDUCES_PER_LAYER * layers * plan.schedule.microbatches
    cost = CostModel(topology)
    across = count * cost.ring_seconds("all_reduce", activation,
                                       Placement.of(members, per_node))
    inside = count * cost.ring_seconds("all_reduce", activation,
                                       Placement.within_node(mesh.tp))
    ratio = f", {across / inside:.1f} times as long" if inside > 0 and across > inside else ""
    return [warning(
        f"tp group [{shown}] spans {where}: the tensor-parallel all-reduces of every layer "
        f"cross the inter-node link",
        plan.sources.span("mesh.tp", "mesh", "plan"),
        f"estimated {format_quantity(across, TIME)} per step on each device for "
        f"{count:,} all-reduces of {format_bytes(activation)} (2 per layer in the "
        f"forward and 2 in the backward, per microbatch), against "
        f"{format_quantity(inside, TIME)} inside one node{ratio}",
        _keep_inside(plan))]


def _keep_inside(plan: Plan) -> str:
    """How to put every tp group on one node, as Megatron-LM does."""
    tp, order = plan.mesh.tp, plan.mesh.order
    per_node = plan.topology.devices_per_node
    if tp > per_node:
        return (f"a node has {counted(per_node, 'device')} and a tp group {tp}: use nodes "
                f"of {tp} or more devices (devices_per_node) or a smaller tp, as Megatron-LM "
                f"keeps tensor parallelism inside a node")
    fixes = []
    if order[0] != "tp":
        fixes.append(f"put tp first in the mesh order (order = "
                     f"[{', '.join(('tp',) + tuple(a for a in order if a != 'tp'))}])")
    if per_node % tp:
        fixes.append(f"make devices_per_node ({per_node}) a multiple of tp = {tp}")
    return (" and ".join(fixes) + f", so that each tp group is {tp} consecutive ranks of one "
            f"node, as Megatron-LM places them")
