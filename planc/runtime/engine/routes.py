"""Run a route recipe (planc.program.routes) on torch.distributed, step by step, as written.

The buffer is cut into the recipe's chunks; each step reads the chunks it lists (as one
contiguous tensor, copied only when they are not already consecutive in the buffer),
runs one sub-group collective or one point-to-point transfer, and replaces the chunks
it wrote. Nothing is decided here: the group, the sub-groups, this rank's position and
its steps all come from the build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from planc.plan.mesh import counts_of
from planc.program.routes import (
    CHUNKS_PER_MEMBER_STEPS,
    RouteTable,
    Step,
    StepOp,
    recipe_key,
)
from planc.runtime.engine.collectives import all_gather_single, reduce_scatter_single


@dataclass(frozen=True)
class Route:
    """One rank's part of a recipe."""

    steps: tuple[Step, ...]
    chunks: int
    position: int  # this rank's position in the group
    levels: dict[str, object]  # "intra" / "inter" -> process group (None: group of one)
    level_index: dict[str, int]  # this rank's place in each sub-group
    group: object  # the whole group, for point-to-point steps
    members: tuple[int, ...]  # global ranks of the whole group, by position


def _wait(work) -> None:
    if work is not None:
        work.wait()


class _Chunks:
    """The buffer's chunks: views of the buffer until a step replaces them."""

    def __init__(self, buffer: torch.Tensor, chunks: int):
        self.buffer, self.size = buffer, buffer.numel() // chunks
        self.pieces: list[torch.Tensor] = list(buffer.view(chunks, self.size))
        self.in_place = [True] * chunks

    def read(self, ids) -> torch.Tensor:
        ids = list(ids)
        if all(self.in_place[c] for c in ids) and ids == list(range(ids[0], ids[0] + len(ids))):
            return self.buffer[ids[0] * self.size:(ids[-1] + 1) * self.size]
        return torch.cat([self.pieces[c] for c in ids])

    def write(self, ids, tensor: torch.Tensor) -> None:
        for k, c in enumerate(ids):
            piece = tensor[k * self.size:(k + 1) * self.size]
            self.in_place[c] = self.in_place[c] and piece.data_ptr() == \
                self.pieces[c].data_ptr()
            self.pieces[c] = piece

    def settle(self) -> torch.Tensor:
        """The buffer with every chunk's final value in it."""
        for c, piece in enumerate(self.pieces):
            if not self.in_place[c]:
                self.buffer[c * self.size:(c + 1) * self.size].copy_(piece)
        return self.buffer


def _empty(numel: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _run(route: Route, state: _Chunks, op) -> None:
    for step in route.steps:
        if step.op is StepOp.ALL_REDUCE:
            data = state.read(step.chunks)
            group = route.levels[step.level]
            if group is not None:
                _wait(dist.all_reduce(data, op=op, group=group, async_op=True))
            state.write(step.chunks, data)
        elif step.op in CHUNKS_PER_MEMBER_STEPS:
            group, lists = route.levels[step.level], step.chunks
            mine = lists[route.level_index[step.level]]
            if step.op is StepOp.REDUCE_SCATTER:
                data = state.read([c for part in lists for c in part])
                out = _empty(len(mine) * state.size, data)
                if group is None:
                    out.copy_(data)
                else:
                    _wait(reduce_scatter_single(out, data, op=op, group=group,
                                                     async_op=True))
                state.write(mine, out)
            else:
                data = state.read(mine).contiguous()
                out = _empty(len(lists) * data.numel(), data)
                if group is None:
                    out.copy_(data)
                else:
                    _wait(all_gather_single(out, data, group=group, async_op=True))
                state.write([c for part in lists for c in part], out)
        elif step.op is StepOp.SEND:
            _wait(dist.isend(state.read(step.chunks).contiguous(), route.members[step.peer],
                             group=route.group))
        else:  # recv, recv_reduce
            out = _empty(len(step.chunks) * state.size, state.buffer)
            _wait(dist.irecv(out, route.members[step.peer], group=route.group))
            if step.op is StepOp.RECV_REDUCE:
                mine = state.read(step.chunks)
                out = torch.maximum(mine, out) if op == dist.ReduceOp.MAX else mine + out
            state.write(step.chunks, out)


def _padded(flat: torch.Tensor, chunks: int) -> torch.Tensor:
    extra = -flat.numel() % chunks
    if not extra:
        return flat
    out = _empty(flat.numel() + extra, flat)
    out[:flat.numel()].copy_(flat)
    out[flat.numel():].zero_()
    return out


def all_reduce(route: Route, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """``tensor`` (contiguous) becomes the reduction over the group, in place."""
    flat = tensor.view(-1)
    work = _padded(flat, route.chunks)
    state = _Chunks(work, route.chunks)
    _run(route, state, op)
    state.settle()
    if work is not flat:
        flat.copy_(work[:flat.numel()])


def reduce_scatter(route: Route, buffer: torch.Tensor, out: torch.Tensor,
                   op=dist.ReduceOp.SUM) -> None:
    """``out`` gets this rank's chunk of the reduction of the flat ``buffer``, whose
    numel is the group size times out's; ``buffer`` is left as scratch."""
    state = _Chunks(buffer.view(-1), route.chunks)
    _run(route, state, op)
    out.view(-1).copy_(state.pieces[route.position])


def all_gather(route: Route, shard: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (flat, group size times shard's numel) gets every member's shard."""
    out = out.view(-1)
    state = _Chunks(out, route.chunks)
    state.pieces[route.position].copy_(shard.reshape(-1))
    _run(route, state, dist.ReduceOp.SUM)
    state.settle()


def resolve(table: RouteTable, kind: str, route: str | None, ref: str,
            members: tuple[int, ...], rank: int, groups, devices_per_node: int
            ) -> Route | None:
    """This rank's part of the recipe the compiler wrote for a collective ``kind`` routed
    by ``route`` on its group ``members`` (None for the backend's own collective)."""
    if route in (None, "ring") or len(members) <= 1:
        return None
    key = recipe_key(str(kind), route, counts_of(members, devices_per_node))
    recipe = table.recipes.get(key)
    if recipe is None:
        raise RuntimeError(f"the build has no route recipe {key}; run planc compile again")
    position = members.index(rank)
    levels, index = {}, {}
    for level in ("intra", "inter"):
        sub = f"{ref}/{level}"
        if sub in groups.members:
            levels[level] = groups.handles.get(sub)
            index[level] = groups.members[sub].index(rank)
    return Route(recipe.positions[position], recipe.chunks, position, levels, index,
                 groups.handles.get(ref), members)
