"""What one rank knows while it runs: its place in the mesh, its groups and its data.

Everything here is read from the build: its coordinates, pipeline peers and the leader
from ``programs/ranks.json`` (:class:`planc.program.ranks.RankTable`), the groups from
``programs/groups.json`` (:class:`planc.program.groups.GroupTable`), the model's sizes,
the optimizer, the data and which tokens and rows this rank takes from
``programs/model.json`` (:class:`planc.program.model_table.ModelTable`). Nothing is
derived again: the token positions are made once, when the rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from planc.program.groups import PIPELINE, GroupTable
from planc.program.model_table import ModelTable
from planc.program.ranks import RankTable
from planc.program.routes import RouteTable
from planc.runtime.engine.data import DataSource, batch_tokens
from planc.data.identity import Identity
from planc.runtime.engine.model import microbatch_rows, seq_split, token_positions
from planc.checkpoint.training_record import TrainingRecord

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Groups:
    """Process groups of this rank, by group reference; ranks are global."""

    handles: dict[str, object] = field(default_factory=dict)
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def index(self, ref: str, rank: int) -> int:
        return self.members[ref].index(rank) if ref in self.members else 0

    def size(self, ref: str) -> int:
        return len(self.members.get(ref, (0,)))


def pp_group_key(direction: str, source: int, target: int) -> str:
    """The group of pipeline transfers from ``source`` to ``target`` in ``direction``."""
    return f"pp:{direction}:{source}>{target}"


def make_groups(table: GroupTable, rank: int, timeout: float) -> Groups:
    """Every rank creates every group of the table, in its order (torch.distributed
    requires one order everywhere); a group of one rank needs no handle."""
    groups = Groups()
    wait = timedelta(seconds=timeout)
    for rule in table.rules:
        for members in table.groups(rule):
            if rule.ref == PIPELINE:
                direction, sender, receiver = members
                handle = dist.new_group(sorted({sender, receiver}), timeout=wait)
                if rank in (sender, receiver):
                    groups.handles[pp_group_key(direction, sender, receiver)] = handle
                continue
            handle = dist.new_group(list(members), timeout=wait) if len(members) > 1 \
                else None
            if rank in members:
                groups.handles[rule.ref] = handle
                groups.members[rule.ref] = members
    return groups


class RankContext:
    """``record``: what a checkpoint's manifest says of the plan (planc.checkpoint.training_record);
    the run itself reads ``model``."""

    def __init__(self, model: ModelTable, ranks: RankTable, rank: int, groups: Groups | None,
                 device: torch.device, routes: RouteTable | None = None,
                 data_identity: Identity | None = None, devices_per_node: int = 1,
                 record: TrainingRecord | None = None):
        self.record, self.rank, self.groups, self.device = record, rank, groups, device
        # the data file as the run began (planc.data.identity); None: not pinned
        self.data_identity = data_identity
        # an evaluation's context: the training step (from 1) after which it reads its
        # batches, for their messages (planc.runtime.engine.evaluation); None: training's
        self.evaluation: int | None = None
        self.routes = routes or RouteTable({})
        self.ranks = ranks
        self.devices_per_node = devices_per_node
        self.coords = ranks.coords(rank)
        self.tp, self.cp = ranks.axes["tp"][0], ranks.axes["cp"][0]
        self.tp_rank, self.cp_rank = self.coords["tp"], self.coords["cp"]
        self.stage = self.coords["pp"]
        self.dtype = DTYPES[model.dtype]
        self.model = model
        self.optimizer = model.optimizer
        self.tokens_per_step = model.batch * model.seq
        self.data = DataSource.of(model)
        self._batch: tuple[int, torch.Tensor] | None = None
        # every cp rank's token positions, on the CPU (cut further per activation)
        self._positions = [token_positions(model, c) for c in range(self.cp)]
        # ... and each cut on the device, made once: a copy from the host per instruction
        # would stop a CUDA rank's one issuing thread until the device caught up
        self._on_device: dict[tuple, torch.Tensor] = {}

    @property
    def leader(self) -> int:
        """The rank that knows the loss first and prints the run's progress: the last
        stage's rank with tp = cp = dp = 0."""
        return self.ranks.leader

    @property
    def label(self) -> str:
        """How traces and reports name this rank."""
        c = self.coords
        return f"rank {self.rank} (stage {c['pp']}, tp {c['tp']}, cp {c['cp']}, dp {c['dp']})"

    def peer(self, stage: int) -> int:
        """The rank of pipeline stage ``stage`` with this rank's other coordinates."""
        return self.ranks.peer(self.rank, stage)

    # --- data --------------------------------------------------------------------------

    def tokens(self, step: int) -> torch.Tensor:
        """The step's batch, on the device: copied there once a step, not once per
        instruction that reads a microbatch of it."""
        if self._batch is None or self._batch[0] != step:
            self._batch = (step, batch_tokens(self.data, step, self.data_identity,
                                              self.evaluation).to(self.device))
        return self._batch[1]

    def _device_copy(self, key: tuple, make) -> torch.Tensor:
        """``make()`` (positions on the CPU) on the device, made once per ``key``; read
        only, as every caller indexes with it."""
        found = self._on_device.get(key)
        if found is None:
            found = self._on_device[key] = make().to(self.device)
        return found

    def positions(self, seq_sharded: bool) -> torch.Tensor:
        """Positions of the tokens this rank holds for an activation: all of its cp
        chunk, or its tp slice of them when the activation is sharded along the tokens."""
        sliced = seq_sharded and self.tp > 1
        return self.tp_positions(self.tp_rank) if sliced else \
            self.block_positions(self.cp_rank)

    def tp_positions(self, tp_rank: int) -> torch.Tensor:
        return self._device_copy(("tp", tp_rank), lambda: seq_split(
            self._positions[self.cp_rank], 0, self.tp, tp_rank))

    def block_positions(self, cp_rank: int) -> torch.Tensor:
        """Positions of the tokens of cp rank ``cp_rank``'s K/V block (ring attention)."""
        return self._device_copy(("cp", cp_rank), lambda: self._positions[cp_rank])

    def all_key_positions(self) -> torch.Tensor:
        """Positions of every cp rank's tokens, in cp rank order (a gathered K/V)."""
        return self._device_copy(("all",), lambda: torch.cat(self._positions))

    def microbatch(self, step: int, microbatch: int, seq_sharded: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, target ids) of this rank's tokens of a microbatch."""
        rows = microbatch_rows(self.model, self.coords["dp"], microbatch)
        tokens = self.tokens(step)[rows]
        positions = self.positions(seq_sharded)
        return tokens[:, positions], tokens[:, positions + 1]
