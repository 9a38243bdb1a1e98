"""The model table, ``programs/model.json``: what the runtime needs of the model, as data.

The compiler (:func:`planc.lower.tabulate_model.model_table`) writes it from the plan
and its family (planc.models); the runtime (planc.runtime) reads it instead of the plan:
the sizes its kernels use, how each feature dimension made of heads is cut over tp
(:mod:`planc.program.heads`), which tokens each cp rank holds and which rows each dp rank and
microbatch take, the optimizer's hyper-parameters, the data and its seed, and every
parameter's full shape and initialisation rule (docs/build.md). Which slice of a
parameter a rank holds, and where it lies in its bucket, are the programs' buckets.

Torch-free, and free of the plan and the families, so that the runtime can import it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from planc.plan.data_source import checked
from planc.program.ranks import integer_of
from planc.plan.lr_schedule import SCHEDULE_ARGUMENTS, LrSchedule, lr_at
from planc.vocabulary.versions import is_version

MODEL_TABLE_FORMAT = "planc-model"
MODEL_TABLE_VERSION = 1
# model.json's "kernels" section: each key, and the table's field it sets
KERNEL_OPTIONS = {"compile": "compile_kernels",
                  "recompute_moe_activation": "recompute_moe_activation",
                  "recompute_activation": "recompute_activation",
                  "recompute_norms": "recompute_norms"}
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")


def _string(value, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is {value!r}, not a string")
    return value


def _source(value, what: str) -> str:
    """A data source: "synthetic", a path, or a mixture's text (planc.plan.data_source)."""
    return checked(_string(value, what), what)


def _number(value, what: str) -> float:
    """A finite number (JSON's 1e400 reads as infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a finite number")
    return float(value)


def _boolean(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} is {value!r}, not true or false")
    return value


def _positive(value, what: str) -> int:
    if integer_of(value, what) < 1:
        raise ValueError(f"{what} is {value}, not positive")
    return value


def _tiles(positions, seq: int) -> bool:
    """Whether the ranges cover 0..seq - 1 once each (checked on the ranges, never on every
    position: a damaged table may claim any sequence length)."""
    ranges = sorted(r for ranges in positions for r in ranges)
    end = 0
    for start, stop in ranges:
        if start != end or stop <= start:
            return False
        end = stop
    return end == seq


@dataclass(frozen=True)
class OptimizerSettings:
    """torch.optim.SGD or AdamW hyper-parameters (planc.runtime.engine.optim reads these names)."""

    name: str
    lr: float
    momentum: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def to_json(self) -> dict:
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum,
                "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    @staticmethod
    def from_json(data: dict) -> "OptimizerSettings":
        name = _string(data["name"], "the optimizer's name")
        if name not in OPTIMIZERS:
            raise ValueError(f"the optimizer {name!r} is not one of {list(OPTIMIZERS)}")
        betas = data["betas"]
        if not isinstance(betas, list) or len(betas) != 2:
            raise ValueError("the optimizer's betas are not two numbers")
        return OptimizerSettings(name, _number(data["lr"], "lr"),
                                 _number(data["momentum"], "momentum"),
                                 (_number(betas[0], "beta 1"), _number(betas[1], "beta 2")),
                                 _number(data["eps"], "eps"),
                                 _number(data["weight_decay"], "weight_decay"))


def _schedule_of(data: dict) -> dict:
    """The lr schedule and its steps, from the model table (none written: constant)."""
    if "lr_schedule" not in data:
        return {}
    s = data["lr_schedule"]
    name = _string(s["name"], "the lr schedule's name")
    if name not in SCHEDULE_ARGUMENTS:
        raise ValueError(f"the lr schedule {name!r} is not one of {list(SCHEDULE_ARGUMENTS)}")
    steps = _positive(s["steps"], "the lr schedule's steps")
    schedule = LrSchedule(name, integer_of(s["warmup"], "warmup"),
                          _number(s["min_lr"], "min_lr"), integer_of(s["decay"], "decay"))
    if not 0 <= schedule.warmup < steps or not 0 <= schedule.decay <= steps - schedule.warmup \
            or schedule.min_lr < 0 or (name == "wsd") != (schedule.decay > 0):
        raise ValueError("its lr schedule's warmup, decay or min_lr do not fit its steps")
    return {"lr_schedule": schedule, "steps": steps}


@dataclass(frozen=True)
class Initial:
    """A parameter's initial value: N(mean, std) drawn in float64 from the seed, the
    parameter's name and its full shape (planc.runtime.engine.model.initial_value)."""

    shape: tuple[int, ...]
    mean: float
    std: float


@dataclass(frozen=True)
class Evaluation:
    """train.eval_every's evaluation: every ``every`` steps, the mean loss of ``batches``
    global batches of ``data`` (token file or "synthetic", whose batches are then drawn
    from ``seed``), run forward only (planc.lower.evaluation)."""

    every: int
    batches: int
    data: str
    seed: int

    def to_json(self) -> dict:
        return {"every": self.every, "batches": self.batches, "source": self.data,
                "seed": self.seed}

    @staticmethod
    def from_json(data: dict) -> "Evaluation":
        return Evaluation(_positive(data["every"], "eval_every"),
                          _positive(data["batches"], "eval_batches"),
                          _source(data["source"], "the evaluation's data source"),
                          integer_of(data["seed"], "the evaluation's seed"))


@dataclass(frozen=True)
class InitSource:
    """Where a parameter's initial value lies in a Hugging Face checkpoint (train.init):
    the part of transformers tensor ``tensor`` from ``start`` along its ``axis``, then
    dimensions ``swap`` exchanged (planc.hf.init.init_sources)."""

    tensor: str
    axis: int
    start: int
    swap: tuple[int, int] | None
    # > 0: one tensor per expert, ``tensor`` naming expert e with ``{}``; each is row e
    # of the parameter's dimension 0 (axis, start and swap then count that row's dims)
    experts: int = 0

    def tensors(self) -> list[str]:
        """The transformers tensors this parameter is read from."""
        return [self.tensor.replace("{}", str(e)) for e in range(self.experts)] \
            if self.experts else [self.tensor]


@dataclass(frozen=True)
class InitTable:
    """The Hugging Face checkpoint the parameters start from: its directory, the shape of
    each transformers tensor read and where each parameter lies in one."""

    directory: str
    tensors: dict[str, tuple[int, ...]]
    sources: dict[str, InitSource]
    # state that is not trained -> the transformers tensor it starts from, whole (a
    # mixture's balancing bias: planc.hf.init.init_buffers)
    buffers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"directory": self.directory,
                "tensors": {k: list(v) for k, v in self.tensors.items()},
                "parameters": {k: {"tensor": s.tensor, "axis": s.axis, "start": s.start,
                                   "swap": list(s.swap) if s.swap else None,
                                   "experts": s.experts}
                               for k, s in self.sources.items()},
                **({"buffers": dict(self.buffers)} if self.buffers else {})}

    @staticmethod
    def from_json(data: dict, parameters: dict[str, Initial]) -> "InitTable":
        tensors = {_string(k, "a transformers tensor"): tuple(
            _positive(n, f"a size of {k}") for n in v) for k, v in data["tensors"].items()}
        sources = {}
        for name, s in data["parameters"].items():
            if name not in parameters:
                raise ValueError(f"init names {name!r}, which is not a parameter")
            tensor, swap = _string(s["tensor"], "a transformers tensor"), s["swap"]
            axis, start = integer_of(s["axis"], "an axis"), integer_of(s["start"], "a start")
            if swap is not None:
                swap = tuple(integer_of(d, "a dimension") for d in swap)
            source = InitSource(tensor, axis, start, swap, integer_of(s["experts"], "experts"))
            if source.experts and source.experts != parameters[name].shape[0]:
                raise ValueError(f"init reads {name} from {source.experts} experts' tensors")
            for read in source.tensors():
                shape = tensors.get(read)
                if shape is None:
                    raise ValueError(f"init reads {name} from {read!r}, which it lists not")
                if not 0 <= axis < len(shape) or not 0 <= start < shape[axis] or \
                        swap is not None and (len(swap) != 2 or
                                              not all(0 <= d < len(shape) for d in swap)):
                    raise ValueError(f"init's place of {name} is outside {read}")
            sources[name] = source
        if set(sources) != set(parameters):
            raise ValueError("init does not place every parameter")
        buffers = {}
        for name, tensor in data.get("buffers", {}).items():
            if _string(tensor, "a transformers tensor") not in tensors:
                raise ValueError(f"init reads {name} from {tensor!r}, which it lists not")
            buffers[_string(name, "a buffer")] = tensor
        return InitTable(_string(data["directory"], "init's directory"), tensors, sources,
                         buffers)


@dataclass(frozen=True)
class ModelTable:
    """The model's sizes carry the names of planc.plan.plan.Model's fields, so the kernels
    read ``ctx.model.heads`` whichever the source."""

    family: str
    layers: int
    hidden: int
    heads: int
    key_value_heads: int
    head_dim: int
    vocab: int
    seq: int
    batch: int
    dtype: str
    tie_embeddings: bool
    norm_eps: float
    rope_theta: float
    # feature dimension -> its head groups, in units (planc.program.heads.split_units)
    feature_groups: dict[str, tuple[int, ...]]
    # cp rank -> the [start, stop) ranges of sample positions it holds, in its order
    positions: tuple[tuple[tuple[int, int], ...], ...]
    rows_per_dp_rank: int
    microbatch_rows: int
    optimizer: OptimizerSettings
    data: str  # "synthetic" or the path of a token file (docs/data.md)
    seed: int
    parameters: dict[str, Initial] = field(default_factory=dict)
    # the family's own keys (a mixture's experts, top_k, ...), read as attributes
    options: dict[str, int | float | bool | str] = field(default_factory=dict)
    evaluation: Evaluation | None = None  # train.eval_every, when set
    # the lr of each step (planc.plan.lr_schedule) over train.steps; written only when set
    lr_schedule: LrSchedule = LrSchedule()
    steps: int = 1  # train.steps, what the schedule spans
    shuffle: bool = False  # samples of a token file in a permutation per epoch
    init: InitTable | None = None  # train.init: a Hugging Face checkpoint to start from
    # optimize { compile }: the family's elementwise formulas run through torch.compile
    compile_kernels: bool = False
    # optimize { recompute_moe_activation }: the experts' SwiGLU product computed again
    # in the backward rather than kept
    recompute_moe_activation: bool = False
    # optimize { recompute_activation }: a dense MLP's activation output computed again in
    # the backward rather than kept
    recompute_activation: bool = False
    # optimize { recompute_norms }: a block's two norms' outputs computed again in the
    # backward of the GEMM reading them rather than kept
    recompute_norms: bool = False

    def lr_at(self, step: int) -> float:
        """The lr of step ``step``'s optimizer update (planc.plan.lr_schedule.lr_at)."""
        return lr_at(self.lr_schedule, self.optimizer.lr, self.steps, step)

    def __getattr__(self, name: str):
        # Called only for names that are not fields: a family's own keys.
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"the model table has no key {name!r}")

    @property
    def cp(self) -> int:
        return len(self.positions)

    def to_json(self) -> dict:
        return {"format": MODEL_TABLE_FORMAT, "version": MODEL_TABLE_VERSION,
                "model": {"family": self.family, "layers": self.layers,
                          "hidden": self.hidden, "heads": self.heads,
                          "key_value_heads": self.key_value_heads,
                          "head_dim": self.head_dim, "vocab": self.vocab, "seq": self.seq,
                          "batch": self.batch, "dtype": self.dtype,
                          "tie_embeddings": self.tie_embeddings,
                          "norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
                          **({"options": dict(self.options)} if self.options else {})},
                "feature_groups": {k: list(v) for k, v in self.feature_groups.items()},
                "tokens": {"positions": [[list(r) for r in ranges]
                                         for ranges in self.positions],
                           "rows_per_dp_rank": self.rows_per_dp_rank,
                           "microbatch_rows": self.microbatch_rows},
                "optimizer": self.optimizer.to_json(),
                "data": {"source": self.data, "seed": self.seed,
                         **({"shuffle": True} if self.shuffle else {})},
                "parameters": {name: {"shape": list(p.shape), "mean": p.mean, "std": p.std}
                               for name, p in self.parameters.items()},
                **({"evaluation": self.evaluation.to_json()} if self.evaluation else {}),
                **({"lr_schedule": {**asdict(self.lr_schedule), "steps": self.steps}}
                   if self.lr_schedule != LrSchedule() else {}),
                **({"init": self.init.to_json()} if self.init else {}),
                **({"kernels": kernels} if (kernels := self._kernels()) else {})}

    def _kernels(self) -> dict[str, bool]:
        """The kernels' options that are on (none: the section is left out)."""
        return {key: True for key in KERNEL_OPTIONS if getattr(self, KERNEL_OPTIONS[key])}

    @staticmethod
    def from_json(data: dict) -> "ModelTable":
        if data.get("format") != MODEL_TABLE_FORMAT or \
                not is_version(data.get("version"), MODEL_TABLE_VERSION):
            raise ValueError(f"not a version {MODEL_TABLE_VERSION} planc model table")
        m, tokens = data["model"], data["tokens"]
        sizes = {key: _positive(m[key], key) for key in
                 ("layers", "hidden", "heads", "key_value_heads", "head_dim", "vocab", "seq",
                  "batch")}
        dtype = _string(m["dtype"], "dtype")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
        groups = {_string(k, "a feature dimension"): tuple(_positive(u, f"a group of {k}")
                                                            for u in v)
                  for k, v in data["feature_groups"].items()}
        positions = tuple(tuple((integer_of(r[0], "a position"), integer_of(r[1], "a position"))
                                for r in ranges) for ranges in tokens["positions"])
        if not positions or not _tiles(positions, sizes["seq"]):
            raise ValueError("its token positions do not cut the sequence among the cp ranks")
        parameters = {}
        for name, p in data["parameters"].items():
            shape = tuple(_positive(n, f"a size of {name}") for n in p["shape"])
            parameters[_string(name, "a parameter")] = Initial(
                shape, _number(p["mean"], "a mean"), _number(p["std"], "a std"))
        source = data["data"]
        options = m.get("options", {})
        if not isinstance(options, dict) or not all(
                isinstance(k, str) and k.isidentifier() and
                (isinstance(v, bool) or isinstance(v, int) or
                 isinstance(v, float) and math.isfinite(v) or
                 isinstance(v, str) and v.isidentifier() and len(v) <= 32)
                for k, v in options.items()):
            raise ValueError("its model options are not names with numbers, true/false or "
                             "words")
        kernels = data.get("kernels", {})
        if not isinstance(kernels, dict) or set(kernels) - set(KERNEL_OPTIONS):
            raise ValueError(f"its kernels are not {{{', '.join(map(repr, KERNEL_OPTIONS))}}}"
                             " each true or false")
        table = ModelTable(
            family=_string(m["family"], "family"), **sizes, dtype=dtype,
            tie_embeddings=_boolean(m["tie_embeddings"], "tie_embeddings"),
            norm_eps=_number(m["norm_eps"], "norm_eps"),
            rope_theta=_number(m["rope_theta"], "rope_theta"),
            feature_groups=groups, positions=positions,
            rows_per_dp_rank=_positive(tokens["rows_per_dp_rank"], "rows_per_dp_rank"),
            microbatch_rows=_positive(tokens["microbatch_rows"], "microbatch_rows"),
            optimizer=OptimizerSettings.from_json(data["optimizer"]),
            data=_source(source["source"], "the data source"),
            seed=integer_of(source["seed"], "the seed"), parameters=parameters,
            options=dict(options), **_schedule_of(data), shuffle=_boolean(
                source.get("shuffle", False), "shuffle"),
            evaluation=Evaluation.from_json(data["evaluation"]) if "evaluation" in data
            else None,
            init=InitTable.from_json(data["init"], parameters) if "init" in data else None,
            **{field: _boolean(kernels.get(key, False), f"kernels.{key}")
               for key, field in KERNEL_OPTIONS.items()})
        if not table.family.isidentifier():
            raise ValueError(f"family {table.family!r} is not a family's name")
        if table.microbatch_rows > table.rows_per_dp_rank or \
                table.rows_per_dp_rank > table.batch:
            raise ValueError("its rows per dp rank and per microbatch exceed the batch")
        return table
