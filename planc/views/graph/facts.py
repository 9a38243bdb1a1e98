"""What ``planc graph`` says about a node: its label, and the facts of its panel.

Sizes and times are in human units (planc.vocabulary.units, as ``planc explain`` prints
them); a transfer's time is the route pass's prediction where it ran, else the cost
model's ring estimate, as summary.json counts it. A bucket's collective lists the
parameters it carries: the members whose elements meet its range.
"""

from __future__ import annotations

import networkx as nx

from planc.estimate.cost import CostModel
from planc.graph.ir import Axis
from planc.graph.select import number_runs
from planc.graph.summary import crosses_nodes
from planc.vocabulary.units import TIME, format_bytes, format_flops, format_quantity
from planc.plan.layout import Layout
from planc.plan.mesh import WHOLE
from planc.views.explain_text import sharing, what_it_moves
from planc.plan.plan import Plan
from planc.diagnostics import counted

AXIS_COLORS = {"tp": "#d62728", "cp": "#9467bd", "pp": "#1f77b4", "dp_cp": "#2ca02c",
               "tied": "#8c564b", "stage": "#7f7f7f"}
AXIS_FILLS = {"tp": "#fbe3e3", "cp": "#efe6f6", "pp": "#e1ecf7", "dp_cp": "#e3f3e3",
              "tied": "#f1e7e3", "stage": "#eeeeee"}
PHASE_FILLS = {"forward": "#eef4fb", "backward": "#fdf2e6", "optimizer": "#eef7ee"}
COMPUTE_STROKE = "#6b7b8c"
ARROW = "\u2192"  # producer \u2192 consumer, in labels and the panel


def format_time(seconds: float) -> str:
    """``7.62 µs``, ``1.3 ms``: format_quantity's units, with the micro sign."""
    return format_quantity(seconds, TIME).replace(" us", " \u00b5s")


def colours(data: dict) -> tuple[str, str]:
    """(fill, stroke) of a node: transfers by mesh axis, compute steps by phase."""
    if data["type"] == "transfer":
        axis = str(data["axis"])
        return AXIS_FILLS.get(axis, "#eeeeee"), AXIS_COLORS.get(axis, "#333333")
    return PHASE_FILLS[str(data["phase"])], COMPUTE_STROKE


def step_letter(data: dict) -> str:
    if data["phase"] == "optimizer":
        return "O"
    if data["phase"] == "forward":
        return "F"
    return "R" if data.get("recompute") else "W" if data.get("weight_grad_of") else "B"


def node_lines(data: dict) -> list[str]:
    """A node's label: what it is and its layer; what it moves; its size or FLOPs."""
    layer = f" \u00b7 L{data['layer']}" if data["layer"] is not None else ""
    times = f" \u00d7{data['repeat']}" if data["repeat"] > 1 else ""
    microbatch = f" (mb {data['microbatch']})" if data.get("microbatch") is not None else ""
    piece = data.get("token_piece")  # tp_overlap: which of the tokens' pieces it runs
    if piece is not None:
        layer += f" \u00b7 piece {piece[0] + 1}/{piece[1]}"
    if data["type"] == "compute":
        name = "optimizer " + data["bucket"] if data["op"] == "optimizer" else str(data["op"])
        return [f"{step_letter(data)} {name}{layer}{microbatch}",
                f"{format_flops(data['flops'])}{times}"]
    return [f"{data['kind']} {data['axis']}{layer}{microbatch}", what_it_moves(data, ARROW),
            f"{format_bytes(data['bytes'])}{times}"]


class Facts:
    """The panel's rows for the nodes of one graph of one plan."""

    def __init__(self, plan: Plan, graph: nx.DiGraph):
        self.plan, self.graph = plan, graph
        self.cost = CostModel(plan.topology)
        ranks = Layout.of(plan)
        self.crosses = {axis.value: crosses_nodes(ranks, axis) for axis in Axis}
        self.buckets = graph.graph.get("buckets", {})
        self.microbatches = graph.graph.get("microbatches", 1)

    def seconds(self, data: dict) -> float:
        if data["type"] == "compute":
            return self.cost.compute_seconds(data["flops"])
        if data.get("route_seconds") is not None:
            return data["route_seconds"]
        return self.cost.transfer_seconds(data["kind"], data["bytes"], data["group_size"],
                                          self.crosses[str(data["axis"])])

    def how_often(self, data: dict) -> str:
        repeat = data["repeat"]
        if data.get("microbatch") is not None:
            return f"{counted(repeat, 'time')} in microbatch {data['microbatch']}"
        if data["per_microbatch"]:
            each = repeat // max(self.microbatches, 1)
            per = "once" if each == 1 else f"{each} times"
            return (f"{counted(repeat, 'time')} per step: {per} per microbatch, "
                    f"{counted(self.microbatches, 'microbatch', 'microbatches')}")
        return "once per step" if repeat == 1 else f"{repeat} times per step"

    def rows(self, node: str) -> list[list[str]]:
        data = self.graph.nodes[node]
        seconds = self.seconds(data)
        where = [["stage", str(data["stage"])], ["layer", "none" if data["layer"] is None
                                                  else str(data["layer"])],
                 ["phase", str(data["phase"])]]
        often = ["how often", self.how_often(data)]
        if data["type"] == "compute":
            rows = [["operator", f"{step_letter(data)} {data['op']}"],
                    ["work", f"{format_flops(data['flops'])} per execution"], often,
                    ["estimated time", f"{format_time(seconds)} each, "
                                       f"{format_time(seconds * data['repeat'])} per step"],
                    ["output", format_bytes(data["bytes"])], *where]
            if data.get("params"):
                rows.append(["parameters", ", ".join(data["params"])])
            return rows
        route = f" ({data['route']} route)" if data.get("route") else ""
        level = "" if data.get("level", WHOLE) == WHOLE else f" ({data['level']}-node part)"
        rows = [["kind", str(data["kind"])], ["axis", f"{data['axis']}{level}"],
                ["size", f"{format_bytes(data['bytes'])} per rank, {data['dtype']}"],
                often, ["per step", format_bytes(data["bytes"] * data["repeat"])],
                ["estimated time", f"{format_time(seconds)} each{route}, "
                                   f"{format_time(seconds * data['repeat'])} per step"],
                ["moves", what_it_moves(data, ARROW)], *where, ["payload", str(data["payload"])]]
        if data.get("shape"):
            rows.append(["shape", " x ".join(map(str, data["shape"]))])
        if data.get("stream"):
            rows.append(["stream", str(data["stream"])])
        return rows

    def parameters(self, node: str) -> list[list[str]]:
        """A bucket collective's parameters, with the size each takes in it."""
        data = self.graph.nodes[node]
        bucket = self.buckets.get(data.get("bucket"))
        if data["type"] != "transfer" or bucket is None or data.get("tensor"):
            return []
        first, end = data.get("elements") or (0, bucket["padded"])
        return [[m["param"], format_bytes(data["bytes"] * m["numel"] / (end - first))]
                for m in sharing(data, bucket)]


def ranks_text(ranks: tuple[int, ...]) -> str:
    """``ranks 0-1, 4-5``; many runs are cut: ``64 ranks: 0-3, 16-19, ... 60-63``."""
    words = [f"{a}-{b}" if b > a else str(a) for a, b in number_runs(ranks)]
    if len(words) <= 3:
        return f"rank {words[0]}" if len(ranks) == 1 else "ranks " + ", ".join(words)
    return f"{len(ranks)} ranks: {words[0]}, {words[1]}, ... {words[-1]}"


def lane_labels(plan: Plan, stages) -> dict[int, list[str]]:
    """Each stage's lane label: its name and its ranks (which differ in tp, cp and dp)."""
    ranks = Layout.of(plan)
    return {s: [f"stage {s}", ranks_text(ranks.group(ranks.first_rank_of_stage(s),
                                                     Axis.STAGE))] for s in stages}
