"""Which rank runs which program, and where each rank sits in the mesh.

Written by the compiler (programs/ranks.json) from the mesh's layout, so that the
runtime finds a rank's coordinates, its pipeline peers and the leader (the rank that
knows the loss first) in the build, without the plan's layout.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator
from planc.vocabulary.versions import is_version

# Version 2: the mesh's axes (size and stride) and the leader (version 1 had pp only).
RANK_TABLE_VERSION = 2
AXES = ("tp", "cp", "dp", "pp")


def _string(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def integer_of(value, what: str) -> int:
    """An integer of a file read back (JSON has no integer type: 1e400 is infinity, 2.5
    and true are numbers too)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} is {value!r}, not an integer")
    return value


@dataclass(frozen=True)
class RankTable:
    """Which program each rank runs. By rule, every rank of a pipeline stage runs that
    stage's program (so the table does not grow with the world); ``overrides`` lists ranks
    that run another program (a program edited by hand, for instance). ``axes``: each mesh
    axis's (size, stride), as planc.plan.layout.Layout orders the ranks; ``leader``: the last
    stage's rank with tp = cp = dp = 0, which knows the loss first."""

    world: int
    pp: int
    stride: int  # how far apart ranks of neighbouring stages are (mesh order)
    stages: dict[str, int]  # program file -> the stage whose ranks run it
    overrides: dict[int, str] = field(default_factory=dict)
    axes: dict[str, tuple[int, int]] = field(default_factory=dict)
    leader: int = 0

    @property
    def names(self) -> list[str]:
        return list(self.stages) + sorted(set(self.overrides.values()) - set(self.stages))

    def stage_of(self, rank: int) -> int:
        return rank // self.stride % self.pp

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on every axis of the mesh."""
        return {axis: rank // stride % size for axis, (size, stride) in self.axes.items()}

    def peer(self, rank: int, stage: int) -> int:
        """The rank of pipeline stage ``stage`` with ``rank``'s other coordinates."""
        return rank + (stage - self.stage_of(rank)) * self.stride

    @cached_property
    def _by_stage(self) -> dict[int, str]:
        by_stage: dict[int, str] = {}
        for name, stage in self.stages.items():
            by_stage.setdefault(stage, name)
        return by_stage

    def program_of(self, rank: int) -> str:
        if rank in self.overrides:
            return self.overrides[rank]
        return self._by_stage[self.stage_of(rank)]

    def ranks(self, name: str) -> Iterator[int]:
        """Every rank that runs ``name``, in order: its stage's ranks by rule, those
        overridden to it added and those overridden away left out (for reports and
        listings; it visits the stage's ranks, not the world's, which the verifier's
        thousand programs of 32,768 ranks each walked)."""
        stage = self.stages.get(name)
        by_rule = () if stage is None else (
            rank for rank in self._ranks_of_stage(stage) if rank not in self.overrides)
        overridden = sorted(rank for rank, other in self.overrides.items()
                            if other == name and 0 <= rank < self.world)
        yield from heapq.merge(by_rule, overridden)

    def _ranks_of_stage(self, stage: int) -> Iterator[int]:
        """The ranks whose stage is ``stage`` by rule: the mesh orders pp with stride
        ``stride``, so they come in runs of ``stride`` every ``stride * pp`` ranks."""
        if self.stride <= 0 or not 0 <= stage < self.pp:  # no rank lies there
            return
        period = self.stride * self.pp
        for start in range(0, self.world, period):
            first = start + stage * self.stride
            yield from range(first, min(first + self.stride, self.world))

    def to_json(self) -> dict:
        return {"format": "planc-ranks", "version": RANK_TABLE_VERSION,
                "world": self.world, "pp": self.pp, "pp_stride": self.stride,
                "stages": dict(self.stages),
                "overrides": {str(r): name for r, name in sorted(self.overrides.items())},
                "axes": {axis: list(value) for axis, value in self.axes.items()},
                "leader": self.leader}

    @staticmethod
    def from_json(data: dict) -> "RankTable":
        if data.get("format") != "planc-ranks" or \
                not is_version(data.get("version"), RANK_TABLE_VERSION):
            raise ValueError(f"not a version {RANK_TABLE_VERSION} planc rank table")
        axes = data["axes"]
        if not isinstance(axes, dict) or sorted(axes) != sorted(AXES):
            raise ValueError(f"its axes must be {list(AXES)}")
        table = RankTable(integer_of(data["world"], "its world"), integer_of(data["pp"], "its pp"),
                          integer_of(data["pp_stride"], "its pp_stride"),
                          {str(k): integer_of(v, f"the stage of {k}")
                           for k, v in data["stages"].items()},
                          {int(k): _string(v) for k, v in data.get("overrides", {}).items()},
                          {axis: (integer_of(axes[axis][0], f"the size of {axis}"),
                                  integer_of(axes[axis][1], f"the stride of {axis}"))
                           for axis in AXES},
                          integer_of(data["leader"], "its leader"))
        if table.world < 1 or table.pp < 1 or table.stride < 1 or \
                len(table.stages) != table.pp or \
                sorted(table.stages.values()) != list(range(table.pp)) or \
                any(not 0 <= r < table.world for r in table.overrides):
            raise ValueError("its world, pp, pp_stride, stages or overrides are inconsistent")
        if min(size for size, _ in table.axes.values()) < 1 or \
                table.axes["pp"] != (table.pp, table.stride) or \
                _ordered(table.axes) != _packed(table.axes) or \
                not 0 <= table.leader < table.world:
            raise ValueError("its axes or its leader are inconsistent with its pp, pp_stride "
                             "and world")
        return table


def _packed(axes: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    """The axes as a mixed-radix numbering of the ranks has them: each stride the product
    of the sizes of the axes with smaller strides."""
    ordered = _ordered(axes)
    out, stride = [], 1
    for size, _ in ordered:
        out.append((size, stride))
        stride *= size
    return out


def _ordered(axes: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    """(size, stride) by stride; of equal strides, an axis of size 1 first."""
    return sorted(axes.values(), key=lambda a: (a[1], a[0]))
