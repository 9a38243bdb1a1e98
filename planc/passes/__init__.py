"""Optimisation passes: functions from graph to graph that never change results.

Each pass takes the graph and one :class:`PassContext` (the plan, its rank layout and
the cost model) and returns a new graph; the input is left as it was. The order is
fixed here, in :data:`PIPELINE`, and nowhere else. A pass records what it did in the
graph it returns (``graph.graph["passes"]``): a one-line summary, counts and bytes of
what it changed before and after, and its decisions with their reasons, so that
``planc compile``, summary.json and ``planc explain`` can show them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import networkx as nx

from planc.passes.context import Pass, PassContext, PassRecord, copy_graph, record
from planc.passes.fuse import fuse
from planc.passes.overlap import overlap
from planc.passes.route import route
from planc.passes.split_backward import split_backward
from planc.passes.split_dispatch import split_dispatch
from planc.passes.tp_overlap import tp_overlap

__all__ = ["PIPELINE", "Pass", "PassContext", "PassRecord", "copy_graph", "names", "record",
           "run"]

# The passes in the order they run: fuse makes the buckets that route chooses a route
# for, split_dispatch cuts a mixture of experts at its all-to-alls (only with
# schedule { overlap_all_to_all }), split_backward splits the backward steps a zero-bubble schedule orders apart
# (it changes nothing under other schedules), overlap schedules what route chose, and
# tp_overlap then cuts the tp collectives overlap put on the comm stream, and the GEMMs
# next to them, into pieces.
PIPELINE: tuple[tuple[str, Pass], ...] = (("fuse", fuse), ("route", route),
                                          ("split_dispatch", split_dispatch),
                                          ("split_backward", split_backward),
                                          ("overlap", overlap), ("tp_overlap", tp_overlap))


def run(graph: nx.DiGraph, context: PassContext,
        check: Callable[[nx.DiGraph, str], None] | None = None,
        owned: bool = False) -> nx.DiGraph:
    """Every pass in order, on one copy of ``graph`` (on ``graph`` itself when ``owned``:
    the caller has no further use for it); ``check(graph, name)`` runs after each (tests
    validate)."""
    graph, context = graph if owned else copy_graph(graph), replace(context, owned=True)
    for name, apply in PIPELINE:
        graph = apply(graph, context)
        if check is not None:
            check(graph, name)
    return graph


def names() -> tuple[str, ...]:
    return tuple(name for name, _ in PIPELINE)
