"""optimize { recompute_moe_activation }: an expert's SwiGLU product computed again in the
backward rather than kept (Megatron-Core's ``recompute_modules`` "moe_act", its
``CheckpointWithoutOutput`` around the experts' activation function).

The down projection's backward reads its input, the product ``silu(gate) * up`` (times the
routing weight), for the weight gradient. The SwiGLU's own backward keeps gate, up and the
weight anyway (planc.runtime.families.llama.SiluTimes), so what the down projection keeps
of the product can be how to compute it from them: the product's bytes go when the
forward is done, one expert-FFN-wide tensor per routed row less for every microbatch in
flight, for one more elementwise pass in the backward. The same operations compute it
again (llama.silu_times), so the gradients are the same bits.
"""

from __future__ import annotations

from typing import Callable

import torch

from planc.runtime.families import llama


def down_of_product(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None,
                    project: Callable[[torch.Tensor], torch.Tensor], again: bool
                    ) -> torch.Tensor:
    """``project(silu(gate) * up * scale)``, the down projection of the SwiGLU's product;
    with ``again``, what ``project``'s backward saves of the product (the whole, or views
    of it) is kept as a :class:`_Product` to compute it again from."""
    product = llama.SiluTimes.apply(gate, up, scale)
    if not again:
        return project(product)
    source = _Product(gate, up, scale, product)
    with torch.autograd.graph.saved_tensors_hooks(source.pack, _unpacked):
        return project(product)


def product_recomputed(m) -> bool:
    """Whether the model table says so (optimize { recompute_moe_activation })."""
    return bool(getattr(m, "recompute_moe_activation", False))


class _Product:
    """How to compute a SwiGLU product again: its inputs (detached: the SwiGLU's backward
    keeps the same tensors), and the storage its saved views are of. The product computed
    again is shared by every view a backward unpacks (one per expert where each runs its
    own GEMM) and dropped after the last of those packed."""

    def __init__(self, gate, up, scale, product: torch.Tensor):
        self.inputs = tuple(None if t is None else t.detach() for t in (gate, up, scale))
        self.storage = product.untyped_storage().data_ptr()
        self.layout = (product.shape, product.stride())
        self.packed = 0  # views saved, not yet unpacked
        self.whole: torch.Tensor | None = None

    def pack(self, saved: torch.Tensor):
        if saved.untyped_storage().data_ptr() != self.storage:
            return saved  # the weights, or anything else the GEMM keeps: as it is
        self.packed += 1
        return _View(self, tuple(saved.shape), saved.stride(), saved.storage_offset())

    def view(self, shape, stride, offset: int) -> torch.Tensor:
        whole = self.whole
        if whole is None:
            with torch.no_grad():
                whole = llama.silu_times(*self.inputs)
            if (whole.shape, whole.stride()) != self.layout:
                raise RuntimeError("the SwiGLU product computed again is not laid out as "
                                   "the forward's")
        self.packed -= 1
        self.whole = whole if self.packed > 0 else None
        return whole.as_strided(shape, stride, offset)


class _View:
    __slots__ = ("source", "shape", "stride", "offset")

    def __init__(self, source: _Product, shape, stride, offset: int):
        self.source, self.shape, self.stride, self.offset = source, shape, stride, offset


def _unpacked(saved):
    if not isinstance(saved, _View):
        return saved
    return saved.source.view(saved.shape, saved.stride, saved.offset)
