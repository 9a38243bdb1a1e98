"""The gpt model's parameters and data, and how a rank holds its part of them.

Initial weights depend only on the seed, the parameter's name and its full shape, and
the batch of step k only on the seed and k (docs/language.md, train), so every plan of
one model starts from the same weights, sees the same data and must follow the same loss
curve. Matrices and embeddings are N(0, 0.02) as in GPT-2; LayerNorm weights are
1 + N(0, 0.02) and biases N(0, 0.02), so that every parameter (and every way of sharding
it) already matters in the first step.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

import torch

from planc.graph.model import Parameter, all_parameters
from planc.plan import Plan

INIT_STD = 0.02


def _seed(*parts) -> int:
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def initial_value(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of parameter ``name`` of full shape ``shape``."""
    generator = torch.Generator().manual_seed(_seed(seed, name, tuple(shape)))
    value = torch.randn(tuple(shape), generator=generator, dtype=torch.float64) * INIT_STD
    if name.split(".")[-2].startswith(("ln", "final_ln")) and name.endswith(".weight"):
        value += 1.0
    return value.to(torch.float32)


def batch_tokens(plan: Plan, step: int) -> torch.Tensor:
    """The global batch of ``step``: (batch, seq + 1) token ids."""
    m = plan.model
    shape = (m.batch, m.seq + 1)
    if plan.train.data == "synthetic":
        generator = torch.Generator().manual_seed(_seed(plan.train.seed, "data", step))
        return torch.randint(0, m.vocab, shape, generator=generator)
    # A file of little-endian uint16 tokens; sample j of the run starts at token
    # j * (seq + 1), wrapping around the file. Only this step's samples are read.
    sample = m.seq + 1
    rows = []
    try:
        usable = os.path.getsize(plan.train.data) // 2 - sample + 1
        with open(plan.train.data, "rb") as data:
            for j in range(step * m.batch, (step + 1) * m.batch):
                data.seek((j * sample) % max(usable, 1) * 2)
                rows.append(data.read(sample * 2))
    except OSError as exc:
        raise DataError(f"data file {plan.train.data} cannot be read for step {step} "
                        f"({exc.strerror})") from None
    if usable < 1 or any(len(row) != sample * 2 for row in rows):
        raise DataError(f"data file {plan.train.data} no longer holds one sample (seq + 1 = "
                        f"{sample} tokens)")
    out = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.int16).view(m.batch, sample)
    out = out.to(torch.int64) & 0xFFFF
    largest = int(out.max())
    if largest >= m.vocab:
        raise DataError(f"data file {plan.train.data} holds token id {largest} in the batch "
                        f"of step {step}, not below vocab = {m.vocab}")
    return out


class DataError(ValueError):
    """The plan's data file cannot feed a step (it changed or vanished during the run)."""


def data_problem(plan: Plan) -> str | None:
    """Why the plan's data file cannot feed a run, or None: checked once, before any rank
    starts, because the file may have appeared or changed since planc check."""
    path, m = plan.train.data, plan.model
    if path == "synthetic":
        return None
    if not os.path.isfile(path):
        return f"data file {path} does not exist"
    size = os.path.getsize(path)
    if size % 2 or size // 2 < m.seq + 1:
        return (f"data file {path} has {size} bytes; it needs an even size and at least "
                f"seq + 1 = {m.seq + 1} little-endian uint16 tokens")
    tokens = torch.from_file(path, shared=False, size=size // 2, dtype=torch.int16)
    tokens = tokens.to(torch.int32) & 0xFFFF
    largest = int(tokens.max())
    if largest >= m.vocab:
        position = int((tokens == largest).nonzero()[0])
        return (f"data file {path} holds token id {largest} (token {position} of the file), "
                f"not below vocab = {m.vocab}")
    return None


@dataclass(frozen=True)
class Coordinates:
    tp: int
    cp: int
    pp: int
    dp: int


def token_positions(plan: Plan, cp_rank: int) -> torch.Tensor:
    """Positions (within a sample) of the tokens a cp rank holds, in its order.

    With load balancing the sequence is cut into 2 cp chunks and rank i holds chunks i
    and 2 cp - 1 - i, so causal attention costs every rank the same (as Megatron's
    context parallelism does)."""
    seq, cp = plan.model.seq, plan.mesh.cp
    if cp == 1:
        return torch.arange(seq)
    if plan.shard.cp.load_balance:
        size = seq // (2 * cp)
        first = torch.arange(cp_rank * size, (cp_rank + 1) * size)
        second_index = 2 * cp - 1 - cp_rank
        second = torch.arange(second_index * size, (second_index + 1) * size)
        return torch.cat([first, second])
    size = seq // cp
    return torch.arange(cp_rank * size, (cp_rank + 1) * size)


def microbatch_rows(plan: Plan, dp_rank: int, microbatch: int) -> slice:
    per_rank = plan.model.batch // plan.mesh.dp
    b = plan.microbatch_size
    start = dp_rank * per_rank + microbatch * b
    return slice(start, start + b)


def seq_split(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, index * size, size)


def split_feature(tensor: torch.Tensor, dim_name: str, parts: int, index: int,
                  heads: int, axis: int = -1) -> torch.Tensor:
    """This rank's slice of a feature dimension. ``qkv`` features ([q | k | v], each
    heads x head_dim) are split by heads, the same heads from q, k and v."""
    if parts == 1:
        return tensor
    axis = axis % tensor.dim()
    if dim_name == "qkv":
        shape = list(tensor.shape)
        view = tensor.reshape(shape[:axis] + [3, heads, shape[axis] // (3 * heads)]
                              + shape[axis + 1:])
        local = seq_split(view, axis + 1, parts, index)
        return local.reshape(shape[:axis] + [shape[axis] // parts] + shape[axis + 1:])
    return seq_split(tensor, axis, parts, index)


def join_feature(pieces: list[torch.Tensor], dim_name: str, heads: int,
                 axis: int = -1) -> torch.Tensor:
    """Inverse of :func:`split_feature` over all ranks' pieces, in rank order."""
    if len(pieces) == 1:
        return pieces[0]
    axis = axis % pieces[0].dim()
    if dim_name == "qkv":
        parts = len(pieces)
        shape = list(pieces[0].shape)
        local_heads = heads // parts
        views = [p.reshape(shape[:axis] + [3, local_heads, shape[axis] // (3 * local_heads)]
                           + shape[axis + 1:]) for p in pieces]
        joined = torch.cat(views, dim=axis + 1)
        return joined.reshape(shape[:axis] + [shape[axis] * parts] + shape[axis + 1:])
    return torch.cat(pieces, dim=axis)


def parameters(plan: Plan) -> dict[str, Parameter]:
    return {p.name: p for p in all_parameters(plan)}


def flat_shard_size(numel: int, parts: int) -> int:
    """ZeRO shards a flattened tensor into equal parts, padding the last."""
    return math.ceil(numel / parts)
