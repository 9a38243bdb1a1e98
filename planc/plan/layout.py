"""Ranks, coordinates, groups and nodes of the device mesh, for one plan.

The rules live in :mod:`planc.plan.mesh` (after Megatron-LM's ``RankGenerator``): a rank's
coordinates are its digits in the mixed radix given by ``mesh.order``, the first axis
varying fastest, and the group of an axis is the set of ranks that differ only in that
axis; ``dp_cp`` (ranks that differ only in dp and cp) is the group over which gradients
are reduced. :class:`Layout` answers them for a plan and adds how groups sit on nodes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from math import prod

from planc.plan.mesh import GROUPS, LAYOUT_GROUPS, RankMesh, expert_cut
from planc.plan.plan import Mesh, Plan

# The groups planc layout --json lists, by the mesh axes along which members differ.
GROUP_AXES: dict[str, tuple[str, ...]] = {name: GROUPS[name].axes for name in LAYOUT_GROUPS}
# The ranks of one pipeline stage, which differ in tp, cp and dp: the graph's "stage"
# group (the loss's all-reduce), listed by planc layout and its JSON after the axes'.
STAGE_AXES = GROUPS["stage"].axes
# With mesh { ep }: the ep groups and the experts' replicas, listed after the others.
EXPERT_GROUPS: tuple[str, ...] = tuple(name for name, kind in GROUPS.items() if kind.experts)
LAYOUT_FORMAT_VERSION = 1


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

    @cached_property
    def ranks(self) -> RankMesh:
        """The mesh's rules (planc.plan.mesh) for this plan's degrees, order and nodes."""
        return RankMesh.of(self.mesh.sizes, self.mesh.order, self.devices_per_node)

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def nodes(self) -> int:
        return self.ranks.nodes

    @property
    def strides(self) -> dict[str, int]:
        return self.ranks.strides

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``, keyed in the canonical axis order tp, cp, pp, dp."""
        return self.ranks.coords(rank)

    def rank(self, coords: dict[str, int]) -> int:
        return self.ranks.rank(coords)

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """The members of ``rank``'s group on ``axis`` (a group of planc.plan.mesh.GROUPS:
        a key of GROUP_AXES, or "stage", the ranks that differ only in tp, cp and dp),
        sorted. With mesh { ep } a stage's ranks are cut into runs of ep (``ep``) and
        across them (``edp``: the ranks at ``rank``'s place in every run); without it
        both are ``rank`` alone."""
        members = self.ranks.group(rank, axis)
        cut, ep = GROUPS[axis].experts, self.mesh.ep
        if not cut:
            return members
        if ep == 1:
            return (rank,)
        return next(piece for piece in expert_cut(members, ep, cut) if rank in piece)

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group of ``axis`` (or "stage"), ordered by smallest member; they partition
        the world. Found once per axis, when first asked for."""
        cut, ep = GROUPS[axis].experts, self.mesh.ep
        if not cut:
            return self.ranks.groups(axis)
        if ep == 1:
            return [(r,) for r in range(self.world)]
        out = [piece for stage in self.ranks.groups("stage")
               for piece in expert_cut(stage, ep, cut)]
        return sorted(out)

    def first_rank_of_stage(self, stage: int) -> int:
        return self.ranks.first_rank_of_stage(stage)

    def pipeline_peer(self, rank: int, stage: int) -> int:
        return self.ranks.pipeline_peer(rank, stage)

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
        size = len(groups[0]) if GROUPS[axis].experts else \
            prod(self.mesh.size(a) for a in GROUPS[axis].axes)
        return GroupPlacement(axis, size, len(groups), tuple(sorted(kinds.items())),
                              tuple(sorted(per_node)))

    def crosses_nodes(self, axis: str) -> bool:
        """Whether the group of rank 0 on ``axis`` spans nodes; costs O(group size), so the
        compiler can ask it of a world of hundreds of thousands of ranks."""
        if GROUPS[axis].experts:
            members = self.group(0, axis)
            return self.node(members[0]) != self.node(members[-1])
        return self.ranks.crosses_nodes(axis)

    def to_dict(self) -> dict:
        """The ``planc layout --json`` document (documented in docs/cli.md)."""
        order = list(self.mesh.order)
        ranks = [{"rank": r, "coords": self.coords(r), "node": self.node(r)}
                 for r in range(self.world)]
        listed = (*GROUP_AXES, "stage", *(EXPERT_GROUPS if self.mesh.ep > 1 else ()))
        groups = {axis: [list(g) for g in self.groups(axis)] for axis in listed}
        placement = {}
        for axis in listed:
            p = self.placement(axis)
            placement[axis] = {"kind": p.kind, "kinds": dict(p.kinds),
                               "ranks_per_node": list(p.ranks_per_node)}
        return {"version": LAYOUT_FORMAT_VERSION, "world": self.world, "order": order,
                "sizes": self.mesh.sizes,
                "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "ranks": ranks, "groups": groups, "placement": placement}
