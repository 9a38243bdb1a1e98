"""This rank's parameters and gradients, in the flat buckets its program lists.

Each bucket of the program (:mod:`planc.passes.fuse`) is a flat fp32 buffer holding its
members at the offsets the compiler chose, padded to whole ZeRO shards, as in
Megatron-LM's param-and-grad buffer: a parameter is a view of its bucket, its gradient
a view of the bucket's gradient buffer, and backward steps accumulate into those views.
Under ZeRO the optimizer owns the rank's equal slice of the bucket (its shard); under
ZeRO-3 only the shard is kept, and a gather fills the whole bucket before each use.
With ``mesh { ep }`` a bucket of routed experts (``over`` edp) holds this rank's experts'
rows of each member, and its ZeRO shard is its place in the experts' replicas (edp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planc.runtime.engine.context import RankContext
from planc.runtime.engine.model import drawn_at_once, initial_value, split_feature

FP32 = torch.float32


@dataclass(frozen=True)
class Member:
    bucket: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def tp_piece(ctx: RankContext, value: torch.Tensor, split, tp_rank: int) -> torch.Tensor:
    """tp rank ``tp_rank``'s piece of a parameter's full ``value`` under the bucket
    member's ``tp_split`` ([dim, axis], or None: every tp rank holds all of it). The
    checkpoints (planc.runtime.checkpoint.checkpoints) cut and join with this same rule."""
    if split is None:
        return value
    dim, axis = split
    return split_feature(value, dim, ctx.tp, tp_rank, ctx.model, axis)


def piece_of(ctx: RankContext, value: torch.Tensor, member: dict, index: int
             ) -> torch.Tensor:
    """Piece ``index`` of a member's full ``value``: its ep index's rows of the experts
    (``ep_split``: ep contiguous parts of dimension 0), else its tp rank's piece."""
    if member.get("ep_split"):
        return value.chunk(member["ep_split"], 0)[index]
    return tp_piece(ctx, value, member["tp_split"], index)


def piece_index(ctx: RankContext, bucket: dict) -> int:
    """Which piece of its members this rank's copy of ``bucket`` holds."""
    return ctx.groups.index("ep", ctx.rank) if bucket.get("over") else ctx.tp_rank


def shard_index(ctx: RankContext, bucket: dict) -> int:
    """This rank's ZeRO shard of ``bucket``: its place in the group the bucket is
    reduced over (dp x cp, or an expert's replicas)."""
    return ctx.groups.index(bucket.get("over", "dp_cp"), ctx.rank)


class ParamStore:
    def __init__(self, ctx: RankContext, buckets: dict[str, dict]):
        self.buckets = buckets
        self.full: dict[str, torch.Tensor] = {}  # whole bucket (absent under ZeRO-3)
        self.shard: dict[str, torch.Tensor] = {}  # this rank's slice (sharded buckets)
        self.grad: dict[str, torch.Tensor] = {}
        self.grad_shard: dict[str, torch.Tensor] = {}
        self.shard_range: dict[str, tuple[int, int]] = {}  # [start, end) of the shard
        self.members: dict[str, Member] = {}
        # state that is not trained: name -> fp32 tensor, the same on every rank holding
        # it (a mixture's balancing bias, planc.runtime.engine.router_bias), kept beside
        # the parameters so that evaluations and checkpoints see it
        self.buffers: dict[str, torch.Tensor] = {}
        seed, initial = ctx.model.seed, ctx.model.parameters
        for bucket_id, bucket in buckets.items():
            flat = torch.zeros(bucket["padded"], dtype=FP32)
            piece = piece_index(ctx, bucket)

            def fill(m: dict) -> None:  # each member's own slice of flat
                rule = initial[m["param"]]  # the model table's rule for its initial value
                value = initial_value(seed, m["param"], tuple(m["full_shape"]), rule.mean,
                                      rule.std)
                flat[m["offset"]:m["offset"] + m["numel"]] = \
                    piece_of(ctx, value, m, piece).reshape(-1)

            if ctx.model.init is None:  # else read from it (planc.runtime.checkpoint.init_load)
                drawn_at_once(fill, bucket["members"])
            for m in bucket["members"]:
                self.members[m["param"]] = Member(bucket_id, m["offset"], m["numel"],
                                                  tuple(m["shape"]))
            flat = flat.to(ctx.device)
            if bucket["sharded"]:
                size, index = bucket["shard"], shard_index(ctx, bucket)
                self.shard_range[bucket_id] = (index * size, (index + 1) * size)
                self.shard[bucket_id] = self.own_shard(bucket_id, flat).clone()
                self.grad_shard[bucket_id] = torch.zeros_like(self.shard[bucket_id])
            if not bucket["zero3"]:
                self.full[bucket_id] = flat
            self.grad[bucket_id] = torch.zeros(bucket["padded"], dtype=FP32, device=ctx.device)

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter ``name`` inside a whole bucket ``flat``."""
        m = self.members[name]
        return flat[m.offset:m.offset + m.numel].view(m.shape)

    def param(self, name: str) -> torch.Tensor:
        return self.view(self.full[self.members[name].bucket], name)

    def grad_of(self, name: str) -> torch.Tensor:
        return self.view(self.grad[self.members[name].bucket], name)

    def own_shard(self, bucket: str, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole (sharded) bucket ``flat``."""
        start, end = self.shard_range[bucket]
        return flat[start:end]

    def current_grad(self, bucket: str) -> torch.Tensor:
        """The bucket's gradient as the next reduction sees it: the shard once reduced
        and scattered, else the whole buffer."""
        return self.grad_shard[bucket] if self.buckets[bucket]["sharded"] else \
            self.grad[bucket]

    def zero_grads(self) -> None:
        for grad in (*self.grad.values(), *self.grad_shard.values()):
            grad.zero_()
