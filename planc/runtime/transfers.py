"""The transfers of the graph on torch.distributed, one function per kind of node.

Activations are (batch, tokens, features): a redistribution along ``seq`` works on
dimension 1, along a feature dimension (hidden, ffn, qkv, vocab) on dimension 2, where a
``qkv`` shard is the same heads of q, k and v. Parameters and their gradients are
flattened for the dp x cp reductions of ZeRO, padded to a multiple of the group
(as PyTorch FSDP and Megatron's distributed optimizer do). Each function issues its
collectives asynchronously and waits on their work handles (on CUDA that wait orders
the current stream after the collective, without blocking the host).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planc.graph.layouts import parse
from planc.runtime.context import RankContext
from planc.runtime.model import flat_shard_size, join_feature, split_feature

FEATURE_AXIS, SEQ_AXIS = 2, 1


class Transfers:
    def __init__(self, ctx: RankContext):
        self.ctx = ctx

    # --- helpers -----------------------------------------------------------------------

    def group(self, axis: str):
        return self.ctx.groups.handles.get(axis)

    def size(self, axis: str) -> int:
        return len(self.ctx.groups.members.get(axis, (self.ctx.rank,)))

    def index(self, axis: str) -> int:
        return self.ctx.groups.index(axis, self.ctx.rank)

    @staticmethod
    def _wait(work) -> None:
        if work is not None:
            work.wait()

    def all_reduce(self, tensor: torch.Tensor, axis: str, op: str = "sum") -> torch.Tensor:
        if self.size(axis) == 1:
            return tensor
        out = tensor.clone().contiguous()
        reduce = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self._wait(dist.all_reduce(out, op=reduce, group=self.group(axis), async_op=True))
        return out

    def all_gather_list(self, tensor: torch.Tensor, axis: str) -> list[torch.Tensor]:
        if self.size(axis) == 1:
            return [tensor]
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(self.size(axis))]
        self._wait(dist.all_gather(pieces, tensor, group=self.group(axis), async_op=True))
        return pieces

    def reduce_scatter_list(self, chunks: list[torch.Tensor], axis: str) -> torch.Tensor:
        if self.size(axis) == 1:
            return chunks[0]
        chunks = [c.contiguous() for c in chunks]
        out = torch.empty_like(chunks[0])
        self._wait(dist.reduce_scatter(out, chunks, group=self.group(axis), async_op=True))
        return out

    # --- tensor parallel redistributions -------------------------------------------------

    def _axis_of(self, dim: str) -> int:
        return SEQ_AXIS if dim == "seq" else FEATURE_AXIS

    def _split(self, tensor, dim: str, parts: int, index: int):
        return split_feature(tensor, dim, parts, index, self.ctx.heads, self._axis_of(dim))

    def _chunks(self, tensor, dim: str, parts: int) -> list[torch.Tensor]:
        return [self._split(tensor, dim, parts, i) for i in range(parts)]

    def redistribute(self, tensor: torch.Tensor, data: dict) -> torch.Tensor:
        """A tp (or loss) redistribution node: source layout -> target layout."""
        kind = data["kind"]
        if kind == "all_reduce":
            return self.all_reduce(tensor, data["axis"], data.get("reduce_op", "sum"))
        source, target = parse(data["source_layout"]), parse(data["target_layout"])
        axis = data["axis"]
        n = self.size(axis)
        if kind == "all_gather":
            pieces = self.all_gather_list(tensor, axis)
            return join_feature(pieces, source.dim, self.ctx.heads, self._axis_of(source.dim))
        if kind == "reduce_scatter":
            return self.reduce_scatter_list(self._chunks(tensor, target.dim, n), axis)
        if kind == "all_to_all":
            sent = self._chunks(tensor, target.dim, n)
            received = [torch.empty_like(c) for c in sent]
            self._wait(dist.all_to_all(received, [c.contiguous() for c in sent],
                                       group=self.group(axis), async_op=True))
            return join_feature(received, source.dim, self.ctx.heads, self._axis_of(source.dim))
        raise ValueError(f"unknown redistribution {kind}")

    # --- context parallel -----------------------------------------------------------------

    def _kv_of(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, width = qkv.shape
        third = width // 3
        return qkv.reshape(b, s, 3, third)[:, :, 1:].reshape(b, s, 2 * third)

    def kv_all_gather(self, qkv: torch.Tensor) -> torch.Tensor:
        """Every cp rank's keys and values, in cp rank order along the tokens."""
        return torch.cat(self.all_gather_list(self._kv_of(qkv), "cp"), dim=SEQ_AXIS)

    def dkv_reduce_scatter(self, dkv: torch.Tensor) -> torch.Tensor:
        chunks = list(dkv.chunk(self.size("cp"), dim=SEQ_AXIS))
        return self.reduce_scatter_list(chunks, "cp")

    def _ring_shift(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send to the next cp rank, receive from the previous, together."""
        members = self.ctx.groups.members["cp"]
        i = members.index(self.ctx.rank)
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), members[(i + 1) % len(members)],
                          group=self.group("cp")),
               dist.P2POp(dist.irecv, received, members[(i - 1) % len(members)],
                          group=self.group("cp"))]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received

    def kv_ring(self, qkv: torch.Tensor, steps: int) -> torch.Tensor:
        """Ring attention's K/V passes: after cp - 1 shifts every block has visited every
        rank; the result is all blocks in cp rank order."""
        n, me = self.size("cp"), self.index("cp")
        blocks = {me: self._kv_of(qkv)}
        current = blocks[me]
        for step in range(1, steps + 1):
            current = self._ring_shift(current)
            blocks[(me - step) % n] = current
        return torch.cat([blocks[i] for i in range(n)], dim=SEQ_AXIS)

    def dkv_ring(self, dkv: torch.Tensor, steps: int) -> torch.Tensor:
        """The gradient accumulator of each K/V block travels the ring, every rank adding
        its share, and comes home after cp shifts."""
        n, me = self.size("cp"), self.index("cp")
        shares = list(dkv.chunk(n, dim=SEQ_AXIS))
        accumulator = shares[me].clone()
        for step in range(1, steps):
            accumulator = self._ring_shift(accumulator) + shares[(me - step) % n]
        return self._ring_shift(accumulator) if steps == n else accumulator

    # --- pipeline ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, peer: int, group) -> None:
        self._wait(dist.isend(tensor.contiguous(), peer, group=group))

    def recv(self, shape, dtype, peer: int, group) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.ctx.device)
        self._wait(dist.irecv(out, peer, group=group))
        return out

    # --- parameters ------------------------------------------------------------------------

    def flat_reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        n = self.size("dp_cp")
        flat = grad.reshape(-1)
        size = flat_shard_size(flat.numel(), n)
        padded = torch.zeros(size * n, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        return self.reduce_scatter_list(list(padded.split(size)), "dp_cp")

    def flat_all_gather(self, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        return torch.cat(self.all_gather_list(shard, "dp_cp"))[:numel].reshape(shape)

    def slice_all_gather(self, grad: torch.Tensor, dim: str, dims: tuple[str, ...]):
        """A replicated parameter used through slices: gather every rank's slice of its
        gradient (the rest of each rank's gradient is zero)."""
        ctx = self.ctx
        if dim == "seq":  # the position table: rows of each tp rank's tokens
            pieces = self.all_gather_list(grad[ctx.tp_positions(ctx.tp_rank)], "tp")
            out = torch.zeros_like(grad)
            for tp_rank, piece in enumerate(pieces):
                out[ctx.tp_positions(tp_rank)] = piece
            return out
        axis = dims.index(dim)
        mine = split_feature(grad, dim, ctx.tp, ctx.tp_rank, ctx.heads, axis)
        return join_feature(self.all_gather_list(mine, "tp"), dim, ctx.heads, axis)
