"""The transfers of the programs on torch.distributed, one function per (op, payload).

:attr:`Transfers.table` maps an instruction's op and its operands' payload
(planc.program.operands) to the method that runs it; the group comes from the operands'
group reference, resolved once. Each
function issues its collectives asynchronously and waits on their work handles (on CUDA
that wait orders the current stream after the collective without blocking the host).

Activations are (batch, tokens, features): a redistribution along ``seq`` works on
dimension 1, along a feature dimension (hidden, ffn, qkv, vocab) on dimension 2, where a
``qkv`` shard is the same heads of q, k and v. Gradients and parameters move as whole
buckets (planc.runtime.engine.store): one flat buffer per collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from planc.program.operands import FEATURE_AXIS, SEQ_AXIS, Operands
from planc.runtime.engine import fp8, routes
from planc.runtime.engine import store as buckets
from planc.runtime.engine.context import RankContext
from planc.runtime.engine.model import join_feature, local_heads, split_feature
from planc.runtime.engine.store import ParamStore
from planc.runtime.engine.collectives import all_gather_single, reduce_scatter_single
from planc.runtime.families import family_module, moe_dispatch, moe_two_hop

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class Call:
    """One transfer instruction, prepared: its operands, group handle and group."""

    operands: Operands
    per_microbatch: bool
    group: object  # a process group, or None for a group of one
    members: tuple[int, ...]
    index: int  # this rank's position in the group
    route: routes.Route | None = None  # a tree or hierarchical recipe; None: native
    peer: int | None = None  # a pipeline transfer's other rank

    @property
    def size(self) -> int:
        return len(self.members)


def _wait(work) -> None:
    if work is not None:
        work.wait()


class Transfers:
    def __init__(self, ctx: RankContext, store: ParamStore):
        self.ctx, self.store = ctx, store
        self.table: dict[tuple[str, str], Callable] = {
            ("all_reduce", "activation"): partial(self.activation, kind="all_reduce"),
            ("all_gather", "activation"): partial(self.activation, kind="all_gather"),
            ("reduce_scatter", "activation"): partial(self.activation, kind="reduce_scatter"),
            ("all_to_all", "activation"): partial(self.activation, kind="all_to_all"),
            ("all_reduce", "loss_stat"): self.loss_statistic,
            ("all_reduce", "loss"): self.loss_report,
            ("all_gather", "kv"): self.kv_all_gather,
            ("reduce_scatter", "dkv"): self.dkv_reduce_scatter,
            ("send", "stream"): self.send,
            ("recv", "stream"): self.recv,
            ("all_reduce", "grad"): self.grad_all_reduce,
            ("reduce_scatter", "grad"): self.grad_reduce_scatter,
            ("all_gather", "grad"): self.grad_slice_gather,
            ("all_gather", "param"): self.param_gather,
            ("all_reduce", "grad_norm"): self.norm_sum,
            ("all_reduce", "router_load"): self.norm_sum,
            ("all_to_all", "counts"): self.expert_counts,
            ("all_to_all", "dispatch"): partial(self.expert_rows, dispatch=True),
            ("all_to_all", "combine"): partial(self.expert_rows, dispatch=False),
        }
        self.fp8 = fp8.recipe_of(ctx.model)  # None: a dispatch in the model's dtype

    # --- a mixture's dispatch and combine (schedule { overlap_all_to_all }) -----------

    def expert_counts(self, call: Call, value):
        """``value``: (the route's Routed, None): its counts per expert exchanged."""
        return moe_dispatch.exchange_counts(value[0], call.group, call.members)

    def expert_rows(self, call: Call, value, dispatch: bool):
        """``value``: (the rows or their gradients, the dispatch's Routed). The forward
        dispatch sends the rows its counts' exchange sized
        (planc.runtime.families.moe_dispatch); the others move rows the dispatch's way
        (the combine's gradients, as FP8 with model { fp8 } as the dispatch's rows:
        DeepSeek-V3, section 3.3) or back."""
        rows, routing = value
        forward = call.operands.direction == "forward"
        if call.operands.hops == 2:
            return self._two_hops(call, rows, routing, dispatch, forward)
        if dispatch and forward:
            return moe_dispatch.dispatch(rows, call.group, self.fp8)
        if not dispatch and not forward:  # the combine's gradients, to the experts: FP8
            return moe_dispatch.exchange_gradients(rows, routing.sent, routing.received,
                                                   call.group, self.fp8)
        return moe_dispatch.exchange(rows, routing, dispatch == forward, call.group)

    def _two_hops(self, call: Call, rows, routing, dispatch: bool, forward: bool):
        """optimize { moe_dispatcher = two_hop } (planc.runtime.families.moe_two_hop):
        ``rows`` is the route's Routed for the forward dispatch, else a tensor."""
        if dispatch and forward:
            node_of = tuple(m // self.ctx.devices_per_node for m in call.members)
            per_rank = self.ctx.model.experts // call.size
            received, counts, hops = moe_two_hop.dispatch(
                rows.rows, rows.experts, rows.tokens, node_of, call.index, per_rank,
                call.group, self.fp8)
            return dataclasses.replace(rows, rows=received, counts=counts,
                                       tokens=hops.tokens1, hops=hops, members=call.members)
        hops = routing.hops
        if dispatch:
            return moe_two_hop.dispatch_backward(rows, hops, hops.order1.numel())
        if forward:
            return moe_two_hop.combine(rows, hops)
        return moe_two_hop.combine_backward(rows, hops, self.fp8)

    # --- collectives on a group -------------------------------------------------------

    @staticmethod
    def all_reduce(tensor: torch.Tensor, call: Call, op=dist.ReduceOp.SUM,
                   in_place: bool = False) -> torch.Tensor:
        if call.size == 1:
            return tensor
        out = tensor if in_place else tensor.clone()
        if call.route is not None:
            routes.all_reduce(call.route, out, op)
        else:
            _wait(dist.all_reduce(out, op=op, group=call.group, async_op=True))
        return out

    @staticmethod
    def all_gather_list(tensor: torch.Tensor, call: Call) -> list[torch.Tensor]:
        if call.size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        if call.route is not None:
            out = torch.empty((call.size, *tensor.shape), dtype=tensor.dtype,
                              device=tensor.device)
            routes.all_gather(call.route, tensor, out)
            return list(out)
        pieces = [torch.empty_like(tensor) for _ in range(call.size)]
        _wait(dist.all_gather(pieces, tensor, group=call.group, async_op=True))
        return pieces

    @staticmethod
    def reduce_scatter_list(chunks: list[torch.Tensor], call: Call) -> torch.Tensor:
        if call.size == 1:
            return chunks[0]
        chunks = [c.contiguous() for c in chunks]
        out = torch.empty_like(chunks[0])
        if call.route is not None:
            routes.reduce_scatter(call.route, torch.cat([c.reshape(-1) for c in chunks]), out)
        else:
            _wait(dist.reduce_scatter(out, chunks, group=call.group, async_op=True))
        return out

    # --- tensor parallel redistributions -------------------------------------------------

    def _split(self, tensor, dim: str, parts: int, index: int):
        axis = SEQ_AXIS if dim == "seq" else FEATURE_AXIS
        return split_feature(tensor, dim, parts, index, self.ctx.model, axis)

    def activation(self, call: Call, value: torch.Tensor, *, kind: str) -> torch.Tensor:
        """A tp redistribution: the operands' source sharding to their target's."""
        operands = call.operands
        if kind == "all_reduce":
            return self.all_reduce(value, call, REDUCE_OPS[operands.reduce_op or "sum"])
        source, target = operands.source_dim, operands.target_dim
        if kind == "all_gather":
            axis = SEQ_AXIS if source == "seq" else FEATURE_AXIS
            return join_feature(self.all_gather_list(value, call), source, self.ctx.model,
                                axis)
        chunks = [self._split(value, target, call.size, i) for i in range(call.size)]
        if kind == "reduce_scatter":
            return self.reduce_scatter_list(chunks, call)
        received = [torch.empty_like(c) for c in chunks]
        _wait(dist.all_to_all(received, [c.contiguous() for c in chunks], group=call.group,
                              async_op=True))
        axis = SEQ_AXIS if source == "seq" else FEATURE_AXIS
        return join_feature(received, source, self.ctx.model, axis)

    def all_gather_into(self, call: Call, value: torch.Tensor, into: torch.Tensor
                        ) -> torch.Tensor:
        """An all-gather of the tokens into the let-go storage of the forward's (a GEMM's
        input gathered again for its backward, planc.runtime.engine.store): the pieces
        joined into autograd's saved bytes, which they outlive only for the join."""
        pieces = self.all_gather_list(value, call)
        torch.cat(pieces, dim=SEQ_AXIS, out=buckets.into_let_go(into))
        return into

    def loss_statistic(self, call: Call, value: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(value, call, REDUCE_OPS[call.operands.reduce_op])

    def loss_report(self, call: Call, value: torch.Tensor) -> torch.Tensor:
        """The step's loss, summed over every rank of the last stage."""
        return self.all_reduce(value.reshape(1).to(torch.float32), call)

    def norm_sum(self, call: Call, value: torch.Tensor) -> torch.Tensor:
        """The shares of the squared gradient norm (planc.runtime.engine.grad_norm), one fp64
        number, summed over every rank; or a stage's expert loads
        (planc.runtime.engine.router_bias), fp64 integers, summed over the stage."""
        return self.all_reduce(value, call)

    # --- context parallel -----------------------------------------------------------------

    def _kv_of(self, qkv: torch.Tensor) -> torch.Tensor:
        """The k and v heads of a local [q | k | v] activation: everything after q, whose
        width the family's ``query_width`` gives where its heads are not head_dim wide
        (multi-head latent attention's)."""
        model = self.ctx.model
        query_width = getattr(family_module(model.family), "query_width", None)
        if query_width is not None:
            return qkv[..., query_width(model, qkv.shape[-1]):].contiguous()
        heads, _ = local_heads(model, qkv.shape[-1], self.ctx.tp)
        return qkv[..., heads * model.head_dim:].contiguous()

    def kv_all_gather(self, call: Call, qkv: torch.Tensor) -> torch.Tensor:
        """Every cp rank's keys and values, in cp rank order along the tokens."""
        return torch.cat(self.all_gather_list(self._kv_of(qkv), call), dim=SEQ_AXIS)

    def dkv_reduce_scatter(self, call: Call, dkv: torch.Tensor) -> torch.Tensor:
        return self.reduce_scatter_list(list(dkv.chunk(call.size, dim=SEQ_AXIS)), call)

    # --- pipeline ------------------------------------------------------------------------

    def send(self, call: Call, value: torch.Tensor) -> None:
        _wait(dist.isend(value.to(self.ctx.dtype).contiguous(), call.peer, group=call.group))

    def recv(self, call: Call, value=None) -> torch.Tensor:
        ctx = self.ctx
        out = torch.empty(call.operands.shape, dtype=ctx.dtype, device=ctx.device)
        _wait(dist.irecv(out, call.peer, group=call.group))
        return out

    # --- gradients and parameters, by bucket ----------------------------------------------

    def grad_all_reduce(self, call: Call, value=None) -> None:
        """Sum a bucket's gradient over the group: the range of elements the node names
        (the partial sums over tp), the whole buffer of which the rank keeps its ZeRO-1
        shard (``into_shard``), or the whole gradient as it stands (over dp x cp under
        ZeRO 0, or its shard between tied stages)."""
        bucket = call.operands.bucket
        if call.operands.elements:
            start, end = call.operands.elements
            self.all_reduce(self.store.whole_grad(bucket)[start:end], call, in_place=True)
        elif call.operands.into_shard:  # ZeRO-1 by all-reduce, as DeepSpeed's BF16_Optimizer
            grad = self.store.whole_grad(bucket)
            self.all_reduce(grad, call, in_place=True)
            self.store.grad_shard[bucket] += self.store.own_shard(bucket, grad)
        else:
            self.all_reduce(self.store.current_grad(bucket), call, in_place=True)

    def grad_reduce_scatter(self, call: Call, value=None) -> None:
        """Each replica keeps the sum of its equal slice of the bucket's gradient; every
        microbatch under ZeRO-2/3, whose whole buffer is then let go until the next
        backward adds into it (planc.runtime.engine.store.ParamStore.let_go_grad)."""
        bucket = call.operands.bucket
        grad = self.store.whole_grad(bucket)
        out = torch.empty_like(self.store.grad_shard[bucket])
        if call.route is not None:
            routes.reduce_scatter(call.route, grad, out)
        else:
            _wait(reduce_scatter_single(out, grad, group=call.group, async_op=True))
        self.store.grad_shard[bucket] += out
        if call.per_microbatch:
            if grad.is_cuda:  # freed once this stream's reduction has read it
                grad.record_stream(torch.cuda.current_stream())
            self.store.let_go_grad(bucket)

    def grad_slice_gather(self, call: Call, value=None) -> None:
        """A replicated parameter used through slices: gather every rank's slice of its
        gradient (the rest of each rank's gradient is zero)."""
        ctx, operands = self.ctx, call.operands
        grad = self.store.grad_of(operands.tensor)
        dim = operands.dim
        if dim == "seq":  # the position table: rows of each tp rank's tokens
            pieces = self.all_gather_list(grad[ctx.tp_positions(ctx.tp_rank)], call)
            for tp_rank, piece in enumerate(pieces):
                grad[ctx.tp_positions(tp_rank)] = piece
            return
        axis = operands.slice_axis
        mine = split_feature(grad, dim, ctx.tp, ctx.tp_rank, ctx.model, axis)
        grad.copy_(join_feature(self.all_gather_list(mine, call), dim, ctx.model, axis))

    def param_gather(self, call: Call, value=None) -> torch.Tensor:
        """Every replica's slice of a bucket's parameters: after a ZeRO-1/2 optimizer
        step into the bucket itself, before a ZeRO-3 use into a buffer of its own, in
        the model's dtype, which is what the forward reads and what the graph's gather
        moves (FSDP's ``param_dtype``; the cast commutes with the gather, so the bits are
        the same as casting after it). ``value``: a backward's gather, the forward's
        bucket whose storage was let go, to gather into (planc.runtime.engine.store)."""
        bucket = call.operands.bucket
        shard = self.store.shard[bucket]
        if call.operands.into_bucket:
            out = self.store.full[bucket]
        else:
            shard = shard.to(self.ctx.dtype)
            out = buckets.filled_again(value) if value is not None else torch.empty(
                self.store.buckets[bucket]["padded"], dtype=shard.dtype, device=shard.device)
        if call.size == 1:
            out.copy_(shard)
        elif call.route is not None:
            routes.all_gather(call.route, shard, out)
        else:
            _wait(all_gather_single(out, shard, group=call.group, async_op=True))
        return out
