"""Per stage, per step and device: transfers by axis, kind and phase; FLOPs; memory.

Counts and bytes are what one device of the stage does in one training step: a node
that runs once per microbatch counts ``repeat`` times. Bytes follow the nccl-tests
convention (each rank's larger buffer), and ``bus_bytes`` what the ring algorithm
actually moves per rank (:func:`planc.estimate.cost.bus_factor`), so that volumes of different
collectives compare (an all-reduce moves twice its buffer).
"""

from __future__ import annotations

from collections import defaultdict

import networkx as nx

from planc.estimate import memory
from planc.estimate.cost import CostModel, bus_factor
from planc.graph.ir import Axis, Kind, Phase
from planc.models import moe
from planc.vocabulary.model_options import gemm_input_bytes
from planc.plan.layout import Layout as RankLayout
from planc.plan.plan import Plan

SUMMARY_FORMAT_VERSION = 1


def crosses_nodes(layout: RankLayout, axis: Axis) -> bool:
    """Whether a group of ``axis`` (rank 0's, as a representative) spans nodes."""
    if axis in (Axis.TIED, Axis.STAGE):
        return layout.nodes > 1
    return layout.crosses_nodes(axis.value)


def _count(entry: dict, key: tuple, kind: str, repeat: int, size: float, group: int,
           seconds: float) -> None:
    """One transfer of ``size`` bytes over a group of ``group``, ``repeat`` times a step."""
    bucket = entry["transfers"][key]
    bucket["count"] += repeat
    bucket["bytes"] += repeat * size
    bucket["bus_bytes"] += repeat * size * bus_factor(kind, group)
    entry["transfer_seconds"] += repeat * seconds


def _inner_all_to_alls(plan: Plan, node: dict) -> list[float]:
    """The bytes of each all-to-all a mixture's compute step runs over its ep group
    inside its instruction, at uniform routing: a forward's (or recomputation's)
    counts, dispatch and combine, a backward's two reversed; what goes toward the
    experts (the dispatch, the combine's gradient) in FP8 under ``model { fp8 }``
    (planc.runtime.families.moe). None where the mixture's all-to-alls are transfers of
    their own (planc.passes.split_dispatch) or it has no ep group: an empty list."""
    if not node.get("experts_over") or node["experts_over"] < 2:
        return []
    rows = node["dispatch_bytes"]
    counts = [moe.expert_counts_bytes(plan.model.experts)] \
        if node["phase"] == Phase.FORWARD or node.get("recompute") else []
    return counts + [rows * _toward_experts_share(plan), rows]


def _toward_experts_share(plan: Plan) -> float:
    """What an all-to-all toward the experts moves per byte of the model's dtype."""
    return gemm_input_bytes(plan.model) / plan.model.dtype_bytes


def _cut_bytes(plan: Plan, node: dict) -> float:
    """A transfer's bytes; a cut mixture's dispatch (forward or recomputed) and its
    combine's gradient (backward) in FP8 under ``model { fp8 }``, as the simulator
    prices them (planc.estimate.instruction_cost)."""
    direction = Phase.FORWARD if node.get("recomputes") else node["phase"]
    if (node.get("payload"), direction) in (("dispatch", Phase.FORWARD),
                                            ("combine", Phase.BACKWARD)):
        return node["bytes"] * _toward_experts_share(plan)
    return node["bytes"]


def summarize(plan: Plan, graph: nx.DiGraph) -> dict:
    """The ``summary.json`` document."""
    ranks = RankLayout.of(plan)
    cost = CostModel(plan.topology)
    crosses = {axis: crosses_nodes(ranks, axis) for axis in Axis}
    stages = {stage: {"stage": stage, "flops": 0.0, "compute_seconds": 0.0,
                      "transfer_seconds": 0.0, "transfers": defaultdict(lambda: {
                          "count": 0, "bytes": 0, "bus_bytes": 0.0})}
              for stage in range(plan.mesh.pp)}
    for _, node in graph.nodes(data=True):
        entry = stages[node["stage"]]
        repeat = node["repeat"]
        if node["type"] == "compute":
            entry["flops"] += repeat * node["flops"]
            entry["compute_seconds"] += repeat * cost.compute_seconds(node["flops"])
            for size in _inner_all_to_alls(plan, node):
                _count(entry, (Axis.EP, Kind.ALL_TO_ALL, node["phase"]), Kind.ALL_TO_ALL,
                       repeat, size, node["experts_over"],
                       cost.transfer_seconds(Kind.ALL_TO_ALL, size, node["experts_over"],
                                             crosses[Axis.EP]))
            continue
        seconds = node.get("route_seconds")  # the route pass's prediction, where it ran
        if seconds is None:
            seconds = cost.transfer_seconds(node["kind"], node["bytes"], node["group_size"],
                                            crosses[node["axis"]])
        _count(entry, (node["axis"], node["kind"], node["phase"]), node["kind"], repeat,
               _cut_bytes(plan, node), node["group_size"], seconds)
    estimate = memory.estimate(plan)
    out_stages = []
    for stage, entry in stages.items():
        mem = estimate.stages[stage]
        out_stages.append({
            "stage": stage,
            "layers": list(plan.layers_of_stage(stage)),
            "flops": entry["flops"],
            "compute_seconds": entry["compute_seconds"],
            "transfer_seconds": entry["transfer_seconds"],
            "transfers": [{"axis": axis, "kind": kind, "phase": phase, **values}
                          for (axis, kind, phase), values in sorted(entry["transfers"].items())],
            "memory": {"parameters": mem.parameters, "parameter_bytes": mem.parameter_bytes,
                       "gradient_bytes": mem.gradient_bytes,
                       "optimizer_bytes": mem.optimizer_bytes,
                       "activation_bytes": mem.activation_bytes,
                       "unsharded_bytes": mem.unsharded_bytes,
                       "microbatches_in_flight": mem.microbatches_in_flight,
                       "total_bytes": mem.total_bytes},
        })
    return {"format": "planc-summary", "version": SUMMARY_FORMAT_VERSION, "plan": plan.name,
            "world": plan.world, "microbatches": plan.schedule.microbatches,
            "nodes": graph.number_of_nodes(), "edges": graph.number_of_edges(),
            "device_memory": plan.topology.device.memory,
            "passes": [{"name": r["name"], "enabled": r["enabled"], "line": r["line"],
                        "changes": r["changes"]} for r in graph.graph.get("passes", [])],
            "buckets": len(graph.graph.get("buckets", {})), "stages": out_stages}


def totals(summary: dict, stage: int) -> dict[tuple[str, str, str], dict]:
    """{(axis, kind, phase): {count, bytes, bus_bytes}} of one stage."""
    entry = summary["stages"][stage]
    return {(t["axis"], t["kind"], t["phase"]): t for t in entry["transfers"]}


# One definition of "what a device moves", for every command that shows one figure where
# planc compile shows one per stage: a device of the stage that moves the most. A sum over
# the stages (a device sits on one stage) is a figure no device ever moves.

def busiest_stage_transfers(summary: dict) -> list[dict]:
    """Per (axis, kind, phase), in that order: the transfers of one device, per step, on
    the stage whose devices move the most bytes for it (the first such stage on a tie),
    as planc compile prints that stage, with that ``stage``."""
    chosen: dict[tuple[str, str, str], dict] = {}
    for stage in summary["stages"]:
        for t in stage["transfers"]:
            key = (t["axis"], t["kind"], t["phase"])
            if key not in chosen or t["bytes"] > chosen[key]["bytes"]:
                chosen[key] = {**t, "stage": stage["stage"]}
    return [chosen[key] for key in sorted(chosen)]


def busiest_stage_by_axis(summary: dict) -> dict[str, dict]:
    """Per axis: the count and bytes per step of one device of the stage that moves the
    most over it, with that ``stage``."""
    chosen: dict[str, dict] = {}
    for stage in summary["stages"]:
        on_stage: dict[str, dict] = {}
        for t in stage["transfers"]:
            moved = on_stage.setdefault(t["axis"], {"count": 0, "bytes": 0,
                                                    "stage": stage["stage"]})
            moved["count"] += t["count"]
            moved["bytes"] += t["bytes"]
        for axis, moved in on_stage.items():
            if axis not in chosen or moved["bytes"] > chosen[axis]["bytes"]:
                chosen[axis] = moved
    return chosen
