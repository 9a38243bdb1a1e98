"""``model { fp8 = blockwise }``: DeepSeek-V3's FP8 GEMMs, emulated.

DeepSeek-V3 (DeepSeek-AI 2024, section 3.3) multiplies in FP8 (E4M3) with fine-grained
scales: an activation in tiles of 1 x 128 (each token's features in groups of 128), a
weight in blocks of 128 x 128, one scale per tile or block, amax / 448; the three GEMMs of
a linear layer (its forward, the input gradient and the weight gradient) take FP8 inputs
and accumulate in higher precision. Megatron-Core calls it the ``blockwise`` recipe.

Here each input is quantised to E4M3 and straight back (``quantise, dequantise,
compute``): the GEMM itself runs in fp32 on what an FP8 GEMM would read, and its output is
cast to the model's dtype. The forward quantises the input in 1 x T tiles along its
features and each weight in T x T blocks (T: ``fp8_tile``, 128 unless written); the
backward quantises the output's gradient in 1 x T tiles along its features, weight by
weight where one GEMM computes several (q, k, v; gate, up), and multiplies it by the
quantised weights (input gradient) and by the quantised input kept from the forward
(weight gradient, the cached FP8 activation of the report). DeepSeek-V3 groups the weight
gradient's inputs 128 x 1 along the tokens, which ties the groups to how tokens are split
over ranks; tiles along the features keep every group inside one token, so that a plan
computes what one process computes, whatever its layout.

On a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper) the
forward and the input gradient run in FP8 for real (:func:`scaled_product`): each 1 x T
tile of the rows against its T x T block, through ``torch._scaled_mm`` with an fp32
output, then scaled by the two tiles' scales as the products are summed in fp32 (the
report's section 3.3.2: FP8 products promoted to fp32 every 128 elements, the scales
applied on promotion). On Hopper (compute capability 9.0) with cuBLAS 12.9 or later and
128-wide tiles, that is one call of PyTorch's scaled matmul with the recipe's own
scales, 1 x 128 for the rows and 128 x 128 for the weight, which cuBLASLt applies as it
promotes each tile's products: on an H200, 250-843 TFLOP/s at a mixture's widths where
the tile-by-tile calls reached 29-33 (bench/kernels_gpu.py --fp8;
:func:`blockwise_kernel` tries it once per device and falls back to the tile-by-tile
calls where it is refused or disagrees with them). The weight gradient cannot run in
FP8 here: its sum runs over tokens, along which a 1 x T tile's scale changes from one
token to the next, so no scale can be taken out of the product. It multiplies the same
decoded FP8 inputs on the bf16 tensor cores instead, each split into two bf16 parts
(:func:`split_product`, 2^-17 of the largest product from fp32's on the recipe's
inputs, where one bf16 GEMM is 2^-8 away), in place of one fp32 GEMM on CUDA cores some
15 times slower. With a tile that is not a multiple of 16 (the kernel's dimensions must
be), or on a CPU, the emulation runs. Hopper's FP8
tensor cores accumulate with about 14 bits inside a tile (the report's section 3.3.2),
so their products differ from the emulation's exact sums by about 2^-14 of a row's size.

Every group lies inside one weight and one token, and a tp shard of whole tiles
(:func:`planc.models.llama.fp8_blocks_split_over_tp` checks it) holds the same groups as
the whole tensor: a sharded run quantises exactly as the one-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from planc.runtime.backward_passes import asked_for, traceable
from planc.runtime.engine.fp8.codes import (E4M3, E5M2, EncodedRows, decoded_rows,
                                            encoded_blocks, encoded_rows, kept_bytes,
                                            quantised_blocks, quantised_rows, readable)
from planc.runtime.engine.fp8.groups import ONE_WEIGHT, Groups, side_by_side
from planc.runtime.engine.fp8.tensor_cores import (blockwise_kernel, blockwise_product,
                                                   scaled_product, split_product,
                                                   split_weight_gradient, tensor_cores,
                                                   tiled_product)
from planc.vocabulary.model_options import fp8_tile

# what the rest of planc reads of FP8, wherever in the package it is written
__all__ = ["E4M3", "EncodedRows", "GRADIENT_FORMATS", "Recipe", "blockwise_kernel",
           "blockwise_product", "decoded_rows", "encoded_blocks", "encoded_rows",
           "experts_swiglu", "joined_matmul", "kept_bytes", "matmul", "quantised_blocks",
           "quantised_rows", "readable", "recipe_of", "scaled_product", "split_product",
           "swiglu_down", "tensor_cores", "tiled_product"]

GRADIENT_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


@dataclass(frozen=True)
class Recipe:
    """A model's FP8 GEMMs: the scaling tile, and the format of the output gradients
    (E4M3 as DeepSeek-V3; E5M2 as TransformerEngine's HYBRID format)."""

    tile: int
    gradients: torch.dtype = E4M3


def recipe_of(model) -> Recipe | None:
    """``model``'s FP8 recipe, or None when it multiplies in its dtype."""
    tile = fp8_tile(model)
    if tile is None:
        return None
    return Recipe(tile, GRADIENT_FORMATS[model.options.get("fp8_gradients") or "e4m3"])


def _times_blocks(codes: torch.Tensor, scale: torch.Tensor, blocks, width: int
                  ) -> torch.Tensor:
    """:func:`scaled_product` cut to ``width`` columns, in the rows' leading shape."""
    return scaled_product(codes, scale, *blocks)[:, :width].reshape(
        *codes.shape[:-2], width)


def _expert_blocks(blocks, expert: int | None, transposed: bool = False):
    """Expert ``expert``'s codes and scales of encoded (stacked) blocks, transposed for
    an input gradient's product."""
    pair = tuple(Groups.weight(t, expert) for t in blocks)
    return tuple(t.t() for t in pair) if transposed else pair


class _Fp8Matmul(torch.autograd.Function):
    """``x @ [w_1 | w_2 | ...]`` with FP8 inputs in all three GEMMs (module docstring),
    its rows in :class:`Groups`; ``scaled``: the forward and the input gradient on FP8
    tensor cores. The backward keeps the input as FP8 bytes and scales (the report's
    cached activations) and the weights themselves, which the step holds anyway (a GEMM
    in the dtype keeps them so), and quantises them again: the same blocks, with no copy
    of the weights kept for every microbatch in flight. Each pass of a split backward
    computes the products it is asked for alone (planc.runtime.backward_passes)."""

    @staticmethod
    def forward(ctx, recipe: Recipe, scaled: bool, groups: Groups, x: torch.Tensor,
                *weights: torch.Tensor) -> torch.Tensor:
        codes, scale = encoded_rows(x, recipe.tile)
        ctx.recipe, ctx.scaled, ctx.groups, ctx.features = recipe, scaled, groups, x.shape[-1]
        ctx.widths = [w.shape[-1] for w in weights]
        ctx.dtypes = (x.dtype, [w.dtype for w in weights])
        ctx.save_for_backward(codes, scale, *weights)
        return _weights_product(codes, scale, weights, recipe.tile, scaled, x.shape[-1],
                                groups).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        codes, scale, *weights = ctx.saved_tensors
        wanted = asked_for(ctx, first=3)
        recipe, groups, (x_dtype, w_dtypes) = ctx.recipe, ctx.groups, ctx.dtypes
        parts = [encoded_rows(part, recipe.tile, recipe.gradients)
                 for part in grad.split(ctx.widths, -1)]

        def gradient_rows(rows: slice) -> torch.Tensor:
            return side_by_side([decoded_rows(part_codes[rows], part_scale[rows], width)
                                  for (part_codes, part_scale), width
                                  in zip(parts, ctx.widths)], -1)

        dx = None
        if wanted[3] and ctx.scaled:
            blocks = [encoded_blocks(w, recipe.tile) for w in weights]
            dx = groups.rows(lambda e, span: sum(
                _times_blocks(part_codes[span], part_scale[span],
                              _expert_blocks(block, e, True), ctx.features)
                for (part_codes, part_scale), block in zip(parts, blocks))).to(x_dtype)
        elif wanted[3]:
            dx = groups.rows(lambda e, span: gradient_rows(span)
                             @ _decoded_weights(weights, e, recipe.tile).t()).to(x_dtype)
        dws = [None] * len(weights)
        if any(wanted[4:]):
            dw = groups.weight_gradient(
                lambda rows: decoded_rows(codes[rows], scale[rows], ctx.features),
                gradient_rows,
                (ctx.features, sum(ctx.widths)), ctx.scaled, codes.device)
            dws = [part.to(dtype) if needed else None for part, dtype, needed in
                   zip(dw.split(ctx.widths, dim=-1), w_dtypes, wanted[4:])]
        return (None, None, None, dx, *dws)


def _decoded_weights(weights, expert: int | None, tile: int) -> torch.Tensor:
    """Expert ``expert``'s weights (the weights themselves for None) as their T x T
    blocks quantise them, side by side, in fp32: an expert's at a time, so that no fp32
    copy of a rank's every expert is made (each weight of a stack is quantised as it
    would be alone: the same bits)."""
    return side_by_side([quantised_blocks(Groups.weight(w, expert), tile)
                          for w in weights], -1)


def _weights_product(codes: torch.Tensor, scale: torch.Tensor, weights, tile: int,
                     scaled: bool, features: int, groups: Groups) -> torch.Tensor:
    """Rows in FP8 (:func:`encoded_rows`) times the weights side by side, each in T x T
    blocks, in fp32, each expert's rows by its own (``groups``): on the tensor cores
    (``scaled``), or emulated."""
    if scaled:
        blocks = [encoded_blocks(w, tile) for w in weights]
        return groups.rows(lambda e, span: side_by_side(
            [_times_blocks(codes[span], scale[span], _expert_blocks(block, e), w.shape[-1])
             for block, w in zip(blocks, weights)], -1))
    return groups.rows(lambda e, span: decoded_rows(codes[span], scale[span], features)
                       @ _decoded_weights(weights, e, tile))


class _Fp8SwiGLUDown(torch.autograd.Function):
    """``(silu(gate) * up) @ down`` as DeepSeek-V3 runs a mixture's SwiGLU (section 3.3.4,
    low-precision storage), gate and up side by side in one tensor (``gate_up``, the
    joined GEMM's output): they are kept in FP8 (1 x T tiles of each) and the output is
    recomputed from them in the backward, where :class:`_Fp8Matmul` would keep the
    product as the down GEMM's cached input; the down GEMM's three products in FP8 as in
    :class:`_Fp8Matmul`, its rows in :class:`Groups`, the backward's weight gradient
    reading the recomputed product, and the weight kept itself and quantised again; each
    pass of a split backward computes what it is asked for (the weight's gradient in the
    weights' pass alone). The gradient of ``gate_up`` is written into one tensor, half by
    half: two halves would be joined by a copy of it all (autograd's own backward of a
    split)."""

    @staticmethod
    def forward(ctx, recipe: Recipe, scaled: bool, groups: Groups, gate_up: torch.Tensor,
                down: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        tile, n = recipe.tile, gate_up.shape[-1] // 2
        gate, up = gate_up[..., :n], gate_up[..., n:]
        activated = F.silu(gate) * up
        product = encoded_rows(activated if weights is None else activated * weights, tile)
        out = _weights_product(*product, (down,), tile, scaled, n, groups)
        ctx.recipe, ctx.scaled, ctx.groups, ctx.dtypes, ctx.features = recipe, scaled, \
            groups, (gate_up.dtype, down.dtype), n
        ctx.weighted = weights is not None
        ctx.save_for_backward(*encoded_rows(gate, tile), *encoded_rows(up, tile), down,
                              *((weights,) if ctx.weighted else ()))
        return out.to(gate_up.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_codes, gate_scale, up_codes, up_scale, down, *weights = ctx.saved_tensors
        wanted = asked_for(ctx, first=3)
        recipe, groups, (dtype, w_dtype), n = ctx.recipe, ctx.groups, ctx.dtypes, ctx.features
        codes, scale = encoded_rows(grad, recipe.tile, recipe.gradients)
        inputs_wanted = wanted[3] or (weights and wanted[5])
        width, lead, device = grad.shape[-1], gate_codes.shape[:-2], down.device
        split = ctx.scaled and split_weight_gradient(device)
        blocks = encoded_blocks(down, recipe.tile) if inputs_wanted and ctx.scaled \
            else None  # emulated: each expert's decoded as its rows need it
        dw = groups.gradient_stack((n, width), device) if wanted[4] else None
        # the inputs' gradients, a run's rows at a time: gate's and up's side by side
        made = {} if not inputs_wanted else {
            "gate_up": grad.new_empty(*lead, 2 * n, dtype=dtype),
            **({"weights": grad.new_empty(*lead, 1, dtype=dtype)} if weights else {})}

        # A run of experts at a time (Groups.runs); in a run each row-wide temporary goes
        # as soon as it is read for the last time, and the gate's factor is computed in
        # place: the same operations in the same order (a product's operands commute
        # exactly), with fewer of them alive at once.
        for rows, spans in groups.runs():
            gate = decoded_rows(gate_codes[rows], gate_scale[rows], n).to(dtype)
            up = decoded_rows(up_codes[rows], up_scale[rows], n).to(dtype)
            silu = F.silu(gate)
            activated = silu * up
            run_codes, run_scale = codes[rows], scale[rows]
            gq = decoded_rows(run_codes, run_scale, width) \
                if wanted[4] or (inputs_wanted and not ctx.scaled) else None
            if wanted[4]:  # the down GEMM's weight gradient reads the product recomputed
                product = activated * weights[0][rows] if weights else activated
                dw = groups.products(dw, spans, quantised_rows(product, recipe.tile), gq,
                                     split)
                del product
            if not inputs_wanted:
                continue
            if ctx.scaled:
                d_product = side_by_side([_times_blocks(
                    run_codes[span], run_scale[span], _expert_blocks(blocks, e, True), n)
                    for e, span in spans], 0).to(dtype)
            else:
                d_product = side_by_side(
                    [gq[span] @ _decoded_weights((down,), e, recipe.tile).t()
                     for e, span in spans], 0).to(dtype)
            gq = None
            if weights:  # the product's gradient to each row's weight, then through it
                made["weights"][rows] = (d_product * activated).sum(-1, keepdim=True)
                d_product = d_product * weights[0][rows]
            del activated
            joined = made["gate_up"][rows]
            torch.mul(d_product, silu, out=joined[..., n:])  # up's
            del silu
            sigmoid = torch.sigmoid(gate)
            factor = (1 - sigmoid).mul_(gate).add_(1)  # 1 + gate * (1 - sigmoid)
            joined[..., :n] = (d_product * up).mul_(sigmoid).mul_(factor)  # gate's
        dw = None if dw is None else dw.to(w_dtype)
        # (weights given or not: as many gradients as the forward had inputs)
        return (None, None, None, made.get("gate_up"), dw,
                made.get("weights") if weights else None)[:len(ctx.needs_input_grad)]


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                recipe: Recipe, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ down`` in FP8, keeping gate and up in FP8 for the backward
    rather than the product (:class:`_Fp8SwiGLUDown`); ``weights`` (rows x 1): a routed
    expert's routing weights, applied to the product before the down GEMM (Megatron-Core's
    weighted SwiGLU), kept in the dtype."""
    return _Fp8SwiGLUDown.apply(recipe, tensor_cores(gate.device, recipe.tile), ONE_WEIGHT,
                                torch.cat([gate, up], dim=-1), traceable(down),
                                traceable(weights))


def experts_swiglu(rows: torch.Tensor, scales: torch.Tensor | None, counts: list[int] | None,
                   gate, up, down, recipe: Recipe) -> torch.Tensor:
    """Experts' SwiGLU in FP8, each row weighted by its ``scales`` where given (a routed
    expert's routing weight, :func:`swiglu_down`): a rank's routed experts, ``rows`` in
    expert order, ``counts[e]`` of expert e's, by the stacked weights (experts x in x
    out) ``gate``, ``up`` and ``down``, each GEMM and each quantisation one operation over
    every expert (:class:`Groups`); or, without ``counts``, one expert (a shared one) by
    its own weights."""
    scaled = tensor_cores(rows.device, recipe.tile)
    groups = ONE_WEIGHT if counts is None else Groups(tuple(counts))
    gate_up = _Fp8Matmul.apply(recipe, scaled, groups, traceable(rows), traceable(gate),
                               traceable(up))
    return _Fp8SwiGLUDown.apply(recipe, scaled, groups, gate_up, traceable(down),
                                traceable(scales))


def matmul(x: torch.Tensor, weights: list[torch.Tensor], recipe: Recipe | None
           ) -> torch.Tensor:
    """``x @ cat(weights, dim=1)``: in FP8 by ``recipe``, else as it is."""
    if recipe is None:
        return x @ weights[0] if len(weights) == 1 else joined_matmul(x, weights)
    return _Fp8Matmul.apply(recipe, tensor_cores(x.device, recipe.tile), ONE_WEIGHT,
                            traceable(x), *map(traceable, weights))


def joined_matmul(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """``x @ cat(weights, dim=1)`` in one GEMM (llama's q, k and v; gate and up), with
    autograd's own derivative, which computes only the gradients a backward asks for (a
    split backward's two halves each their own); but what it keeps of the concatenation
    is the weights themselves, joined again when a backward reads it: autograd would keep
    a copy of the layer's weights for every microbatch in flight. The same operations as
    ``x @ cat(weights)``, so the same bits (tests/test_llama.py). Hooks a caller set (a
    recipe that makes ``x`` again: planc.runtime.families.recomputed_output), which these
    replace while they are on, still keep what the GEMM saves of anything else."""
    joined = torch.cat(weights, dim=1)
    storage = joined.untyped_storage().data_ptr()
    outer = _outer_hooks()

    def pack(saved: torch.Tensor):
        if saved.untyped_storage().data_ptr() == storage:
            return _Pieces(tuple(weights), saved.shape, saved.stride(), saved.storage_offset())
        return saved if outer is None else (outer, outer[0](saved))

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpacked):
        return x @ joined


def _outer_hooks():
    """The saved-tensor hooks in force (pack, unpack), or None: autograd applies only the
    innermost pair, so a pair pushed inside another hands on what it does not keep itself.
    torch's own accessor (its context manager keeps a stack of them); None where a torch
    lacks it, and the caller's hooks then see nothing (they check)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class _Pieces:
    """A concatenation of weights as a backward keeps it: the weights, and the layout of
    the view of their concatenation the GEMM saved."""

    def __init__(self, weights: tuple[torch.Tensor, ...], shape, stride, offset: int):
        self.weights, self.shape, self.stride, self.offset = weights, shape, stride, offset


def _unpacked(saved):
    if isinstance(saved, tuple):  # what the outer hooks packed, by them
        (_, unpack), packed = saved
        return unpack(packed)
    if not isinstance(saved, _Pieces):
        return saved
    return torch.cat(saved.weights, dim=1).as_strided(saved.shape, saved.stride,
                                                      saved.offset)


