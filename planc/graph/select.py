"""Views on a communication graph: unfold microbatches, and keep only part of it.

The derived graph stands for every microbatch at once (see derive.py). A view picks
some microbatches and gets one copy of each per-microbatch node for each of them
(``F/L0/qkv#mb2``), with once-per-step nodes kept once; then filters by stage, layer,
phase and axis, so that a 96-layer plan stays readable.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace

import networkx as nx

DEFAULT_NODE_LIMIT = 300  # bigger graphs default to one layer and one microbatch
# Unfolding microbatches copies nodes; past this many no drawing is readable, and a plan
# at planc's limits would unfold billions (about 2 KB of memory each).
MAX_UNFOLDED_NODES = 200_000


@dataclass(frozen=True)
class Selection:
    stages: tuple[int, ...] | None = None
    layers: tuple[int, int] | None = None  # inclusive range
    microbatches: tuple[int, ...] | None = None  # None: the folded graph
    phases: tuple[str, ...] | None = None
    axes: tuple[str, ...] | None = None
    transfers_only: bool = False

    @property
    def is_empty(self) -> bool:
        return self == Selection()

    def describe(self) -> str:
        parts = []
        if self.stages is not None:
            parts.append("stage " + ", ".join(map(str, self.stages)))
        if self.layers is not None:
            first, last = self.layers
            parts.append(f"layer {first}" if first == last else f"layers {first}-{last}")
        if self.microbatches is not None:
            parts.append(_microbatches_text(self.microbatches))
        if self.phases is not None:
            parts.append(" and ".join(self.phases))
        if self.axes is not None:
            parts.append("axis " + ", ".join(self.axes))
        if self.transfers_only:
            parts.append("transfers only")
        return "; ".join(parts) or "whole step"


def _microbatches_text(microbatches: tuple[int, ...]) -> str:
    """"microbatch 0, 2" or, for a run of consecutive ones (--microbatch all of
    thousands), "microbatches 0-4095"."""
    first, last = min(microbatches), max(microbatches)
    if len(microbatches) > 2 and len(set(microbatches)) == last - first + 1:
        return f"microbatches {first}-{last}"
    return "microbatch " + ", ".join(map(str, microbatches))


def default_selection(graph: nx.DiGraph) -> Selection:
    """Small graphs whole; big ones: the first layer and the first microbatch."""
    if graph.number_of_nodes() <= DEFAULT_NODE_LIMIT:
        return Selection()
    first = min((d["layer"] for _, d in graph.nodes(data=True) if d["layer"] is not None),
                default=0)
    return Selection(layers=(first, first), microbatches=(0,))


def expand(graph: nx.DiGraph, microbatches: tuple[int, ...]) -> nx.DiGraph:
    """One copy of every per-microbatch node for each of ``microbatches``."""
    total = graph.graph.get("microbatches", 1)
    out = nx.DiGraph()
    out.graph.update(graph.graph)

    def copies(node: str) -> list[str]:
        if graph.nodes[node]["per_microbatch"]:
            return [f"{node}#mb{k}" for k in microbatches]
        return [node]

    for node, data in graph.nodes(data=True):
        if data["per_microbatch"]:
            for k in microbatches:
                out.add_node(f"{node}#mb{k}", **{**data, "microbatch": k,
                                                 "repeat": data["repeat"] // total})
        else:
            out.add_node(node, **data)
    for u, v, data in graph.edges(data=True):
        per_u, per_v = graph.nodes[u]["per_microbatch"], graph.nodes[v]["per_microbatch"]
        if per_u and per_v:
            pairs = [(f"{u}#mb{k}", f"{v}#mb{k}") for k in microbatches]
        else:
            pairs = [(a, b) for a in copies(u) for b in copies(v)]
        for a, b in pairs:
            out.add_edge(a, b, **data)
    return out


def bucket_layers(graph: nx.DiGraph) -> dict[str, set[int]]:
    """The layers whose parameters each gradient bucket holds."""
    return {bucket: {m["layer"] for m in info["members"] if m.get("layer") is not None}
            for bucket, info in graph.graph.get("buckets", {}).items()}


def _keep(data: dict, selection: Selection, buckets: dict[str, set[int]]) -> bool:
    if selection.stages is not None and data["stage"] not in selection.stages:
        return False
    if selection.layers is not None:
        first, last = selection.layers
        if data.get("bucket") in buckets and not data.get("tensor"):
            # A bucket's collective belongs to every layer it carries parameters of, as
            # planc explain --layer lists it (a layer's gradients leave in buckets).
            if not any(first <= layer <= last for layer in buckets[data["bucket"]]):
                return False
        elif data["layer"] is None or not first <= data["layer"] <= last:
            return False
    if selection.phases is not None and data["phase"] not in selection.phases:
        return False
    if data["type"] == "transfer":
        return selection.axes is None or data["axis"] in selection.axes
    return not selection.transfers_only


# The criteria of a selection that filter nodes (microbatches unfold, they never filter),
# and the node attribute each one reads; --axis and --transfers-only filter transfers
# together, so they are one criterion.
_CRITERIA = {"stages": "stage", "layers": "layer", "phases": "phase", "axes": "axis"}


def why_empty(graph: nx.DiGraph, selection: Selection) -> str:
    """Why ``selection`` keeps no node of ``graph``: the criterion that alone keeps none,
    or the first two that together keep none, with what the graph holds instead."""
    buckets = bucket_layers(graph)
    criteria = [replace(Selection(), **{name: getattr(selection, name)})
                for name in _CRITERIA if getattr(selection, name) is not None]
    if selection.transfers_only:
        transfers = next((c for c in criteria if c.axes is not None), None)
        criteria = [c for c in criteria if c is not transfers] + [
            replace(transfers or Selection(), transfers_only=True)]

    def kept(chosen: Selection) -> list[dict]:
        return [d for _, d in graph.nodes(data=True) if _keep(d, chosen, buckets)]

    everything = list(graph.nodes.values())
    for alone in criteria:
        if not kept(alone):
            return _none_of(alone, everything, "the graph")
    for size in range(2, len(criteria) + 1):  # the fewest criteria that keep nothing
        for *rest, last in itertools.combinations(criteria, size):
            if not kept(_together([*rest, last])):
                return _none_of(last, kept(_together(rest)),
                                " in ".join(_named(criterion) for criterion in rest))
    return "the options choose nothing together"


def _together(criteria: list[Selection]) -> Selection:
    """One selection of every criterion of ``criteria``."""
    return replace(Selection(), **{f.name: getattr(c, f.name) for c in criteria
                                   for f in fields(c) if getattr(c, f.name) != f.default})


def _named(criterion: Selection) -> str:
    """A criterion as the subject of a sentence: "stage 1", "layers 1-2", "the backward
    phase"."""
    if criterion.phases is not None:
        return f"the {' and '.join(criterion.phases)} phase" + \
            "s" * (len(criterion.phases) > 1)
    return criterion.describe()


def _none_of(criterion: Selection, nodes: list[dict], where: str) -> str:
    """No node of ``where`` is kept by ``criterion``, and what ``nodes`` (its) hold
    instead: "no node of stage 1 is in layer 0 (stage 1: layers 2-3)"."""
    if criterion.transfers_only:
        axes = sorted({d["axis"] for d in nodes if d["type"] == "transfer"})
        if not axes or criterion.axes is None:
            return f"{where} holds no transfer"
        return (f"no transfer of {where} is on axis {', '.join(criterion.axes)} (its "
                f"transfers are on axis {', '.join(axes)})")
    name = next(name for name in _CRITERIA if getattr(criterion, name) is not None)
    key = _CRITERIA[name]
    values = sorted({d[key] for d in nodes if d.get(key) is not None})
    held = ("" if not values else f" ({where}: layers {_runs(values)})"
            if name == "layers" else f" ({where}: {key} {', '.join(map(str, values))})")
    return f"no node of {where} is in {_named(criterion)}{held}"


def number_runs(numbers) -> list[tuple[int, int]]:
    """Sorted numbers as (first, last) runs of consecutive ones: [6, 7, 8, 18] ->
    [(6, 8), (18, 18)]."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return [(a, b) for a, b in runs]


def _runs(numbers: list[int]) -> str:
    """Sorted numbers as runs: "6-8, 18-20" (an interleaved stage's layers), "3"."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in number_runs(numbers))


def _unfolded_part(graph: nx.DiGraph, selection: Selection,
                   buckets: dict[str, set[int]]) -> nx.DiGraph:
    """The nodes :func:`select` unfolds: those it keeps, or every node where it contracts
    the dropped ones (``transfers_only``), which a path between two transfers crosses."""
    if selection.transfers_only:
        return graph
    return graph.subgraph([n for n, d in graph.nodes(data=True) if _keep(d, selection, buckets)])


def unfolded_size(graph: nx.DiGraph, selection: Selection) -> int:
    """How many nodes :func:`select` builds before it keeps the selection's: what
    unfolding the microbatches costs (``planc graph`` refuses over MAX_UNFOLDED_NODES)."""
    if selection.microbatches is None:
        return graph.number_of_nodes()
    part = _unfolded_part(graph, selection, bucket_layers(graph))
    per_microbatch = sum(1 for _, d in part.nodes(data=True) if d["per_microbatch"])
    return part.number_of_nodes() + per_microbatch * (len(selection.microbatches) - 1)


def select(graph: nx.DiGraph, selection: Selection) -> nx.DiGraph:
    """The part of ``graph`` the selection names, microbatches unfolded if asked.

    With ``transfers_only`` the dropped compute nodes are contracted, so that two
    transfers stay connected when one feeds the other through computation.
    """
    buckets = bucket_layers(graph)
    if selection.microbatches is None:
        source = graph
    else:  # only what can be kept is unfolded (all of it where transfers are contracted)
        source = expand(_unfolded_part(graph, selection, buckets), selection.microbatches)
    order = [n for n, d in source.nodes(data=True) if _keep(d, selection, buckets)]
    kept = set(order)
    out = nx.DiGraph()
    out.graph.update(source.graph)
    out.graph["selection"] = selection.describe()
    out.add_nodes_from((n, source.nodes[n]) for n in order)  # in the graph's own order
    for u in order:
        stack, seen = list(reversed(list(source.successors(u)))), set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in kept:
                out.add_edge(u, v, **source.edges[u, v]) if source.has_edge(u, v) \
                    else out.add_edge(u, v, kind="path")
            elif selection.transfers_only:
                stack.extend(source.successors(v))
    return out
