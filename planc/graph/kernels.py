"""The attributes of an operator's compute node that its kernel reads: how it runs on
its shards."""

from __future__ import annotations

from planc.estimate.model import Shapes
from planc.graph.mixture import in_kernel_collectives
from planc.graph.parameters import param_name
from planc.graph.sharding import S
from planc.graph.tensor_parallel import OpLayout
from planc.models.family import Family
from planc.plan.plan import Plan


def kernel_attributes(plan: Plan, family: Family, shapes: Shapes, op: str,
                      layer: int | None, layout: OpLayout) -> dict:
    """What the runtime needs to run the operator on its shards: its layouts, the
    parameters it reads (and the slice it reads of a replicated one), the bias of a
    row-parallel producer it adds, and whether it works on a slice of the vocabulary."""
    tp = plan.mesh.tp
    attrs: dict = {"tp_input": str(layout.input), "tp_output": str(layout.output),
                   "params": [param_name(u.name, layer) for u in layout.params]}
    slices = {}
    for use in layout.params:
        data = use.data
        if tp > 1 and not use.storage.is_sharded and data.is_sharded and \
                data.dim in use.dims and data.dim != "seq":
            slices[param_name(use.name, layer)] = [data.dim, use.dims.index(data.dim)]
        if tp > 1 and use.shared_slice is not None:
            slices[param_name(use.name, layer)] = list(use.shared_slice)
    if slices:
        attrs["param_slices"] = slices
    if layout.bias_from:
        attrs["bias"] = param_name(f"{layout.bias_from}.bias", layer)
    if op == "embedding":
        attrs["vocab_parallel"] = tp > 1 and layout.params[0].storage == S("vocab")
    if op == "loss":
        attrs["vocab_parallel"] = tp > 1 and layout.input == S("vocab")
    rule = family.rules.get(op)
    if rule is not None:  # a mixture's all-to-alls over ep, its counts' all-reduce
        attrs.update(in_kernel_collectives(plan, rule, shapes, layout))
    return attrs
