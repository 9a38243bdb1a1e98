"""The typed operands of an instruction: everything the runtime needs to run it.

The compiler decides each of these when it lowers the graph (:mod:`planc.lower.bind`);
the runtime binds them once when a run starts and reads nothing else about the step:
not graph.json, not the plan's layouts. The verifier derives them again from the graph
and refuses a program whose operands differ (docs/programs.md, operands).

Torch-free and networkx-free: the compiler, the verifier, the simulator and the
runtime all import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum

# Ports of an input (planc.graph.ir.Port, as the kernels key their inputs).
PORTS = ("x", "skip", "kv", "max", "sum_exp", "grad", "routing", "shared", "gathered")


class StepKind(StrEnum):
    """Which step of a compute node's life an instruction runs (docs/programs.md,
    operands); its value is the JSON's ``step``."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"  # the forward again, before its backward
    BACKWARD = "backward"
    WEIGHT = "weight"  # the parameter half of a split backward (W)
    OPTIMIZER = "optimizer"
    CLIP = "clip"  # train { grad_clip }: the gradient norm's share, or the clip by it
    ROUTER = "router"  # model moe { bias_update }: the expert loads, or the bias update


STEPS = tuple(kind.value for kind in StepKind)
_STEP_KIND_OF_TEXT = {kind.value: kind for kind in StepKind}
# the steps that run an operator's forward (and its collectives)
FORWARD_STEPS = (StepKind.FORWARD, StepKind.RECOMPUTE)
# The steps that ask autograd for gradients: a whole backward, or either half of a split
# one (its input gradient, B, and its weight gradient, W).
GRADIENT_STEPS = (StepKind.BACKWARD, StepKind.WEIGHT)
PAYLOADS = ("activation", "loss_stat", "loss", "kv", "dkv", "stream", "grad", "param",
            "grad_norm", "router_load", "counts", "dispatch", "combine")
REDUCE_OPS = ("sum", "max")
DIRECTIONS = ("forward", "backward")
SEQ_AXIS, FEATURE_AXIS = 1, 2  # activations are (batch, tokens, features)


def _string(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _integer(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return value


def _boolean(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _one_of(choices):
    def check(value):
        if value not in choices:
            raise ValueError(f"expected one of {list(choices)}, got {value!r}")
        return value
    return check


_port = _one_of(PORTS)


def _step_kind(value) -> StepKind:
    kind = _STEP_KIND_OF_TEXT.get(value) if isinstance(value, str) else None
    if kind is None:
        raise ValueError(f"expected one of {list(STEPS)}, got {value!r}")
    return kind


def _slice(value) -> tuple[str, int]:
    """(dimension name, tensor axis) of a feature or sequence slice."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"a slice is [dimension, axis], not {value!r}")
    return _string(value[0]), _integer(value[1])


def _piece(value) -> tuple[int, int, int]:
    """(index, count, spread) of a piece of the tokens (:func:`token_ranges`)."""
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"a piece of the tokens is [index, count, spread], not {value!r}")
    index, count, spread = (_integer(v) for v in value)
    if not (0 <= index < count and spread >= 1):
        raise ValueError(f"malformed piece of the tokens {value!r}")
    return index, count, spread


def token_ranges(tokens: int, index: int, count: int, spread: int) -> list[tuple[int, int]]:
    """[start, stop) of piece ``index`` of ``count`` over ``tokens`` tokens spread over
    ``spread`` tp ranks: the ``index``-th of ``count`` slices of every rank's share, in rank
    order (what an all-gather over tp of each rank's ``index``-th slice yields;
    planc.passes.tp_overlap)."""
    share = tokens // spread
    size = share // count
    return [(r * share + index * size, r * share + (index + 1) * size) for r in range(spread)]


def _norm_range(value) -> tuple[str, int, int, float]:
    """(bucket, start, end, weight) of a gradient norm's share (Operands.norm_ranges)."""
    if not isinstance(value, list) or len(value) != 4:
        raise ValueError(f"a norm range is [bucket, start, end, weight], not {value!r}")
    start, end, weight = _integer(value[1]), _integer(value[2]), _number(value[3])
    if not 0 <= start < end or not 0 < weight <= 1:
        raise ValueError(f"malformed norm range {value!r}")
    return _string(value[0]), start, end, float(weight)


def _tuple_of(check):
    def convert(value):
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return tuple(check(v) for v in value)
    return convert


def _pairs_of(check):
    """An object as sorted (key, value) pairs: hashable, comparable."""
    def convert(value):
        if not isinstance(value, dict):
            raise ValueError(f"expected an object, got {value!r}")
        return tuple(sorted((_string(k), check(v)) for k, v in value.items()))
    return convert


@dataclass(frozen=True)
class Input:
    """One value an instruction reads, and how it takes it."""

    buffer: str  # the producing instruction's buffer
    port: str = "x"  # the kernel's argument it feeds
    per_microbatch: bool = True  # the buffer holds one value per microbatch
    grad_of: str | None = None  # a backward step's output: the gradient of that port
    local_slice: tuple[str, int] | None = None  # (dim, axis): this tp rank's slice
    # tp_overlap: the piece of the tokens it takes of the buffer (index, count, spread)
    tokens: tuple[int, int, int] | None = None
    # tp_overlap: the buffer is that piece of ``piece_of``'s value; the consumer puts the
    # pieces of one value back together in token order
    piece: tuple[int, int, int] | None = None
    piece_of: str | None = None

    def to_json(self) -> dict:
        item: dict = {"buffer": self.buffer}
        if self.port != "x":
            item["port"] = self.port
        if not self.per_microbatch:
            item["per_microbatch"] = False
        if self.grad_of is not None:
            item["grad_of"] = self.grad_of
        if self.local_slice is not None:
            item["local_slice"] = list(self.local_slice)
        for key in ("tokens", "piece"):
            if getattr(self, key) is not None:
                item[key] = list(getattr(self, key))
        if self.piece_of is not None:
            item["piece_of"] = self.piece_of
        return item

    @staticmethod
    def from_json(item) -> "Input":
        if not isinstance(item, dict) or not _INPUT_KEYS.issuperset(item):
            raise ValueError(f"malformed input {item!r}")
        grad_of, local = item.get("grad_of"), item.get("local_slice")
        if ("piece" in item) != ("piece_of" in item):
            raise ValueError(f"a piece names the value it is a piece of: {item!r}")
        tokens, piece, piece_of = item.get("tokens"), item.get("piece"), item.get("piece_of")
        return Input(_string(item["buffer"]), _port(item.get("port", "x")),
                     _boolean(item.get("per_microbatch", True)),
                     None if grad_of is None else _port(grad_of),
                     None if local is None else _slice(local),
                     None if tokens is None else _piece(tokens),
                     None if piece is None else _piece(piece),
                     None if piece_of is None else _string(piece_of))


_INPUT_KEYS = frozenset({"buffer", "port", "per_microbatch", "grad_of", "local_slice",
                         "tokens", "piece", "piece_of"})


def _inputs(value) -> tuple[Input, ...]:
    if not isinstance(value, list):
        raise ValueError(f"inputs must be a list, not {value!r}")
    return tuple(Input.from_json(item) for item in value)


def _maybe(check):
    return lambda value: None if value is None else check(value)


@dataclass(frozen=True)
class Operands:
    """The operands of one compute or transfer instruction; unused ones keep their
    defaults and are left out of the JSON."""

    inputs: tuple[Input, ...] = ()
    # --- compute ---
    kernel: str | None = None  # the operator (planc.graph.ir.Op's value)
    step: StepKind | None = None
    layer: int | None = None
    params: tuple[str, ...] = ()  # global parameter names, in the kernel's order
    param_slices: tuple[tuple[str, tuple[str, int]], ...] = ()  # name -> (dim, axis)
    bias: str | None = None  # a row-parallel producer's bias, added after its reduction
    vocab_parallel: bool = False
    seq_sharded: bool = False  # the input holds this tp rank's slice of the tokens
    replicated: bool = False  # every tp rank holds the whole input
    forward_of: str | None = None  # a backward or recomputed step's forward step
    saved_from: str | None = None  # the step whose kept tensors a backward step uses
    keeps_graph: bool = True  # a forward keeps autograd's graph (not when recomputed)
    # a recomputed forward: the input ports its recomputation takes from what it kept
    # (the others the program brings the recomputation again); None: every port
    keeps_inputs: tuple[str, ...] | None = None
    weight_step: str | None = None  # a split backward: its W step, which comes later
    gathered: tuple[tuple[str, str], ...] = ()  # bucket -> the ZeRO-3 gather's buffer
    tokens: tuple[int, int, int] | None = None  # tp_overlap: the piece of the tokens it runs
    flops: float | None = None  # what it computes, for the cost model (simulator, Chakra)
    output_bytes: int | None = None  # its output's size: the roofline's memory traffic
    # --- compute (optimizer) and transfers of gradients and parameters ---
    bucket: str | None = None
    sharded: bool = False  # the optimizer updates the rank's shard of the bucket
    # --- transfers ---
    payload: str | None = None
    group: str | None = None  # a group reference of programs/groups.json
    route: str | None = None  # a route recipe's kind (programs/routes.json); None: native
    reduce_op: str | None = None
    source_dim: str | None = None  # an activation's sharded dimension before and after
    target_dim: str | None = None
    # ring attention (a compute step): its cp ring steps; its group is ``group`` and the
    # bytes of the K/V block one shift moves ``bytes``. A ring step posts the shift of the
    # block in hand (send to the next cp rank, receive from the previous) before it
    # computes on that block, and waits for the shift after.
    ring_steps: int | None = None
    # a mixture's balance loss (a compute step): the group over which its forward sums the
    # per-(sequence, expert) counts (all-reduce; the ranks holding parts of each sequence)
    # and the bytes of those counts
    counts_group: str | None = None
    counts_bytes: int | None = None
    # ... and, with model moe { capacity }, the bytes of this rank's choices and positions
    # its forward all-gathers over the same group
    capacity_bytes: int | None = None
    peer_stage: int | None = None  # a pipeline transfer's other stage
    direction: str | None = None  # forward or backward: which pipeline group
    partner: str | None = None  # a pipeline send's receive on the peer stage (traces)
    shape: tuple[int, ...] = ()  # what a pipeline receive receives
    elements: tuple[int, ...] = ()  # [start, end) of a bucket's gradient: a tp sum
    tensor: str | None = None  # a parameter whose gradient slices are gathered
    dim: str | None = None
    slice_axis: int | None = None
    into_bucket: bool = False  # a parameter gather after the optimizer: into the bucket
    # a ZeRO-1 gradient all-reduce (shard { dp { grad_reduce = all_reduce } }): the
    # whole bucket summed, then the rank's shard of the sum kept
    into_shard: bool = False
    bytes: int | None = None
    # train { grad_clip } (planc.graph.grad_norm): the ranges of the stage's buckets whose
    # squares a rank's share of the norm sums, as (bucket, start, end, weight) over the
    # whole bucket (a ZeRO shard sums its part of them), and the norm the clip clips to
    norm_ranges: tuple[tuple[str, int, int, float], ...] = ()
    max_norm: float | None = None
    # model moe { bias_update } (planc.graph.router_bias): the stage's mixture blocks whose
    # expert loads a rank counts, sums and updates the balancing bias of, and the step
    # each bias moves by
    router_layers: tuple[int, ...] = ()
    bias_update: float | None = None
    # a cut mixture's dispatch and combine in two hops, over the network once per node
    # then inside it (optimize { moe_dispatcher = two_hop }: planc.passes.split_dispatch)
    hops: int | None = None
    # a cut mixture's experts with model { fp8 }: after their forward the received rows'
    # bytes go (they keep FP8 copies for their backward; later steps read the routing)
    drops_rows: bool = False

    def to_json(self) -> dict:
        out: dict = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name == "inputs":
                value = [i.to_json() for i in value]
            elif f.name in ("param_slices", "gathered"):
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value}
            elif f.name == "norm_ranges":
                value = [list(item) for item in value]
            elif f.name == "step":
                value = str(value)  # its text: the member serialises as the string it is
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @staticmethod
    def from_json(data) -> "Operands":
        if not isinstance(data, dict):
            raise ValueError(f"operands must be an object, not {data!r}")
        if not _READERS.keys() >= data.keys():
            raise ValueError(f"operands with unknown keys {sorted(set(data) - set(_READERS))}")
        return Operands(**{key: _READERS[key](value) for key, value in data.items()})


_READERS = {
    "inputs": _inputs, "kernel": _maybe(_string), "step": _maybe(_step_kind),
    "layer": _maybe(_integer), "params": _tuple_of(_string),
    "param_slices": _pairs_of(_slice), "bias": _maybe(_string),
    "vocab_parallel": _boolean, "seq_sharded": _boolean, "replicated": _boolean,
    "forward_of": _maybe(_string), "saved_from": _maybe(_string),
    "keeps_graph": _boolean, "keeps_inputs": _maybe(_tuple_of(_string)),
    "weight_step": _maybe(_string),
    "gathered": _pairs_of(_string), "tokens": _maybe(_piece), "flops": _maybe(_number),
    "output_bytes": _maybe(_integer), "bucket": _maybe(_string), "sharded": _boolean,
    "payload": _maybe(_one_of(PAYLOADS)), "group": _maybe(_string), "route": _maybe(_string),
    "reduce_op": _maybe(_one_of(REDUCE_OPS)), "source_dim": _maybe(_string),
    "target_dim": _maybe(_string), "ring_steps": _maybe(_integer),
    "counts_group": _maybe(_string), "counts_bytes": _maybe(_integer),
    "capacity_bytes": _maybe(_integer),
    "peer_stage": _maybe(_integer), "direction": _maybe(_one_of(DIRECTIONS)),
    "partner": _maybe(_string),
    "shape": _tuple_of(_integer), "elements": _tuple_of(_integer),
    "tensor": _maybe(_string), "dim": _maybe(_string), "slice_axis": _maybe(_integer),
    "into_bucket": _boolean, "into_shard": _boolean, "bytes": _maybe(_integer),
    "norm_ranges": _tuple_of(_norm_range), "max_norm": _maybe(_number),
    "router_layers": _tuple_of(_integer), "bias_update": _maybe(_number),
    "hops": _maybe(_integer), "drops_rows": _boolean,
}
