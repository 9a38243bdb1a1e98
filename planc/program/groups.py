"""The process groups a build's programs use, written by the compiler for the runtime.

``programs/groups.json`` names every group reference the programs use and says, by
rule, which ranks form each group: the mesh axes along which members differ (and, for
the tied embedding, the pipeline coordinates that take part), or neighbouring stages
for pipeline transfers. A rule does not grow with the world, so a 16,384-rank build
stays small; :meth:`GroupTable.groups` enumerates the groups of a reference in the
order every rank must create them (torch.distributed requires one order everywhere),
each group's ranks increasing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Iterator

from planc.program.names import Axis
from planc.program.ranks import integer_of
from planc.plan.mesh import AXES, GROUPS, INTER, INTRA, PIPELINE_AXIS, Placement, RankMesh, \
    counts_of, expert_cut, is_axis_order, sub_group
from planc.vocabulary.versions import is_version

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from planc.plan.plan import Mesh

GROUPS_FORMAT_VERSION = 1
PIPELINE = "pp"  # pairs of neighbouring stages, one group per pair and direction
EXPERTS = "ep"  # the ranks a mixture of experts spreads its experts over
# The ranks holding parts of one sequence (tp x cp), over which a mixture sums its balance
# loss's per-sequence counts; a group of its own, used by nothing else, so that its
# all-reduces leave from the mixture's stream alone in program order.
SEQUENCE = "sequence"


@dataclass(frozen=True)
class GroupRule:
    ref: str  # a group reference of the graph: tp, cp, dp_cp, stage, tied, pp
    axes: tuple[str, ...] = ()  # mesh axes along which the members differ
    coordinates: dict[str, tuple[int, ...]] = field(default_factory=dict)  # restricts axes
    wrap: bool = False  # pp: the last stage also sends to the first (interleaved)
    split: str | None = None  # a hierarchical route's sub-groups: "intra" or "inter"
    turns: bool = False  # pp: forwards and backwards go both ways between neighbours (a V)
    # ep: the group along ``axes`` cut into runs of ``fold`` consecutive ranks (expert
    # parallelism folded over a stage's ranks, fastest mesh axis first); 0: not cut
    fold: int = 0
    # edp: cut instead into the members at the same place of every run (one per ep group)
    across: bool = False

    def cut(self, whole: tuple[int, ...], rank: int | None = None) -> tuple:
        """The runs of ``whole`` (sorted members), or across them, or the one holding
        ``rank``."""
        if not self.fold:
            return (whole,) if rank is None else whole
        runs = expert_cut(whole, self.fold, "across" if self.across else "runs")
        return runs if rank is None else next((r for r in runs if rank in r), ())

    def to_json(self) -> dict:
        item: dict = {"ref": self.ref, "axes": list(self.axes)}
        if self.fold:
            item["fold"] = self.fold
        if self.across:
            item["across"] = True
        if self.coordinates:
            item["coordinates"] = {k: list(v) for k, v in self.coordinates.items()}
        if self.wrap:
            item["wrap"] = True
        if self.split:
            item["split"] = self.split
        if self.turns:
            item["turns"] = True
        return item


@dataclass(frozen=True)
class GroupTable:
    """``programs/groups.json``: the mesh (planc.plan.mesh.RankMesh: degrees, order, node size)
    and a rule per group reference."""

    ranks: RankMesh
    rules: tuple[GroupRule, ...]

    @property
    def devices_per_node(self) -> int:
        return self.ranks.devices_per_node

    def rule(self, ref: str) -> GroupRule | None:
        return next((r for r in self.rules if r.ref == ref), None)

    def groups(self, rule: GroupRule) -> Iterator[tuple]:
        """Every group of ``rule``. Pipeline groups are (direction, sender, receiver): one
        per pair of neighbouring stages and direction, so that a forward and a backward
        transfer between the same two ranks can never be matched with each other."""
        ranks = self.ranks
        if rule.ref == PIPELINE:
            for rank in range(self.ranks.world):
                after = ranks.pipeline_neighbours(rank, wrap=rule.wrap)[1]
                if after is not None:
                    yield ("forward", rank, after)
                    yield ("backward", after, rank)
                    if rule.turns:  # the way back of a V
                        yield ("forward", after, rank)
                        yield ("backward", rank, after)
            return
        for leader in ranks.leaders(rule.axes, rule.coordinates):
            for whole in rule.cut(ranks.members(leader, rule.axes, rule.coordinates)):
                if rule.split is None:
                    yield whole
                else:  # the sub-groups (of a cut group too), by their smallest member
                    yield from sorted({sub_group(whole, r, rule.split,
                                                 self.devices_per_node) for r in whole})

    def members(self, rank: int, rule: GroupRule) -> tuple[int, ...]:
        """The members of ``rank``'s group of ``rule`` (empty if it is in none); for a
        split rule, its sub-group of the (cut) group."""
        whole = rule.cut(self.ranks.members(rank, rule.axes, rule.coordinates), rank)
        if rule.split is None or not whole:
            return whole
        return sub_group(whole, rank, rule.split, self.devices_per_node)

    def shapes(self, ref: str, stage: int) -> dict[tuple[int, ...], tuple[int, ...]]:
        """The distinct placements on nodes of the groups of ``ref`` that have a member on
        pipeline ``stage``: members per node, in node order -> the members of one such
        group. A group's placement depends only on its first member modulo the node size
        (its members are that rank plus fixed offsets), so this walks residues, at most
        ``devices_per_node`` of them, never the world."""
        rule = self.rule(ref)
        layout, per_node = self.ranks, self.devices_per_node
        first = self._first_on_stage(rule, stage)
        if first is None:
            return {}
        if self.ranks.world <= per_node:  # one node holds every group: one placement
            members = self.members(first, rule)
            return {counts_of(members, per_node): members}
        if rule.fold:  # cut groups differ in shape: every one of the stage's, once
            out = {}
            for members in rule.cut(self.ranks.members(first, rule.axes, rule.coordinates)):
                out.setdefault(counts_of(members, per_node), members)
            return out
        residues = {first % per_node: first}
        for axis in AXES:
            if axis in rule.axes or axis == PIPELINE_AXIS:
                continue
            stride = layout.strides[axis]
            grown: dict[int, int] = {}
            # Residues repeat after per_node steps along an axis: no need to walk further.
            for base in residues.values():
                for k in range(min(self.ranks.degree(axis), per_node)):
                    grown.setdefault((base + k * stride) % per_node, base + k * stride)
            residues = grown
        # Every group of the rule is its first member plus the same offsets.
        offsets = [rank - first for rank in self.members(first, rule)]
        out = {}
        for base in sorted(residues.values()):
            members = tuple(base + offset for offset in offsets)
            out.setdefault(counts_of(members, per_node), members)
        return out

    def _first_on_stage(self, rule: GroupRule, stage: int) -> int | None:
        """The first member of the first group of ``rule`` with a member on ``stage``;
        None when no group has one (a middle stage has no tied group)."""
        start = {axis: 0 for axis in AXES}
        for axis, allowed in rule.coordinates.items():
            start[axis] = allowed[0]
        if PIPELINE_AXIS not in rule.axes:
            start[PIPELINE_AXIS] = stage
        elif rule.coordinates.get(PIPELINE_AXIS) and \
                stage not in rule.coordinates[PIPELINE_AXIS]:
            return None
        return self.ranks.rank(start)

    def placements(self, ref: str, stage: int) -> tuple[Placement, ...]:
        """How the groups of ``ref`` with a member on ``stage`` sit on nodes, each distinct
        placement once, fewest nodes first (a route must suit all of them). They depend
        only on the first member's place on its node (see :meth:`shapes`), so stages whose
        first members share it share one answer, found once."""
        first = self._first_on_stage(self.rule(ref), stage)
        if first is None:
            return ()
        key = (ref, first % self.devices_per_node)
        if key not in self._placements:
            distinct = {Placement.of_counts(counts) for counts in self.shapes(ref, stage)}
            self._placements[key] = tuple(sorted(
                distinct, key=lambda p: (p.nodes, p.size, p.most_per_node)))
        return self._placements[key]

    @cached_property
    def _placements(self) -> dict[tuple[str, int], tuple[Placement, ...]]:
        return {}

    def size(self, ref: str) -> int:
        """How many ranks a group of ``ref`` has (a pipeline group: the two stages)."""
        if ref == PIPELINE:
            return 2
        return len(self.members(self._member(ref), self.rule(ref)))

    def crosses_nodes(self, ref: str) -> bool:
        """Whether a group of ``ref`` spans nodes, rank 0's group (or, for a rule rank 0 is
        not in, the first group's) standing for all, as the cost model's estimate of an
        unrouted transfer does; a pipeline group stands for rank 0's whole pipeline."""
        if ref == PIPELINE:
            members = self.ranks.pipeline_column(0)
        else:
            members = self.members(self._member(ref), self.rule(ref))
        return self.ranks.node(members[0]) != self.ranks.node(members[-1])

    def _member(self, ref: str) -> int:
        """The smallest rank in some group of ``ref``."""
        rule = self.rule(ref)
        if rule is None:
            raise ValueError(f"the programs use group {ref!r}, which groups.json lacks")
        return self.ranks.rank({axis: allowed[0] for axis, allowed in rule.coordinates.items()})

    def to_json(self) -> dict:
        return {"format": "planc-groups", "version": GROUPS_FORMAT_VERSION,
                "mesh": {**self.ranks.sizes, "order": list(self.ranks.order)},
                "devices_per_node": self.devices_per_node,
                "groups": [r.to_json() for r in self.rules]}

    @staticmethod
    def from_json(data: dict) -> "GroupTable":
        if data.get("format") != "planc-groups" or \
                not is_version(data.get("version"), GROUPS_FORMAT_VERSION):
            raise ValueError(f"not a version {GROUPS_FORMAT_VERSION} planc group table")
        mesh_data = data["mesh"]
        sizes = {a: integer_of(mesh_data[a], f"its mesh's {a}") for a in AXES}
        order = tuple(map(str, mesh_data["order"]))
        if not is_axis_order(order) or min(sizes.values()) < 1:
            raise ValueError("its mesh is not a mesh")
        rules = []
        for item in data["groups"]:
            axes = tuple(map(str, item.get("axes", ())))
            coordinates = {str(k): tuple(integer_of(x, "a coordinate") for x in v)
                           for k, v in item.get("coordinates", {}).items()}
            if any(a not in AXES for a in (*axes, *coordinates)) or any(
                    not 0 <= x < sizes[a] for a, v in coordinates.items() for x in v):
                raise ValueError(f"group {item.get('ref')!r} names axes or coordinates "
                                 f"outside the mesh")
            split = item.get("split")
            if split not in (None, INTRA, INTER):
                raise ValueError(f"group {item.get('ref')!r} splits by {split!r}; sub-groups "
                                 f"are intra or inter")
            fold = integer_of(item.get("fold", 0), f"group {item.get('ref')!r}'s fold")
            if fold < 0:
                raise ValueError(f"group {item.get('ref')!r} folds by {fold}")
            rules.append(GroupRule(str(item["ref"]), axes, coordinates,
                                   bool(item.get("wrap", False)), split,
                                   bool(item.get("turns", False)), fold,
                                   bool(item.get("across", False)) and fold > 0))
        devices = integer_of(data["devices_per_node"], "its devices_per_node")
        if devices < 1:
            raise ValueError(f"its devices_per_node is {devices}")
        return GroupTable(RankMesh.of(sizes, order, devices), tuple(rules))


def group_table(mesh: "Mesh", devices_per_node: int, tied: bool, virtual: int = 1,
                split: tuple[str, ...] = (), turns: bool = False,
                sequences: bool = False, world: bool = False) -> GroupTable:
    """Every group reference a program may use, by rule; ``split`` names the references
    whose intra- and inter-node sub-groups hierarchical routes use; ``sequences``: an
    operator sums counts over the ranks holding each sequence's tokens; ``world``: the
    gradient norm is summed over every rank (train { grad_clip })."""
    rules = [GroupRule(axis.value, axis.mesh_axes) for axis in Axis
             if axis.within_stage and not GROUPS[axis.value].experts]
    tied_group = GROUPS[Axis.TIED]
    if tied and mesh.pp > 1:
        rules.append(GroupRule(tied_group.name, tied_group.axes,
                               tied_group.coordinates(mesh.sizes)))
    if mesh.pp > 1:
        rules.append(GroupRule(PIPELINE, wrap=virtual > 1 and not turns, turns=turns))
    if mesh.ep > 1:  # a stage's ranks, fastest mesh axis first, in runs of ep
        rules.append(GroupRule(EXPERTS, GROUPS[Axis.STAGE].axes, fold=mesh.ep))
        # ... and across the runs: the replicas of each rank's experts
        rules.append(GroupRule(Axis.EDP.value, GROUPS[Axis.EDP].axes, fold=mesh.ep,
                               across=True))
    # after every axis's rule: edp's transfers take hierarchical routes too
    for base in [r for r in rules if r.ref in split]:
        for part in (INTRA, INTER):
            rules.append(replace(base, ref=f"{base.ref}/{part}", split=part))
    if sequences and mesh.tp * mesh.cp > 1:
        rules.append(GroupRule(SEQUENCE, GROUPS[SEQUENCE].axes))
    if world:  # on one rank too: the programs' norm all-reduce names it all the same
        rules.append(GroupRule(Axis.WORLD.value, GROUPS[Axis.WORLD].axes))
    return GroupTable(RankMesh.of(mesh.sizes, mesh.order, devices_per_node), tuple(rules))
