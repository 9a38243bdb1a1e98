"""FP8 codes of ``model { fp8 = blockwise }`` (the package's docstring): tensors quantised
to E4M3 or E5M2 in 1 x T tiles along their features or T x T blocks, one fp32 scale a
tile or block (amax over the format's largest number), kept as codes and scales or
decoded back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# the largest finite number of each format (OCP 8-bit floating point specification)
LARGEST = {E4M3: 448.0, E5M2: 57344.0}
FP32 = torch.float32
# Encoding divides a tensor by its scales in this many pieces (:func:`_divided`).
PIECES = 8


def _encoded(groups: torch.Tensor, dims: tuple[int, ...], form: torch.dtype = E4M3
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group (the elements along ``dims``) in ``form`` and its fp32 scale, amax over
    the format's largest number (1 for a group of zeros). ``groups`` in any float dtype:
    the amax is exact in it, and the division promotes each element to fp32 as it goes,
    the bits of a copy in fp32 first without its memory traffic. The amax is the larger
    of the largest element and the smallest's negation, so no magnitudes are written (a
    tensor the size of ``groups``)."""
    if len(dims) == 1:  # tiles of rows, as large as the activations: one read of them
        low, high = torch.aminmax(groups, dim=dims[0], keepdim=True)
    else:
        low, high = groups.amin(dim=dims, keepdim=True), groups.amax(dim=dims, keepdim=True)
    largest = torch.maximum(high, low.neg())
    scale = largest.to(FP32) / LARGEST[form]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _divided(groups, scale, dims, form), scale


def _divided(groups: torch.Tensor, scale: torch.Tensor, dims: tuple[int, ...],
             form: torch.dtype) -> torch.Tensor:
    """``(groups / scale).to(form)``, a piece of about 1 / :data:`PIECES` of the groups
    at a time along their longest dimension before the grouped ones: the division's fp32
    quotient, four times the codes' bytes (twice a bf16 input's), is never whole (a
    rank's stacked experts' weights: each piece a few experts). The same division and
    the same cast, element by element, so the same bits."""
    lead = min(d % groups.dim() for d in dims)
    axis = max(range(lead), key=lambda d: groups.shape[d], default=None)
    if axis is None or groups.shape[axis] < 2:
        return (groups / scale).to(form)
    codes = torch.empty(groups.shape, dtype=form, device=groups.device)
    size = groups.shape[axis]
    step = -(-size // PIECES)
    for start in range(0, size, step):
        length = min(step, size - start)
        codes.narrow(axis, start, length).copy_(
            groups.narrow(axis, start, length) / scale.narrow(axis, start, length))
    return codes


def _quantised(groups: torch.Tensor, dims: tuple[int, ...], form: torch.dtype = E4M3
               ) -> torch.Tensor:
    """Each group rounded to ``form`` with its scale and scaled back, in fp32."""
    codes, scale = _encoded(groups, dims, form)
    return codes.to(FP32).mul_(scale)  # in place on the new fp32 copy: one tensor, not two


def _row_groups(x: torch.Tensor, tile: int) -> torch.Tensor:
    """``x`` (..., n) as tiles of 1 x ``tile`` along its last dimension, zero-padded, in
    its own dtype (a view where ``tile`` divides n)."""
    tiles = -(-x.shape[-1] // tile)
    if x.shape[-1] % tile:
        x = F.pad(x, (0, -x.shape[-1] % tile))
    return x.reshape(*x.shape[:-1], tiles, tile)


def quantised_rows(x: torch.Tensor, tile: int, form: torch.dtype = E4M3) -> torch.Tensor:
    """``x`` (..., n) quantised to ``form`` in tiles of 1 x ``tile`` along its last
    dimension (the last tile shorter when ``tile`` does not divide n), in fp32."""
    n = x.shape[-1]
    groups = _row_groups(x, tile)  # the padded width given whole: a batch may hold no rows
    return _quantised(groups, (-1,), form).reshape(
        *x.shape[:-1], groups.shape[-2] * groups.shape[-1])[..., :n]


def encoded_rows(x: torch.Tensor, tile: int, form: torch.dtype = E4M3
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as :func:`quantised_rows` rounds it, kept as it would be in memory: one byte
    of ``form`` an element and an fp32 scale a tile (the FP8 activation a linear layer
    keeps for its backward)."""
    return _encoded(_row_groups(x, tile), (-1,), form)


def decoded_rows(codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """What :func:`encoded_rows` encoded, in fp32: :func:`quantised_rows` of it."""
    width = codes.shape[-2] * codes.shape[-1]  # given whole: a hop may carry no rows
    return codes.to(FP32).mul_(scale).reshape(*codes.shape[:-2], width)[..., :n]


@dataclass(frozen=True)
class EncodedRows:
    """Rows kept as they arrived in FP8 (:func:`encoded_rows`' codes and scales),
    ``features`` wide, read in ``dtype``: the experts' output gradients, sent to them in
    FP8 (DeepSeek-V3, section 3.3.4: the activation gradient before the
    down-projections), which a split backward's input half reads and its weight half
    reads again later (the report's figure 6: the weight gradient's GEMM takes FP8
    inputs): kept at one byte an element until then, not decoded into the dtype's two.
    Each half decodes them alike, so both read the same bits."""

    codes: torch.Tensor
    scale: torch.Tensor
    features: int
    dtype: torch.dtype

    def decoded(self) -> torch.Tensor:
        return decoded_rows(self.codes, self.scale, self.features).to(self.dtype)


def kept_bytes(value) -> int | None:
    """The bytes ``value`` holds: an :class:`EncodedRows`' codes and scales, a tensor's
    elements (None: nothing)."""
    if isinstance(value, EncodedRows):
        return value.codes.nbytes + value.scale.nbytes
    return None if value is None else value.nbytes


def readable(value):
    """``value`` as a tensor: :class:`EncodedRows` decoded, anything else as it is."""
    return value.decoded() if isinstance(value, EncodedRows) else value


def encoded_blocks(w: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (k, n), or a stack of them (..., k, n) (a rank's routed experts), in E4M3,
    zero-padded to whole ``tile`` x ``tile`` blocks, and its fp32 scales, one a block:
    (..., k', n') codes and (..., k' / tile, n' / tile) scales; each weight of a stack
    encoded as it would be alone."""
    *stack, k, n = w.shape
    padded = F.pad(w, (0, -n % tile, 0, -k % tile)) if (n % tile or k % tile) else w
    rows, cols = padded.shape[-2:]
    codes, scale = _encoded(padded.reshape(*stack, rows // tile, tile, cols // tile, tile),
                            (-3, -1))
    return codes.reshape(*stack, rows, cols), scale.reshape(*stack, rows // tile, cols // tile)


def decoded_blocks(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]
                   ) -> torch.Tensor:
    """What :func:`encoded_blocks` encoded, in fp32, cut back to the weights' ``shape``."""
    *stack, rows, cols = codes.shape
    blocks, tile = scale.shape[-2:], rows // scale.shape[-2]
    decoded = codes.reshape(*stack, blocks[0], tile, blocks[1], tile).to(FP32).mul_(
        scale.reshape(*stack, blocks[0], 1, blocks[1], 1))
    return decoded.reshape(*stack, rows, cols)[..., :shape[-2], :shape[-1]]


def quantised_blocks(w: torch.Tensor, tile: int) -> torch.Tensor:
    """A weight (k, n), or a stack of them, quantised in ``tile`` x ``tile`` blocks, in
    fp32."""
    return decoded_blocks(*encoded_blocks(w, tile), w.shape)
