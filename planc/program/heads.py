"""How a dimension made of heads is cut over tensor-parallel ranks: one rule, shared by
the compiler (planc.models, which describes each family's head groups) and the runtime
(planc.runtime.engine.model, which cuts tensors by the groups the build's model table lists).
Torch-free and free of the plan, so that the runtime can import it."""

from __future__ import annotations


def split_units(units: int, parts: int, index: int) -> tuple[int, int]:
    """(first unit, count) of part ``index`` when ``units`` heads are cut ``parts`` ways:
    contiguous blocks when parts divides units; when units divides parts, each unit is
    replicated on parts / units consecutive ranks (Megatron's grouped-query attention
    with fewer key/value heads than tensor-parallel ranks)."""
    if units % parts == 0:
        size = units // parts
        return index * size, size
    if parts % units == 0:
        return index // (parts // units), 1
    raise ValueError(f"{units} heads cannot be split {parts} ways")
