"""A communication graph as Graphviz DOT, written by planc itself.

Clusters per pipeline stage and, inside, per layer; compute steps are boxes tinted by
phase, transfers are coloured by mesh axis and labelled with their kind and size.
"""

from __future__ import annotations

from collections import defaultdict

import networkx as nx

from planc.lang.units import format_bytes

AXIS_COLORS = {"tp": "#d62728", "cp": "#9467bd", "pp": "#1f77b4", "dp_cp": "#2ca02c",
               "tied": "#8c564b", "stage": "#7f7f7f"}
AXIS_FILLS = {"tp": "#fbe3e3", "cp": "#efe6f6", "pp": "#e1ecf7", "dp_cp": "#e3f3e3",
              "tied": "#f1e7e3", "stage": "#eeeeee"}
PHASE_FILLS = {"forward": "#eef4fb", "backward": "#fdf2e6", "optimizer": "#eef7ee"}


def _quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _flops(value: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                        ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} FLOP"


def node_label(node: str, data: dict) -> str:
    suffix = f" (mb {data['microbatch']})" if data.get("microbatch") is not None else ""
    times = f" x{data['repeat']}" if data["repeat"] > 1 else ""
    if data["type"] == "compute":
        name = data.get("name", data["op"])
        if data.get("part"):
            name = f"loss {data['part']}"
        phase = {"forward": "F", "backward": "R" if data.get("recompute") else "B",
                 "optimizer": "opt"}[data["phase"]]
        return f"{phase} {name}{suffix}\n{_flops(data['flops'])}{times}"
    what = data.get("tensor", "")
    return (f"{data['kind']} {data['axis']}{suffix}\n{what}\n"
            f"{format_bytes(data['bytes'])}{times}")


def _node_attributes(node: str, data: dict) -> str:
    if data["type"] == "compute":
        style = "rounded,filled" + (",dashed" if data.get("recompute") else "")
        attrs = {"shape": "box", "style": style, "fillcolor": PHASE_FILLS[data["phase"]],
                 "color": "#6b7b8c"}
    else:
        axis = data["axis"]
        attrs = {"shape": "box", "style": "rounded,filled,bold",
                 "fillcolor": AXIS_FILLS.get(axis, "#eeeeee"),
                 "color": AXIS_COLORS.get(axis, "#333333"), "penwidth": "2",
                 "fontcolor": AXIS_COLORS.get(axis, "#333333")}
        attrs["tooltip"] = data.get("reason", "")
    attrs["label"] = node_label(node, data)
    return ", ".join(f"{key}={_quote(value)}" for key, value in attrs.items())


def to_dot(graph: nx.DiGraph, title: str = "") -> str:
    lines = ["digraph planc {",
             f"  graph [rankdir=TB, fontname=\"Helvetica\", fontsize=11, labelloc=t, "
             f"newrank=true, nodesep=0.25, ranksep=0.35, label={_quote(title)}];",
             "  node [fontname=\"Helvetica\", fontsize=9, margin=\"0.08,0.04\"];",
             "  edge [color=\"#8a96a3\", arrowsize=0.6];"]
    clusters: dict[int, dict[object, list[str]]] = defaultdict(lambda: defaultdict(list))
    for node, data in graph.nodes(data=True):
        layer = data["layer"]
        group = f"layer {layer}" if layer is not None else (
            "optimizer" if data["phase"] == "optimizer" else "embedding and head")
        clusters[data["stage"]][group].append(node)
    for stage in sorted(clusters):
        lines.append(f"  subgraph cluster_stage_{stage} {{")
        lines.append(f"    label={_quote(f'stage {stage}')}; style=\"rounded\"; "
                     f"color=\"#9aa5b1\"; fontcolor=\"#52606d\";")
        for index, (group, nodes) in enumerate(sorted(clusters[stage].items(),
                                                      key=lambda kv: str(kv[0]))):
            lines.append(f"    subgraph cluster_stage_{stage}_{index} {{")
            lines.append(f"      label={_quote(group)}; style=\"rounded,dashed\"; "
                         f"color=\"#c3cbd3\"; fontcolor=\"#7b8794\";")
            for node in sorted(nodes):
                lines.append(f"      {_quote(node)} [{_node_attributes(node, graph.nodes[node])}];")
            lines.append("    }")
        lines.append("  }")
    for u, v, data in sorted(graph.edges(data=True)):
        kind = data.get("kind", "data")
        style = {"saved": " [style=dashed, color=\"#c3cbd3\"]",
                 "path": " [style=dotted]"}.get(kind, "")
        lines.append(f"  {_quote(u)} -> {_quote(v)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"
