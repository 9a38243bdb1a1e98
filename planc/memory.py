"""Memory per device and per pipeline stage: model states and activations.

Model states follow the ZeRO paper (Rajbhandari et al., SC'20, section 3): with
Psi parameters, p bytes per parameter and gradient and K bytes of optimizer state per
parameter (fp32 master weights for bf16/fp16, plus Adam's two moments or SGD's
momentum), a device holds (p + p + K) Psi without ZeRO, and stages 1, 2 and 3
partition the optimizer state, then the gradients, then the parameters over the N_d
replicas: p Psi + p Psi + K Psi / N_d, p Psi + (p + K) Psi / N_d, (2p + K) Psi / N_d.
Here the replicas are the dp x cp ranks, which hold the same shard of every parameter.

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

from planc.plan import Plan

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

    @property
    def total_bytes(self) -> float:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes)


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


def _linear_elements(fan_in: int, fan_out: int, placement: str, tp: int) -> int:
    """Weight plus bias of a linear layer on one tp rank (a row-parallel bias is whole)."""
    weight = fan_in * fan_out
    if placement == "column":
        return (weight + fan_out) // tp
    if placement == "row":
        return weight // tp + fan_out
    return weight + fan_out


def layer_parameters(plan: Plan) -> int:
    """Parameter elements of one transformer block on one tp rank."""
    m, tensor, tp = plan.model, plan.shard.tp, plan.mesh.tp
    return (4 * m.hidden  # ln1 and ln2, weight and bias, replicated
            + _linear_elements(m.hidden, 3 * m.hidden, tensor.qkv, tp)
            + _linear_elements(m.hidden, m.hidden, tensor.proj, tp)
            + _linear_elements(m.hidden, m.ffn, tensor.fc1, tp)
            + _linear_elements(m.ffn, m.hidden, tensor.fc2, tp))


def stage_parameters(plan: Plan, stage: int) -> int:
    """Parameter elements held by one device of pipeline stage ``stage``."""
    m, tensor, tp, pp = plan.model, plan.shard.tp, plan.mesh.tp, plan.mesh.pp
    embedding_table = m.vocab * m.hidden // (tp if tensor.embedding != "replicate" else 1)
    head_table = m.vocab * m.hidden // (tp if tensor.head != "replicate" else 1)
    count = len(plan.shard.pp.layers_of_stage(stage, pp)) * layer_parameters(plan)
    if stage == 0:
        count += embedding_table + m.seq * m.hidden
    if stage == pp - 1:
        count += 2 * m.hidden  # final LayerNorm
        # A tied head on its own stage keeps a copy of the embedding (Megatron).
        if not m.tie_embeddings or pp > 1:
            count += embedding_table if m.tie_embeddings else head_table
    return count


def microbatches_in_flight(plan: Plan, stage: int) -> int:
    """Microbatch-chunks whose activations a stage holds at its peak."""
    m, pp, virtual = plan.schedule.microbatches, plan.mesh.pp, plan.shard.pp.virtual
    if plan.schedule.pipeline == "gpipe":
        return m
    if plan.schedule.pipeline == "interleaved":
        # Megatron's interleaved 1F1B: (pp - stage - 1) * 2 + (virtual - 1) * pp warm-up
        # forwards, then one more before the first backward.
        return min((pp - stage - 1) * 2 + (virtual - 1) * pp + 1, m * virtual)
    return min(pp - stage, m)


def layer_activation_bytes(plan: Plan, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022, Table 2: one layer, one microbatch, one device."""
    m, tp = plan.model, plan.mesh.tp
    recompute = recompute or plan.optimize.recompute
    s, s_full = m.seq // plan.mesh.cp, m.seq  # local queries attend to the whole sequence
    b, h, a = plan.microbatch_size, m.hidden, m.heads
    sp = plan.shard.tp.sequence_parallel and tp > 1
    sbh = s * b * h
    if recompute == "full":
        half = 2 * sbh / (tp if sp else 1)
    elif recompute == "selective":
        half = 34 * sbh / tp if sp else sbh * (10 + 24 / tp)
    elif sp:
        half = sbh / tp * (34 + 5 * a * s_full / h)
    else:
        half = sbh * (10 + 24 / tp + 5 * a * s_full / (h * tp))
    return half * m.dtype_bytes / 2


def stage_activation_bytes(plan: Plan, stage: int) -> tuple[float, int]:
    m, tp, pp = plan.model, plan.mesh.tp, plan.mesh.pp
    layers = len(plan.shard.pp.layers_of_stage(stage, pp))
    in_flight = microbatches_in_flight(plan, stage)
    per_chunk_layers = layers / plan.shard.pp.virtual
    total = in_flight * per_chunk_layers * layer_activation_bytes(plan)
    if plan.optimize.recompute == "full":
        # Recomputing one layer materialises its full activations once more.
        total += layer_activation_bytes(plan, "none")
    if stage == pp - 1:
        s, b = m.seq // plan.mesh.cp, plan.microbatch_size
        sp_div = tp if plan.shard.tp.sequence_parallel and tp > 1 else 1
        vocab_div = tp if plan.shard.tp.head == "vocab" else 1
        final_ln_and_head_inputs = 2 * s * b * m.hidden * m.dtype_bytes / sp_div
        logits_fp32 = FP32_BYTES * s * b * m.vocab / vocab_div
        total += min(in_flight, plan.schedule.microbatches) * (final_ln_and_head_inputs
                                                               + logits_fp32)
    return total, in_flight


def estimate(plan: Plan) -> MemoryEstimate:
    replicas = plan.mesh.dp * plan.mesh.cp
    k = optimizer_state_bytes(plan)
    stages = []
    for stage in range(plan.mesh.pp):
        params = stage_parameters(plan, stage)
        p, g, o = model_state_bytes(params, plan.model.dtype_bytes, k, plan.shard.dp.zero,
                                    replicas)
        activations, in_flight = stage_activation_bytes(plan, stage)
        stages.append(StageMemory(stage, params, p, g, o, activations, in_flight))
    return MemoryEstimate(tuple(stages), plan.topology.device.memory)


def total_parameters(plan: Plan) -> int:
    """Parameters of the whole unsharded model (a tied head counted once)."""
    m = plan.model
    per_layer = (4 * m.hidden + 3 * m.hidden * m.hidden + 3 * m.hidden + m.hidden * m.hidden
                 + m.hidden + 2 * m.hidden * m.ffn + m.ffn + m.hidden)
    head = 0 if m.tie_embeddings else m.hidden * m.vocab
    return m.vocab * m.hidden + m.seq * m.hidden + m.layers * per_layer + 2 * m.hidden + head
