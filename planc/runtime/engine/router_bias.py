"""``model moe { bias_update }`` on a rank: the step's expert loads, and the bias update.

The compiler wrote both steps (planc.graph.router_bias) with the stage's mixture blocks
(``router_layers``); between them the program's all-reduce over the stage sums the loads
(planc.runtime.engine.transfers). The mixtures' forwards (planc.runtime.families.moe) route
with the biases held in the store and count each microbatch's choices, once per block and
microbatch, a recomputed forward overwriting its own count with the same one.
"""

from __future__ import annotations

import torch

from planc.runtime.engine.kernels import taken
from planc.runtime.families.moe_gate import update_bias
from planc.vocabulary.model_options import balance_bias_name, balanced_layers

FP32, FP64 = torch.float32, torch.float64


def shapes(model) -> dict[str, list[int]]:
    """Every stage's biases, by name, with their shapes: what a checkpoint holds."""
    return {name: [model.experts] for name in beside(model)}


def beside(model) -> dict[str, str]:
    """Every bias, by name, with the parameter whose stage keeps it: its block's router."""
    return {balance_bias_name(layer): f"layers.{layer}.router.weight"
            for layer in balanced_layers(model)}


def hold(buffers: dict[str, torch.Tensor], layers: tuple[int, ...], experts: int,
         device) -> None:
    """The stage's biases, zero before the first update (a checkpoint fills them)."""
    for layer in layers:
        buffers.setdefault(balance_bias_name(layer),
                           torch.zeros(experts, dtype=FP32, device=device))


def loads(chosen: dict[tuple, torch.Tensor], step: int, layers: tuple[int, ...],
          experts: int, device) -> torch.Tensor:
    """This rank's counts of ``step``, (blocks x experts) in fp64, block by block as
    ``layers`` lists them; forgets them."""
    out = torch.zeros(len(layers), experts, dtype=FP64, device=device)
    row = {layer: i for i, layer in enumerate(layers)}
    for (_, _, layer), per_expert in taken(chosen, step).items():
        out[row[layer]] += per_expert.to(FP64)
    return out.reshape(-1)


def update(buffers: dict[str, torch.Tensor], summed: torch.Tensor,
           layers: tuple[int, ...], rate: float) -> None:
    """Every block's bias moved by the stage's summed loads."""
    for layer, load in zip(layers, summed.reshape(len(layers), -1)):
        update_bias(buffers[balance_bias_name(layer)], load, rate)


def imbalance(summed: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The busiest expert's load over the mean, the worst of the blocks: what the bias
    works against (MaxVio + 1 in Wang et al. 2024, per block and step); a tensor, read
    once the step has ended."""
    loads = summed.reshape(len(layers), -1)
    return (loads.max(dim=1).values / loads.mean(dim=1)).max()
