"""A model family as data: what the compiler, the memory estimate and the checks need.

A family is a description, not code paths spread over the compiler: the operators of
one transformer block and how they connect, the operators before and after the blocks,
each parameter with its full shape and named dimensions, each operator's FLOPs, the
width of every activation, how each operator may be placed over tensor parallelism
(which ``shard { tp { } }`` values exist for it), how a feature dimension is cut into
heads, the keys of its ``model NAME { }`` block (each with its kind, default and doc
line), its presets, and the rules its keys must keep beyond the common ones. The
language, the checker, the plan text and the transfer reasons read these, never the
family's name: a new family is its description, its kernels and one line of
:data:`planc.models.FAMILIES`. The derivation
(:mod:`planc.graph.derive`), the tensor-parallel layout search
(:mod:`planc.graph.tensor_parallel`), the memory estimate and the checks read only this.
The kernels of a family live in one runtime module, ``planc.runtime.families.NAME``.

Operator kinds follow Megatron-LM's building blocks (Shoeybi et al. 2019): a linear layer
is column- or row-parallel or replicated; a norm, a residual add and an elementwise
operator run on whatever slice they are given; attention runs on whole heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from planc.vocabulary.kinds import Key

# A planc.plan.plan.Model (or a Mesh, or a shard { tp { } } block). The plan reads the families
# (the keys a model holds, the checks it must pass), so a family names these types
# without importing them.
Model = Any
Mesh = Any
TensorParallel = Any

INPUT = "input"  # in a block's links: the block's input (the residual stream)
HEAD_OPS = ("final_ln", "head", "loss")
# A vocabulary-parallel cross-entropy's local max and sum of exponentials (Megatron-LM):
# per logit of the rank's slice, a compare or an exponential, and an add.
LOSS_PART_FLOPS_PER_LOGIT = 2
# Keys every family's model block has (or may have: preset), which the plan text shows
# in its own words; the rest of a family's keys are its own.
COMMON_KEYS = ("preset", "layers", "hidden", "heads", "ffn", "vocab", "seq", "batch",
               "dtype", "tie_embeddings")
# Keys the plan text shows beside the common ones whatever the family (the head width,
# after the heads), not among a family's own.
SHOWN_KEYS = ("head_dim",)


def pre_norm_block(activation: str) -> tuple[tuple[str, ...], tuple[tuple[str, str, str], ...]]:
    """(operators, links) of a pre-norm decoder block, GPT-2's and Llama's alike:
    ``x + proj(attention(qkv(ln1(x))))``, then ``x + fc2(activation(fc1(ln2(x))))``."""
    ops = ("ln1", "qkv", "attention", "proj", "attn_residual",
           "ln2", "fc1", activation, "fc2", "mlp_residual")
    links = ((INPUT, "ln1", "x"), *((a, b, "x") for a, b in zip(ops[:4], ops[1:5])),
             (INPUT, "attn_residual", "skip"),
             *((a, b, "x") for a, b in zip(ops[4:9], ops[5:10])),
             ("attn_residual", "mlp_residual", "skip"))
    return ops, links


def pre_norm_chains(embedding_ops: tuple[str, ...], layer_ops: tuple[str, ...]
                    ) -> dict[str, tuple[str, ...]]:
    """The layout-search chains of a pre-norm decoder: between the residual stream's
    fixed points (Korthikanti et al. 2022's f/g boundaries)."""
    return {"embedding": embedding_ops, "attention": layer_ops[:5], "mlp": layer_ops[5:],
            "head": HEAD_OPS}


@dataclass(frozen=True)
class Parameter:
    name: str  # e.g. "layers.3.qkv.weight"
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    layer: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def split_over_experts(self, ep: int) -> bool:
        """Whether this is a routed experts' stacked weight (leading dimension
        ``experts``) that ``mesh { ep }`` splits over ep ranks, each keeping its experts'
        rows (GShard, Lepikhin et al. 2021)."""
        return ep > 1 and self.dims[:1] == ("experts",)


@dataclass(frozen=True)
class Weight:
    """One weight of a linear operator, stored (in, out) and applied as ``x @ W``."""

    name: str  # within its layer ("q.weight") or global ("head.weight")
    fan_in: str  # dimension names
    fan_out: str


@dataclass(frozen=True)
class OpRule:
    """How an operator computes and how it may be placed over tp.

    kinds: ``linear`` (the weights' outputs concatenated along ``output_dim``, plus an
    optional bias), ``norm`` (per-token, with ``params`` over hidden), ``pointwise``
    (elementwise over the features, ``input_dim`` to ``output_dim``), ``attention``,
    ``residual``, ``embedding``, ``position``, ``loss``.
    """

    kind: str
    weights: tuple[Weight, ...] = ()
    bias: str | None = None
    output_dim: str | None = None
    input_dim: str | None = None
    placement: str | None = None  # the shard.tp key that places this operator
    params: tuple[str, ...] = ()
    # Model keys any of which, when set (non-zero), makes a ``tokenwise`` operator compute
    # a statistic of each whole sequence (a mixture's load-balancing loss, its capacity's
    # drops): over tp it then runs on a 1/tp share, and its kernel exchanges the
    # statistic's counts with the ranks that hold the sequence's other tokens (tp x cp;
    # planc.program.groups.SEQUENCE).
    sequence_statistic_when: tuple[str, ...] = ()
    # A ``tokenwise`` operator whose experts spread over the mesh's ep group: every rank
    # of the group must send it distinct tokens, so over tp it runs on a 1/tp share.
    expert_parallel: bool = False
    # A ``tokenwise`` operator's weights that its ``placement`` slot, when ``column``,
    # splits along their outputs (the heads), into ``output_dim``'s groups; its other
    # parameters stay whole on every tp rank, each rank's gradient of them a partial sum
    # (Megatron-Core's multi-latent attention: the up-projections column-parallel, the
    # down-projections and the latents' norms duplicated).
    column_weights: tuple[Weight, ...] = ()

    def sums_over_sequences(self, model: Model) -> bool:
        """Whether the operator computes a statistic of each whole sequence on ``model``
        (one of its :attr:`sequence_statistic_when` keys is set there)."""
        return any(model.options.get(key) for key in self.sequence_statistic_when)


# What tp must divide when a placement slot of a pre-norm block is split (Megatron-LM,
# Shoeybi et al. 2019): (model key, shard.tp slot, placement), in the order a diagnostic
# names them. A column-parallel qkv and a row-parallel proj split the heads; the other
# side of each linear layer splits the features it reads or writes.
PRE_NORM_SPLITS = (
    ("heads", "qkv", "column"), ("heads", "proj", "row"),
    ("hidden", "qkv", "row"), ("hidden", "fc1", "row"), ("hidden", "proj", "column"),
    ("hidden", "fc2", "column"), ("hidden", "embedding", "hidden"),
    ("ffn", "fc1", "column"), ("ffn", "fc2", "row"),
    ("vocab", "embedding", "vocab"), ("vocab", "head", "vocab"),
)

# A pre-norm block's column-parallel GEMM inputs that sequence parallelism gathers over tp
# and planc's runtime keeps whole for the weight gradient, by recomputation: qkv's and
# fc1's under none and selective, fc1's alone under attention_inputs (qkv's input is
# recomputed), none under full (the block's input alone); Megatron-LM keeps their shards
# and gathers again (Korthikanti et al. 2022, section 4.2.2; planc.estimate.memory)
PRE_NORM_GATHERED_INPUTS = MappingProxyType({"none": 2, "selective": 2, "attention_inputs": 1})


@dataclass(frozen=True)
class Finding:
    """An error one of a family's checks found: the message, the dotted keys whose span
    it points at (the first the user wrote; else the plan's name), and a hint ("" for
    none)."""

    message: str
    keys: tuple[str, ...]
    hint: str = ""


# A check of a family's model, run after the common ones (hidden divides by heads).
ModelCheck = Callable[[Model], "Finding | None"]
# A check of a family's model against the mesh, run once both are known.
MeshCheck = Callable[[Model, Mesh], "Finding | None"]
# A check of a family's model under tensor parallelism with tp > 1, run before the
# common divisibility checks of shard { tp { } }.
TensorParallelCheck = Callable[[Model, TensorParallel, Mesh], "Finding | None"]


@dataclass(frozen=True)
class Family:
    name: str
    summary: str  # one line for `planc explain` and the docs
    layer_ops: tuple[str, ...]  # one block's operators, in forward order
    layer_links: tuple[tuple[str, str, str], ...]  # (producer or INPUT, consumer, port)
    embedding_ops: tuple[str, ...]  # before the first block
    head_ops: tuple[str, ...]  # after the last block; the last one is the loss
    chains: Mapping[str, tuple[str, ...]]  # layout-search units between fixed points
    rules: Mapping[str, OpRule]
    output_tensor: Mapping[str, str]  # operator -> the activation it produces
    placements: Mapping[str, tuple[str, ...]]  # shard.tp slot -> the values that exist
    global_parameters: tuple[str, ...]  # names not repeated per block
    widths: Callable[[Model], Mapping[str, int]]  # activation -> features per token
    feature_groups: Callable[[Model], Mapping[str, tuple[int, ...]]]
    forward_flops: Callable[[str, "Any"], float]  # (operator, Shapes) -> FLOPs
    layer_parameters: Callable[[Model, int], list[Parameter]]
    embedding_parameters: Callable[[Model], list[Parameter]]
    head_parameters: Callable[[Model], list[Parameter]]
    model_flops_per_token: Callable[[Model], float]  # forward, Narayanan et al. 2021
    activation_bytes: Callable[..., float]  # one block, one microbatch, one device
    # Of activation_bytes, what the block's steps without parameters keep (the attention
    # core's, the activation function's): their backward runs whole in a split backward's
    # input half, which frees it; the rest stays until the weight half. None: count all
    # of it as kept until the weight half.
    input_half_bytes: Callable[..., float] | None = None
    keys: Mapping[str, Key] = field(default_factory=dict)  # the model block's keys
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> keys
    model_checks: tuple[ModelCheck, ...] = ()
    # (model key, shard.tp slot, placement): tp must divide the key under the placement
    tensor_parallel_splits: tuple[tuple[str, str, str], ...] = PRE_NORM_SPLITS
    tensor_parallel_checks: tuple[TensorParallelCheck, ...] = ()
    mesh_checks: tuple[MeshCheck, ...] = ()
    # The transformers class `planc export --format hf` writes this family as (None: none)
    hf_architecture: str | None = None
    # (operators, links) of block ``layer`` where blocks differ (a mixture of experts'
    # dense first layers); None: every block is layer_ops and layer_links. Every variant
    # starts with layer_ops[0] and ends with layer_output.
    layer_block: Callable[[Model, int], tuple[tuple[str, ...], tuple]] | None = None
    # Bytes one device holds for a moment while one block runs, beyond what the block
    # keeps for its backward: (model, mesh, tokens it holds) -> bytes (a mixture's
    # dispatch buffers at the routing's priced imbalance); None: nothing. The same under
    # the worst input the block can get (every row of the ep group on one rank), which
    # the memory estimate reports beside its peak.
    transient_bytes: Callable[[Model, Mesh, float], float] | None = None
    worst_transient_bytes: Callable[[Model, Mesh, float], float] | None = None
    # Operators that the reference PyTorch module computes with elementwise kernels the
    # graph does not show, by the name of what it runs (planc.estimate.kernel_cost's
    # MODULE_PASSES: "rmsnorm", "rope", "repeat_kv", "swiglu", "fp32_cross_entropy"):
    # what the simulator prices under optimize { kernels }. Absent: one kernel.
    module_kernels: Mapping[str, str] = field(default_factory=dict)
    # Operators that run several GEMMs, each (N, K) per token in order, where one linear
    # layer of the rule's weights would not say what they cost (multi-head latent
    # attention's four projections), on one of ``tp`` ranks that the operator's column
    # weights are split over (1: whole); None: every linear is one GEMM.
    linear_gemms: Callable[[Model, int], Mapping[str, tuple[tuple[int, int], ...]]] | None \
        = None
    # recompute -> the block's gathered inputs planc's runtime keeps under sequence
    # parallelism (PRE_NORM_GATHERED_INPUTS); empty: not counted
    gathered_inputs_kept: Mapping[str, int] = field(default_factory=dict)
    # features per gathered token that the attention keeps of the keys and values
    # all-gathered over cp, on one of tp ranks: (model, tp, bias_after_gather) -> features
    # (planc.estimate.memory counts the tokens, the mask and the recomputations); None:
    # not counted
    gathered_kv_width: Callable[[Model, int, bool], int] | None = None
    # optimize { recompute_norms } applies: each block norm's output is read by one dense
    # GEMM alone (q/k/v, the MLP's first), whose backward can make it again
    norms_made_again: bool = False
    # FLOPs of one of ``tp`` ranks of an operator whose split over the features leaves
    # part of its work whole on every rank (MLA's latents), or None where the split
    # divides it evenly: (op, shapes, tp) -> FLOPs or None.
    split_flops: Callable[[str, object, int], "float | None"] | None = None

    @property
    def own_keys(self) -> tuple[str, ...]:
        """The keys only this family has (llama's kv_heads), in the order declared: what
        the plan text shows after the common ones."""
        return tuple(k for k in self.keys if k not in COMMON_KEYS + SHOWN_KEYS)

    @property
    def layer_output(self) -> str:
        return self.layer_ops[-1]

    def block(self, model: Model, layer: int) -> tuple[tuple[str, ...], tuple]:
        """(operators, links) of block ``layer``."""
        if self.layer_block is None:
            return self.layer_ops, self.layer_links
        return self.layer_block(model, layer)

    def all_parameters(self, model: Model) -> list[Parameter]:
        params = self.embedding_parameters(model)
        for layer in range(model.layers):
            params.extend(self.layer_parameters(model, layer))
        return params + self.head_parameters(model)

    def sums_over_sequences(self, model: Model) -> bool:
        """Whether some operator computes a statistic of each whole sequence on ``model``
        (its counts are then summed over the tp x cp ranks holding a sequence's tokens)."""
        return any(rule.sums_over_sequences(model) for rule in self.rules.values())

    @property
    def has_mixture(self) -> bool:
        """Whether blocks of this family may hold a mixture of experts (operator ``moe``)."""
        return "moe" in self.rules

    def linear_rule(self, op: str) -> OpRule | None:
        rule = self.rules.get(op)
        return rule if rule is not None and rule.kind == "linear" else None


def shares_heads(family: Family, model: Model, tp: int, dim: str) -> bool:
    """Whether feature dimension ``dim`` has fewer heads than tp ranks, so that ranks
    share them (grouped-query attention with kv_heads < tp: Megatron-LM replicates them)."""
    groups = family.feature_groups(model).get(dim)
    return tp > 1 and groups is not None and len(groups) == 1 and groups[0] % tp != 0
