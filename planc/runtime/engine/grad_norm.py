"""``train { grad_clip }`` on a rank: its share of the squared gradient norm, and the clip.

The compiler wrote both steps' operands (planc.graph.grad_norm, planc.lower.bind): the
ranges of each bucket whose squares the share sums, each with its weight 1/(the ranks
holding the same value), and the norm to clip to. Between them the program's all-reduce
over every rank sums the shares (planc.runtime.engine.transfers). The clip then does what
``torch.nn.utils.clip_grad_norm_`` does on one process: ``total = sqrt(sum)``,
``coef = max_norm / (total + 1e-6)``, every gradient multiplied by ``min(coef, 1)``; the
total and the coefficient in fp32 as torch computes them from fp32 gradients (the sum of
squares itself is fp64, so that the order the ranks add in does not show).
"""

from __future__ import annotations

import torch

from planc.runtime.engine.store import ParamStore
from planc.runtime.engine.context import RankContext

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def share(ctx: RankContext, store: ParamStore, ranges) -> torch.Tensor:
    """This rank's weighted sum of squares over the gradients it holds, as its optimizer
    steps will read them (a ZeRO shard: its part of each range), one fp64 number."""
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for bucket, start, end, weight in ranges:
        info = store.buckets[bucket]
        grad, offset = store.current_grad(bucket), 0
        if info["sharded"]:
            offset, _ = store.shard_range[bucket]
        low, high = max(start - offset, 0), min(end - offset, grad.numel())
        if low < high:
            part = grad[low:high].to(torch.float64)
            total += weight * torch.dot(part, part)
    return total


def clip(store: ParamStore, summed: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every gradient of the stage's buckets by the clip coefficient of the norm
    whose square ``summed`` is; returns the norm before clipping, as a tensor (read once
    the step has ended: a number read here would stop a CUDA rank's issuing)."""
    norm = summed.sqrt().to(torch.float32)
    coefficient = torch.clamp(max_norm / (norm + EPS), max=1.0)
    for bucket in store.buckets:
        store.current_grad(bucket).mul_(coefficient)
    return norm.reshape(())
