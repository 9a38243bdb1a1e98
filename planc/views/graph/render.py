"""A (selected) communication graph in each output format of ``planc graph``."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from enum import Enum

import networkx as nx

from planc.plan.plan import Plan
from planc.views import html
from planc.views.graph import dot
from planc.views.graph import svg as graph_svg
from planc.views.graph.facts import lane_labels


class RenderError(Exception):
    pass


def _scalar(value):
    """GraphML holds only scalars: lists and dicts become JSON text, enums their value."""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value.value if isinstance(value, Enum) else value


def _graphml(graph: nx.DiGraph) -> bytes:
    """GraphML holds only scalars; None values are left out."""
    clean = nx.DiGraph()
    for node, data in graph.nodes(data=True):
        clean.add_node(node, **{k: _scalar(v) for k, v in data.items() if v is not None})
    for u, v, data in graph.edges(data=True):
        clean.add_edge(u, v, **{k: _scalar(x) for k, x in data.items() if x is not None})
    buffer = io.BytesIO()
    nx.write_graphml(clean, buffer)
    return buffer.getvalue()


def _graphviz(source: str, fmt: str) -> bytes:
    executable = shutil.which("dot")
    if executable is None:
        raise RenderError(f"{fmt} output needs Graphviz's dot program, which is not "
                          f"installed (apt-get install graphviz); --format svg, dot, html, "
                          f"json and graphml work without it")
    try:
        result = subprocess.run([executable, f"-T{fmt}"], input=source.encode(),
                                capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RenderError("Graphviz took more than 5 minutes; select less of the graph "
                          "(--layers, --stage, --microbatch)") from None
    if result.returncode != 0:
        raise RenderError(f"Graphviz failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def render(graph: nx.DiGraph, fmt: str, title: str, plan: Plan) -> bytes:
    """``fmt`` of ``graph``: the SVG is planc's own layout (graph_svg), any size in about a
    second; PNG is Graphviz's drawing of the DOT, whose big groups are cards."""
    if fmt in ("dot", "svg", "png"):
        labels = lane_labels(plan, sorted({d["stage"] for _, d in graph.nodes(data=True)}))
        if fmt == "svg":
            return graph_svg.to_svg(graph, title, labels).encode()
        text = dot.to_dot(graph, title, labels)
        return text.encode() if fmt == "dot" else _graphviz(text, fmt)
    if fmt == "graphml":
        return _graphml(graph)
    if fmt == "json":
        return (json.dumps(nx.node_link_data(graph, edges="edges"), indent=1) + "\n").encode()
    return html.to_html(graph, title, plan).encode()


