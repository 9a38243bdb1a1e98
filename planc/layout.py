"""Ranks, coordinates, groups and nodes of the 4-D device mesh.

A rank's coordinates are its digits in the mixed radix given by ``mesh.order``, the
first axis varying fastest; with the default order
``r = tp_i + tp * (cp_i + cp * (pp_i + pp * dp_i))``, as in Megatron-LM's
``RankGenerator`` (megatron/core/parallel_state.py). The group of an axis is the set
of ranks that differ only in that axis; ``dp_cp`` (ranks that differ only in dp and
cp) is the group over which gradients are reduced.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from math import prod

from planc.plan import AXES, Mesh, Plan

GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp"),
}
# The ranks of one pipeline stage, which differ in tp, cp and dp: the graph's "stage"
# group (the loss's all-reduce), listed by planc layout but not part of its JSON.
STAGE_AXES = ("tp", "cp", "dp")
LAYOUT_FORMAT_VERSION = 1


def _axes_of(group: str) -> tuple[str, ...]:
    return STAGE_AXES if group == "stage" else GROUP_AXES[group]


@dataclass(frozen=True)
class GroupPlacement:
    """How the groups of one axis sit on nodes."""

    axis: str
    size: int
    count: int
    kinds: tuple[tuple[str, int], ...]  # ("intra-node" | "inter-node" | "mixed", groups)
    ranks_per_node: tuple[int, ...]  # distinct numbers of members per node, sorted

    @property
    def kind(self) -> str:
        return self.kinds[0][0] if len(self.kinds) == 1 else "mixed"


@dataclass(frozen=True)
class Layout:
    mesh: Mesh
    devices_per_node: int

    @staticmethod
    def of(plan: Plan) -> "Layout":
        return Layout(plan.mesh, plan.topology.devices_per_node)

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def nodes(self) -> int:
        return -(-self.world // self.devices_per_node)

    @cached_property
    def strides(self) -> dict[str, int]:
        strides, step = {}, 1
        for axis in self.mesh.order:
            strides[axis] = step
            step *= self.mesh.size(axis)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``, keyed in the canonical axis order tp, cp, pp, dp."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world}")
        return {axis: rank // self.strides[axis] % self.mesh.size(axis) for axis in AXES}

    def rank(self, coords: dict[str, int]) -> int:
        return sum(coords.get(axis, 0) * self.strides[axis] for axis in AXES)

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """The members of ``rank``'s group on ``axis`` (a key of GROUP_AXES, or "stage":
        the ranks that differ only in tp, cp and dp), sorted."""
        axes = _axes_of(axis)
        coords = self.coords(rank)
        base = rank - sum(coords[a] * self.strides[a] for a in axes)
        members = [base]
        for a in axes:
            stride = self.strides[a]
            members = [m + i * stride for m in members for i in range(self.mesh.size(a))]
        return tuple(sorted(members))

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group of ``axis`` (or "stage"), ordered by smallest member; they partition
        the world. Found once per axis, when first asked for."""
        if axis not in self._groups:
            axes = _axes_of(axis)
            # A group's smallest member is the one at coordinate 0 on the group's axes.
            leaders = [r for r in range(self.world)
                       if all(r // self.strides[a] % self.mesh.size(a) == 0 for a in axes)]
            self._groups[axis] = tuple(self.group(r, axis) for r in leaders)
        return list(self._groups[axis])

    @cached_property
    def _groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        return {}

    def placement(self, axis: str) -> GroupPlacement:
        kinds: Counter[str] = Counter()
        per_node: set[int] = set()
        groups = self.groups(axis)
        for members in groups:
            on_node = Counter(self.node(r) for r in members)
            per_node.update(on_node.values())
            if len(on_node) == 1:
                kinds["intra-node"] += 1
            elif max(on_node.values()) == 1:
                kinds["inter-node"] += 1
            else:
                kinds["mixed"] += 1
        size = prod(self.mesh.size(a) for a in _axes_of(axis))
        return GroupPlacement(axis, size, len(groups), tuple(sorted(kinds.items())),
                              tuple(sorted(per_node)))

    def crosses_nodes(self, axis: str) -> bool:
        """Whether the group of rank 0 on ``axis`` spans nodes; costs O(group size), so the
        compiler can ask it of a world of hundreds of thousands of ranks."""
        members = self.group(0, axis)
        return self.node(members[0]) != self.node(members[-1])

    def to_dict(self) -> dict:
        """The ``planc layout --json`` document (documented in docs/cli.md)."""
        order = list(self.mesh.order)
        ranks = [{"rank": r, "coords": self.coords(r), "node": self.node(r)}
                 for r in range(self.world)]
        groups = {axis: [list(g) for g in self.groups(axis)] for axis in GROUP_AXES}
        placement = {}
        for axis in GROUP_AXES:
            p = self.placement(axis)
            placement[axis] = {"kind": p.kind, "kinds": dict(p.kinds),
                               "ranks_per_node": list(p.ranks_per_node)}
        return {"version": LAYOUT_FORMAT_VERSION, "world": self.world, "order": order,
                "sizes": {axis: self.mesh.size(axis) for axis in AXES},
                "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "ranks": ranks, "groups": groups, "placement": placement}
