"""What one rank knows while it runs: its coordinates, groups, parameters and data."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from planc.graph.layouts import R, S
from planc.graph.tensor_parallel import ParamUse, TensorParallelPlan, plan_tensor_parallel
from planc.layout import Layout
from planc.plan import Plan
from planc.runtime.model import (batch_tokens, flat_shard_size, initial_value, microbatch_rows,
                                 parameters, seq_split, split_feature, token_positions)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Groups:
    """Process groups of this rank, by axis of the graph; ranks are global."""

    handles: dict[str, object] = field(default_factory=dict)
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def index(self, axis: str, rank: int) -> int:
        return self.members[axis].index(rank)


def pp_group_key(source: int, target: int, phase: str) -> str:
    return f"pp:{source}>{target}:{phase}"


def make_groups(plan: Plan, layout: Layout, rank: int, timeout: float) -> Groups:
    """Every rank creates every group, in the same order (torch.distributed requires it)."""
    groups = Groups()
    axes: dict[str, list[tuple[int, ...]]] = {
        axis: layout.groups(axis) for axis in ("tp", "cp", "dp_cp")}
    pp = plan.mesh.pp
    stage_stride = layout.strides["pp"]
    axes["stage"] = [tuple(r for r in range(plan.world) if r // stage_stride % pp == s)
                     for s in range(pp)]
    if plan.model.tie_embeddings and pp > 1:
        axes["tied"] = [(r, layout.rank({**layout.coords(r), "pp": pp - 1}))
                        for r in range(plan.world) if layout.coords(r)["pp"] == 0]
    # Point-to-point: one group per ordered pair of neighbouring stages and direction, so
    # that each stream of a rank talks over a group of its own.
    if pp > 1:
        for r in range(plan.world):
            nxt = layout.rank({**layout.coords(r), "pp": (layout.coords(r)["pp"] + 1) % pp})
            for src, dst, phase in ((r, nxt, "forward"), (nxt, r, "backward")):
                handle = dist.new_group(sorted({src, dst}), timeout=timedelta(seconds=timeout))
                if rank in (src, dst):
                    groups.handles[pp_group_key(src, dst, phase)] = handle
    for axis, all_groups in axes.items():
        for members in all_groups:
            members = tuple(sorted(members))
            if len(members) == 1:
                handle = None
            else:
                handle = dist.new_group(list(members), timeout=timedelta(seconds=timeout))
            if rank in members:
                groups.handles[axis] = handle
                groups.members[axis] = members
    return groups


class ParamStore:
    """This rank's parameters: the tp-local tensor each operator uses and, with ZeRO,
    the flat shard over dp x cp that the optimizer owns."""

    def __init__(self, ctx: "RankContext"):
        self.ctx = ctx
        self.full: dict[str, torch.Tensor] = {}  # tp-local (absent under ZeRO-3)
        self.shard: dict[str, torch.Tensor] = {}  # flat, padded (ZeRO >= 1)
        self.shape: dict[str, torch.Size] = {}
        specs = parameters(ctx.plan)
        for name, use in ctx.storage.items():
            value = ctx.local_slice(initial_value(ctx.plan.train.seed, specs[name]),
                                    use).to(ctx.device)
            self.shape[name] = value.shape
            if ctx.zero >= 1 and ctx.replicas > 1:
                self.shard[name] = ctx.flat_shard(value)
            if not (ctx.zero == 3 and ctx.replicas > 1):
                self.full[name] = value


class RankContext:
    def __init__(self, plan: Plan, rank: int, groups: Groups | None, device: torch.device):
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        self.layout = Layout.of(plan)
        self.coords = self.layout.coords(rank)
        self.tpp: TensorParallelPlan = plan_tensor_parallel(plan)
        self.tp, self.cp = plan.mesh.tp, plan.mesh.cp
        self.tp_rank, self.cp_rank = self.coords["tp"], self.coords["cp"]
        self.stage = self.coords["pp"]
        self.replicas = plan.mesh.dp * plan.mesh.cp
        self.zero = plan.shard.dp.zero
        self.dtype = DTYPES[plan.model.dtype]
        self.heads = plan.model.heads
        self.tokens_per_step = plan.model.batch * plan.model.seq
        self.storage = self._storage()
        self._batch: tuple[int, torch.Tensor] | None = None

    # --- parameters --------------------------------------------------------------------

    def _storage(self) -> dict[str, ParamUse]:
        """The parameters of this stage, each with how it is stored over tp."""
        from planc.graph.model import LAYER_OPS

        pp = self.plan.mesh.pp
        layers = self.plan.shard.pp.layers_of_stage(self.stage, pp)
        chunks = [c for c in range(len(self.plan.shard.pp.chunks)) if c % pp == self.stage]
        first, last = 0 in chunks, len(self.plan.shard.pp.chunks) - 1 in chunks
        out: dict[str, ParamUse] = {}
        for op, layout in self.tpp.ops.items():
            for use in layout.params:
                if op in LAYER_OPS:
                    for layer in layers:
                        out.setdefault(f"layers.{layer}.{use.name}", use)
                elif (op in ("embedding", "position") and first) or \
                        (op in ("final_ln", "head", "loss") and last):
                    out.setdefault(use.name, use)
        return out

    def local_slice(self, full: torch.Tensor, use: ParamUse) -> torch.Tensor:
        """The tp-local part of a whole parameter, as it is stored."""
        if not use.storage.is_sharded or self.tp == 1:
            return full.clone()
        axis = use.storage_axis
        return split_feature(full, use.storage.dim, self.tp, self.tp_rank, self.heads,
                             axis).clone()

    def flat_shard(self, value: torch.Tensor) -> torch.Tensor:
        flat = value.reshape(-1)
        size = flat_shard_size(flat.numel(), self.replicas)
        padded = torch.zeros(size * self.replicas, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        index = self.groups.index("dp_cp", self.rank) if self.groups else 0
        return padded[index * size:(index + 1) * size].clone()

    # --- data --------------------------------------------------------------------------

    def tokens(self, step: int) -> torch.Tensor:
        if self._batch is None or self._batch[0] != step:
            self._batch = (step, batch_tokens(self.plan, step))
        return self._batch[1]

    def positions(self, layout) -> torch.Tensor:
        """Positions of the tokens this rank holds for an activation of ``layout`` (over
        tp): all of its cp chunk, or its tp slice of them under S(seq)."""
        positions = token_positions(self.plan, self.cp_rank)
        if layout == S("seq") and self.tp > 1:
            positions = seq_split(positions, 0, self.tp, self.tp_rank)
        return positions.to(self.device)

    def tp_positions(self, tp_rank: int) -> torch.Tensor:
        return seq_split(token_positions(self.plan, self.cp_rank), 0, self.tp,
                         tp_rank).to(self.device)

    def all_key_positions(self) -> torch.Tensor:
        """Positions of every cp rank's tokens, in cp rank order (a gathered K/V)."""
        return torch.cat([token_positions(self.plan, c) for c in range(self.cp)]).to(
            self.device)

    def microbatch(self, step: int, microbatch: int, layout=R) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """(input ids, target ids) of this rank's tokens of a microbatch."""
        rows = microbatch_rows(self.plan, self.coords["dp"], microbatch)
        tokens = self.tokens(step)[rows].to(self.device)
        positions = self.positions(layout)
        return tokens[:, positions], tokens[:, positions + 1]
