"""optimize { recompute_moe_activation }: an expert's SwiGLU product computed again in the
backward rather than kept (Megatron-Core's ``recompute_modules`` "moe_act", its
``CheckpointWithoutOutput`` around the experts' activation function), by
planc.runtime.families.recomputed_output.
"""

from __future__ import annotations

from typing import Callable

import torch

from planc.runtime.families import llama
from planc.runtime.families.recomputed_output import kept_as_recipe


def down_of_product(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None,
                    project: Callable[[torch.Tensor], torch.Tensor], again: bool
                    ) -> torch.Tensor:
    """``project(silu(gate) * up * scale)``, the down projection of the SwiGLU's product;
    with ``again``, what ``project``'s backward saves of the product (the whole, or views
    of it) is kept as how to compute it again."""
    product = llama.SiluTimes.apply(gate, up, scale)
    if not again:
        return project(product)
    inputs = tuple(None if t is None else t.detach() for t in (gate, up, scale))
    with kept_as_recipe(product, lambda: llama.silu_times(*inputs)):
        return project(product)


def product_recomputed(m) -> bool:
    """Whether the model table says so (optimize { recompute_moe_activation })."""
    return bool(getattr(m, "recompute_moe_activation", False))
