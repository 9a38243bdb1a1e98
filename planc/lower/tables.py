"""The group and route tables of a build, built from the plan and its graph.

The tables' format is the programs' (:mod:`planc.program.groups`, :mod:`planc.program.routes`);
building them reads the plan, its model family and the communication graph, which a rank
never loads: it reads ``programs/groups.json`` and ``programs/routes.json``.
"""

from __future__ import annotations

from planc.models import family_of
from planc.plan.plan import Plan
from planc.program.groups import GroupTable, group_table
from planc.program.names import Route
from planc.program.routes import Recipe, RouteTable, build, recipe_key


def plan_group_table(plan: Plan, split: tuple[str, ...] = ()) -> GroupTable:
    """:func:`group_table` of ``plan``: a tied embedding needs a group only when the head
    is on another stage than the embedding, a V's stages send both ways, and a model
    whose operator sums a statistic over each sequence needs the sequence group."""
    return group_table(plan.mesh, plan.topology.devices_per_node,
                       plan.model.tie_embeddings and plan.head_stage != 0,
                       plan.shard.pp.virtual, split, plan.placement.name == "v",
                       family_of(plan).sums_over_sequences(plan.model),
                       plan.train.grad_clip is not None)


def routed_nodes(graph) -> list[tuple[str, dict]]:
    """The graph's transfers whose route is not the backend's own collective."""
    return [(n, d) for n, d in graph.nodes(data=True)
            if d.get("route") not in (None, Route.RING.value)]


def split_refs(graph) -> tuple[str, ...]:
    """The group references whose sub-groups hierarchical routes use."""
    return tuple(sorted({str(d["axis"]) for _, d in routed_nodes(graph)
                         if d["route"] == Route.HIERARCHICAL.value}))


def route_table(graph, groups) -> RouteTable:
    """A recipe for every routed transfer and every placement of its groups."""
    recipes: dict[str, Recipe] = {}
    shapes: dict[tuple[str, int], dict] = {}
    for _, data in routed_nodes(graph):
        key = (str(data["axis"]), data["stage"])
        if key not in shapes:
            shapes[key] = groups.shapes(*key)
        for counts in sorted(shapes[key]):
            recipe_id = recipe_key(str(data["kind"]), data["route"], counts)
            if recipe_id not in recipes:
                recipes[recipe_id] = build(str(data["kind"]), data["route"], counts)
    return RouteTable(recipes)
