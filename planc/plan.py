"""The validated plan: every default applied, every unit converted, every rule checked.

A :class:`Plan` is what every later stage takes as input. It is immutable, holds only
plain values in SI units (bytes, bytes per second, seconds, FLOP per second), and
remembers where the user wrote each setting (:class:`Sources`) so that any stage can
point back at the right line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from planc.diagnostics import Span

AXES = ("tp", "cp", "pp", "dp")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Model:
    """The spec's GPT: pre-LayerNorm decoder blocks, learned positions, optional tying."""

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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

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
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class Device:
    flops: float  # peak FLOP/s at the model's dtype
    memory: float | None  # bytes; None when the topology does not say
    efficiency: float = 0.5  # achievable fraction of peak


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds


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
    schedule (Narayanan et al., SC'21, section 2.2).
    """

    chunks: tuple[tuple[int, int], ...]
    virtual: int = 1
    auto: bool = True

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
    pipeline: str = "1f1b"


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
    """Where each setting was written: dotted key path (``mesh.tp``) to span."""

    path: str
    spans: Mapping[str, Span] = field(default_factory=dict, compare=False, hash=False)

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
        body = {f.name: dataclasses.asdict(getattr(self, f.name))
                for f in dataclasses.fields(self) if f.name not in ("name", "sources")}
        spans = {key: [s.line, s.column, s.end_line, s.end_column]
                 for key, s in sorted(self.sources.spans.items())}
        return {"version": PLAN_FORMAT_VERSION, "name": self.name, **body,
                "sources": {"path": self.sources.path, "spans": spans}}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`; raises KeyError/TypeError/ValueError if malformed
        (a field missing or of the wrong type, a count below 1)."""
        plan = Plan._from_dict(data)
        _check_types(plan)
        return plan

    @staticmethod
    def _from_dict(data: Mapping[str, Any]) -> "Plan":
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(f"unsupported plan format version {data.get('version')!r}")
        topology = dict(data["topology"])
        shard = data["shard"]
        train = dict(data["train"])
        optimizer = dict(train.pop("optimizer"))
        optimizer["betas"] = tuple(optimizer["betas"])
        pp = dict(shard["pp"])
        pp["chunks"] = tuple(tuple(c) for c in pp["chunks"])
        sources = data.get("sources", {})
        spans = {key: Span(*value) for key, value in sources.get("spans", {}).items()}
        return Plan(
            name=data["name"],
            model=Model(**data["model"]),
            mesh=Mesh(**{**data["mesh"], "order": tuple(data["mesh"]["order"])}),
            topology=Topology(
                nodes=topology["nodes"], devices_per_node=topology["devices_per_node"],
                device=Device(**topology["device"]), intra=Link(**topology["intra"]),
                inter=Link(**topology["inter"]), preset=topology.get("preset")),
            shard=Shard(tp=TensorParallel(**shard["tp"]), cp=ContextParallel(**shard["cp"]),
                        pp=PipelineParallel(**pp), dp=DataParallel(**shard["dp"])),
            schedule=Schedule(**data["schedule"]),
            optimize=Optimize(**data["optimize"]),
            train=Train(optimizer=Optimizer(**optimizer), **train),
            sources=Sources(sources.get("path", ""), spans),
        )


def _check_types(value: Any, where: str = "plan") -> None:
    """Check every field of a dataclass tree against its annotation."""
    import typing

    hints = typing.get_type_hints(type(value))
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
    import typing

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
