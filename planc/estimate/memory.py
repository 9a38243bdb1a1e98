"""Memory per device and per pipeline stage: model states and activations.

Model states follow the ZeRO paper (Rajbhandari et al., SC'20, section 3): with
Psi parameters, p bytes per parameter and gradient and K bytes of optimizer state per
parameter (fp32 master weights for bf16/fp16, plus Adam's two moments or SGD's
momentum), a device holds (p + p + K) Psi without ZeRO, and stages 1, 2 and 3
partition the optimizer state, then the gradients, then the parameters over the N_d
replicas: p Psi + p Psi + K Psi / N_d, p Psi + (p + K) Psi / N_d, (2p + K) Psi / N_d.
Here the replicas are the dp x cp ranks, which hold the same shard of every parameter;
with ``mesh { ep }`` a routed expert's weights are split over ep and their replicas are
the tp x cp x dp / ep ranks of the stage holding the same experts (MoE Parallel Folding).
``shard { dp { fp32_grads = on } }`` adds an fp32 copy of every gradient, never sharded,
as DeepSpeed's BF16_Optimizer accumulates them (BigScience tr11 README, "Deepspeed
config": "4 bytes * params of additional memory").

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023), Table 2, per layer and microbatch in bytes for
16-bit activations: s b h (10 + 24/t + 5 a s / (h t)) with tensor parallelism,
s b h / t (34 + 5 a s / h) with sequence parallelism, s b h (10 + 24/t) and
34 s b h / t with selective recomputation, and 2 s b h (/ t) with full
recomputation. The formulas count dropout masks, which the gpt model does not have,
so they over-estimate slightly. They are scaled by the dtype's size over 2, and the
pipeline schedule decides how many microbatches each stage holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc import schedules
from planc.estimate import weight_half
from planc.estimate.kernel_cost import GPUS
from planc.estimate.in_flight import (head_microbatches_in_flight, layers_in_flight,
                                       microbatches_in_flight)
from planc.estimate.parameter_counts import (_local_elements, layer_expert_parameters,
                                             layer_parameters, stage_expert_parameters,
                                             stage_parameters)
from planc.models import (family_of, moe, moe_memory, recomputed_activation_bytes,
                          recomputes_norms)
from planc.estimate.step_gradient import largest_step_gradient_bytes, one_layer_of_each_block
from planc.plan.plan import Plan

FP32_BYTES = 4


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int  # parameter elements held by one device of the stage, before ZeRO
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    microbatches_in_flight: int
    # more bytes a block's transient buffers take under the worst input it can get than
    # at the priced one (a dropless mixture's dispatch: planc.models.moe.dispatch_bytes)
    worst_routing_extra_bytes: float = 0.0
    # ZeRO-3's largest unit whole while it is used (:func:`unsharded_unit_bytes`)
    unsharded_bytes: float = 0.0
    # what planc's runtime keeps beyond the count, under sequence parallelism
    # (:func:`gathered_inputs_bytes`)
    gathered_inputs_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes + self.unsharded_bytes)

    @property
    def worst_routing_total_bytes(self) -> float:
        return self.total_bytes + self.worst_routing_extra_bytes

    @property
    def planc_run_total_bytes(self) -> float:
        return self.total_bytes + self.gathered_inputs_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    capacity: float | None  # bytes per device, None when unknown

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total_bytes)

    @property
    def overflows(self) -> bool:
        return self.capacity is not None and self.peak.total_bytes > self.capacity

    @property
    def held_peak_bytes(self) -> float:
        """The most a stage's device holds as planc run runs the plan: the estimate's
        peak, or more where the runtime keeps the gathered inputs of sequence
        parallelism whole (gathered_inputs = keep)."""
        return max(s.planc_run_total_bytes for s in self.stages)

    @property
    def planc_run_peak(self) -> StageMemory | None:
        """The stage that needs the most as planc's runtime holds it, where that is more
        than the estimate (Megatron-LM's count), or None."""
        if not any(s.gathered_inputs_bytes for s in self.stages):
            return None
        return max(self.stages, key=lambda s: s.planc_run_total_bytes)

    @property
    def worst_routing_peak(self) -> StageMemory | None:
        """The stage that needs the most under the worst routing, or None where routing
        cannot change what a stage holds."""
        if not any(s.worst_routing_extra_bytes for s in self.stages):
            return None
        return max(self.stages, key=lambda s: s.worst_routing_total_bytes)


def optimizer_state_bytes(plan: Plan) -> int:
    """K of the ZeRO paper: optimizer bytes per parameter (fp32 master copy included)."""
    optimizer = plan.train.optimizer
    master = FP32_BYTES if plan.model.dtype != "fp32" else 0
    if optimizer.name == "adamw":
        return master + 2 * FP32_BYTES
    return master + (FP32_BYTES if optimizer.momentum > 0 else 0)


def model_state_bytes(parameters: float, dtype_bytes: int, optimizer_bytes: int, zero: int,
                      replicas: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes on one device, by the ZeRO stage."""
    p, k, n = dtype_bytes * parameters, optimizer_bytes * parameters, replicas
    if zero == 0:
        return p, p, k
    if zero == 1:
        return p, p, k / n
    if zero == 2:
        return p, p / n, k / n
    return p / n, p / n, k / n


def head_unit_kept(plan: Plan) -> bool:
    """Whether ZeRO-3 keeps the head's unit (the final norm and head) whole from its
    forward to its backward instead of gathering it again: where the head's stage holds
    one microbatch's head at a time, its backward comes as soon as its forward is done,
    and a second gather would bring back what was just let go. FSDP2 does not reshard
    its root module after the forward for this reason ("the root module is typically
    required immediately when the backward pass begins": torch.distributed.fsdp.
    fully_shard, ``reshard_after_forward``)."""
    return plan.shard.dp.zero == 3 and plan.mesh.dp * plan.mesh.cp > 1 and \
        head_microbatches_in_flight(plan) == 1


def last_block_kept(plan: Plan) -> bool:
    """Whether ZeRO-3 keeps the last block's units whole from its forward to its backward
    too: where the head's unit is kept (:func:`head_unit_kept`) and the last block is on
    the head's chunk, only the head and the loss run between the block's forward and its
    backward, and a gather would bring back at once what was just let go. torchtitan
    leaves the last transformer block unresharded after the forward for this reason
    ("FSDP would prefetch it immediately": its ``apply_fsdp``, reshard_after_forward
    policy ``default``)."""
    first, last = plan.shard.pp.chunks[-1]
    return head_unit_kept(plan) and first <= last == plan.model.layers - 1


def unsharded_unit_bytes(plan: Plan, stage: int) -> float:
    """What ZeRO-3 holds whole beside the shards, at its most: the stage's largest unit
    (a block, the embedding, the head and final norm) gathered twice in the model's dtype
    and its gradient whole in fp32. The ZeRO paper's (2p + K) Psi / N_d counts only
    shards; FSDP's peak adds the unsharded units in use (Zhao et al., "PyTorch FSDP",
    VLDB 2023, section 3.2), and planc's backward holds the forward's views of a unit's
    parameters (filled again), the backward's own gather where it ran first, and the
    unit's whole gradient until its reduce-scatter (planc.runtime.engine.store). The
    last block kept whole beside the head's unit while the loss runs
    (:func:`last_block_kept`) is within that: one copy of each, no more than two of the
    larger."""
    if plan.shard.dp.zero != 3 or plan.mesh.dp * plan.mesh.cp == 1:
        return 0.0
    family, m, ep = family_of(plan), plan.model, plan.mesh.ep
    layers = one_layer_of_each_block(plan, plan.layers_of_stage(stage))
    units = [layer_parameters(plan, layer) for layer in layers]
    if ep > 1 and plan.mesh.tp * plan.mesh.dp * plan.mesh.cp // ep > 1:
        # a block's routed experts split over ep: a unit of their own, gathered over edp
        # (with no replica, edp of one, they are never gathered)
        units += [layer_expert_parameters(plan, layer) for layer in layers]
    if stage == 0:
        units.append(_local_elements(plan, family.embedding_parameters(m)))
    if stage == plan.head_stage:
        units.append(_local_elements(plan, family.head_parameters(m)))
    return max(units, default=0) * (2 * m.dtype_bytes + FP32_BYTES) + \
        _whole_until_weight_gradient(plan, stage)


def _whole_until_weight_gradient(plan: Plan, stage: int) -> float:
    """ZeRO-3's units kept whole from a chunk's input half to its weight half, at the
    stage's peak (planc.estimate.weight_half.units_beyond_peak)."""
    return weight_half.units_beyond_peak(plan, stage, layer_activation_bytes(plan, stage=stage),
                                         layer_input_half_bytes(plan, stage))


def weight_gradient_reads_bytes(plan: Plan, stage: int) -> float:
    """What a split backward's weight halves read, kept from their input halves, at the
    stage's peak (planc.estimate.weight_half.reads_beyond_peak)."""
    return weight_half.reads_beyond_peak(plan, stage,
                                         layer_activation_bytes(plan, stage=stage))


def input_half_frees_bytes(plan: Plan, stage: int) -> float:
    """How much lower the stage's peak is than its activations and what the weight halves
    read (:func:`weight_gradient_reads_bytes`) count, because each input half frees
    what the steps without parameters keep (:func:`layer_input_half_bytes`): the
    runtime's W differentiates the graphs of the steps with parameters alone
    (planc.runtime.engine.interpreter; bench/memory_live.py's zb1p plan under ZeRO-3
    measured 366.5 MiB at peak, estimated 404.3 MiB without this, 369.7 with it)."""
    per_layer = layer_activation_bytes(plan, stage=stage)
    return weight_half.reads_beyond_peak(plan, stage, per_layer) - \
        weight_half.reads_beyond_peak(plan, stage, per_layer,
                                      layer_input_half_bytes(plan, stage))


def layer_activation_bytes(plan: Plan, recompute: str | None = None,
                           stage: int | None = None) -> float:
    """One block, one microbatch, one device, by the family's count (for gpt,
    Korthikanti et al. 2022, Table 2); of ``stage``'s blocks, or of the model's."""
    recompute = recompute or plan.optimize.recompute
    return _block_count(plan, family_of(plan).activation_bytes, recompute, stage) + \
        _gathered_kv(plan, recompute)


def _gathered_kv(plan: Plan, recompute: str) -> float:
    """The keys and values all-gathered over cp, which the attention keeps, one block and
    microbatch: every cp rank's tokens at the family's ``gathered_kv_width`` and the mask,
    which SDPA keeps in the dtype; none with the ring, nor under full recomputation or
    attention_inputs, which gather them again for the recomputed attention
    (planc.graph.derive). A step without parameters' (its input half frees them)."""
    family, m = family_of(plan), plan.model
    if plan.mesh.cp == 1 or plan.shard.cp.attention == "ring" or \
            family.gathered_kv_width is None or recompute in ("full", "attention_inputs"):
        return 0.0
    qkv = family.linear_rule("qkv")  # a row-parallel qkv's bias waits for the reduction
    biased = plan.mesh.tp > 1 and plan.shard.tp.qkv == "row" and qkv is not None and \
        qkv.bias is not None
    width = family.gathered_kv_width(m, plan.mesh.tp, biased)
    seq_full, seq = m.seq, m.seq // plan.mesh.cp
    return (width * seq_full * plan.microbatch_size + seq * seq_full) * m.dtype_bytes


def layer_input_half_bytes(plan: Plan, stage: int | None = None) -> float:
    """Of :func:`layer_activation_bytes`, what a split backward's input half frees: what
    the block's steps without parameters keep, whose backward runs whole there
    (planc.passes.split_backward.splittable; the family's ``input_half_bytes``, none if
    it does not say)."""
    count, recompute = family_of(plan).input_half_bytes, plan.optimize.recompute
    return 0.0 if count is None else \
        _block_count(plan, count, recompute, stage) + _gathered_kv(plan, recompute)


def _block_count(plan: Plan, count, recompute: str, stage: int | None = None) -> float:
    """A family's per-block ``count`` (one microbatch, one device) of the plan's sizes.
    On a GPU whose published runs used FlashAttention (planc.estimate.kernel_cost.GPU.flash:
    the H100's), the attention keeps no s x s probabilities: FlashAttention's backward
    recomputes them from q, k, v and a log-sum-exp per query (Dao et al. 2022, section
    3.1). Every family's ``selective`` count is its ``none`` less exactly those
    probabilities, so there ``none`` is counted as ``selective``. A mixture cut at its
    all-to-alls (planc.models.moe.cut_over_ep) keeps the rows its experts piece received,
    except with model { fp8 }, whose experts keep FP8 copies and let the rows go after
    the forward (planc.runtime.families.moe_dispatch). A model of dense blocks and
    mixtures counts, for ``stage``, the kinds of blocks it holds (the larger of the two
    where it holds both, as for the whole model): a stage of mixtures alone is not
    counted as holding the dense blocks' SwiGLU, nor as freeing it in an input half."""
    m = plan.model
    if recompute == "none" and flash_attention(plan):
        recompute = "selective"
    extra = {key: True for key, on in (
        ("rows_received_kept", moe.cut_over_ep(plan) and m.options.get("fp8") is None),
        ("product_recomputed", plan.recomputes_moe_activation),
        ("activation_recomputed", plan.recomputes_activation),
        ("norms_recomputed", recomputes_norms(plan))) if on}
    if stage is not None and getattr(m, "first_dense", 0):
        extra["kinds"] = moe_memory.kinds_of_layers(m, plan.layers_of_stage(stage))
    return count(m, seq=m.seq // plan.mesh.cp, seq_full=m.seq, batch=plan.microbatch_size,
                 tp=plan.mesh.tp, sequence_parallel=plan.shard.tp.sequence_parallel,
                 recompute=recompute, **extra)


def flash_attention(plan: Plan) -> bool:
    """Whether the plan's GPU runs FlashAttention, as the kernel model prices it."""
    gpu = GPUS.get(plan.topology.preset or "")
    return gpu is not None and gpu.flash


def stage_activation_bytes(plan: Plan, stage: int) -> tuple[float, int]:
    m, tp = plan.model, plan.mesh.tp
    in_flight = microbatches_in_flight(plan, stage)
    total = layers_in_flight(plan, stage) * layer_activation_bytes(plan, stage=stage)
    if not schedules.named(plan.schedule.pipeline).splits_backward:
        # Recomputing one layer materialises its full activations once more (a split
        # backward keeps its chunk's until the W: weight_gradient_reads_bytes), and
        # attention_inputs one layer's attention inputs: the first norm's output, q, k
        # and v, and the keys and values gathered over cp again.
        if plan.optimize.recompute == "full":
            total += layer_activation_bytes(plan, "none", stage)
        elif plan.optimize.recompute == "attention_inputs":
            total += layer_activation_bytes(plan, "none", stage) - \
                layer_activation_bytes(plan, "attention_inputs", stage)
    total += largest_step_gradient_bytes(plan, stage)
    transient = family_of(plan).transient_bytes
    if plan.layers_of_stage(stage):  # not a stage of the head alone
        if transient is not None:
            total += transient(m, plan.mesh, plan.microbatch_size * m.seq / plan.mesh.cp)
        for again in (moe_memory.recomputed_product_bytes, recomputed_activation_bytes):
            total += _block_count(plan, again, plan.optimize.recompute, stage)  # in a backward
    if stage == plan.head_stage:
        s, b = m.seq // plan.mesh.cp, plan.microbatch_size
        sp_div = tp if plan.shard.tp.sequence_parallel and tp > 1 else 1
        vocab_div = tp if plan.shard.tp.head == "vocab" else 1
        final_ln_and_head_inputs = 2 * s * b * m.hidden * m.dtype_bytes / sp_div
        logits_fp32 = FP32_BYTES * s * b * m.vocab / vocab_div
        total += head_microbatches_in_flight(plan) * (final_ln_and_head_inputs + logits_fp32)
        if m.dtype_bytes < FP32_BYTES:
            # A 16-bit model's logits beside their fp32 copy while the loss reads them, and
            # the gradient it returns in the model's dtype beside the fp32 softmax it came
            # from: one microbatch's, once (Megatron-LM's cross-entropy likewise reads
            # ``logits.float()`` while the 16-bit output is alive).
            total += m.dtype_bytes * s * b * m.vocab / vocab_div
    return total + weight_gradient_reads_bytes(plan, stage) - \
        input_half_frees_bytes(plan, stage), in_flight


def gathered_inputs_bytes(plan: Plan, stage: int) -> float:
    """What planc's runtime keeps under sequence parallelism beyond Korthikanti et al.'s
    count (their Table 2, section 4.2.2), which the estimate is: a column-parallel GEMM's
    input, gathered over tp, is kept whole for its weight gradient, where Megatron-LM
    keeps each rank's shard and gathers it again in the backward; in every block of the
    stage held in flight and, on the head's stage, the head's input. Not in the estimate's
    total: it prices the layout as Megatron-LM runs it, which planc's runtime does with
    ``shard { tp { gathered_inputs = regather } }`` (then this is 0); under the default,
    ``keep``, ``planc simulate`` and ``planc check -v`` say both. How many inputs a block keeps
    is its family's (``gathered_inputs_kept``: gpt's and llama's pre-norm blocks; measured
    on a llama at tp 2, docs/simulate.md, "Memory"); the other families' are not
    counted."""
    m, tp = plan.model, plan.mesh.tp
    kept = family_of(plan).gathered_inputs_kept
    if tp == 1 or not plan.shard.tp.sequence_parallel or not kept or \
            plan.regathers_gemm_inputs:
        return 0.0
    gathered_beyond_shard = (m.seq // plan.mesh.cp) * plan.microbatch_size * m.hidden * \
        m.dtype_bytes * (1 - 1 / tp)
    total = layers_in_flight(plan, stage) * kept.get(plan.optimize.recompute, 0) * \
        gathered_beyond_shard
    if stage == plan.head_stage:
        total += head_microbatches_in_flight(plan) * gathered_beyond_shard
    return total


def stage_activations(plan: Plan) -> tuple[tuple[float, int], ...]:
    """Every stage's :func:`stage_activation_bytes`: what ZeRO does not change."""
    return tuple(stage_activation_bytes(plan, stage) for stage in range(plan.mesh.pp))


def stage_parameter_counts(plan: Plan) -> tuple[tuple[int, int], ...]:
    """Every stage's (:func:`stage_parameters`, :func:`stage_expert_parameters`): what
    neither ZeRO, dp, cp, the microbatches nor recomputation change."""
    per_layer = layer_parameters(plan) if family_of(plan).layer_block is None else None
    return tuple((stage_parameters(plan, stage, per_layer),
                  stage_expert_parameters(plan, stage)) for stage in range(plan.mesh.pp))


def estimate(plan: Plan, activations: tuple[tuple[float, int], ...] | None = None,
             parameters: tuple[tuple[int, int], ...] | None = None) -> MemoryEstimate:
    """``activations``: :func:`stage_activations` of ``plan``, and ``parameters``:
    :func:`stage_parameter_counts`, if known (planc tune estimates thousands of
    variants of one layout with them)."""
    mesh, zero = plan.mesh, plan.shard.dp.zero
    replicas = mesh.dp * mesh.cp
    expert_replicas = mesh.tp * replicas // mesh.ep
    k = optimizer_state_bytes(plan)
    accumulation = FP32_BYTES if plan.shard.dp.fp32_grads and plan.model.dtype != "fp32" else 0
    worst_extra = _worst_routing_extra_bytes(plan)
    stages = []
    for stage, (params, experts) in enumerate(parameters or stage_parameter_counts(plan)):
        dense = model_state_bytes(params, plan.model.dtype_bytes, k, zero, replicas)
        split = model_state_bytes(experts, plan.model.dtype_bytes, k, zero, expert_replicas)
        p, g, o = (a + b for a, b in zip(dense, split))
        g += accumulation * (params + experts)
        held, in_flight = activations[stage] if activations is not None else \
            stage_activation_bytes(plan, stage)
        stages.append(StageMemory(stage, params + experts, p, g, o, held, in_flight,
                                  worst_extra if plan.layers_of_stage(stage) else 0.0,
                                  unsharded_unit_bytes(plan, stage),
                                  gathered_inputs_bytes(plan, stage)))
    return MemoryEstimate(tuple(stages), plan.topology.device.memory)


def _worst_routing_extra_bytes(plan: Plan) -> float:
    """What a stage holding blocks needs more under the worst routing than the
    estimate's transient buffers (the same on every such stage)."""
    family = family_of(plan)
    if family.worst_transient_bytes is None:
        return 0.0
    m = plan.model
    tokens = plan.microbatch_size * m.seq / plan.mesh.cp
    return (family.worst_transient_bytes(m, plan.mesh, tokens)
            - family.transient_bytes(m, plan.mesh, tokens))


def total_parameters(plan: Plan) -> int:
    """Parameters of the whole unsharded model (a tied head counted once)."""
    return sum(p.numel for p in family_of(plan).all_parameters(plan.model))
