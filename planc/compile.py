"""The compiler, end to end: derive -> passes -> lower -> verify.

One function per stage, each with one input and one output; this module only chains
them. Writing and reading build directories is :mod:`planc.build.directory`'s.
"""

from __future__ import annotations

from typing import Callable

import networkx as nx

from planc import passes
from planc.build.directory import Build
from planc.host.collector import without_collector
from planc.graph.derive import derive
from planc.graph.summary import summarize
from planc.lower.tables import plan_group_table, route_table, split_refs
from planc.lower.lower import lower
from planc.lower.paired import ordered_by_cost
from planc.lower.bind import Binding
from planc.lower.tabulate_model import model_table
from planc.verify.verifier import verify
from planc.plan.plan import Plan


class CompileError(Exception):
    """The compiler produced programs that fail verification: a bug in planc."""


@without_collector
def compile_plan(plan: Plan, check: Callable[[nx.DiGraph, str], None] | None = None) -> Build:
    """The build of ``plan``; ``check(graph, stage)`` runs after derive and every pass."""
    graph = derive(plan)
    if check is not None:
        check(graph, "derive")
    graph = passes.run(graph, passes.PassContext.of(plan), check, owned=True)
    binding = Binding(graph)  # each instruction's operands, derived once for both
    programs, table = lower(plan, graph, binding)
    groups = plan_group_table(plan, split_refs(graph))
    programs = ordered_by_cost(plan, programs, groups)  # needs the groups' placement
    routes = route_table(graph, groups)
    # the step, and an evaluation batch (the forward blocks alone) where the plan has one
    report = verify(plan, graph, programs, table, groups, routes, binding)
    if not report.ok:
        raise CompileError("internal error: the lowered programs fail verification (a bug "
                           "in planc; please report it): " + "; ".join(report.problems))
    return Build(plan, graph, summarize(plan, graph), programs=programs, table=table,
                 groups=groups, routes=routes, model=model_table(plan))
