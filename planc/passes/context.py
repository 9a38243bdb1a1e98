"""What every pass receives and what it records: the pass context and the pass record.

Its own module below the passes (planc.passes imports the passes, the passes import
this), so that the order of the passes can be a plain constant in planc.passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import networkx as nx

from planc.estimate.cost import CostModel
from planc.plan.layout import Layout
from planc.plan.plan import Plan


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
