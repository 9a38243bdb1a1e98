"""The validated plan: every default applied, every unit converted, every rule checked.

A :class:`Plan` is what every later stage takes as input. It is immutable, holds only
plain values in SI units (bytes, bytes per second, seconds, FLOP per second), and
remembers where the user wrote each setting (:class:`Sources`) so that any stage can
point back at the right line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from planc.diagnostics import Span
from planc.plan.lr_schedule import LrSchedule
from planc.plan.mesh import AXES
from planc.plan.optimize import Optimize
from planc.plan.topology import Topology
from planc.schedules import DEFAULT_SCHEDULE, named as named_schedule

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# planc's limits (docs/language.md, "Limits"): checked by planc check, and again when a
# build's plan.json is read, since a build directory is untrusted input.
LIMITS = {"world": 524_288, "layers": 1_024, "microbatches": 65_536, "schedule": 131_072}
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
        """Features of one attention head: the family's ``head_dim`` key where given
        (Qwen3's 128 on a 2,048-wide stream), else hidden / heads."""
        given = self.options.get("head_dim")
        return given if given is not None else self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """Features of the attention's output, the input of its output projection: the
        query heads side by side."""
        return self.heads * self.head_dim

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
    # Expert parallelism, folded over a stage's tp x cp x dp ranks (MoE Parallel Folding,
    # arXiv 2504.14960): not an axis of the world. plan.json omits it at 1.
    ep: int = field(default=1, metadata={"omitted_when_default": True})

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def sizes(self) -> dict[str, int]:
        """Degree by axis, in the canonical order of planc.plan.mesh.AXES."""
        return {axis: self.size(axis) for axis in AXES}

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())


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
    # under sequence parallelism, what the backward of a column-parallel GEMM reads of its
    # gathered input: "keep" (kept whole from the forward) or "regather" (the shard kept,
    # gathered again over tp in the backward; Korthikanti et al. 2022, section 4.2.2)
    gathered_inputs: str = "keep"


@dataclass(frozen=True)
class ContextParallel:
    attention: str = "allgather"
    load_balance: bool = True


@dataclass(frozen=True)
class PipelineParallel:
    """Model chunks as inclusive layer ranges, one per stage with ``virtual`` = 1, else
    pp * v of them placed by the schedule (:meth:`Plan.stage_of_chunk`): round-robin as
    Megatron's interleaving (Narayanan et al., SC'21, 2.2), or in a V (zbv, dualpipev).
    The chunks may differ in size; the first and last may be empty, the embedding or head
    alone (planc.schedules.layers)."""

    chunks: tuple[tuple[int, int], ...]
    virtual: int = 1
    auto: bool = True

    def chunk_layers(self, chunk: int) -> int:
        first, last = self.chunks[chunk]
        return last - first + 1

    def layers_of_stage(self, stage: int, pp: int,
                        pipeline: str = DEFAULT_SCHEDULE) -> tuple[int, ...]:
        """The layers of the chunks that schedule ``pipeline`` places on ``stage``."""
        place = named_schedule(pipeline).stage_of_chunk
        return tuple(layer for c, (first, last) in enumerate(self.chunks)
                     if place(c, pp, self.virtual) == stage
                     for layer in range(first, last + 1))


@dataclass(frozen=True)
class DataParallel:
    zero: int = 0
    # An fp32 gradient-accumulation buffer of every parameter beside the 16-bit
    # gradients, never sharded (DeepSpeed's BF16_Optimizer); the memory estimate's only.
    fp32_grads: bool = field(default=False, metadata={"omitted_when_default": True})
    # The dtype the gradients cross the data-parallel (and tied-embedding) reductions in:
    # REDUCE_DTYPES; "model", the model's dtype, or "fp32" (DeepSpeed's BF16_Optimizer,
    # Megatron-LM's accumulate_allreduce_grads_in_fp32). Sizes the derived collectives.
    reduce_dtype: str = field(default="model", metadata={"omitted_when_default": True})
    # How ZeRO-1 sums its gradients over the replicas: GRAD_REDUCES; "reduce_scatter", each
    # replica receiving the sum of its own shard (ZeRO, Megatron-LM's distributed
    # optimizer), or "all_reduce", the whole buffer summed on every replica, which then
    # updates its shard (DeepSpeed's BF16_Optimizer under its pipeline engine:
    # _bf16_reduce_grads all-reduces the fp32 gradients). zero = 1 only.
    grad_reduce: str = field(default="reduce_scatter", metadata={"omitted_when_default": True})


# shard { dp { reduce_dtype } }: the gradients' dtype in their data-parallel reduction.
REDUCE_DTYPES = ("model", "fp32")
# shard { dp { grad_reduce } }: ZeRO-1's gradient reduction.
GRAD_REDUCES = ("reduce_scatter", "all_reduce")


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
    # A mixture of experts over ep: its dispatch and combine all-to-alls as transfers of
    # their own on the ep stream (planc.passes.split_dispatch), not inside its compute.
    overlap_all_to_all: bool = field(default=False, metadata={"omitted_when_default": True})


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
    # plan.json omits these where they have their defaults (as it does lr_schedule's)
    eval_every: int = field(default=0, metadata={"omitted_when_default": True})  # 0: none
    # global batches each evaluation averages; the evaluation's tokens (the training's
    # data where eval_data is not written, synthetic when nothing evaluates)
    eval_batches: int = field(default=1, metadata={"omitted_when_default": True})
    eval_data: str = field(default="synthetic", metadata={"omitted_when_default": True})
    # clip by the global L2 norm of the gradients; None: off
    grad_clip: float | None = field(default=None, metadata={"omitted_when_default": True})
    # the lr of each step (planc.plan.lr_schedule); plan.json omits the default, no schedule
    lr_schedule: LrSchedule = field(default=LrSchedule(),
                                    metadata={"omitted_when_default": True})
    # samples in a seeded permutation per epoch (planc.data.sample_order); omitted when off
    shuffle: bool = field(default=False, metadata={"omitted_when_default": True})
    # a Hugging Face checkpoint directory to start from (plan.json omits it when None)
    init: str | None = field(default=None, metadata={"omitted_when_default": True})
    # how init's tensors are named, as the checker found them: "saved" (as save_pretrained
    # writes them) or "memory" (as the transformers class holds them, and planc export
    # writes them); planc.hf.init.saved_form
    init_form: str | None = field(default=None, metadata={"omitted_when_default": True})


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
    def regathers_gemm_inputs(self) -> bool:
        """shard { tp { gathered_inputs = regather } } in effect: not with model { fp8 },
        whose GEMMs keep FP8 codes of their whole input for the weight gradient
        (planc.runtime.engine.fp8), so that a gather again would be read by nothing."""
        return self.shard.tp.gathered_inputs == "regather" and \
            self.model.options.get("fp8") is None

    @property
    def recomputes_moe_activation(self) -> bool:
        """optimize { recompute_moe_activation } in effect: on a model with mixtures (not
        every block dense), not under recompute = full (a block keeps only its input), nor
        with model { fp8 }, whose experts compute the product again already; what the
        model table tells the runtime, and what the estimates price."""
        m = self.model
        return self.optimize.recompute_moe_activation and bool(m.options.get("experts")) \
            and m.options.get("first_dense", 0) < m.layers \
            and self.optimize.recompute != "full" and m.options.get("fp8") is None

    @property
    def recomputes_activation(self) -> bool:
        """optimize { recompute_activation } in effect: on a model with dense blocks (a
        family without experts, or a mixture's first_dense blocks), not under recompute =
        full, nor with model { fp8 }, whose down projection keeps FP8 codes of its input
        rather than the activation's output."""
        m = self.model
        dense = m.options.get("first_dense", 0) if m.options.get("experts") else m.layers
        return self.optimize.recompute_activation and dense > 0 \
            and self.optimize.recompute != "full" and m.options.get("fp8") is None

    @property
    def norms_recomputable(self) -> bool:
        """optimize { recompute_norms } asked where the rest of the plan lets it act: not
        under recompute = full or attention_inputs (which keep neither output), nor with
        model { fp8 } (FP8 GEMMs keep FP8 codes of their input), nor under sequence
        parallelism with tp > 1, where the GEMMs read and keep the norms' outputs gathered
        over tp, not the outputs. Whether the family's norms can be made again is the
        family's (planc.models.recomputes_norms)."""
        tp = self.mesh.tp
        return self.optimize.recompute_norms \
            and self.optimize.recompute in ("none", "selective") \
            and self.model.options.get("fp8") is None \
            and not (self.shard.tp.sequence_parallel and tp > 1)

    @property
    def placement(self):
        """Where the schedule puts model chunks (a :class:`planc.schedules.ChunkPlacement`)."""
        return named_schedule(self.schedule.pipeline).placement

    def stage_of_chunk(self, chunk: int) -> int:
        return self.placement.stage_of_chunk(chunk, self.mesh.pp, self.shard.pp.virtual)

    def chunks_of_stage(self, stage: int) -> tuple[int, ...]:
        return self._chunks_by_stage[stage] if 0 <= stage < self.mesh.pp else ()

    @cached_property
    def _chunks_by_stage(self) -> tuple[tuple[int, ...], ...]:
        """Every stage's chunks, in chunk order, from one pass over the chunks: derive,
        lower and the memory estimate ask stage by stage, and a pass per question made
        compile quadratic in pp (3 million placements at 1,024 stages, 0.7 s)."""
        stages: list[list[int]] = [[] for _ in range(self.mesh.pp)]
        for chunk in range(len(self.shard.pp.chunks)):
            stages[self.stage_of_chunk(chunk)].append(chunk)
        return tuple(map(tuple, stages))

    @property
    def head_stage(self) -> int:
        """The stage of the last chunk, with the head and the loss (stage 0 in a V)."""
        return self.stage_of_chunk(len(self.shard.pp.chunks) - 1)

    def layers_of_stage(self, stage: int) -> tuple[int, ...]:
        """The layers of the chunks the schedule places on ``stage``
        (:meth:`PipelineParallel.layers_of_stage`, from the chunks found once)."""
        chunks = self.shard.pp.chunks
        return tuple(layer for c in self.chunks_of_stage(stage)
                     for layer in range(chunks[c][0], chunks[c][1] + 1))

    @property
    def reduce_dtype(self) -> str:
        """The dtype of the gradients in their data-parallel and tied-embedding reductions
        (``shard { dp { reduce_dtype } }``; "model" is the model's dtype)."""
        dtype = self.shard.dp.reduce_dtype
        return self.model.dtype if dtype == "model" else dtype

    @property
    def reduce_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]

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


def json_form(section: Any) -> dict[str, Any]:
    """A section's asdict() form without its fields that plan.json omits when empty (a
    model's options): how plan.json and a checkpoint's manifest write a section."""
    body = dataclasses.asdict(section)
    for f in dataclasses.fields(section):
        default = dataclasses.asdict(f.default) if dataclasses.is_dataclass(f.default) \
            else f.default
        if f.metadata.get("omitted_when_empty") and not body[f.name] or \
                f.metadata.get("omitted_when_default") and body[f.name] == default:
            del body[f.name]
    return body
