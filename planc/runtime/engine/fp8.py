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

Every group lies inside one weight and one token, and a tp shard of whole tiles
(:func:`planc.models.llama.fp8_blocks_split_over_tp` checks it) holds the same groups as
the whole tensor: a sharded run quantises exactly as the one-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from planc.vocabulary.model_options import fp8_tile

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# the largest finite number of each format (OCP 8-bit floating point specification)
LARGEST = {E4M3: 448.0, E5M2: 57344.0}
GRADIENT_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
FP32 = torch.float32


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


def _encoded(groups: torch.Tensor, dims: tuple[int, ...], form: torch.dtype = E4M3
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group (the elements along ``dims``) in ``form`` and its fp32 scale, amax over
    the format's largest number (1 for a group of zeros)."""
    scale = groups.abs().amax(dim=dims, keepdim=True) / LARGEST[form]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (groups / scale).to(form), scale


def _quantised(groups: torch.Tensor, dims: tuple[int, ...], form: torch.dtype = E4M3
               ) -> torch.Tensor:
    """Each group rounded to ``form`` with its scale and scaled back, in fp32."""
    codes, scale = _encoded(groups, dims, form)
    return codes.to(FP32) * scale


def _row_groups(x: torch.Tensor, tile: int) -> torch.Tensor:
    """``x`` (..., n) as tiles of 1 x ``tile`` along its last dimension, zero-padded."""
    return F.pad(x.to(FP32), (0, -x.shape[-1] % tile)).reshape(*x.shape[:-1], -1, tile)


def quantised_rows(x: torch.Tensor, tile: int, form: torch.dtype = E4M3) -> torch.Tensor:
    """``x`` (..., n) quantised to ``form`` in tiles of 1 x ``tile`` along its last
    dimension (the last tile shorter when ``tile`` does not divide n), in fp32."""
    n = x.shape[-1]
    return _quantised(_row_groups(x, tile), (-1,), form).reshape(*x.shape[:-1], -1)[..., :n]


def encoded_rows(x: torch.Tensor, tile: int, form: torch.dtype = E4M3
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as :func:`quantised_rows` rounds it, kept as it would be in memory: one byte
    of ``form`` an element and an fp32 scale a tile (the FP8 activation a linear layer
    keeps for its backward)."""
    return _encoded(_row_groups(x, tile), (-1,), form)


def decoded_rows(codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """What :func:`encoded_rows` encoded, in fp32: :func:`quantised_rows` of it."""
    return (codes.to(FP32) * scale).reshape(*codes.shape[:-2], -1)[..., :n]


def quantised_blocks(w: torch.Tensor, tile: int) -> torch.Tensor:
    """A weight (k, n) quantised in ``tile`` x ``tile`` blocks, in fp32."""
    k, n = w.shape
    padded = F.pad(w.to(FP32), (0, -n % tile, 0, -k % tile))
    rows, cols = padded.shape
    groups = padded.reshape(rows // tile, tile, cols // tile, tile)
    return _quantised(groups, (1, 3)).reshape(rows, cols)[:k, :n]


class _Fp8Matmul(torch.autograd.Function):
    """``x @ [w_1 | w_2 | ...]`` with FP8 inputs in all three GEMMs (module docstring)."""

    @staticmethod
    def forward(ctx, recipe: Recipe, x: torch.Tensor, *weights: torch.Tensor
                ) -> torch.Tensor:
        tile = recipe.tile
        codes, scale = encoded_rows(x, tile)
        xq = decoded_rows(codes, scale, x.shape[-1])
        wq = torch.cat([quantised_blocks(w, tile) for w in weights], dim=1)
        ctx.recipe, ctx.widths, ctx.features = recipe, [w.shape[1] for w in weights], \
            x.shape[-1]
        ctx.dtypes = (x.dtype, [w.dtype for w in weights])
        # the input kept as FP8 bytes and scales (the report's cached activations); the
        # weights' blocks, which a kernel would quantise again, kept decoded
        ctx.save_for_backward(codes, scale, wq)
        return (xq @ wq).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        codes, scale, wq = ctx.saved_tensors
        xq = decoded_rows(codes, scale, ctx.features)
        recipe, (x_dtype, w_dtypes) = ctx.recipe, ctx.dtypes
        gq = torch.cat([quantised_rows(part, recipe.tile, recipe.gradients)
                        for part in grad.split(ctx.widths, -1)], dim=-1)
        dx = (gq @ wq.t()).to(x_dtype) if ctx.needs_input_grad[1] else None
        dw = xq.reshape(-1, xq.shape[-1]).t() @ gq.reshape(-1, gq.shape[-1])
        dws = [part.to(dtype) if needed else None for part, dtype, needed in
               zip(dw.split(ctx.widths, dim=1), w_dtypes, ctx.needs_input_grad[2:])]
        return (None, dx, *dws)


class _Fp8SwiGLUDown(torch.autograd.Function):
    """``(silu(gate) * up) @ down`` as DeepSeek-V3 runs a mixture's SwiGLU (section 3.3.4,
    low-precision storage): its inputs, gate and up, are kept in FP8 (1 x T tiles) and
    its output is recomputed from them in the backward, where :class:`_Fp8Matmul` would
    keep the product as the down GEMM's cached input; the down GEMM's three products in
    FP8 as in :class:`_Fp8Matmul`, the backward's weight gradient reading the recomputed
    product."""

    @staticmethod
    def forward(ctx, recipe: Recipe, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
        tile = recipe.tile
        wq = quantised_blocks(down, tile)
        out = (quantised_rows(F.silu(gate) * up, tile) @ wq).to(gate.dtype)
        ctx.recipe, ctx.dtypes, ctx.features = recipe, (gate.dtype, down.dtype), \
            gate.shape[-1]
        ctx.save_for_backward(*encoded_rows(gate, tile), *encoded_rows(up, tile), wq)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_codes, gate_scale, up_codes, up_scale, wq = ctx.saved_tensors
        recipe, (dtype, w_dtype), n = ctx.recipe, ctx.dtypes, ctx.features
        gate = decoded_rows(gate_codes, gate_scale, n).to(dtype)
        up = decoded_rows(up_codes, up_scale, n).to(dtype)
        silu = F.silu(gate)
        xq = quantised_rows(silu * up, recipe.tile)
        gq = quantised_rows(grad, recipe.tile, recipe.gradients)
        d_product = (gq @ wq.t()).to(dtype)
        dw = xq.reshape(-1, n).t() @ gq.reshape(-1, gq.shape[-1])
        sigmoid = torch.sigmoid(gate)
        d_gate = d_product * up * sigmoid * (1 + gate * (1 - sigmoid))
        return None, d_gate, d_product * silu, dw.to(w_dtype)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                recipe: Recipe) -> torch.Tensor:
    """``(silu(gate) * up) @ down`` in FP8, keeping gate and up in FP8 for the backward
    rather than the product (:class:`_Fp8SwiGLUDown`)."""
    return _Fp8SwiGLUDown.apply(recipe, gate, up, down)


def matmul(x: torch.Tensor, weights: list[torch.Tensor], recipe: Recipe | None
           ) -> torch.Tensor:
    """``x @ cat(weights, dim=1)``: in FP8 by ``recipe``, else as it is."""
    if recipe is None:
        return x @ (weights[0] if len(weights) == 1 else torch.cat(weights, dim=1))
    return _Fp8Matmul.apply(recipe, x, *weights)
