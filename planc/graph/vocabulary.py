"""The vocabulary of the communication graph: its enums and the attributes of its nodes
and edges, one place (:mod:`planc.graph.ir` is the module other code imports).

The enums are ``StrEnum`` so that a graph serialises to plain JSON strings and a
value read back compares equal to its member. The groups a transfer names (``Axis``)
and the parts of a group (``Level``) come from the mesh's registry, :mod:`planc.plan.mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from math import ceil
from typing import TYPE_CHECKING, Iterable

from planc.plan.mesh import GROUPS, INTER, INTRA, WHOLE
# Transfer kinds and the groups transfers name are the programs' words too: defined beside
# the programs' streams and routes, and part of the graph's vocabulary.
from planc.program.names import Axis, GraphGroup, Kind  # noqa: F401

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
    MOE = "moe"  # a mixture of experts: router, top-k experts, shared experts
    # schedule { overlap_all_to_all }: the mixture cut at its all-to-alls
    # (planc.passes.split_dispatch): the router and the rows it dispatches, the shared
    # experts, this rank's routed experts on the rows they received, the weighted sum
    MOE_ROUTE = "moe_route"
    MOE_SHARED = "moe_shared"
    MOE_EXPERTS = "moe_experts"
    MOE_COMBINE = "moe_combine"
    MLP_RESIDUAL = "mlp_residual"
    FINAL_LN = "final_ln"
    HEAD = "head"
    LOSS_MAX = "loss_max"  # vocabulary-parallel cross-entropy: the local max logit
    LOSS_SUM_EXP = "loss_sum_exp"  # and the local sum of exponentials
    LOSS = "loss"
    OPTIMIZER = "optimizer"
    # train { grad_clip }: this rank's share of the squared gradient norm, and the clip
    # of every gradient of the stage by the global norm (planc.graph.grad_norm)
    GRAD_NORM = "grad_norm"
    GRAD_CLIP = "grad_clip"
    # model moe { bias_update }: the step's expert loads this rank counted, and the update
    # of the balancing bias by their sum over the stage (planc.graph.router_bias)
    ROUTER_LOAD = "router_load"
    ROUTER_BIAS = "router_bias"


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
    GRAD_NORM = "grad_norm"  # the squared gradient norm, summed over every rank
    # a mixture's (token, expert) rows to the ranks of their experts, and back
    # (schedule { overlap_all_to_all }: planc.passes.split_dispatch)
    COUNTS = "counts"  # the rows each expert gets, exchanged before the dispatch
    DISPATCH = "dispatch"
    COMBINE = "combine"
    ROUTER_LOAD = "router_load"  # a mixture's expert loads, summed over the stage


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
    # a mixture cut at its all-to-alls: what routed its rows (their splits over the ep
    # group, their tokens), and the shared experts' output
    ROUTING = "routing"
    SHARED = "shared"
    # a backward or weight step's forward input, gathered again over tp (shard { tp {
    # gathered_inputs = regather } }): what its forward kept of it was let go
    GATHERED = "gathered"


GRAPH_FORMAT_VERSION = 2
PARAMETER_PORTS = frozenset({Port.PARAM})

# --- the schema ---------------------------------------------------------------------

# The types an attribute may have (a StrEnum: one of its members).
INTEGER = (int,)
NUMBER = (int, float)
# Attributes every node carries, and those of every compute and every transfer node.
COMMON_ATTRIBUTES = {"type": NodeType, "phase": Phase, "stage": INTEGER, "chunk": INTEGER,
                     "repeat": INTEGER, "per_microbatch": (bool,)}
COMPUTE_ATTRIBUTES = {"op": Op, "flops": NUMBER, "bytes": INTEGER, "recompute": (bool,),
                      "params": (list,)}
TRANSFER_ATTRIBUTES = {"kind": Kind, "axis": Axis, "level": Level, "payload": Payload,
                       "bytes": INTEGER, "group_size": INTEGER, "dtype": (str,),
                       "reason": (str,)}
# Attributes a transfer must carry, by what it carries.
PAYLOAD_ATTRIBUTES = {
    Payload.ACTIVATION: {"source_layout": (str,), "target_layout": (str,), "tensor": (str,)},
    Payload.LOSS_STAT: {"reduce_op": (str,)},
    Payload.KV: {"tensor": (str,)},
    Payload.DKV: {"tensor": (str,)},
    Payload.STREAM: {"peer_stage": INTEGER},
    Payload.GRAD: {"bucket": (str,)},
    Payload.PARAM: {"bucket": (str,)},
    Payload.ROUTER_LOAD: {"router_layers": (list,)},
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
    "ring_steps": "ring attention (compute): the cp ring steps it runs per microbatch",
    "ring_bytes": "ring attention (compute): the bytes of the K/V block one shift moves",
    "ring_reason": "ring attention (compute): why its blocks travel the cp ring",
    "experts_over": "a mixture of experts (compute): the ranks of the ep group its experts "
                    "are spread over, which it dispatches tokens to and combines them from",
    "dispatch_bytes": "a mixture of experts (compute): the bytes of its (token, expert) "
                      "rows, which each of its all-to-alls moves at uniform routing",
    "counts_over": "a mixture with a balance loss (compute): the ranks holding parts of each "
                   "sequence (tp x cp), over which its forward all-reduces the loss's "
                   "per-sequence expert counts",
    "counts_bytes": "a mixture with a balance loss (compute): the bytes of those counts",
    "capacity_bytes": "a mixture with a capacity whose sequences lie on several ranks "
                      "(compute): the bytes of one rank's choices and positions, which its "
                      "forward all-gathers over the same ranks",
    "scatter_gather": "pp send/recv with pp_scatter_gather: the tp ranks that each move 1/tp",
    "toward": "pipeline transfers: next or prev, the way the tensor travels along the "
              "stages (forward is next except on the way back of a V)",
    "dim": "the dimension a collective gathers or scatters",
    "producer": "tp redistributions: the operator that produced the tensor",
    "consumer": "tp redistributions: the operator that reads it",
    "collective": "tied reductions and the gradient norm's sum: the name every stage "
                  "gives the collective",
    "max_norm": "the gradient clip (compute): train { grad_clip }, the norm it clips to",
    "router_layers": "the balancing bias's loads, their sum and update: the stage's "
                     "mixture blocks, in order",
    "bias_update": "the balancing bias's update (compute): model moe { bias_update }, the "
                   "step it moves each bias by",
    "hops": "a cut mixture's dispatch and combine (transfers): 2 with optimize "
            "{ moe_dispatcher = two_hop } where the ep group spans nodes",
    "drops_rows": "a cut mixture's experts with model { fp8 } (compute), not recomputed: "
                  "the rows they received go once they have run (their backward reads "
                  "FP8 copies; the combine and the sum read the routing)",
    "recomputes": "transfers of a recomputed forward (R), redoing the forward's in the "
                  "backward: a tp or cp transfer, or a cut mixture's all-to-alls "
                  "(recompute = full), which move the rows the forward's way",
    "regathers": "a tp all-gather of the backward (gathered_inputs = regather): the "
                 "forward's all-gather whose output it makes again for the GEMM's backward",
    "sharded": "optimizer steps: whether they update a ZeRO shard",
    "stream": "placed by the overlap pass: the program stream it runs on",
    "guard": "placed by the overlap pass: 'last' to run on the last microbatch only",
    "placement": "per-step work placed by the overlap pass: block, prologue or epilogue",
    "route": "collectives, placed by the route pass: ring, tree or hierarchical",
    "route_seconds": "collectives: the cost model's time for the route taken",
}


# The types of the OPTIONAL attributes (and of a few more some nodes carry), where present:
# a graph read back from a build is checked against them too.
TEXT = (str,)
SEQUENCE = (list, tuple)
OPTIONAL_TYPES = {
    "forward_of": TEXT, "recompute_of": TEXT, "weight_grad": TEXT, "weight_grad_of": TEXT,
    "tp_input": TEXT, "tp_output": TEXT, "bucket": TEXT, "ring_steps": INTEGER,
    "ring_bytes": INTEGER, "ring_reason": TEXT, "experts_over": INTEGER,
    "dispatch_bytes": INTEGER, "counts_over": INTEGER, "counts_bytes": INTEGER,
    "capacity_bytes": INTEGER,
    "scatter_gather": INTEGER, "toward": TEXT,
    "dim": (str, type(None)), "producer": TEXT, "consumer": TEXT, "collective": TEXT,
    "sharded": (bool,), "stream": TEXT, "placement": TEXT, "route": TEXT,
    "route_seconds": (int, float, type(None)), "tensor": TEXT, "bias": TEXT,
    "recomputed": (bool,), "vocab_parallel": (bool,), "peer_stage": INTEGER,
    "slice_axis": INTEGER, "shape": SEQUENCE, "elements": SEQUENCE,
    "max_norm": NUMBER, "router_layers": SEQUENCE, "bias_update": NUMBER, "hops": INTEGER,
    "recomputes": (bool,), "drops_rows": (bool,), "regathers": TEXT,
}


def buckets(graph: nx.DiGraph) -> dict[str, dict]:
    """The graph's parameter buckets, by id."""
    return graph.graph.setdefault("buckets", {})


def shard_numel(numel: int, parts: int) -> int:
    """A bucket of ``numel`` elements padded so that ``parts`` equal shards cover it."""
    return ceil(numel / parts) if parts > 1 else numel


def node_is(data: dict, kind: Kind, payload: Payload | None = None) -> bool:
    return data["type"] == NodeType.TRANSFER and data["kind"] == kind and \
        (payload is None or data["payload"] == payload)


def is_pipeline_receive(data: dict) -> bool:
    """A receive of the pipeline: it runs on a receive stream of its own, not in a block."""
    return node_is(data, Kind.RECV) and data["axis"] == Axis.PP


def transfers(graph: nx.DiGraph) -> Iterable[tuple[str, dict]]:
    return ((n, d) for n, d in graph.nodes(data=True) if d["type"] == NodeType.TRANSFER)


def coerce(graph: nx.DiGraph) -> nx.DiGraph:
    """Turn the strings of a graph read from JSON back into the schema's enums, in place
    (values that are not members are left for :func:`validate` to report)."""
    node_members = _members_by_value({"type": NodeType, "phase": Phase, "op": Op,
                                      "kind": Kind, "axis": Axis, "level": Level,
                                      "payload": Payload})
    for _, data in graph.nodes(data=True):
        _to_members(data, node_members)
    edge_members = _members_by_value({"kind": EdgeKind, "port": Port})
    for _, _, data in graph.edges(data=True):
        _to_members(data, edge_members)
    return graph


def _members_by_value(enums: dict) -> tuple[tuple[str, dict], ...]:
    """Each attribute's enum as a map from a member's value to the member (what calling
    the enum does, without its machinery: a graph at the limits has a million values)."""
    return tuple((key, {member.value: member for member in enum})
                 for key, enum in enums.items())


def _to_members(data: dict, members: tuple[tuple[str, dict], ...]) -> None:
    for key, by_value in members:
        value = data.get(key)
        if isinstance(value, str):
            member = by_value.get(value)
            if member is not None:
                data[key] = member
