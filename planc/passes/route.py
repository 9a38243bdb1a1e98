"""The route pass: ring, tree or hierarchical for every collective, by the cost model.

For each collective left after fusion the pass asks :meth:`planc.estimate.cost.CostModel.candidates`
for every route's predicted time on the node's groups (one node stands for the groups of
its axis in its stage; they may sit differently on nodes, and a route must suit them
all, so a route's time is its slowest group's). ``route = auto`` takes the fastest;
``ring``, ``tree`` or ``hierarchical`` force one, falling back to ring, with the reason
recorded, where it does not apply. Point-to-point transfers and all_to_all keep the
backend's own algorithm.

The node gets ``route`` and ``route_seconds``; the pass records every candidate with its
time and reason, for ``planc explain`` and summary.json. Lowering turns tree and
hierarchical routes into recipes of sub-group collectives and point-to-point steps
(:mod:`planc.program.routes`), in the manner of NCCL choosing an algorithm per call
(``src/graph/tuning.cc``) but with the choice made once, at compile time.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx

from planc.estimate.cost import Candidate, Placement, Route
from planc.graph.ir import Axis, Kind, transfers
from planc.program.groups import PIPELINE, group_table
from planc.passes.context import PassContext, PassRecord, record

ROUTED_KINDS = (Kind.ALL_REDUCE, Kind.ALL_GATHER, Kind.REDUCE_SCATTER)


def group_placements(ctx: PassContext) -> dict[tuple[str, int], tuple[Placement, ...]]:
    """The distinct placements of the groups of each within-stage axis (and ``tied``),
    by (axis, stage): :meth:`planc.program.groups.GroupTable.placements`, which the
    simulator asks too, so that it times a route as this pass predicted it."""
    plan = ctx.plan
    table = group_table(plan.mesh, plan.topology.devices_per_node, plan.model.tie_embeddings)
    found: dict[tuple[str, int], tuple[Placement, ...]] = {}
    for rule in table.rules:
        if rule.ref == PIPELINE:
            continue
        for stage in range(plan.mesh.pp):
            placements = table.placements(rule.ref, stage)
            if placements:
                found[(rule.ref, stage)] = placements
    return found


def _combined(per_group: list[list[Candidate]]) -> list[Candidate]:
    """Candidates for a node whose groups have different placements: a route applies if
    it applies to every group, and takes as long as its slowest group."""
    out = []
    for options in zip(*per_group):
        blocked = next((c for c in options if c.seconds is None), None)
        if blocked is not None:
            out.append(blocked)
        else:
            slowest = max(options, key=lambda c: c.seconds)
            out.append(slowest)
    return out


TIE = 0.01  # predictions closer than this are a tie, which the simpler route wins


def choose(candidates: list[Candidate], asked: str) -> tuple[Candidate, str]:
    """The route taken and why. Under ``auto``, a route must be predicted more than 1 %
    faster than a simpler one (ring, then tree, then hierarchical: fewer calls, fewer
    sub-groups) to be taken."""
    usable = [c for c in candidates if c.seconds is not None]
    if asked == "auto":
        fastest = min(c.seconds for c in usable)
        best = next(c for c in sorted(usable, key=lambda c: list(Route).index(c.route))
                    if c.seconds <= fastest * (1 + TIE))
        return best, "auto: the least predicted time"
    forced = next(c for c in candidates if c.route == asked)
    if forced.seconds is None:
        ring = next(c for c in candidates if c.route == Route.RING)
        return ring, f"route = {asked} does not apply ({forced.reason}): ring"
    return forced, f"route = {asked}"


def route(graph: nx.DiGraph, ctx: PassContext) -> nx.DiGraph:
    out = ctx.working_copy(graph)
    asked = ctx.plan.optimize.route
    placements = group_placements(ctx)
    decisions, taken = [], Counter()
    for node, data in transfers(out):
        if data["kind"] not in ROUTED_KINDS or data["group_size"] <= 1 or \
                data["axis"] == Axis.WORLD:  # the gradient norm: one number, a ring
            continue
        key = (data["axis"].value, data["stage"])
        groups = placements.get(key) or (Placement.within_node(data["group_size"]),)
        per_group = [ctx.cost.candidates(data["kind"], data["bytes"], p) for p in groups]
        candidates = _combined(per_group) if len(per_group) > 1 else per_group[0]
        chosen, why = choose(candidates, asked)
        data["route"] = chosen.route.value
        data["route_seconds"] = chosen.seconds
        taken[chosen.route.value] += 1
        decisions.append({
            "node": node, "kind": data["kind"].value, "axis": data["axis"].value,
            "stage": data["stage"], "bytes": data["bytes"],
            "placements": [p.text() for p in groups], "route": chosen.route.value,
            "why": why, "candidates": [c.to_json() for c in candidates]})
    counts = ", ".join(f"{taken[r.value]} {r.value}" for r in Route if taken[r.value])
    line = f"route ({asked}): " + (f"{counts} of {sum(taken.values())} collectives"
                                   if taken else "no collective to route")
    total = sum(taken.values())
    changes = [{"what": f"{r.value} collectives", "before": total if r == Route.RING else 0,
                "after": taken[r.value]} for r in Route]
    return record(out, PassRecord("route", True, line, changes, decisions))
