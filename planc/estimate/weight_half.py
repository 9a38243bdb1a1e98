"""What a split backward's weight halves read, held from their input halves until they
run: the memory estimate's share of the zero-bubble schedules (``zb1p``,
``interleaved_zb``, ``zbv``, ``dualpipev``; Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024).

A backward step with parameters is split into its input gradient (I) and its weight
gradient (W, planc.passes.split_backward); W differentiates the graph I ran through, so
what that graph holds for the parameters' gradients stays from the chunk's I to its W:
each step's output gradient and, under recomputation, the inputs it recomputed; under
ZeRO-3, the units' parameters the backward's gather filled. The stage's order is
replayed with its activations, and what these add at its peak is counted
(planc.estimate.memory). Where the gradients at a step's products take fewer bytes than
its output gradient, the runtime keeps those instead (planc.runtime.backward_passes):
the output gradient counted here is then an upper bound."""

from __future__ import annotations

import functools

from planc import schedules
from planc.estimate.parameter_counts import (_local_elements, layer_expert_parameters,
                                             layer_parameters)
from planc.models import family_of, moe
from planc.models.family import INPUT
from planc.plan.plan import Plan
from planc.vocabulary.model_options import gemm_input_bytes

# the kinds after which a chunk's activations are no longer needed
_LAYERS_DONE = (schedules.ActionKind.BACKWARD, schedules.ActionKind.BACKWARD_WEIGHT)


def units_beyond_peak(plan: Plan, stage: int, per_layer: float,
                      freed_by_input: float = 0.0) -> float:
    """ZeRO-3 under a schedule that splits the backward: autograd's weight-gradient half
    (W) reads the graph the input-gradient half (I) ran through, whose saved views hold
    the unit's parameters as the backward's gather filled them, so every gathered unit of
    a chunk stays whole in the model's dtype from the chunk's I to its W (Qi et al.,
    "Zero Bubble Pipeline Parallelism", ICLR 2024: W is deferred into the bubbles, here
    with what it reads): what that adds at the stage's peak, beside what W reads
    (:func:`reads_beyond_peak`); ``per_layer``: a layer's activations, one microbatch's,
    and ``freed_by_input`` the part of them an I frees."""
    if not schedules.named(plan.schedule.pipeline).splits_backward:
        return 0.0
    reads = functools.partial(_weight_half_bytes, plan)
    units = functools.partial(_gathered_unit_bytes, plan)
    logits = functools.partial(_logits_gradient_bytes, plan)
    return _beyond_activation_peak(plan, stage, per_layer, freed_by_input,
                                   lambda c: reads(c) + units(c), logits) - \
        reads_beyond_peak(plan, stage, per_layer, freed_by_input)


def _gathered_unit_bytes(plan: Plan, chunk: int) -> float:
    """A chunk's parameters in the model's dtype as ZeRO-3 gathers them, whole: its
    blocks' (with a mixture's routed experts where their step is split too, cut by
    split_dispatch), the embedding on the first chunk, the final norm and head on the
    last."""
    family, m, chunks = family_of(plan), plan.model, plan.shard.pp.chunks
    first, last = chunks[chunk]
    count = sum(layer_parameters(plan, layer) for layer in range(first, last + 1))
    if moe.cut_over_ep(plan) and plan.mesh.tp * plan.mesh.dp * plan.mesh.cp // plan.mesh.ep > 1:
        count += sum(layer_expert_parameters(plan, layer) for layer in range(first, last + 1))
    if chunk == 0:
        count += _local_elements(plan, family.embedding_parameters(m))
    if chunk == len(chunks) - 1:
        count += _local_elements(plan, family.head_parameters(m))
    return count * m.dtype_bytes


# planc tune estimates thousands of layouts, each stage's reads two or three times over
@functools.lru_cache(maxsize=1 << 12)
def _weight_half_bytes(plan: Plan, chunk: int) -> float:
    """What a chunk's weight half reads, for one microbatch, in the model's dtype: the
    output gradient of each step with parameters (:func:`_step_reads`), and under
    recomputation the inputs of the recomputed ones (which their W graphs keep)."""
    family, m = family_of(plan), plan.model
    chunks = plan.shard.pp.chunks
    first, last = chunks[chunk]
    features = 0.0
    per_block: dict[tuple, float] = {}  # a chunk's layers mostly share one block
    for layer in range(first, last + 1):
        block = family.block(m, layer)
        if block not in per_block:
            ops, links = block
            recomputed = _recomputed_ops(plan, ops)
            per_block[block] = sum(_step_reads(plan, op, links, op in recomputed)
                                   for op in ops)
        features += per_block[block]
    if chunk == 0:
        features += sum(_step_reads(plan, op, (), False) for op in family.embedding_ops)
    if chunk == len(chunks) - 1:
        features += sum(_step_reads(plan, op, (), False) for op in family.head_ops
                        if op not in _LOGITS)
    return features * _token_bytes(plan)


def _token_bytes(plan: Plan) -> float:
    """A feature of one microbatch's tokens on one device, in the model's dtype."""
    m = plan.model
    return plan.microbatch_size * m.seq / plan.mesh.cp * m.dtype_bytes


# the steps whose output gradient is the logits', a vocabulary wide
_LOGITS = ("head",)


def _logits_gradient_bytes(plan: Plan, chunk: int) -> float:
    """The head's output gradient (the logits'), one microbatch's, on the last chunk:
    kept for its W like any other, but at the moment its I makes it the head stage's
    terms already count it (planc.estimate.memory.stage_activation_bytes: the logits in
    fp32, whose buffer the loss's gradient is written into, and a 16-bit model's copy in
    its dtype); it adds to them only once the next microbatch's logits are made."""
    if chunk != len(plan.shard.pp.chunks) - 1:
        return 0.0
    return sum(_step_reads(plan, op, (), False) for op in _LOGITS if op in
               family_of(plan).head_ops) * _token_bytes(plan)


def _recomputed_ops(plan: Plan, ops: tuple[str, ...]) -> frozenset[str]:
    """The block's operators a recomputation runs again: every one under ``full``, those
    before the attention core under ``attention_inputs`` (the core with them, which has
    no parameters), none with parameters under ``selective`` (the core alone)."""
    mode = plan.optimize.recompute
    if mode == "full":
        return frozenset(ops)
    if mode == "attention_inputs" and "attention" in ops:
        return frozenset(ops[:ops.index("attention")])
    return frozenset()


def _step_reads(plan: Plan, op: str, links, recomputed: bool) -> float:
    """Features a token of what step ``op``'s weight half keeps from its input half: its
    output's gradient, as wide as its output on one device (split over tp after a
    column-parallel linear and a tokenwise step's column weights, over the sequence where
    sequence parallelism splits the stream), and its input where it was recomputed. A
    step without parameters, or a mixture over ep whose all-to-alls run inside it, runs
    its whole backward in the input half (planc.passes.split_backward.splittable); a
    residual carries a row-parallel linear's bias over tp (Megatron-LM), so it is split
    there; a cut mixture's pieces keep their rows' gradients (planc.passes.split_dispatch:
    the experts' on the rows received, at the priced imbalance, in FP8 with model
    { fp8 }; the shared experts' output; its route runs whole)."""
    family, m, tp, tensor = family_of(plan), plan.model, plan.mesh.tp, plan.shard.tp
    rule, widths = family.rules[op], family.widths(m)
    sequence_split = tp if tensor.sequence_parallel and tp > 1 else 1
    producer = next((a for a, b, port in links if b == op and port == "x"), None)
    if rule.kind == "residual":
        before = family.rules.get(producer) if producer else None
        carries_bias = tp > 1 and before is not None and before.bias is not None and \
            getattr(tensor, before.placement, None) == "row"
        return widths["stream"] / sequence_split if carries_bias else 0.0
    if not (rule.weights or rule.params or rule.bias or rule.column_weights
            or rule.kind == "embedding"):
        return 0.0
    if rule.expert_parallel and plan.mesh.ep > 1:
        if not moe.cut_over_ep(plan):
            return 0.0
        # (the route runs whole: planc.passes.split_backward.splittable); with model
        # { fp8 } the rows' gradients kept as they arrived, in FP8 (DeepSeek-V3, section
        # 3.3.4; planc.runtime.engine.fp8.EncodedRows), here in the dtype's elements
        rows = m.top_k / tp * gemm_input_bytes(m) / m.dtype_bytes
        return rows * moe.routing_imbalance(m) * m.hidden + \
            (m.hidden / tp if m.shared_experts else 0.0)
    width = widths[family.output_tensor[op]]
    placement = getattr(tensor, rule.placement, None) if rule.placement else None
    if rule.kind == "linear" and placement in ("column", "vocab"):
        output = _column_share(family, m, tp, rule, width)
    elif rule.kind == "linear":
        output = width
    elif rule.kind == "embedding" and placement == "vocab":
        output = width  # its gradient comes whole, gathered over tp (sequence parallel)
    elif rule.column_weights and placement == "column" and tp > 1:
        output = width / tp
    else:
        output = width / sequence_split
    if not recomputed:
        return output
    source = widths["stream"] if producer in (None, INPUT) else \
        widths[family.output_tensor[producer]]
    if rule.kind == "linear" and placement == "row":
        return output + source / tp
    if rule.kind == "linear":
        return output + source
    return output + source / sequence_split


def _column_share(family, m, tp: int, rule, width: float) -> float:
    """A column-parallel linear's output features on one of ``tp`` ranks: each of its
    groups' share (heads, or features), a group of fewer heads than ranks whole on each
    (grouped-query attention's k and v with kv_heads < tp, which Megatron-LM replicates;
    planc.models.family.shares_heads)."""
    groups = family.feature_groups(m).get(rule.output_dim) if tp > 1 else None
    if not groups:
        return width / tp
    return width / sum(groups) * sum(g / tp if g >= tp else 1 for g in groups)


@functools.lru_cache(maxsize=1 << 12)  # see _weight_half_bytes
def reads_beyond_peak(plan: Plan, stage: int, per_layer: float,
                      freed_by_input: float = 0.0) -> float:
    """Under a schedule that splits the backward, what each chunk's weight half (W)
    reads, kept from its input half (I) until it runs, beside the activations: the
    output gradients of the steps with parameters (dW = x^T dy: Qi et al., "Zero Bubble
    Pipeline Parallelism", ICLR 2024, section 2; Megatron-LM's zero-bubble keeps them
    until then), and under recomputation the recomputed inputs of those steps, which
    their graphs keep for W (:func:`_weight_half_bytes`): what they add at the stage's
    peak, less what the I frees of the activations (``freed_by_input`` of a layer's
    ``per_layer``: what the steps without parameters keep, whose backward runs whole in
    the I; the rest is what W differentiates), which can make it negative."""
    if not schedules.named(plan.schedule.pipeline).splits_backward:
        return 0.0
    return _beyond_activation_peak(plan, stage, per_layer, freed_by_input,
                                   functools.partial(_weight_half_bytes, plan),
                                   functools.partial(_logits_gradient_bytes, plan))


def _beyond_activation_peak(plan: Plan, stage: int, per_layer: float, freed_by_input: float,
                            pending, after_input=lambda chunk: 0.0) -> float:
    """What ``pending(chunk)`` (one microbatch's bytes, held from the chunk's I to its W)
    adds to the peak of the stage's activations: the order replayed, a forward making
    its chunk's layers' activations live, the I freeing ``freed_by_input`` of each layer
    and making ``pending`` live, the last backward block (B, or the W) freeing the rest;
    the most of both at once less the most of the activations alone, freed whole by the
    last backward block (planc.estimate.memory's count of the layers in flight). Where Ws
    are held back to the end of the order (DualPipeV's cool-down), few activations are
    left beside them. ``after_input(chunk)`` becomes live only once its I is done
    (counted elsewhere while it runs)."""
    count = len(plan.shard.pp.chunks)
    mine = [False] * count
    for c in plan.chunks_of_stage(stage):
        mine[c] = True
    layers = tuple(plan.shard.pp.chunk_layers(c) if mine[c] else 0 for c in range(count))
    reads = tuple(pending(c) if mine[c] else 0.0 for c in range(count))
    later = tuple(after_input(c) if mine[c] else 0.0 for c in range(count))
    return _pending_beyond_peak(plan.schedule.pipeline, stage, plan.mesh.pp,
                                plan.schedule.microbatches, plan.shard.pp.virtual,
                                tuple(n * per_layer for n in layers),
                                tuple(n * freed_by_input for n in layers), reads, later)


@functools.lru_cache(maxsize=1 << 16)
def _pending_beyond_peak(pipeline: str, stage: int, pp: int, microbatches: int, virtual: int,
                         activations: tuple[float, ...], freed: tuple[float, ...],
                         pending: tuple[float, ...], later: tuple[float, ...]) -> float:
    kinds = schedules.ActionKind
    # live: the activations freed whole by the last backward block (the peak the estimate
    # counts), left: as the runtime frees them, what an I frees at its end
    live = left = held = peak = both = 0.0
    for action in schedules.peak_order(pipeline, stage, pp, microbatches, virtual):
        chunk = action.chunk
        if action.kind.is_forward:
            live += activations[chunk]
            left += activations[chunk]
        elif action.kind in (kinds.BACKWARD_INPUT, kinds.BACKWARD):
            held += pending[chunk]
        peak, both = max(peak, live), max(both, left + held)
        if action.kind is kinds.BACKWARD_INPUT:
            held += later[chunk]
            left -= freed[chunk]
        if action.kind in _LAYERS_DONE:
            live -= activations[chunk]
            left -= activations[chunk] - (freed[chunk] if action.kind is
                                          kinds.BACKWARD_WEIGHT else 0.0)
        # a whole backward (DualPipeV's B) runs as an I block and its W block at once
        if action.kind in (kinds.BACKWARD_WEIGHT, kinds.BACKWARD):
            held -= pending[chunk] + \
                (later[chunk] if action.kind is kinds.BACKWARD_WEIGHT else 0.0)
    return both - peak
