"""FP8 GEMMs on a GPU's tensor cores (the package's docstring): rows in 1 x T tiles times
a weight in T x T blocks, the scales applied as each tile's products are summed in fp32,
by one block-scaled call on Hopper or one call a tile of the contraction elsewhere."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from planc.runtime.engine.fp8.codes import E4M3, FP32, encoded_blocks, encoded_rows


def tensor_cores(device: torch.device, tile: int) -> bool:
    """Whether FP8 GEMMs on ``device`` run on its tensor cores (:func:`scaled_product`):
    a CUDA device of compute capability 8.9 or later, and a tile that is a multiple of
    16, as cuBLASLt's FP8 GEMMs require of their dimensions (the rows are padded to
    one)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
            and tile % 16 == 0)


def scaled_product(codes: torch.Tensor, scale: torch.Tensor, block_codes: torch.Tensor,
                   block_scale: torch.Tensor) -> torch.Tensor:
    """Rows in 1 x T tiles (``codes`` (..., K / T, T) and ``scale`` (..., K / T, 1), as
    :func:`encoded_rows` gives them) times a matrix in T x T blocks (``block_codes``
    (K, N) and ``block_scale`` (K / T, N / T), as :func:`encoded_blocks`), in fp32, with
    N the blocks' padded width, the scales applied to each tile's products as they are
    summed in fp32 (DeepSeek-V3, section 3.3.2): by the kernel itself where the device
    has block scaling and the rows are E4M3 (:func:`blockwise_product`; PyTorch refuses
    E5M2 rows there, seen on an H200), else tile by tile (:func:`tiled_product`)."""
    tile = codes.shape[-1]
    rows, width = codes[..., 0, 0].numel(), block_codes.shape[1]
    if rows == 0:  # an expert that no token chose
        return torch.zeros(rows, width, dtype=FP32, device=codes.device)
    output = blockwise_kernel(codes.device, tile)
    if output is not None and codes.dtype == E4M3:  # cuBLASLt scales E4M3 blocks alone
        return blockwise_product(codes, scale, block_codes, block_scale, output)
    return tiled_product(codes, scale, block_codes, block_scale)


def tiled_product(codes: torch.Tensor, scale: torch.Tensor, block_codes: torch.Tensor,
                  block_scale: torch.Tensor) -> torch.Tensor:
    """:func:`scaled_product` as one ``torch._scaled_mm`` a tile of the contraction, the
    scales applied by PyTorch operations in fp32 (any FP8 tensor core, and the CPU)."""
    chunks, tile = codes.shape[-2:]
    rows, width = codes[..., 0, 0].numel(), block_codes.shape[1]
    out = torch.zeros(rows, width, dtype=FP32, device=codes.device)
    # one contiguous operand per tile of the contraction, the rows padded with zeros to
    # a multiple of 16: the kernel reads a row-major left and a column-major right operand
    left = codes.reshape(rows, chunks, tile).transpose(0, 1)
    left = torch.cat([left, left.new_zeros(chunks, -rows % 16, tile)], dim=1)
    left_scale = scale.reshape(rows, chunks).t()
    right = block_codes.t().reshape(width, chunks, tile).transpose(0, 1).contiguous()
    right_scale = block_scale.repeat_interleave(tile, dim=1)
    unit = torch.ones((), dtype=FP32, device=codes.device)
    for chunk in range(chunks):
        product = torch._scaled_mm(left[chunk], right[chunk].t(), scale_a=unit,
                                   scale_b=unit, out_dtype=FP32)[:rows]
        out.addcmul_(product * left_scale[chunk][:, None], right_scale[chunk])
    return out


def blockwise_product(codes: torch.Tensor, scale: torch.Tensor, block_codes: torch.Tensor,
                      block_scale: torch.Tensor, output: torch.dtype) -> torch.Tensor:
    """:func:`scaled_product` as one ``torch.nn.functional.scaled_mm`` whose kernel applies
    the 1 x 128 and 128 x 128 scales itself (cuBLASLt's, cuBLAS 12.9, Hopper only), its
    product in ``output`` (fp32, or bf16), returned in fp32. The rows are padded with
    zeros to a multiple of 16; each scale tensor outer-dimension-major, the weight's with
    its tiles of the contraction padded to a multiple of 4, as PyTorch asks."""
    chunks, tile = codes.shape[-2:]
    rows = codes[..., 0, 0].numel()
    padded = rows + -rows % 16
    left = codes.reshape(rows, chunks * tile)
    if padded > rows:
        left = torch.cat([left, left.new_zeros(padded - rows, chunks * tile)])
    left_scale = torch.ones(chunks, padded, dtype=FP32, device=codes.device)
    left_scale[:, :rows] = scale.reshape(rows, chunks).t()
    blocks_k, blocks_n = block_scale.shape
    right_scale = torch.ones(blocks_n, blocks_k + -blocks_k % 4, dtype=FP32,
                             device=codes.device)
    right_scale[:, :blocks_k] = block_scale.t()
    right = block_codes.t().contiguous().t()  # column-major, as the kernel reads it
    product = F.scaled_mm(left, right, left_scale.t(), F.ScalingType.BlockWise1x128,
                          right_scale.t(), F.ScalingType.BlockWise128x128,
                          output_dtype=output)
    return product[:rows].to(FP32)


@functools.lru_cache(maxsize=None)  # a fact of the device and the installed PyTorch
def blockwise_kernel(device: torch.device, tile: int) -> torch.dtype | None:
    """The dtype of the products :func:`blockwise_product` gives on ``device`` (fp32 if it
    can, else bf16), or None where it does not run: not Hopper, a tile other than 128, a
    PyTorch without ``scaled_mm``'s block scaling or a cuBLAS before 12.9, or products
    that disagree with :func:`tiled_product`'s on a product of two blocks by three (a
    scale read from the wrong block would: PyTorch 2.11's older ``torch._scaled_mm``
    accepts these scales and reads them so)."""
    if device.type != "cuda" or tile != 128 or not hasattr(F, "scaled_mm") \
            or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    generator = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(48, 256, device=device, generator=generator) \
        * torch.rand(48, 1, device=device, generator=generator).mul(8)
    weight = torch.randn(256, 384, device=device, generator=generator)
    weight[:128, 128:256] *= 64  # blocks of different scales
    codes, scale = encoded_rows(rows, tile)
    blocks = encoded_blocks(weight, tile)
    expected = tiled_product(codes, scale, *blocks)
    for output, tolerance in ((FP32, 2**-16), (torch.bfloat16, 2**-7)):
        try:
            got = blockwise_product(codes, scale, *blocks, output)
        except (RuntimeError, ValueError, NotImplementedError, TypeError, AttributeError):
            continue  # refused: no such output, layout, cuBLAS or signature
        if (got - expected).abs().max() <= tolerance * expected.abs().max():
            return output
    return None


def split_weight_gradient(device: torch.device) -> bool:
    """Whether a weight gradient on ``device`` runs as :func:`split_product` on its bf16
    tensor cores: a CUDA device whose ``torch.mm`` gives bf16 products in fp32
    (``out_dtype``); elsewhere it stays one fp32 GEMM."""
    return device.type == "cuda" and _bf16_products_in_fp32(device)


@functools.lru_cache(maxsize=None)  # a fact of the device and the installed PyTorch
def _bf16_products_in_fp32(device: torch.device) -> bool:
    ones = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    try:
        product = torch.mm(ones, ones, out_dtype=FP32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return product.dtype == FP32 and bool((product == 16).all())


def bf16_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32) as two bf16 tensors whose sum is ``x`` to 16 significant bits: the
    high part, ``x`` rounded, and the low part, what the rounding left, rounded."""
    high = x.to(torch.bfloat16)
    return high, (x - high).to(torch.bfloat16)  # high widened exactly as it is subtracted


def split_product(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
    """``a @ b`` in fp32 from operands split by :func:`bf16_pair`, as three bf16 GEMMs that
    sum in fp32 (high by high, high by low, low by high; the low parts' product, 2^-16 of
    the whole, left out): the split-bf16 product of Henry, Tang and Heinecke ("Leveraging
    the bfloat16 artificial intelligence datatype for higher-precision computations",
    ARITH 2019), about 2^-16 of each product from fp32's, on tensor cores that run bf16
    some 15 times faster than fp32 (an H200: 989 against 67 TFLOP/s, NVIDIA's
    datasheet). The FP8 recipe's weight gradient: its inputs, an E4M3 code times an fp32
    scale, have up to 28 significant bits, which one bf16 rounding would cut to 8."""
    (a_high, a_low), (b_high, b_low) = a, b
    out = _fp32_product(a_high, b_low)
    out += _fp32_product(a_low, b_high)
    return out.add_(_fp32_product(a_high, b_high))


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two bf16 matrices' product in fp32: on CUDA by the bf16 GEMM itself, accumulating
    in fp32; elsewhere in fp32 (bf16 numbers multiply exactly there)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=FP32)
    return a.to(FP32) @ b.to(FP32)
