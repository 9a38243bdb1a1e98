"""Checks of a graph against the schema of :mod:`planc.graph.vocabulary`, for graphs the
compiler made and for graphs read back from a build, which are untrusted: every node's
required attributes and their types, the attributes its payload needs, the optional
ones where present, edges, parameter buckets, the passes' report, and acyclicity.
"""

from __future__ import annotations

from enum import StrEnum
from math import inf
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from planc.host.json_values import json_kind
from planc.graph.vocabulary import (
    COMMON_ATTRIBUTES,
    COMPUTE_ATTRIBUTES,
    INTEGER,
    OPTIONAL_TYPES,
    PAYLOAD_ATTRIBUTES,
    SEQUENCE,
    TEXT,
    TRANSFER_ATTRIBUTES,
    EdgeKind,
    Kind,
    NodeType,
    Payload,
    Port,
    buckets,
    node_is,
    shard_numel,
)

if TYPE_CHECKING:
    import networkx as nx


def _optional_problem(data: dict) -> str | None:
    """What is wrong with a node's optional attributes, or None."""
    # a node holds a few of the optional attributes: look at those it holds, and name
    # the wrong ones in the schema's order
    if not all(_type_ok(data[key], OPTIONAL_TYPES[key]) for key in data
               if key in OPTIONAL_TYPES):
        bad = [key for key, expected in OPTIONAL_TYPES.items()
               if key in data and not _type_ok(data[key], expected)]
        return f"invalid {', '.join(bad)}"
    seconds = data.get("route_seconds")
    if seconds is not None and not 0 <= seconds < inf:
        return f"route_seconds {seconds!r} is not a time"
    for key in ("shape", "elements"):
        if key in data and not all(_type_ok(x, INTEGER) and x >= 0 for x in data[key]):
            return f"{key} is not a list of sizes"
    if "flops" in data and not 0 <= data["flops"] < inf:
        return f"flops {data['flops']!r} is not a count"
    if "params" in data and not all(isinstance(p, str) for p in data["params"]):
        return "params is not a list of parameter names"
    if ("producer" in data) != ("consumer" in data):
        return "a producer without a consumer, or a consumer without a producer"
    if data.get("type") == NodeType.TRANSFER and not (
            "producer" in data or data.get("tensor") or "bucket" in data):
        return "a transfer with no producer, tensor or bucket: it moves nothing"
    return None


def _rejects_bool(expected) -> bool:
    """Whether a bool, which ``isinstance`` takes for an int, is refused where ``expected``
    is asked: an int type that does not list bool itself (a StrEnum holds no bool)."""
    return not (isinstance(expected, type) and issubclass(expected, StrEnum)) and \
        bool not in expected


def _type_ok(value: Any, expected) -> bool:
    return isinstance(value, expected) and not (value.__class__ is bool and
                                                _rejects_bool(expected))


def validate(graph: nx.DiGraph, *, microbatches: int | None = None,
             stages: int | None = None, layers: int | None = None,
             chunks: int | None = None, stage_of_chunk: Callable[[int], int] | None = None,
             limit: int = 20) -> list[str]:
    """Problems of ``graph`` against the schema (empty when it is well formed).

    Checks every node's required attributes and their types, the payload's own
    attributes, edges (known kinds and ports, parameter edges from PARAM gathers,
    ``forward_of`` and ``bucket`` references), buckets (members inside their bucket
    and disjoint, padding to whole shards) and that the graph is acyclic. The optional
    bounds come from the plan the graph belongs to; ``stage_of_chunk`` is where its
    schedule places each chunk (c mod stages if not given).
    """
    problems: list[str] = []

    def report(text: str) -> bool:
        if len(problems) < limit:
            problems.append(text)
        return len(problems) < limit

    table = buckets(graph) if "buckets" in graph.graph else {}
    place = stage_of_chunk or (lambda chunk: chunk % stages)
    schemas: dict[tuple, tuple] = {}  # (type, payload) -> the attributes it requires
    for node, data in graph.nodes(data=True):
        kind = data.get("type")
        if not isinstance(kind, NodeType):
            if not report(f"node {node!r}: type {kind!r} is not compute or transfer"):
                return problems
            continue
        payload = data.get("payload") if kind == NodeType.TRANSFER else None
        schema = (kind, payload if isinstance(payload, Payload) else None)
        required = schemas.get(schema)
        if required is None:
            required = schemas[schema] = tuple(
                (key, expected, _rejects_bool(expected)) for key, expected in {
                    **COMMON_ATTRIBUTES, **(COMPUTE_ATTRIBUTES if kind == NodeType.COMPUTE
                                            else TRANSFER_ATTRIBUTES),
                    **PAYLOAD_ATTRIBUTES.get(schema[1], {})}.items())
        # _type_ok inlined: a graph read back holds a million attributes at the limits
        bad = [key for key, expected, strict in required
               if not isinstance(value := data.get(key), expected) or
               (strict and value.__class__ is bool)]
        if bad:
            if not report(f"node {node!r}: missing or invalid {', '.join(bad)}"):
                return problems
            continue
        if "layer" not in data:
            report(f"node {node!r}: missing layer (a layer, or null outside the layers)")
            continue
        problem = _optional_problem(data)
        if problem:
            report(f"node {node!r}: {problem}")
            continue
        layer = data["layer"]
        if layer is not None and (not _type_ok(layer, INTEGER) or layer < 0 or
                                  (layers is not None and layer >= layers)):
            report(f"node {node!r}: layer {layer!r} is not a layer of the model")
        if stages is not None and not 0 <= data["stage"] < stages:
            report(f"node {node!r}: stage {data['stage']} is not a pipeline stage")
        elif chunks is not None and stages is not None and not (
                0 <= data["chunk"] < chunks and place(data["chunk"]) == data["stage"]):
            report(f"node {node!r}: chunk {data['chunk']} is not a model chunk of stage "
                   f"{data['stage']}")
        if data["repeat"] < 1 or data["bytes"] < 0:
            report(f"node {node!r}: repeat and bytes must be positive")
        if microbatches is not None and data["per_microbatch"] and \
                data["repeat"] % microbatches:
            report(f"node {node!r}: runs per microbatch but repeat {data['repeat']} is not "
                   f"a multiple of {microbatches} microbatches")
        for key in ("forward_of", "recompute_of"):
            if key in data and data[key] not in graph:
                report(f"node {node!r}: {key} names {data[key]!r}, which is not in the graph")
        if "bucket" in data and data["bucket"] not in table:
            report(f"node {node!r}: bucket {data['bucket']!r} is not in the graph's buckets")
        if data.get("guard") not in (None, "first", "last"):
            report(f"node {node!r}: guard {data['guard']!r} is not 'first' or 'last'")
    for u, v, data in graph.edges(data=True):
        if not isinstance(data.get("kind"), EdgeKind):
            report(f"edge {u!r} -> {v!r}: kind {data.get('kind')!r} is not data, saved or "
                   f"order")
        port = data.get("port")
        if port is not None and not isinstance(port, Port):
            report(f"edge {u!r} -> {v!r}: port {port!r} is unknown")
        if port == Port.PARAM and not node_is(graph.nodes[u], Kind.ALL_GATHER, Payload.PARAM):
            report(f"edge {u!r} -> {v!r}: only parameter gathers feed a param port")
    for bucket_id, bucket in table.items():
        for problem in bucket_problems(bucket):
            report(f"bucket {bucket_id!r}: {problem}")
    for problem in pass_report_problems(graph.graph.get("passes", [])):
        report(f"the passes' report: {problem}")
    import networkx as nx

    if not problems and not nx.is_directed_acyclic_graph(graph):
        report("the graph has a cycle")
    return problems


# A bucket's fields and its members' (planc.passes.fuse), with their types.
_BUCKET_FIELDS = {"stage": INTEGER, "chunk": INTEGER, "dtype": TEXT, "members": SEQUENCE,
                  "numel": INTEGER, "parts": INTEGER, "shard": INTEGER, "padded": INTEGER,
                  "sharded": (bool,), "zero3": (bool,), "tp_sum_numel": INTEGER, "tied": (bool,),
                  "reason": TEXT}
_MEMBER_FIELDS = {"param": TEXT, "offset": INTEGER, "numel": INTEGER, "shape": SEQUENCE,
                  "full_shape": SEQUENCE, "tp_split": (list, tuple, type(None)),
                  "layer": (int, type(None))}


def _fields_problem(item, fields: dict) -> str | None:
    if not isinstance(item, dict):
        return f"a JSON {json_kind(item)}, not an object"
    bad = [key for key, expected in fields.items()
           if key not in item or not _type_ok(item[key], expected)]
    if bad:
        return f"missing or invalid {', '.join(bad)}"
    negative = [key for key, expected in fields.items() if expected == INTEGER and item[key] < 0]
    if negative:
        return f"negative {', '.join(negative)}"
    return None


_PASS_FIELDS = {"name": TEXT, "enabled": (bool,), "line": TEXT, "changes": SEQUENCE,
                "decisions": SEQUENCE}
_ROUTE_DECISION_FIELDS = {"node": TEXT, "route": TEXT, "why": TEXT, "placements": SEQUENCE,
                          "candidates": SEQUENCE}
_CANDIDATE_FIELDS = {"route": TEXT, "seconds": (int, float, type(None)), "reason": TEXT}


def pass_report_problems(records) -> list[str]:
    """The passes' report (``graph.graph["passes"]``, what planc explain prints): one
    record per pass, and for the route pass every decision with its candidates, the route
    taken among them."""
    if not isinstance(records, (list, tuple)):
        return ["not a list"]
    for k, record in enumerate(records):
        problem = _fields_problem(record, _PASS_FIELDS)
        if problem is None and record["name"] == "route":
            for decision in record["decisions"]:
                problem = _fields_problem(decision, _ROUTE_DECISION_FIELDS)
                if problem is None and not all(isinstance(p, str)
                                               for p in decision["placements"]):
                    problem = "placements that are not text"
                for candidate in decision["candidates"] if problem is None else ():
                    problem = _fields_problem(candidate, _CANDIDATE_FIELDS)
                    if problem is None and candidate["seconds"] is not None and \
                            not 0 <= candidate["seconds"] < inf:
                        problem = f"a candidate route of {candidate['seconds']!r} seconds"
                    if problem is not None:
                        break
                if problem is None and not any(
                        c["route"] == decision["route"] and c["seconds"] is not None
                        for c in decision["candidates"]):
                    problem = f"the route taken, {decision['route']!r}, is not a candidate"
                if problem is not None:
                    problem = f"a decision: {problem}"
                    break
        if problem is not None:
            return [f"record {k}: {problem}"]
    return []


def bucket_problems(bucket: dict) -> list[str]:
    """Fields of the right types; members inside the bucket, disjoint, in offset order;
    the bucket padded to whole shards of its group."""
    problem = _fields_problem(bucket, _BUCKET_FIELDS)
    if problem is None and bucket["parts"] < 1:
        problem = "parts must be at least 1"
    if problem is None and bucket.get("over", "edp") != "edp":  # optional: split experts
        problem = f"over {bucket['over']!r} is not edp"
    for member in bucket["members"] if problem is None else ():
        problem = _fields_problem(member, _MEMBER_FIELDS)
        if problem is None and not all(_type_ok(d, INTEGER) and d >= 0 for d in
                                       (*member["shape"], *member["full_shape"])):
            problem = "a shape that is not a list of sizes"
        if problem is None and member["tp_split"] is not None and not (
                len(member["tp_split"]) == 2 and isinstance(member["tp_split"][0], str)
                and _type_ok(member["tp_split"][1], INTEGER)):
            problem = f"tp_split {member['tp_split']!r} is not [dimension, axis]"
        if problem is None and "ep_split" in member and not (
                _type_ok(member["ep_split"], INTEGER) and member["ep_split"] >= 1 and
                member["tp_split"] is None and bucket.get("over") == "edp"):
            problem = f"ep_split {member['ep_split']!r} is not a degree of an edp bucket"
        if problem is not None:
            problem = f"member {member.get('param') if isinstance(member, dict) else None!r}: " \
                      f"{problem}"
            break
    if problem is not None:
        return [f"malformed ({problem})"]
    problems = []
    try:
        members, numel, padded = bucket["members"], bucket["numel"], bucket["padded"]
        parts, shard = bucket["parts"], bucket["shard"]
        end = 0
        for member in members:
            offset, size = member["offset"], member["numel"]
            count = 1
            for d in member["shape"]:
                count *= d
            if count != size:
                problems.append(f"member {member['param']} has shape {member['shape']} but "
                                f"numel {size}")
            if offset < end:
                problems.append(f"member {member['param']} at offset {offset} overlaps the "
                                f"member before it")
            end = offset + size
        if end > numel:
            problems.append(f"its members end at {end}, past its {numel} elements")
        if padded != shard * parts or padded < numel or shard != shard_numel(numel, parts):
            problems.append(f"{padded} padded elements are not {parts} shards of "
                            f"{shard_numel(numel, parts)} covering {numel}")
    except (KeyError, TypeError) as exc:
        problems.append(f"malformed ({exc})")
    return problems
