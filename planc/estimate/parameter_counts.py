"""Parameter elements on one device, by stage, block and tensor: how a model family's
parameters split over tp (Megatron-LM's column- and row-parallel linears, Shoeybi et al.
2019) and a mixture's routed experts over ep (GShard, Lepikhin et al. 2021). What the
memory estimate multiplies by the ZeRO paper's bytes per parameter."""

from __future__ import annotations

from planc.models import family_of
from planc.models.family import shares_heads
from planc.plan.plan import Plan


def _local_elements(plan: Plan, params) -> int:
    """Elements of ``params`` on one tp rank, as the placements of the model's family
    store them (Megatron-LM: a column-parallel weight and bias and a row-parallel weight
    are split; a row-parallel bias, norms and shared k/v heads are whole)."""
    split, ep = _split_over_tp(plan), plan.mesh.ep
    # a routed expert's weights are counted by _expert_elements
    return sum(_on_one_device(plan, param, split) for param in params
               if not param.split_over_experts(ep))


def local_parameter_elements(plan: Plan) -> dict[str, int]:
    """Every parameter's global name -> its elements on one device (split over tp as
    :func:`_local_elements` counts, a routed expert's over ep)."""
    split = _split_over_tp(plan)
    return {param.name: _on_one_device(plan, param, split)
            for param in family_of(plan).all_parameters(plan.model)}


def _on_one_device(plan: Plan, param, split: set[str]) -> int:
    """``param``'s elements on one device: a routed expert's split over ep, a parameter
    that tp splits (``split``: block-local names) over tp, any other whole."""
    if param.split_over_experts(plan.mesh.ep):
        return param.numel // plan.mesh.ep
    local = param.name.split(".", 2)[-1] if param.layer is not None else param.name
    return param.numel // (plan.mesh.tp if local in split else 1)


def _split_over_tp(plan: Plan) -> set[str]:
    """The parameters (block-local names) that tp splits."""
    family, tp, tensor = family_of(plan), plan.mesh.tp, plan.shard.tp
    split: set[str] = set()
    for rule in family.rules.values():
        if rule.column_weights and getattr(tensor, rule.placement) == "column":
            split.update(w.name for w in rule.column_weights)
        if rule.kind != "linear":
            continue
        placement = getattr(tensor, rule.placement)
        for w in rule.weights:
            if placement in ("column", "vocab") and not shares_heads(family, plan.model, tp, w.fan_out) or \
                    placement == "row":
                split.add(w.name)
        if rule.bias is not None and placement in ("column", "vocab"):
            split.add(rule.bias)
    if tensor.embedding != "replicate":
        split.add("embedding.weight")
    return split


def stage_expert_parameters(plan: Plan, stage: int) -> int:
    """Elements of the routed experts split over ep held by one device of ``stage``:
    its experts' rows, experts / ep of them (0 without mesh { ep })."""
    return sum(layer_expert_parameters(plan, layer) for layer in plan.layers_of_stage(stage))


def layer_expert_parameters(plan: Plan, layer: int) -> int:
    """Elements of block ``layer``'s routed experts split over ep on one device (0
    without mesh { ep })."""
    ep = plan.mesh.ep
    if ep == 1:
        return 0
    return sum(p.numel // ep for p in family_of(plan).layer_parameters(plan.model, layer)
               if p.split_over_experts(ep))


def layer_parameters(plan: Plan, layer: int = 0) -> int:
    """Parameter elements of transformer block ``layer`` on one tp rank."""
    return _local_elements(plan, family_of(plan).layer_parameters(plan.model, layer))


def stage_parameters(plan: Plan, stage: int, per_layer: int | None = None) -> int:
    """Parameter elements held by one device of pipeline stage ``stage``; ``per_layer``:
    :func:`layer_parameters` of a model whose blocks are all alike, if known."""
    m, tensor, tp = plan.model, plan.shard.tp, plan.mesh.tp
    family = family_of(plan)
    embedding_table = m.vocab * m.hidden // (tp if tensor.embedding != "replicate" else 1)
    head_table = m.vocab * m.hidden // (tp if tensor.head != "replicate" else 1)
    if family.layer_block is None:  # every block alike
        count = len(plan.layers_of_stage(stage)) * (layer_parameters(plan) if per_layer is None
                                                     else per_layer)
    else:
        count = sum(layer_parameters(plan, layer) for layer in plan.layers_of_stage(stage))
    if stage == 0:
        count += _local_elements(plan, family.embedding_parameters(m))
    if stage == plan.head_stage:
        count += sum(p.numel for p in family.head_parameters(m)
                     if p.name != "head.weight")  # the final norm
        # A tied head on its own stage keeps a copy of the embedding (Megatron).
        if not m.tie_embeddings or plan.head_stage != 0:
            count += embedding_table if m.tie_embeddings else head_table
    return count
