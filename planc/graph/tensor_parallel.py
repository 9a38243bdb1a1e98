"""Layout propagation over the tp axis: which layout every activation takes.

Each operator can run in a few ways given its parameter's placement (a column-parallel
linear needs a replicated input and yields a shard of its output features, a
row-parallel one needs a shard of its input features and yields a partial sum, a
replicated one runs on whatever it is given, ...). The residual stream's layout is
fixed by the plan: replicated, or sharded along the sequence with
``sequence_parallel`` (Korthikanti et al. 2022). Between two fixed points the
operators form short chains (embedding; attention branch; MLP branch; head and
loss); for each chain every combination of ways is tried, transfers are inserted
with :func:`planc.graph.layouts.redistribute` forward and backward, and the
combination of least estimated time per step wins (ties go to the earlier, more
sharded way). For Megatron's placements this reproduces Megatron exactly; for any
other placement it is the cheapest correct derivation.

A row-parallel linear's bias is added by its consumer once the partial sum has been
reduced, as Megatron's fused bias-GeLU and bias-dropout-add kernels do, so the bias
is added exactly once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from planc.cost import CostModel
from planc.graph.layouts import (R, IllegalRedistribution, Layout, P, S, gradient_layout,
                                 redistribute)
from planc.graph.model import LINEAR_DIMS, OUTPUT_TENSOR, Shapes, forward_flops
from planc.layout import Layout as RankLayout
from planc.plan import Plan

LOSS_REDUCTIONS = ("max", "sum_exp")  # vocabulary-parallel cross-entropy (Megatron)
FP32_BYTES = 4


@dataclass(frozen=True)
class ParamUse:
    """A parameter as one operator uses it, over the tp axis."""

    name: str  # within its layer: "qkv.weight"; or a global name: "embedding.weight"
    storage: Layout  # how the parameter is stored over tp
    data: Layout  # the layout of the activation it is applied to
    dims: tuple[str, ...]
    axis: int | None = None  # which tensor axis ``storage`` shards (dims may repeat a name)

    @property
    def storage_axis(self) -> int:
        return self.axis if self.axis is not None else self.dims.index(self.storage.dim)

    def local_gradient(self) -> Layout:
        """Layout of the gradient each rank computes for this use.

        A sharded parameter gets the gradient of its own shard. A replicated one
        applied to replicated data gets the whole gradient everywhere; applied to data
        sharded along one of its own dimensions, only its slice's gradient; applied to
        data sharded along another dimension (tokens), a partial sum.
        """
        if self.storage.is_sharded:
            return self.storage
        if self.data.is_sharded:
            return S(self.data.dim) if self.data.dim in self.dims else P
        return R

    def gradient_transfer(self):
        return redistribute(self.local_gradient(), gradient_layout(self.storage))


@dataclass(frozen=True)
class Choice:
    input: Layout
    output: Layout
    grad_input: Layout  # layout of the gradient the operator returns for its input
    sharded: bool  # whether its FLOPs are split over tp
    params: tuple[ParamUse, ...] = ()


@dataclass(frozen=True)
class OpLayout:
    """How one operator runs over tp, as chosen."""

    op: str
    input: Layout
    output: Layout
    grad_input: Layout
    sharded: bool
    params: tuple[ParamUse, ...]
    bias_from: str | None = None  # producer whose (deferred) bias this operator adds


def _linear(name: str, placement: str) -> list[Choice]:
    fan_in, fan_out = LINEAR_DIMS[name]
    weight, bias = f"{name}.weight", f"{name}.bias"
    has_bias = name != "head"

    def uses(storage_w: Layout, storage_b: Layout, data: Layout, bias_here: bool = True,
             axis: int | None = None):
        used = [ParamUse(weight, storage_w, data, (fan_in, fan_out), axis)]
        if has_bias and bias_here:
            used.append(ParamUse(bias, storage_b, data, (fan_out,),
                                 0 if storage_b.is_sharded else None))
        return tuple(used)

    # The weight is (in, out): column-parallel shards axis 1, row-parallel axis 0 (the
    # names alone cannot say which: proj's weight is hidden x hidden).
    if placement in ("column", "vocab"):
        return [Choice(R, S(fan_out), P, True, uses(S(fan_out), S(fan_out), R, axis=1))]
    if placement == "row":
        # The bias is added after the partial sum is reduced, by the consumer.
        return [Choice(S(fan_in), P, S(fan_in), True,
                       uses(S(fan_in), R, S(fan_in), False, axis=0))]
    return [Choice(R, R, R, False, uses(R, R, R)),
            Choice(S("seq"), S("seq"), S("seq"), True, uses(R, R, S("seq")))]


def _pointwise(dim: str) -> list[Choice]:
    return [Choice(R, R, R, False), Choice(S(dim), S(dim), S(dim), True),
            Choice(S("seq"), S("seq"), S("seq"), True)]


def _layer_norm(name: str, stream: Layout) -> list[Choice]:
    params = tuple(ParamUse(f"{name}.{p}", R, stream, ("hidden",)) for p in ("weight", "bias"))
    return [Choice(stream, stream, stream, stream.is_sharded, params)]


def choices(op: str, plan: Plan, stream: Layout) -> list[Choice]:
    """Every way to run ``op`` over tp given the plan's placements."""
    t = plan.shard.tp
    if op in ("qkv", "proj", "fc1", "fc2"):
        return _linear(op, getattr(t, op))
    if op == "head":
        if plan.model.tie_embeddings:  # the head is the transposed embedding table
            return [Choice(c.input, c.output, c.grad_input, c.sharded,
                           tuple(ParamUse("embedding.weight", u.storage, u.data,
                                          ("vocab", "hidden"),
                                          0 if u.storage.is_sharded else None)
                                 for u in c.params))
                    for c in _linear("head", t.head)]
        return _linear("head", t.head)
    if op == "attention":
        # Whole heads per rank, or every head everywhere; never split along tokens over
        # tp, since every query needs every key.
        return [Choice(S("qkv"), S("hidden"), S("qkv"), True), Choice(R, R, R, False)]
    if op == "gelu":
        return _pointwise("ffn")
    if op in ("ln1", "ln2", "final_ln"):
        return _layer_norm(op, stream)
    if op in ("attn_residual", "mlp_residual"):
        return [Choice(stream, stream, stream, stream.is_sharded)]
    if op == "position":
        return [Choice(stream, stream, stream, stream.is_sharded,
                       (ParamUse("position.weight", R, stream, ("seq", "hidden")),))]
    if op == "embedding":
        table = "embedding.weight"
        dims = ("vocab", "hidden")
        if t.embedding == "vocab":  # each rank looks up its rows; others give zeros
            return [Choice(R, P, R, True, (ParamUse(table, S("vocab"), R, dims),))]
        if t.embedding == "hidden":
            return [Choice(R, S("hidden"), R, True, (ParamUse(table, S("hidden"), R, dims),))]
        return [Choice(R, R, R, False, (ParamUse(table, R, R, dims),)),
                Choice(S("seq"), S("seq"), S("seq"), True, (ParamUse(table, R, S("seq"), dims),))]
    if op == "loss":
        return [Choice(S("vocab"), P, S("vocab"), True), Choice(R, R, R, False),
                Choice(S("seq"), P, S("seq"), True)]
    raise KeyError(op)


def _replicated(op: str, plan: Plan, stream: Layout) -> Choice:
    """With tp = 1 every operator runs whole, as if every placement were replicate (a
    row-parallel bias is then the linear's own again)."""
    if op in ("qkv", "proj", "fc1", "fc2", "head"):
        first = _linear(op, "replicate")[0]
        if op == "head" and plan.model.tie_embeddings:
            first = Choice(R, R, R, False, (ParamUse("embedding.weight", R, R,
                                                     ("vocab", "hidden")),))
    else:
        first = choices(op, plan, stream)[0]
    return Choice(R, R, R, False, tuple(ParamUse(u.name, R, R, u.dims)
                                        for u in first.params))


CHAINS = {
    "embedding": ("embedding", "position"),
    "attention": ("ln1", "qkv", "attention", "proj", "attn_residual"),
    "mlp": ("ln2", "fc1", "gelu", "fc2", "mlp_residual"),
    "head": ("final_ln", "head", "loss"),
}


@dataclass(frozen=True)
class TensorParallelPlan:
    stream: Layout  # the residual stream: R, or S(seq) with sequence parallelism
    ops: dict[str, OpLayout]
    seconds: dict[str, float]  # estimated time per step of each chain's choice


class _Coster:
    """Estimated seconds per step of a chain's choices, by the shared cost model."""

    def __init__(self, plan: Plan, shapes: Shapes):
        self.plan, self.shapes = plan, shapes
        self.cost = CostModel(plan.topology)
        self.tp = plan.mesh.tp
        self.crosses_nodes = RankLayout.of(plan).crosses_nodes("tp")
        self.microbatches = plan.schedule.microbatches

    def transfer(self, redistribution, nbytes: float) -> float:
        if redistribution is None or not redistribution.is_transfer:
            return 0.0
        size = nbytes * redistribution.buffer_fraction(self.tp)
        # A tiny constant per transfer breaks ties towards fewer transfers.
        return self.cost.transfer_seconds(redistribution.kind, size, self.tp,
                                          self.crosses_nodes) + 1e-12

    def parameter(self, use: ParamUse, elements: int) -> float:
        return self.transfer(use.gradient_transfer(), elements * self.shapes.dtype_bytes)

    def compute(self, op: str, sharded: bool) -> float:
        flops = 3 * forward_flops(op, self.shapes)  # forward and backward
        return self.cost.compute_seconds(flops / (self.tp if sharded else 1))


def _param_elements(plan: Plan, name: str) -> int:
    m = plan.model
    h = m.hidden
    sizes = {"qkv.weight": h * 3 * h, "qkv.bias": 3 * h, "proj.weight": h * h, "proj.bias": h,
             "fc1.weight": h * m.ffn, "fc1.bias": m.ffn, "fc2.weight": m.ffn * h,
             "fc2.bias": h, "head.weight": h * m.vocab, "embedding.weight": m.vocab * h,
             "position.weight": m.seq * h}
    return sizes.get(name, h)  # LayerNorm weights and biases


def _evaluate(ops: tuple[str, ...], picks: tuple[Choice, ...], source: Layout,
              coster: _Coster, shapes: Shapes, plan: Plan, tied_gradient: Layout | None):
    """(seconds per step, OpLayouts) of one combination, or None if it is illegal.

    ``tied_gradient``: with tied embeddings, the layout of the embedding's own gradient;
    the head's use of the same table must produce its gradient in the same layout, so
    that the two can be summed before any fix-up.
    """
    total = 0.0
    layout, tensor, producer = source, "stream", None
    chosen = []
    for op, pick in zip(ops, picks):
        try:
            forward = redistribute(layout, pick.input)
            backward = redistribute(pick.grad_input, gradient_layout(layout))
        except IllegalRedistribution:
            return None
        if op == "loss" and forward is not None and forward.is_transfer:
            return None  # the loss never gathers the logits (docs/semantics.md, 1)
        if tied_gradient is not None and any(u.name == "embedding.weight" and
                                             u.local_gradient() != tied_gradient
                                             for u in pick.params):
            return None
        nbytes = shapes.bytes(tensor)
        total += coster.microbatches * (coster.transfer(forward, nbytes)
                                        + coster.transfer(backward, nbytes)
                                        + coster.compute(op, pick.sharded))
        params, bias_from = pick.params, None
        if layout.is_partial and producer in LINEAR_DIMS and producer != "head":
            # The producer's bias, deferred past the reduction of its partial sum.
            fan_out = LINEAR_DIMS[producer][1]
            params = params + (ParamUse(f"{producer}.bias", R, pick.input, (fan_out,)),)
            bias_from = producer
        for use in params:
            total += coster.parameter(use, _param_elements(plan, use.name))
        if op == "loss" and pick.input == S("vocab"):
            total += coster.microbatches * len(LOSS_REDUCTIONS) * coster.transfer(
                redistribute(P, R), shapes.elements("tokens") * FP32_BYTES)
        chosen.append(OpLayout(op, pick.input, pick.output, pick.grad_input, pick.sharded,
                               params, bias_from))
        layout, tensor, producer = pick.output, OUTPUT_TENSOR[op], op
    return total, chosen


def _choose_chain(name: str, plan: Plan, stream: Layout, coster: _Coster, shapes: Shapes,
                  tied_gradient: Layout | None = None):
    ops = CHAINS[name]
    if plan.mesh.tp == 1:
        options = [[_replicated(op, plan, stream)] for op in ops]
    else:
        options = [choices(op, plan, stream) for op in ops]
    best = None
    for picks in itertools.product(*options):
        # The embedding's token ids come from the data loader, in whatever layout the
        # embedding asks for; every other chain starts from the residual stream.
        source = picks[0].input if name == "embedding" else stream
        result = _evaluate(ops, picks, source, coster, shapes, plan,
                           tied_gradient if name == "head" else None)
        if result is not None and (best is None or result[0] < best[0] - 1e-15):
            best = result
    if best is None:
        raise AssertionError(f"no legal layout for the {name} chain")  # cannot happen
    return best


def plan_tensor_parallel(plan: Plan) -> TensorParallelPlan:
    stream = S("seq") if (plan.shard.tp.sequence_parallel and plan.mesh.tp > 1) else R
    shapes = Shapes.of(plan)
    coster = _Coster(plan, shapes)
    ops: dict[str, OpLayout] = {}
    seconds: dict[str, float] = {}
    tied = None
    for name in CHAINS:
        seconds[name], chosen = _choose_chain(name, plan, stream, coster, shapes, tied)
        ops.update((item.op, item) for item in chosen)
        if name == "embedding" and plan.model.tie_embeddings:
            tied = ops["embedding"].params[0].local_gradient()
    return TensorParallelPlan(stream, ops, seconds)
