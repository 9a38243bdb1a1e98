"""The device mesh: its axes, its groups and where ranks sit, in one registry.

Everything planc knows about the mesh's vocabulary lives here and nowhere else: which
axes there are (:data:`MESH_AXES`), in which order a plan may list them, which groups
the compiler and the graph name (:data:`GROUPS`: the ranks that differ only along some
axes), how a group splits into the members on one node and one member per node (the
sub-groups of a hierarchical route), who a rank's neighbours on a ring are, and which
rank leads a pipeline stage. Adding an axis is one :class:`MeshAxis` entry (and a
:class:`GroupKind` for its group), plus the derivation rule that inserts its transfers
and the plan's field for its degree (``planc.plan.plan.Mesh`` and the language's schema).

A rank's coordinates are its digits in the mixed radix given by the plan's order, the
first axis varying fastest; with the default order
``r = tp_i + tp * (cp_i + cp * (pp_i + pp * dp_i))``. This is the rule of Megatron-LM's
``RankGenerator`` (an order string read fastest axis first, a group being the ranks
whose coordinates agree off its axes), and the registry of degrees follows torchtitan's
``ParallelDims`` (one object knows every degree and answers which are in use).

The module imports only the standard library, so the command line, the plan and the
graph's schema can all ask it without loading torch or networkx.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Iterable, Mapping


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the mesh: a way of splitting the work over ranks."""

    name: str
    meaning: str


# The axes in their canonical order, which is also the default order of a plan's mesh
# (fastest first) and the order in which coordinates and sizes are always listed.
MESH_AXES: tuple[MeshAxis, ...] = (
    MeshAxis("tp", "tensor parallel: one layer's matrices split over ranks"),
    MeshAxis("cp", "context parallel: the sequence split over ranks"),
    MeshAxis("pp", "pipeline parallel: the layers split into stages"),
    MeshAxis("dp", "data parallel: replicas, each with its share of the batch"),
)
AXES: tuple[str, ...] = tuple(axis.name for axis in MESH_AXES)
PIPELINE_AXIS = "pp"  # the axis whose coordinate is a rank's pipeline stage
RING_AXIS = "cp"  # the axis whose groups pass K and V around a ring (ring attention)
# A ring shift's two halves, as a transfer's ``peer`` names them: it sends to the next
# coordinate and receives from the previous.
RING_NEXT, RING_PREVIOUS = "next", "prev"

# Which part of a group a collective runs on (a hierarchical route's sub-groups).
WHOLE, INTRA, INTER = "whole", "intra", "inter"
LEVELS: tuple[str, ...] = (WHOLE, INTRA, INTER)


@dataclass(frozen=True)
class GroupKind:
    """A kind of group: the ranks whose coordinates agree on every axis but ``axes``.

    ``ends_only`` restricts the group to the first and last coordinate along its axes
    (the tied embedding is shared by the first and last pipeline stage only).
    ``in_layout``: ``planc layout --json`` lists its groups; ``in_graph``: the graph's
    transfers name it (:class:`planc.graph.ir.Axis`). ``experts``: the group along
    ``axes`` is cut by the plan's ep degree (MoE Parallel Folding), into runs of ep
    consecutive members (``runs``: an ep group) or into the members at the same place of
    every run (``across``: an expert's replicas, the expert-data-parallel group).
    """

    name: str
    axes: tuple[str, ...]
    meaning: str
    ends_only: bool = False
    in_layout: bool = False
    in_graph: bool = False
    experts: str = ""  # "", "runs" or "across"

    @property
    def within_stage(self) -> bool:
        """Every member sits on one pipeline stage, so all run the same program."""
        return PIPELINE_AXIS not in self.axes

    def coordinates(self, degrees: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """The coordinates a member may have along the axes the group restricts."""
        if not self.ends_only:
            return {}
        return {axis: tuple(sorted({0, degrees[axis] - 1})) for axis in self.axes}


def _group_kinds(*kinds: GroupKind) -> dict[str, GroupKind]:
    return {kind.name: kind for kind in kinds}


# Every group, in the order the layout lists them and the graph's Axis enumerates them.
GROUPS: dict[str, GroupKind] = _group_kinds(
    GroupKind("tp", ("tp",), "a layer's tensor-parallel shards", in_layout=True,
              in_graph=True),
    GroupKind("cp", ("cp",), "the sequence's context-parallel shards", in_layout=True,
              in_graph=True),
    GroupKind("pp", ("pp",), "the stages of one pipeline", in_layout=True, in_graph=True),
    GroupKind("dp", ("dp",), "the data-parallel replicas", in_layout=True),
    # The ranks holding replicas of a parameter, over which gradients are reduced.
    GroupKind("dp_cp", ("dp", "cp"), "the replicas of a parameter (dp x cp)",
              in_layout=True, in_graph=True),
    GroupKind("tied", ("pp",), "the first and last stage, sharing a tied embedding",
              ends_only=True, in_graph=True),
    # Listed by planc layout beside the others, but not part of its JSON.
    GroupKind("stage", ("tp", "cp", "dp"), "every rank of one pipeline stage",
              in_graph=True),
    # With mesh { ep }: the ranks of a stage that spread the experts between them, and
    # the ranks holding the same experts, over which the experts' gradients are reduced
    # (Megatron-Core's expert-data-parallel group).
    GroupKind("ep", ("tp", "cp", "dp"), "the ranks spreading the experts (runs of ep)",
              in_graph=True, experts="runs"),
    GroupKind("edp", ("tp", "cp", "dp"), "the replicas of an expert (tp x cp x dp / ep)",
              in_graph=True, experts="across"),
    # With a statistic of each sequence (a mixture's balance loss): the ranks holding
    # parts of the same sequences, over which its counts are summed.
    GroupKind("sequence", ("tp", "cp"), "the ranks holding parts of one sequence (tp x cp)"),
    # With train { grad_clip }: every rank, over which the squares of the gradients are
    # summed once per step for their global norm (planc.graph.grad_norm).
    GroupKind("world", ("tp", "cp", "pp", "dp"), "every rank (the gradient norm's sum)",
              in_graph=True),
)
LAYOUT_GROUPS: tuple[str, ...] = tuple(name for name, kind in GROUPS.items()
                                       if kind.in_layout)


def is_axis_order(order: Iterable[str]) -> bool:
    """Whether ``order`` names every mesh axis exactly once."""
    return sorted(order) == sorted(AXES)


def expert_cut(stage: tuple[int, ...], ep: int, how: str) -> tuple[tuple[int, ...], ...]:
    """A stage's ranks (sorted, fastest mesh axis first) cut by ``ep``: into runs of ep
    consecutive ranks (``runs``: the ep groups) or into the ranks at the same place of
    every run (``across``: each expert's replicas, edp) (MoE Parallel Folding)."""
    if how == "across":
        return tuple(stage[i::ep] for i in range(ep))
    return tuple(stage[i:i + ep] for i in range(0, len(stage), ep))


def sub_group(whole: tuple[int, ...], rank: int, level: str,
              devices_per_node: int) -> tuple[int, ...]:
    """``rank``'s sub-group of the group ``whole`` (sorted members) at ``level``: the
    members on its node (intra), or the members holding its place among their node's
    members, one per node (inter), as NCCL's hierarchical algorithms split a group."""
    if level == WHOLE:
        return whole
    node = rank // devices_per_node
    if level == INTRA:
        return tuple(r for r in whole if r // devices_per_node == node)
    if level != INTER:
        raise ValueError(f"level {level!r} is not one of {', '.join(LEVELS)}")
    by_node: dict[int, list[int]] = {}
    for r in whole:
        by_node.setdefault(r // devices_per_node, []).append(r)
    local = by_node[node].index(rank)
    return tuple(members[local] for members in by_node.values() if local < len(members))


@dataclass(frozen=True)
class PlacedAxis:
    """An axis of one mesh: its degree, its place in the order (0 varies fastest) and
    the distance between ranks one coordinate apart along it."""

    name: str
    degree: int
    position: int
    stride: int


# --- how a group sits on nodes (the cost model and the routes read it) ------------------

def counts_of(members: Iterable[int], devices_per_node: int) -> tuple[int, ...]:
    """Members on each node a group spans, in node order."""
    counts: dict[int, int] = {}
    for rank in sorted(members):
        counts[rank // devices_per_node] = counts.get(rank // devices_per_node, 0) + 1
    return tuple(counts.values())


@dataclass(frozen=True)
class Placement:
    """How one group sits on nodes: its size, the nodes it spans, and its members per
    node when every node holds the same number (``None`` when they differ)."""

    size: int
    nodes: int
    per_node: int | None
    most_per_node: int
    fewest_per_node: int

    @staticmethod
    def of(members: Iterable[int], devices_per_node: int) -> "Placement":
        return Placement.of_counts(counts_of(members, devices_per_node))

    @staticmethod
    def of_counts(counts: tuple[int, ...]) -> "Placement":
        """The placement of a group with ``counts`` members on each node it spans."""
        values = set(counts)
        return Placement(sum(counts), len(counts),
                         next(iter(values)) if len(values) == 1 else None,
                         max(values, default=0), min(values, default=0))

    @staticmethod
    def within_node(size: int) -> "Placement":
        return Placement(size, 1, size, size, size)

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    def text(self) -> str:
        per = (f"{self.per_node} per node" if self.per_node is not None else
               f"{self.fewest_per_node}..{self.most_per_node} per node")
        return (f"{self.size} rank{'s' * (self.size != 1)} on {self.nodes} "
                f"node{'s' * (self.nodes != 1)}, {per}")


@dataclass(frozen=True)
class RankMesh:
    """The ranks of one mesh: coordinates, groups, nodes and neighbours.

    ``degrees`` holds one degree per axis of :data:`AXES`, in that order; ``order`` is
    the plan's order, fastest first."""

    degrees: tuple[int, ...]
    order: tuple[str, ...] = AXES
    devices_per_node: int = 1

    @staticmethod
    def of(degrees: Mapping[str, int], order: Iterable[str] = AXES,
           devices_per_node: int = 1) -> "RankMesh":
        if not is_axis_order(order):
            raise ValueError(f"order {list(order)} does not name {', '.join(AXES)} once each")
        if any(degrees.get(axis, 1) < 1 for axis in AXES) or devices_per_node < 1:
            raise ValueError("degrees and devices per node must be positive")
        return RankMesh(tuple(degrees.get(axis, 1) for axis in AXES), tuple(order),
                        devices_per_node)

    # --- axes ---------------------------------------------------------------------------

    def degree(self, axis: str) -> int:
        return self.sizes[axis]

    @cached_property
    def sizes(self) -> dict[str, int]:
        """Degree by axis, in the canonical order."""
        return dict(zip(AXES, self.degrees))

    @cached_property
    def strides(self) -> dict[str, int]:
        """Stride by axis, in the plan's order (fastest first)."""
        strides, step = {}, 1
        for axis in self.order:
            strides[axis] = step
            step *= self.sizes[axis]
        return strides

    @cached_property
    def axes(self) -> tuple[PlacedAxis, ...]:
        """Every axis with its degree, position and stride, in the canonical order."""
        return tuple(PlacedAxis(axis, self.sizes[axis], self.order.index(axis),
                                self.strides[axis]) for axis in AXES)

    @property
    def world(self) -> int:
        return prod(self.degrees)

    @property
    def nodes(self) -> int:
        return -(-self.world // self.devices_per_node)

    # --- ranks and coordinates -----------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``, keyed in the canonical axis order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world}")
        strides, sizes = self.strides, self.sizes
        return {axis: rank // strides[axis] % sizes[axis] for axis in AXES}

    def rank(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords``; an axis left out is at coordinate 0."""
        return sum(coords.get(axis, 0) * self.strides[axis] for axis in AXES)

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    # --- groups ---------------------------------------------------------------------------

    def group(self, rank: int, kind: str) -> tuple[int, ...]:
        """The members of ``rank``'s group of ``kind`` (a key of :data:`GROUPS`), sorted;
        empty when ``rank`` is in none (a middle stage has no tied group)."""
        group = GROUPS[kind]
        return self.members(rank, group.axes, group.coordinates(self.sizes))

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of ``kind``, ordered by smallest member; found once per kind."""
        if kind not in self._groups:
            group = GROUPS[kind]
            allowed = group.coordinates(self.sizes)
            self._groups[kind] = tuple(self.members(r, group.axes, allowed)
                                       for r in self.leaders(group.axes, allowed))
        return list(self._groups[kind])

    @cached_property
    def _groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        return {}

    def members(self, rank: int, axes: Iterable[str],
                allowed: Mapping[str, Iterable[int]] | None = None) -> tuple[int, ...]:
        """The ranks whose coordinates agree with ``rank``'s off ``axes``, sorted: the
        group along ``axes``. ``allowed`` restricts the coordinates members may have on
        some axes; empty when ``rank``'s own are not allowed."""
        allowed = {axis: tuple(values) for axis, values in (allowed or {}).items()}
        coords = self.coords(rank)
        if any(coords[axis] not in values for axis, values in allowed.items()):
            return ()
        strides = self.strides
        members = [rank - sum(coords[axis] * strides[axis] for axis in axes)]
        for axis in axes:
            values = allowed.get(axis, range(self.sizes[axis]))
            members = [m + v * strides[axis] for m in members for v in values]
        return tuple(sorted(members))

    def leaders(self, axes: Iterable[str],
                allowed: Mapping[str, Iterable[int]] | None = None) -> list[int]:
        """The smallest member of every group along ``axes``, increasing: the ranks at
        the first allowed coordinate (0 when unrestricted) of each of those axes."""
        first = {axis: tuple(values)[0] for axis, values in (allowed or {}).items()}
        for axis in axes:
            first.setdefault(axis, 0)
        strides, sizes = self.strides, self.sizes
        return [r for r in range(self.world)
                if all(r // strides[a] % sizes[a] == c for a, c in first.items())]

    def level_group(self, rank: int, kind: str, level: str) -> tuple[int, ...]:
        """``rank``'s sub-group at ``level`` (whole, intra or inter) of its group of
        ``kind``; empty when it is in no group of ``kind``."""
        whole = self.group(rank, kind)
        return sub_group(whole, rank, level, self.devices_per_node) if whole else ()

    def level_groups(self, kind: str, level: str) -> list[tuple[int, ...]]:
        """Every sub-group at ``level`` of the groups of ``kind``: group by group (ordered
        by smallest member), and within a group by smallest member."""
        out: list[tuple[int, ...]] = []
        for whole in self.groups(kind):
            out.extend(sorted({sub_group(whole, r, level, self.devices_per_node)
                               for r in whole}))
        return out

    def crosses_nodes(self, kind: str) -> bool:
        """Whether the group of rank 0 of ``kind`` spans nodes; costs O(group size)."""
        members = self.group(0, kind)
        return self.node(members[0]) != self.node(members[-1])

    # --- neighbours ---------------------------------------------------------------------

    def ring_neighbours(self, rank: int, axis: str = RING_AXIS) -> tuple[int, int]:
        """(previous, next) of ``rank`` on the ring along ``axis``: a ring shift sends to
        the next coordinate and receives from the previous, wrapping around."""
        coords = self.coords(rank)
        degree = self.sizes[axis]
        return (self.rank({**coords, axis: (coords[axis] - 1) % degree}),
                self.rank({**coords, axis: (coords[axis] + 1) % degree}))

    def ring_peer(self, rank: int, peer: str, axis: str = RING_AXIS) -> int:
        """The rank a ring shift of ``rank`` talks to: ``peer`` is RING_NEXT (where it
        sends) or RING_PREVIOUS (where it receives from)."""
        before, after = self.ring_neighbours(rank, axis)
        if peer not in (RING_NEXT, RING_PREVIOUS):
            raise ValueError(f"ring peer {peer!r} is not {RING_NEXT} or {RING_PREVIOUS}")
        return after if peer == RING_NEXT else before

    def stage_of(self, rank: int) -> int:
        return self.coords(rank)[PIPELINE_AXIS]

    def first_rank_of_stage(self, stage: int) -> int:
        """The smallest rank of pipeline ``stage``: every other coordinate 0 (the rank
        that speaks for the stage, and the leader of the last stage's loss)."""
        return self.rank({PIPELINE_AXIS: stage})

    def pipeline_peer(self, rank: int, stage: int) -> int:
        """The rank on pipeline ``stage`` whose other coordinates are ``rank``'s."""
        return self.rank({**self.coords(rank), PIPELINE_AXIS: stage})

    def pipeline_column(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline, stage by stage."""
        return [self.pipeline_peer(rank, s) for s in range(self.sizes[PIPELINE_AXIS])]

    def pipeline_neighbours(self, rank: int, wrap: bool = False
                            ) -> tuple[int | None, int | None]:
        """(previous stage's rank, next stage's rank) of ``rank``'s pipeline; None past
        either end unless ``wrap`` (interleaved schedules send from the last stage to
        the first)."""
        stages, stage = self.sizes[PIPELINE_AXIS], self.stage_of(rank)
        before = stage - 1 if stage > 0 or wrap else None
        after = stage + 1 if stage < stages - 1 or wrap else None
        return (None if before is None else self.pipeline_peer(rank, before % stages),
                None if after is None else self.pipeline_peer(rank, after % stages))
