"""Optimisation passes: functions from graph to graph that never change results.

Each pass takes the graph and one :class:`PassContext` (the plan, its rank layout and
the cost model) and returns a new graph; the input is left as it was. The order is
fixed here, in :data:`PIPELINE`, and nowhere else. A pass records what it did in the
graph it returns (``graph.graph["passes"]``): a one-line summary, counts and bytes of
what it changed before and after, and its decisions with their reasons, so that
``planc compile``, summary.json and ``planc explain`` can show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import networkx as nx

from planc.cost import CostModel
from planc.layout import Layout
from planc.plan import Plan


@dataclass(frozen=True)
class PassContext:
    plan: Plan
    layout: Layout
    cost: CostModel
    owned: bool = False  # the graph is :func:`run`'s own copy: a pass changes it in place

    def working_copy(self, graph: nx.DiGraph) -> nx.DiGraph:
        """The graph a pass changes: a copy (its input is left as it was), except inside
        :func:`run`, which copies once for every pass (a copy of a 1,024-layer graph
        takes a good part of a second)."""
        return graph if self.owned else copy_graph(graph)

    @staticmethod
    def of(plan: Plan) -> "PassContext":
        return PassContext(plan, Layout.of(plan), CostModel(plan.topology))


@dataclass
class PassRecord:
    """What one pass did: ``line`` for people, ``changes`` and ``decisions`` for tools."""

    name: str
    enabled: bool
    line: str
    changes: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"name": self.name, "enabled": self.enabled, "line": self.line,
                "changes": self.changes, "decisions": self.decisions}


Pass = Callable[[nx.DiGraph, PassContext], nx.DiGraph]


def copy_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy that a pass may change freely: its own node and edge attribute dicts, its
    own table of buckets (a pass that changes a bucket's members replaces the bucket)."""
    out = graph.copy()
    out.graph = {**graph.graph, "buckets": dict(graph.graph.get("buckets", {})),
                 "passes": list(graph.graph.get("passes", []))}
    return out


def record(graph: nx.DiGraph, entry: PassRecord) -> nx.DiGraph:
    graph.graph["passes"] = [*graph.graph.get("passes", []), entry.to_json()]
    return graph


def _pipeline() -> tuple[tuple[str, Pass], ...]:
    from planc.passes.fuse import fuse
    from planc.passes.overlap import overlap
    from planc.passes.route import route

    return (("fuse", fuse), ("route", route), ("overlap", overlap))


def run(graph: nx.DiGraph, context: PassContext,
        check: Callable[[nx.DiGraph, str], None] | None = None,
        owned: bool = False) -> nx.DiGraph:
    """Every pass in order, on one copy of ``graph`` (on ``graph`` itself when ``owned``:
    the caller has no further use for it); ``check(graph, name)`` runs after each (tests
    validate)."""
    graph, context = graph if owned else copy_graph(graph), replace(context, owned=True)
    for name, apply in _pipeline():
        graph = apply(graph, context)
        if check is not None:
            check(graph, name)
    return graph


def names() -> tuple[str, ...]:
    return tuple(name for name, _ in _pipeline())
