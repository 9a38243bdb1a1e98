"""The largest gradient one backward step of a stage returns for its parameters, which
the memory estimate (planc.estimate.memory) counts beside everything else the step holds,
and the layers that stand for a stage's blocks when it is worked out."""

from __future__ import annotations

import functools

from planc.estimate.parameter_counts import _local_elements
from planc.models import family_of, moe
from planc.plan.plan import Model, Plan

FP32_BYTES = 4


def one_layer_of_each_block(plan: Plan, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The model's first layer of each block among ``layers`` (a mixture's and a dense
    block's), in order: the layers of one block hold the same parameters and activations,
    and stages that hold the same blocks get the same layers, so that what is worked out
    from them is shared (:func:`_largest_step_gradient_bytes`)."""
    family, m = family_of(plan), plan.model
    if family.layer_block is None:
        return (0,) if layers else ()
    first = dict(_first_layer_of_each_block(m))
    return tuple(sorted({first[family.block(m, layer)] for layer in layers}))


@functools.lru_cache(maxsize=1 << 8)  # asked for every stage, of every layout tune tries
def _first_layer_of_each_block(m: Model) -> tuple[tuple[tuple, int], ...]:
    family, first = family_of(m), {}
    for layer in range(m.layers):
        first.setdefault(family.block(m, layer), layer)
    return tuple(first.items())


def largest_step_gradient_bytes(plan: Plan, stage: int) -> float:
    """The largest gradient one backward step of the stage returns for its parameters,
    alive beside everything else while that step's backward runs: autograd returns it
    whole, in fp32 (the rank's parameters are fp32 leaves), before the interpreter adds
    it into the rank's gradient (planc.runtime.engine.interpreter; Megatron-LM's
    gradient-accumulation fusion writes into its main gradient instead). A step's
    parameters are its rule's: a linear's weights, a norm's, the embedding's table, the
    head's, a mixture's (its router, its routed experts on this rank, its shared experts,
    each a step of their own where it is cut at its all-to-alls). The largest is the
    head's or embedding's vocabulary table, or a mixture's routed experts."""
    return _largest_step_gradient_bytes(
        plan, one_layer_of_each_block(plan, plan.layers_of_stage(stage)), stage == 0,
        stage == plan.head_stage)


@functools.lru_cache(maxsize=1 << 12)  # planc tune asks for every stage of thousands
def _largest_step_gradient_bytes(plan: Plan, layers: tuple[int, ...], embedding: bool,
                                 head: bool) -> float:
    family, m, ep = family_of(plan), plan.model, plan.mesh.ep
    cut = moe.cut_over_ep(plan)
    groups: list[list] = []
    for layer in layers:
        prefix = f"layers.{layer}."
        by_name = {p.name[len(prefix):]: p for p in family.layer_parameters(m, layer)}
        for rule in family.rules.values():
            owned = [n for n in (*(w.name for w in rule.weights), *rule.params,
                                 *((rule.bias,) if rule.bias else ())) if n in by_name]
            pieces = ("router.", "experts.", "shared.") if rule.expert_parallel and cut \
                else ("",)
            groups += [[by_name[n] for n in owned if n.startswith(piece)] for piece in pieces]
    if embedding:
        groups += [[p] for p in family.embedding_parameters(m)]
    if head:
        groups += [[p] for p in family.head_parameters(m)]
    largest = max((_local_elements(plan, group) + sum(
        p.numel // ep for p in group if p.split_over_experts(ep)) for group in groups),
        default=0)
    return largest * FP32_BYTES
