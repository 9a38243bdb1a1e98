"""The typed schema of the communication graph: every node and edge attribute, one place.

Every stage after the derivation reads and writes a ``networkx.DiGraph`` whose nodes
and edges follow this module. Meaning lives in attributes, never in node ids: a
backward step names its forward step in ``forward_of``, a recomputed step in
``recompute_of``, a transfer says what it carries in ``payload`` and over which group
in ``axis`` and ``level``. :func:`validate` checks a graph against the schema; the
tests run it after every pass, and ``planc`` runs it on every graph it reads.

The enums are ``StrEnum`` so that a graph serialises to plain JSON strings and a
value read back compares equal to its member.

Node kinds (``type``):

- compute: one operator of one chunk, forward (F), backward (B) or recomputed (R),
  or an optimizer step over one bucket of parameters (O);
- transfer: a collective over a group, or one side of a point-to-point transfer.

Parameters live in *buckets* (``graph.graph["buckets"]``): flat buffers holding one or
more parameters at fixed offsets, padded so that a ZeRO shard is an equal slice of the
bucket, as in Megatron-LM's param-and-grad buffer. The derivation makes one bucket per
parameter; the fuse pass merges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from math import ceil, inf
from typing import TYPE_CHECKING, Any, Iterable

from planc.mesh import GROUPS, INTER, INTRA, WHOLE

if TYPE_CHECKING:  # the schema itself is light: the command line reads its enums
    import networkx as nx


class NodeType(StrEnum):
    COMPUTE = "compute"
    TRANSFER = "transfer"


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Op(StrEnum):
    """The operators of every model family (planc.models), and the optimizer step."""

    EMBEDDING = "embedding"
    POSITION = "position"
    LN1 = "ln1"
    QKV = "qkv"
    ATTENTION = "attention"
    PROJ = "proj"
    ATTN_RESIDUAL = "attn_residual"
    LN2 = "ln2"
    FC1 = "fc1"
    GELU = "gelu"
    SWIGLU = "swiglu"  # llama: silu(gate) * up
    FC2 = "fc2"
    MLP_RESIDUAL = "mlp_residual"
    FINAL_LN = "final_ln"
    HEAD = "head"
    LOSS_MAX = "loss_max"  # vocabulary-parallel cross-entropy: the local max logit
    LOSS_SUM_EXP = "loss_sum_exp"  # and the local sum of exponentials
    LOSS = "loss"
    OPTIMIZER = "optimizer"


class Kind(StrEnum):
    """Transfer kinds: the collectives of semantics section 3, and point to point."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"

    @property
    def is_collective(self) -> bool:
        return self not in (Kind.SEND, Kind.RECV)


class Payload(StrEnum):
    """What a transfer carries; with the kind, it says how the runtime executes it."""

    ACTIVATION = "activation"  # a tp redistribution of an activation or its gradient
    LOSS_STAT = "loss_stat"  # max or sum of exponentials per token (vocab-parallel loss)
    LOSS = "loss"  # the step's loss, summed over the last stage for the report
    KV = "kv"  # keys and values over cp
    DKV = "dkv"  # their gradients over cp
    STREAM = "stream"  # the residual stream (or its gradient) between pipeline stages
    GRAD = "grad"  # parameter gradients: one bucket, or one parameter's tp fix-up
    PARAM = "param"  # parameters: one bucket gathered from its ZeRO shards


class GraphGroup(StrEnum):
    """What every group the graph names knows of itself, from planc.mesh's registry."""

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes along which members of one group differ (``tied`` is the first
        and last stage, ``stage`` every rank of a stage)."""
        return GROUPS[self.value].axes

    @property
    def within_stage(self) -> bool:
        """Every member of a group runs the same program (the group lies in one stage)."""
        return GROUPS[self.value].within_stage


# Groups of the graph, one member per group of planc.mesh.GROUPS that transfers name:
# TP, CP and PP (the mesh axes); DP_CP, the ranks holding replicas of a parameter
# (dp x cp), over which gradients are reduced; TIED, the first and last stage sharing a
# tied embedding; STAGE, every rank of a stage. A new axis is a new registry entry.
Axis = GraphGroup("Axis", [(name.upper(), name) for name, kind in GROUPS.items()
                           if kind.in_graph], module=__name__)


class Level(StrEnum):
    """Which part of a group a collective runs on: all of it, the members on the
    caller's node, or one member per node (the sub-groups of a hierarchical route)."""

    WHOLE = WHOLE
    INTRA = INTRA
    INTER = INTER


@dataclass(frozen=True)
class GroupRef:
    """A group as a transfer names it: an axis and a level."""

    axis: Axis
    level: Level = Level.WHOLE

    def __str__(self) -> str:
        return self.axis.value if self.level == Level.WHOLE else \
            f"{self.axis.value}/{self.level.value}"

    @staticmethod
    def parse(text: str) -> "GroupRef":
        axis, _, level = text.partition("/")
        return GroupRef(Axis(axis), Level(level) if level else Level.WHOLE)

    @staticmethod
    def of(data: dict) -> "GroupRef":
        return GroupRef(Axis(data["axis"]), Level(data.get("level", Level.WHOLE)))


class EdgeKind(StrEnum):
    DATA = "data"  # the consumer reads the producer's value
    SAVED = "saved"  # a backward (or recomputed) step uses what a forward step kept
    ORDER = "order"  # issue after, no value: placed by the overlap pass


class Port(StrEnum):
    """The input of a consumer that an edge feeds."""

    X = "x"
    SKIP = "skip"  # the residual connection
    KV = "kv"
    MAX = "max"
    SUM_EXP = "sum_exp"
    GRAD = "grad"
    PARAM = "param"


GRAPH_FORMAT_VERSION = 2
PARAMETER_PORTS = frozenset({Port.PARAM})

# --- the schema ---------------------------------------------------------------------

_INT = (int,)
_NUMBER = (int, float)
_COMMON = {"type": NodeType, "phase": Phase, "stage": _INT, "chunk": _INT, "repeat": _INT,
           "per_microbatch": (bool,)}
_COMPUTE = {"op": Op, "flops": _NUMBER, "bytes": _INT, "recompute": (bool,),
            "params": (list,)}
_TRANSFER = {"kind": Kind, "axis": Axis, "level": Level, "payload": Payload, "bytes": _INT,
             "group_size": _INT, "dtype": (str,), "reason": (str,)}
# Attributes a transfer must carry, by what it carries.
_PAYLOAD_ATTRIBUTES = {
    Payload.ACTIVATION: {"source_layout": (str,), "target_layout": (str,), "tensor": (str,)},
    Payload.LOSS_STAT: {"reduce_op": (str,)},
    Payload.KV: {"tensor": (str,)},
    Payload.DKV: {"tensor": (str,)},
    Payload.STREAM: {"peer_stage": _INT},
    Payload.GRAD: {"bucket": (str,)},
    Payload.PARAM: {"bucket": (str,)},
}
OPTIONAL = {
    "layer": "the transformer layer, or None outside the layers",
    "forward_of": "B and R nodes: the forward node whose output they differentiate or redo",
    "recompute_of": "B nodes whose forward is recomputed: the R node that redoes it",
    "weight_grad": "B nodes split by the overlap pass: the W node computing their weight "
                   "gradients (the B node computes the input gradients only)",
    "weight_grad_of": "W nodes: the B node whose weight gradients they compute",
    "tp_input": "compute: the operator's input layout over tp",
    "tp_output": "compute: its output layout over tp",
    "bucket": "GRAD and PARAM transfers and optimizer steps: the bucket they work on",
    "ring_steps": "cp ring shifts: how many times the shift runs per microbatch",
    "peer": "cp ring shifts: next or prev",
    "dim": "the dimension a collective gathers or scatters",
    "producer": "tp redistributions: the operator that produced the tensor",
    "consumer": "tp redistributions: the operator that reads it",
    "collective": "tied reductions: the name both stages give the collective",
    "sharded": "optimizer steps: whether they update a ZeRO shard",
    "stream": "placed by the overlap pass: the program stream it runs on",
    "guard": "placed by the overlap pass: 'last' to run on the last microbatch only",
    "placement": "per-step work placed by the overlap pass: block, prologue or epilogue",
    "route": "collectives, placed by the route pass: ring, tree or hierarchical",
    "route_seconds": "collectives: the cost model's time for the route taken",
}


# The types of the OPTIONAL attributes (and of a few more some nodes carry), where present:
# a graph read back from a build is checked against them too.
_STR = (str,)
_SEQUENCE = (list, tuple)
_OPTIONAL_TYPES = {
    "forward_of": _STR, "recompute_of": _STR, "weight_grad": _STR, "weight_grad_of": _STR,
    "tp_input": _STR, "tp_output": _STR, "bucket": _STR, "ring_steps": _INT, "peer": _STR,
    "dim": (str, type(None)), "producer": _STR, "consumer": _STR, "collective": _STR,
    "sharded": (bool,), "stream": _STR, "placement": _STR, "route": _STR,
    "route_seconds": (int, float, type(None)), "tensor": _STR, "bias": _STR,
    "recomputed": (bool,), "vocab_parallel": (bool,), "peer_stage": _INT,
    "slice_axis": _INT, "shape": _SEQUENCE, "elements": _SEQUENCE,
}


def _optional_problem(data: dict) -> str | None:
    """What is wrong with a node's optional attributes, or None."""
    bad = [key for key, expected in _OPTIONAL_TYPES.items()
           if key in data and not _type_ok(data[key], expected)]
    if bad:
        return f"invalid {', '.join(bad)}"
    seconds = data.get("route_seconds")
    if seconds is not None and not 0 <= seconds < inf:
        return f"route_seconds {seconds!r} is not a time"
    for key in ("shape", "elements"):
        if key in data and not all(_type_ok(x, _INT) and x >= 0 for x in data[key]):
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


def buckets(graph: nx.DiGraph) -> dict[str, dict]:
    """The graph's parameter buckets, by id."""
    return graph.graph.setdefault("buckets", {})


def shard_numel(numel: int, parts: int) -> int:
    """A bucket of ``numel`` elements padded so that ``parts`` equal shards cover it."""
    return ceil(numel / parts) if parts > 1 else numel


def node_is(data: dict, kind: Kind, payload: Payload | None = None) -> bool:
    return data["type"] == NodeType.TRANSFER and data["kind"] == kind and \
        (payload is None or data["payload"] == payload)


def transfers(graph: nx.DiGraph) -> Iterable[tuple[str, dict]]:
    return ((n, d) for n, d in graph.nodes(data=True) if d["type"] == NodeType.TRANSFER)


def coerce(graph: nx.DiGraph) -> nx.DiGraph:
    """Turn the strings of a graph read from JSON back into the schema's enums, in place
    (values that are not members are left for :func:`validate` to report)."""
    node_enums = {"type": NodeType, "phase": Phase, "op": Op, "kind": Kind, "axis": Axis,
                  "level": Level, "payload": Payload}
    for _, data in graph.nodes(data=True):
        _to_members(data, node_enums)
    for _, _, data in graph.edges(data=True):
        _to_members(data, {"kind": EdgeKind, "port": Port})
    return graph


def _to_members(data: dict, enums: dict) -> None:
    for key, enum in enums.items():
        value = data.get(key)
        if isinstance(value, str) and not isinstance(value, enum):
            try:
                data[key] = enum(value)
            except ValueError:
                pass


def _type_ok(value: Any, expected) -> bool:
    if isinstance(expected, type) and issubclass(expected, StrEnum):
        return isinstance(value, expected)
    if isinstance(value, bool) and bool not in expected:
        return False
    return isinstance(value, expected)


def validate(graph: nx.DiGraph, *, microbatches: int | None = None,
             stages: int | None = None, layers: int | None = None,
             chunks: int | None = None, limit: int = 20) -> list[str]:
    """Problems of ``graph`` against the schema (empty when it is well formed).

    Checks every node's required attributes and their types, the payload's own
    attributes, edges (known kinds and ports, parameter edges from PARAM gathers,
    ``forward_of`` and ``bucket`` references), buckets (members inside their bucket
    and disjoint, padding to whole shards) and that the graph is acyclic. The optional
    bounds come from the plan the graph belongs to.
    """
    problems: list[str] = []

    def report(text: str) -> bool:
        if len(problems) < limit:
            problems.append(text)
        return len(problems) < limit

    table = buckets(graph) if "buckets" in graph.graph else {}
    for node, data in graph.nodes(data=True):
        kind = data.get("type")
        if not isinstance(kind, NodeType):
            if not report(f"node {node!r}: type {kind!r} is not compute or transfer"):
                return problems
            continue
        required = {**_COMMON, **(_COMPUTE if kind == NodeType.COMPUTE else _TRANSFER)}
        if kind == NodeType.TRANSFER and isinstance(data.get("payload"), Payload):
            required.update(_PAYLOAD_ATTRIBUTES.get(data["payload"], {}))
        bad = [key for key, expected in required.items()
               if not _type_ok(data.get(key), expected if isinstance(expected, tuple)
                               or not isinstance(expected, type) else expected)]
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
        if layer is not None and (not _type_ok(layer, _INT) or layer < 0 or
                                  (layers is not None and layer >= layers)):
            report(f"node {node!r}: layer {layer!r} is not a layer of the model")
        if stages is not None and not 0 <= data["stage"] < stages:
            report(f"node {node!r}: stage {data['stage']} is not a pipeline stage")
        elif chunks is not None and stages is not None and not (
                0 <= data["chunk"] < chunks and data["chunk"] % stages == data["stage"]):
            report(f"node {node!r}: chunk {data['chunk']} is not a model chunk of stage "
                   f"{data['stage']} (chunk c runs on stage c mod {stages})")
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
_BUCKET_FIELDS = {"stage": _INT, "chunk": _INT, "dtype": _STR, "members": _SEQUENCE,
                  "numel": _INT, "parts": _INT, "shard": _INT, "padded": _INT,
                  "sharded": (bool,), "zero3": (bool,), "tp_sum_numel": _INT, "tied": (bool,),
                  "reason": _STR}
_MEMBER_FIELDS = {"param": _STR, "offset": _INT, "numel": _INT, "shape": _SEQUENCE,
                  "full_shape": _SEQUENCE, "tp_split": (list, tuple, type(None)),
                  "layer": (int, type(None))}


def _fields_problem(item, fields: dict) -> str | None:
    if not isinstance(item, dict):
        return f"{type(item).__name__}, not an object"
    bad = [key for key, expected in fields.items()
           if key not in item or not _type_ok(item[key], expected)]
    if bad:
        return f"missing or invalid {', '.join(bad)}"
    negative = [key for key, expected in fields.items() if expected == _INT and item[key] < 0]
    if negative:
        return f"negative {', '.join(negative)}"
    return None


_PASS_FIELDS = {"name": _STR, "enabled": (bool,), "line": _STR, "changes": _SEQUENCE,
                "decisions": _SEQUENCE}
_ROUTE_DECISION_FIELDS = {"node": _STR, "route": _STR, "why": _STR, "placements": _SEQUENCE,
                          "candidates": _SEQUENCE}
_CANDIDATE_FIELDS = {"route": _STR, "seconds": (int, float, type(None)), "reason": _STR}


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
    for member in bucket["members"] if problem is None else ():
        problem = _fields_problem(member, _MEMBER_FIELDS)
        if problem is None and not all(_type_ok(d, _INT) and d >= 0 for d in
                                       (*member["shape"], *member["full_shape"])):
            problem = "a shape that is not a list of sizes"
        if problem is None and member["tp_split"] is not None and not (
                len(member["tp_split"]) == 2 and isinstance(member["tp_split"][0], str)
                and _type_ok(member["tp_split"][1], _INT)):
            problem = f"tp_split {member['tp_split']!r} is not [dimension, axis]"
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
