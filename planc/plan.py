"""The validated plan: every default applied, every unit converted, every rule checked.

A :class:`Plan` is what every later stage takes as input. It is immutable, holds only
plain values in SI units (bytes, bytes per second, seconds, FLOP per second), and
remembers where the user wrote each setting (:class:`Sources`) so that any stage can
point back at the right line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from planc.diagnostics import Span
from planc.mesh import AXES, is_axis_order
from planc.schedules import DEFAULT_SCHEDULE

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Model:
    """The model block: its family (planc.models) and that family's keys.

    The fields are those of plan.json version 1: the common keys, then ``kv_heads``,
    ``rope_theta`` and ``norm_eps``, which are llama's (gpt has one k and v head per
    head) but which version 1 writes for every family. A family's other keys are held in
    ``options`` and read as attributes (``model.experts``); plan.json holds ``options``
    only when there are some, so that earlier plans' plan.json stay as they were."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    dtype: str = "fp32"
    tie_embeddings: bool = False
    family: str = "gpt"
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    options: Mapping[str, Any] = field(default_factory=dict, hash=False,
                                       metadata={"omitted_when_empty": True})

    @staticmethod
    def of(family: str, keys: Mapping[str, Any]) -> "Model":
        """The model of family ``family`` with ``keys`` (a model block's values): those
        plan.json version 1 has a field for as fields, the others as options."""
        fields = {f.name for f in dataclasses.fields(Model)} - {"family", "options"}
        return Model(family=family, **{k: v for k, v in keys.items() if k in fields},
                     options={k: v for k, v in keys.items() if k not in fields})

    def __getattr__(self, name: str) -> Any:
        # Called only for names that are not fields: a family's own keys.
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"model {self.__dict__.get('family')} has no key {name!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def key_value_heads(self) -> int:
        """Heads of k and v: ``kv_heads`` under grouped-query attention, else one per
        query head."""
        return self.kv_heads or self.heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Mesh:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    order: tuple[str, ...] = AXES  # fastest-varying axis first

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def sizes(self) -> dict[str, int]:
        """Degree by axis, in the canonical order of planc.mesh.AXES."""
        return {axis: self.size(axis) for axis in AXES}

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())


@dataclass(frozen=True)
class Device:
    flops: float  # peak FLOP/s at the model's dtype
    memory: float | None  # bytes; None when the topology does not say
    efficiency: float = 0.5  # achievable fraction of peak
    bandwidth: float = 1e12  # memory bytes/s, for operators bound by memory traffic


@dataclass(frozen=True)
class Tuning:
    """What a backend achieves for one collective on a link, as ``planc calibrate``
    measured it: its bus bandwidth and the fixed cost of a call (the base latency per
    algorithm of NCCL's tuning model, src/graph/tuning.cc)."""

    kind: str  # all_reduce, reduce_scatter, all_gather
    bandwidth: float  # bytes/s, bus bandwidth (nccl-tests' convention)
    latency: float  # seconds per call, beside the link's latency per step


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per message (one step of a ring, one hop of a tree)
    collectives: tuple[Tuning, ...] = ()  # measured figures per collective, if any

    def tuning(self, kind: str) -> Tuning | None:
        return next((t for t in self.collectives if t.kind == kind), None)


@dataclass(frozen=True)
class Topology:
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    preset: str | None = None

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node


@dataclass(frozen=True)
class TensorParallel:
    """shard { tp { } }: how each placement slot of a pre-norm decoder block is split
    over tp (Megatron-LM, Shoeybi et al. 2019). A family's operators name the slot that
    places them (planc.models.family.OpRule.placement: llama's q, k and v are ``qkv``)
    and the values each slot may take (Family.placements)."""

    embedding: str = "vocab"
    qkv: str = "column"
    proj: str = "row"
    fc1: str = "column"
    fc2: str = "row"
    head: str = "vocab"
    sequence_parallel: bool = False


@dataclass(frozen=True)
class ContextParallel:
    attention: str = "allgather"
    load_balance: bool = True


@dataclass(frozen=True)
class PipelineParallel:
    """Model chunks as inclusive layer ranges; chunk c runs on pipeline rank c % pp.

    With ``virtual`` = 1 there is one chunk per stage. With ``virtual`` = v the model
    is cut into pp * v chunks assigned round-robin, as in Megatron's interleaved
    schedule (Narayanan et al., SC'21, section 2.2). The chunks may differ in size; the
    first and last may be empty, the embedding or head alone (planc.schedules.layers).
    """

    chunks: tuple[tuple[int, int], ...]
    virtual: int = 1
    auto: bool = True

    def chunk_layers(self, chunk: int) -> int:
        first, last = self.chunks[chunk]
        return last - first + 1

    def layers_of_stage(self, stage: int, pp: int) -> tuple[int, ...]:
        return tuple(layer for first, last in self.chunks[stage::pp]
                     for layer in range(first, last + 1))


@dataclass(frozen=True)
class DataParallel:
    zero: int = 0


@dataclass(frozen=True)
class Shard:
    tp: TensorParallel
    cp: ContextParallel
    pp: PipelineParallel
    dp: DataParallel


@dataclass(frozen=True)
class Schedule:
    microbatches: int = 1
    pipeline: str = DEFAULT_SCHEDULE  # a name of planc.schedules.SCHEDULES


@dataclass(frozen=True)
class Optimize:
    fuse: bool = True
    bucket: float = 25e6  # bytes
    route: str = "auto"
    overlap: bool = True
    recompute: str = "none"


@dataclass(frozen=True)
class Optimizer:
    """torch.optim.SGD or torch.optim.AdamW hyper-parameters."""

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class Train:
    steps: int = 1
    optimizer: Optimizer = Optimizer()
    seed: int = 0
    data: str = "synthetic"  # or the path of a file of little-endian uint16 tokens


@dataclass(frozen=True)
class Sources:
    """Where each setting was written: dotted key path (``mesh.tp``) to span (a span of
    an overridden key lies in its override's Source), and the ``--set KEY=VALUE``
    overrides applied, as given, in order."""

    path: str
    spans: Mapping[str, Span] = field(default_factory=dict, compare=False, hash=False)
    overrides: tuple[str, ...] = ()

    def span(self, *keys: str) -> Span | None:
        """The span of the first of ``keys`` that the user wrote."""
        for key in keys:
            if key in self.spans:
                return self.spans[key]
        return None


@dataclass(frozen=True)
class Plan:
    name: str
    model: Model
    mesh: Mesh
    topology: Topology
    shard: Shard
    schedule: Schedule
    optimize: Optimize
    train: Train
    sources: Sources = field(default=Sources(""), compare=False)

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch on one data-parallel rank."""
        return self.model.batch // self.mesh.dp // self.schedule.microbatches

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``plan.json`` of a build directory)."""
        body = {f.name: json_form(getattr(self, f.name))
                for f in dataclasses.fields(self) if f.name not in ("name", "sources")}
        spans = {key: [s.line, s.column, s.end_line, s.end_column]
                 for key, s in sorted(self.sources.spans.items())}
        return {"version": PLAN_FORMAT_VERSION, "name": self.name, **body,
                "sources": {"path": self.sources.path, "spans": spans}}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`. Strict: raises ValueError naming the field when a
        field is missing, unknown, of the wrong type, or inconsistent with the others."""
        if not isinstance(data, Mapping):
            raise ValueError("the plan is not a JSON object")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(f"unsupported plan format version {data.get('version')!r}")
        body = {k: v for k, v in data.items() if k != "version"}
        sources = body.pop("sources", None)
        if not isinstance(sources, Mapping) or not isinstance(sources.get("path"), str) or \
                not isinstance(sources.get("spans"), Mapping):
            raise ValueError("plan.sources must hold a path and spans")
        try:
            spans = {str(k): Span(*v) for k, v in sources["spans"].items()}
        except TypeError:
            raise ValueError("plan.sources.spans holds a malformed span") from None
        plan = _build(Plan, body, "plan", skip=("sources",))
        plan = dataclasses.replace(plan, sources=Sources(sources["path"], spans))
        _check_types(plan)
        _check_values(plan)
        _check_consistency(plan)
        return plan

def json_form(section: Any) -> dict[str, Any]:
    """A section's asdict() form without its fields that plan.json omits when empty (a
    model's options): how plan.json and a checkpoint's manifest write a section."""
    body = dataclasses.asdict(section)
    for f in dataclasses.fields(section):
        if f.metadata.get("omitted_when_empty") and not body[f.name]:
            del body[f.name]
    return body


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations, evaluated (once per class: reading a plan.json
    walks every section three times)."""
    return typing.get_type_hints(cls)


def _check_types(value: Any, where: str = "plan") -> None:  # noqa: C901
    """Check every field of a dataclass tree against its annotation."""
    hints = _field_types(type(value))
    for f in dataclasses.fields(value):
        item, hint = getattr(value, f.name), hints[f.name]
        path = f"{where}.{f.name}"
        if dataclasses.is_dataclass(item):
            _check_types(item, path)
            continue
        if not _matches(item, hint):
            raise TypeError(f"{path} has the wrong type ({type(item).__name__})")
        if isinstance(item, int) and not isinstance(item, bool) and f.name in _COUNTS \
                and item < 1:
            raise ValueError(f"{path} must be at least 1, got {item}")


_COUNTS = {"layers", "hidden", "heads", "ffn", "vocab", "seq", "batch", "tp", "cp", "pp", "dp",
           "nodes", "devices_per_node", "virtual", "microbatches", "steps"}


def _matches(item: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_matches(item, a) for a in args)
    if origin is tuple:
        if not isinstance(item, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(x, args[0]) for x in item)
        return len(item) == len(args) and all(_matches(x, a) for x, a in zip(item, args))
    if origin is not None:  # Mapping and the like: trust the container
        return isinstance(item, origin)
    if hint is type(None):
        return item is None
    if hint is float:
        return isinstance(item, (int, float)) and not isinstance(item, bool)
    if hint is int:
        return isinstance(item, int) and not isinstance(item, bool)
    return isinstance(item, hint)


def _build(cls, data: Any, where: str, skip: tuple[str, ...] = ()) -> Any:
    """A dataclass from its asdict() form, every field required and none unknown."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} is not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [name for name in fields if name not in data and name not in skip
               and not fields[name].metadata.get("omitted_when_empty")]
    unknown = [name for name in data if name not in fields]
    if missing or unknown:
        raise ValueError(f"{where} has " + ", ".join(
            ([f"no {', '.join(missing)}"] if missing else [])
            + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    hints = _field_types(cls)
    values = {}
    for name in fields:
        if name in skip or name not in data:
            continue
        values[name] = _convert(data[name], hints[name], f"{where}.{name}")
    return cls(**values)  # skipped fields take their defaults


def _convert(value: Any, hint: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} is not a list")
        args = typing.get_args(hint)
        inner = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(inner) != len(value):
            raise ValueError(f"{where} should hold {len(inner)} items")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, inner)))
    return value


# planc's limits (docs/language.md, "Limits"): checked by planc check, and again when a
# build's plan.json is read, since a build directory is untrusted input.
LIMITS = {"world": 524_288, "layers": 1_024, "microbatches": 65_536, "schedule": 131_072}
# Floats that must be above 0; every other float must be 0 or more. None is finite.
_POSITIVE = {"flops", "bandwidth", "efficiency", "lr", "eps", "memory", "norm_eps",
             "rope_theta"}


def _real(hint: Any) -> bool:
    """Whether a field annotated ``hint`` holds a real number (JSON may write it as an
    integer: 1 for 1.0)."""
    return hint is float or float in typing.get_args(hint)


def _check_values(value: Any, where: str = "plan") -> None:
    """Every number finite and in its range, every enum word known, every limit kept:
    what planc check guarantees, for a plan read back from a build's plan.json."""
    hints = _field_types(type(value))
    for f in dataclasses.fields(value):
        item, path = getattr(value, f.name), f"{where}.{f.name}"
        number = isinstance(item, (int, float)) and not isinstance(item, bool)
        if dataclasses.is_dataclass(item):
            _check_values(item, path)
        elif isinstance(item, tuple):
            for i, x in enumerate(item):
                if dataclasses.is_dataclass(x):
                    _check_values(x, f"{path}[{i}]")
                elif isinstance(x, float) and not (math.isfinite(x) and 0 <= x < 1
                                                   if f.name == "betas" else math.isfinite(x)):
                    raise ValueError(f"{path}[{i}] is {x}")
        elif number and (isinstance(item, float) or f.name in _POSITIVE or
                         _real(hints[f.name])):
            if not math.isfinite(item) or item < 0 or (item == 0 and f.name in _POSITIVE):
                raise ValueError(f"{path} is {item}, not a "
                                 f"{'positive' if f.name in _POSITIVE else 'non-negative'} "
                                 f"finite number")
    if where != "plan":
        return
    plan = value
    if plan.model.dtype not in DTYPE_BYTES:
        raise ValueError(f"plan.model.dtype is {plan.model.dtype!r}, not one of "
                         f"{', '.join(DTYPE_BYTES)}")
    from planc.models import FAMILIES

    if plan.model.family not in FAMILIES:
        raise ValueError(f"plan.model.family is {plan.model.family!r}, not one of "
                         f"{', '.join(FAMILIES)}")
    family = FAMILIES[plan.model.family]
    for key, value in plan.model.options.items():
        if key not in family.keys or not isinstance(value, (bool, int, float, str)) or \
                isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"plan.model.options.{key} is not a value of a key of model "
                             f"{family.name}")
    if plan.train.optimizer.name not in ("sgd", "adamw"):
        raise ValueError(f"plan.train.optimizer.name is {plan.train.optimizer.name!r}")
    mesh, pp = plan.mesh, plan.shard.pp
    for what, have in (("world", mesh.world), ("layers", plan.model.layers),
                       ("microbatches", plan.schedule.microbatches),
                       ("schedule", mesh.pp * pp.virtual * plan.schedule.microbatches)):
        if have > LIMITS[what]:
            raise ValueError(f"plan's {what} ({have}) is more than planc's limit of "
                             f"{LIMITS[what]}")


def _check_consistency(plan: "Plan") -> None:
    mesh, pp = plan.mesh, plan.shard.pp
    if not is_axis_order(mesh.order):
        raise ValueError("plan.mesh.order must name tp, cp, pp and dp once each")
    if plan.topology.nodes * plan.topology.devices_per_node != mesh.world:
        raise ValueError("plan.topology does not hold the mesh's world")
    chunks = pp.chunks
    if len(chunks) != mesh.pp * pp.virtual or chunks[0][0] != 0 or \
            chunks[-1][1] != plan.model.layers - 1 or any(
                b[0] != a[1] + 1 for a, b in zip(chunks, chunks[1:])) or any(
                c[0] > c[1] for c in chunks[1:-1]) or any(c[0] > c[1] + 1 for c in chunks):
        # Only the first and the last chunk may be empty (the embedding or head alone).
        raise ValueError("plan.shard.pp.chunks do not cover the layers in order")
    if plan.model.batch % (mesh.dp * plan.schedule.microbatches) or \
            plan.model.hidden % plan.model.heads:
        raise ValueError("plan.model does not divide as the plan needs")
