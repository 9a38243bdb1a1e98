"""The model's parameters and data, and how a rank holds its part of them.

Initial weights depend only on the seed, the parameter's name and its full shape, and
the batch of step k only on the seed and k (docs/language.md, train), so every plan of
one model starts from the same weights, sees the same data and must follow the same loss
curve. Everything about the model comes from the build's model table
(planc.program.model_table): its rules for initial values, head groups and token positions.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import torch

from planc.program.heads import split_units
from planc.program.operands import SEQ_AXIS
from planc.program.model_table import ModelTable
from planc.runtime.engine.seeds import seed_of


def initial_value(seed: int, name: str, shape: tuple[int, ...], mean: float, std: float
                  ) -> torch.Tensor:
    """The initial value of parameter ``name`` of full shape ``shape``: N(mean, std), the
    rule the build's model table gives it (planc.lower.tabulate_model)."""
    generator = torch.Generator().manual_seed(seed_of(seed, name, tuple(shape)))
    value = torch.randn(tuple(shape), generator=generator, dtype=torch.float64) * std
    if mean:
        value += mean
    return value.to(torch.float32)


Item = TypeVar("Item")
Result = TypeVar("Result")


def drawn_at_once(draw: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
    """``draw`` of each item, on as many threads as torch's intra-op threads: each
    parameter's value comes from its own generator (:func:`initial_value`), so the order
    does not change a value, and one thread draws some 0.1 G values a second (a 1.1B
    model took 30 s on one core of this project's machine)."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        return list(pool.map(draw, items))


@dataclass(frozen=True)
class Coordinates:
    tp: int
    cp: int
    pp: int
    dp: int


def token_positions(table: ModelTable, cp_rank: int) -> torch.Tensor:
    """Positions (within a sample) of the tokens a cp rank holds, in its order: the
    ranges the model table gives it (planc.lower.tabulate_model.cp_positions)."""
    return torch.cat([torch.arange(start, stop) for start, stop in table.positions[cp_rank]])


def microbatch_rows(table: ModelTable, dp_rank: int, microbatch: int) -> slice:
    start = dp_rank * table.rows_per_dp_rank + microbatch * table.microbatch_rows
    return slice(start, start + table.microbatch_rows)


def seq_split(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, index * size, size)


def _groups(model: ModelTable, dim_name: str, width: int) -> list[tuple[int, int]] | None:
    """(units, unit width) of each group of a feature dimension cut by heads, from the
    model table; None for a plain contiguous cut."""
    groups = model.feature_groups.get(dim_name)
    if groups is None:
        return None
    unit = width // sum(groups)
    return [(units, unit) for units in groups]


def split_feature(tensor: torch.Tensor, dim_name: str, parts: int, index: int,
                  model: ModelTable, axis: int = -1) -> torch.Tensor:
    """This rank's slice of a feature dimension. A dimension made of head groups
    (gpt's [q | k | v], llama's [q | k | v] with fewer k/v heads, [gate | up]) gives
    each rank its heads of every group; a group with fewer heads than ranks gives
    each rank the head its group of ranks shares (planc.program.heads.split_units)."""
    if parts == 1:
        return tensor
    axis = axis % tensor.dim()
    groups = _groups(model, dim_name, tensor.shape[axis])
    if groups is None:
        return seq_split(tensor, axis, parts, index)
    pieces, start = [], 0
    for units, unit in groups:
        first, count = split_units(units, parts, index)
        pieces.append(tensor.narrow(axis, start + first * unit, count * unit))
        start += units * unit
    return torch.cat(pieces, dim=axis) if len(pieces) > 1 else pieces[0]


def join_feature(pieces: list[torch.Tensor], dim_name: str, model: ModelTable,
                 axis: int = -1) -> torch.Tensor:
    """Inverse of :func:`split_feature` over all ranks' pieces, in rank order (a shared
    head is taken from the first rank of its group)."""
    parts = len(pieces)
    if parts == 1:
        return pieces[0]
    axis = axis % pieces[0].dim()
    groups = model.feature_groups.get(dim_name)
    if groups is None or len(groups) == 1 and groups[0] % parts == 0:
        return torch.cat(pieces, dim=axis)
    local = [split_units(units, parts, 0)[1] for units in groups]
    unit = pieces[0].shape[axis] // sum(local)
    joined = []
    for g, units in enumerate(groups):
        offset = sum(local[:g]) * unit
        owners = range(parts) if units % parts == 0 else range(0, parts, parts // units)
        joined.extend(pieces[r].narrow(axis, offset, local[g] * unit) for r in owners)
    return torch.cat(joined, dim=axis)


def local_heads(model: ModelTable, qkv_width: int, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) in a local [q | k | v] activation of this width:
    all of them, or one tp rank's (a shared k/v head counts once)."""
    heads, kv = model.heads, model.key_value_heads
    units = qkv_width // model.head_dim
    if units == heads + 2 * kv:
        return heads, kv
    return heads // tp, split_units(kv, tp, 0)[1]


def flat_shard_size(numel: int, parts: int) -> int:
    """ZeRO shards a flattened tensor into equal parts, padding the last."""
    return math.ceil(numel / parts)


def select_tokens(value: torch.Tensor, index: int, count: int, spread: int) -> torch.Tensor:
    """Piece ``index`` of ``count`` of the tokens of ``value`` (batch, tokens, ...), spread
    over ``spread`` tp ranks: planc.program.operands.token_ranges, as one strided view."""
    shape = value.shape
    size = shape[SEQ_AXIS] // (spread * count)
    grouped = value.reshape(shape[0], spread, count, size, *shape[2:])
    return grouped[:, :, index].reshape(shape[0], spread * size, *shape[2:])


def join_tokens(pieces: list[torch.Tensor], spread: int) -> torch.Tensor:
    """The tensor whose pieces (in order) ``pieces`` are: :func:`select_tokens` undone."""
    shape = pieces[0].shape
    size = shape[SEQ_AXIS] // spread
    grouped = [p.reshape(shape[0], spread, size, *shape[2:]) for p in pieces]
    return torch.stack(grouped, dim=2).reshape(shape[0], spread * size * len(pieces),
                                                *shape[2:])
