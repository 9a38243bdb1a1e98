"""The groups that ``planc graph`` draws: what a person looks for in a training step.

Every node of a (selected) communication graph belongs to one group of its pipeline
stage: a layer's forward or backward steps (per microbatch, when microbatches are
unfolded), the embedding, the head and loss, the gradient buckets' reductions, the
optimizer, or one pipeline transfer. Groups are ordered as the stage runs them: a
topological order of the groups' own dependency graph (its cycles, which order edges
can make, condensed), ties broken by how deep their first node lies in the step.
The HTML page, the SVG and the DOT output all draw these groups, so they agree.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import networkx as nx

HEAD_OPS = {"final_ln", "head", "loss", "loss_max", "loss_sum_exp"}
EMBEDDING_OPS = {"embedding", "position"}
GROUP_KINDS = ("embedding", "layer", "head", "pipeline", "buckets", "optimizer", "other")


@dataclass
class Group:
    key: str  # stable and readable: "s0/L3/B", "s1/head/F/mb2", "s0/buckets"
    stage: int
    kind: str  # one of GROUP_KINDS
    title: str  # "layer 3 backward"
    layer: int | None
    phase: str
    nodes: list[str] = field(default_factory=list)

    @property
    def boxed(self) -> bool:
        """Pipeline transfers stand alone in their lane, between the lanes they join."""
        return self.kind != "pipeline"


def _direction(data: dict) -> str:
    return "F" if data["phase"] == "forward" else "B"


def _suffix(data: dict) -> tuple[str, str]:
    """The microbatch part of a key and a title, in unfolded views."""
    k = data.get("microbatch")
    return ("", "") if k is None else (f"/mb{k}", f", microbatch {k}")


def _own_group(node: str, data: dict) -> tuple[str, str, str, int | None] | None:
    """(key, kind, title, layer) of a node whose group its own attributes say, or None
    for a transfer outside the layers that goes with the computation next to it."""
    stage, phase = data["stage"], data["phase"]
    key_mb, title_mb = _suffix(data)
    words = {"F": "forward", "B": "backward"}
    if phase == "optimizer":
        return f"s{stage}/optimizer", "optimizer", "optimizer", None
    if data["type"] == "transfer":
        if data["axis"] == "pp":
            return f"s{stage}/pp/{node}", "pipeline", f"{data['kind']} over pp", None
        if data["payload"] == "grad" and not data["per_microbatch"]:
            return f"s{stage}/buckets", "buckets", "gradient buckets", None
    direction = _direction(data)
    if data["layer"] is not None:
        layer = data["layer"]
        return (f"s{stage}/L{layer}/{direction}{key_mb}", "layer",
                f"layer {layer} {words[direction]}{title_mb}", layer)
    if data["type"] == "compute":
        part = "head" if data["op"] in HEAD_OPS else "embedding"
    else:  # a redistribution or loss statistic names the operators it joins
        names = {data.get("tensor"), data.get("producer"), data.get("consumer")}
        part = "head" if names & HEAD_OPS else "embedding" if names & EMBEDDING_OPS else ""
    if part:
        title = "head and loss" if part == "head" else "embedding"
        return (f"s{stage}/{part}/{direction}{key_mb}", part,
                f"{title} {words[direction]}{title_mb}", None)
    return None


def assign(graph: nx.DiGraph) -> dict[str, tuple[str, str, str, int | None]]:
    """Every node's (key, kind, title, layer). A transfer outside the layers (the head's
    all-gather, the loss's all-reduces, a ZeRO-3 gather of the embedding) joins the group
    of the computation it follows on its stage, else of the one it feeds."""
    found = {n: g for n, d in graph.nodes(data=True) if (g := _own_group(n, d)) is not None}
    order = {node: i for i, node in enumerate(nx.topological_sort(graph))}
    for node in order:
        if node in found:
            continue
        data = graph.nodes[node]
        stage = data["stage"]
        before = [p for p in graph.predecessors(node) if p in found
                  and graph.nodes[p]["stage"] == stage
                  and found[p][1] not in ("pipeline", "buckets", "optimizer")]
        after = [s for s in graph.successors(node) if s in found
                 and graph.nodes[s]["stage"] == stage]
        if before:
            found[node] = found[max(before, key=order.__getitem__)]
        elif after:
            found[node] = found[min(after, key=order.__getitem__)]
        else:
            direction = _direction(data)
            found[node] = (f"s{data['stage']}/other/{direction}", "other",
                           f"other {'forward' if direction == 'F' else 'backward'}", None)
    return found


def groups_of(graph: nx.DiGraph) -> list[Group]:
    """The groups of ``graph`` in the order their stages run them; each group's nodes in
    the graph's own order."""
    owner = assign(graph)
    groups: dict[str, Group] = {}
    for node, data in graph.nodes(data=True):
        key, kind, title, layer = owner[node]
        if key not in groups:
            groups[key] = Group(key, data["stage"], kind, title, layer, data["phase"])
        groups[key].nodes.append(node)
    depth: dict[str, int] = {}
    for node in nx.topological_sort(graph):
        depth[node] = max((depth[p] + 1 for p in graph.predecessors(node)), default=0)
    between = nx.DiGraph()
    between.add_nodes_from(groups)
    between.add_edges_from((owner[u][0], owner[v][0]) for u, v in graph.edges
                           if owner[u][0] != owner[v][0])
    first = {key: min(depth[n] for n in g.nodes) for key, g in groups.items()}
    condensed = nx.condensation(between)
    members = condensed.graph["mapping"]
    inside: dict[int, list[str]] = defaultdict(list)
    for key, component in members.items():
        inside[component].append(key)

    def rank(keys: list[str]) -> tuple:
        return min((first[k], groups[k].stage, k) for k in keys)

    order = []
    for component in nx.lexicographical_topological_sort(
            condensed, key=lambda c: rank(inside[c])):
        order.extend(sorted(inside[component], key=lambda k: rank([k])))
    return [groups[key] for key in order]


def _kind_words(kind: str) -> str:
    return kind.replace("_", "-")


def summary_lines(graph: nx.DiGraph, nodes: list[str], transfers_only: bool = False
                  ) -> list[str]:
    """What a collapsed group shows: its compute steps, then its transfers per axis."""
    compute = sum(1 for n in nodes if graph.nodes[n]["type"] == "compute")
    by_axis: dict[str, Counter] = defaultdict(Counter)
    for n in nodes:
        data = graph.nodes[n]
        if data["type"] == "transfer":
            by_axis[str(data["axis"])][str(data["kind"])] += 1
    lines = [] if transfers_only or not compute else [
        f"{compute} compute step{'s' if compute != 1 else ''}"]
    for axis in sorted(by_axis):
        kinds = ", ".join(f"{count} {_kind_words(kind)}"
                          for kind, count in sorted(by_axis[axis].items()))
        lines.append(f"{axis}: {kinds}")
    return lines or ["no transfers"]
