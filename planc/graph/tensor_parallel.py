"""Layout propagation over the tp axis: which layout every activation takes.

Each operator can run in a few ways given its parameter's placement (a column-parallel
linear needs a replicated input and yields a shard of its output features, a
row-parallel one needs a shard of its input features and yields a partial sum, a
replicated one runs on whatever it is given, ...). The residual stream's layout is
fixed by the plan: replicated, or sharded along the sequence with
``sequence_parallel`` (Korthikanti et al. 2022). Between two fixed points the
operators form short chains (embedding; attention branch; MLP branch; head and
loss); for each chain every combination of ways is tried, transfers are inserted
with :func:`planc.graph.sharding.redistribute` forward and backward, and the
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

from planc.estimate.cost import CostModel
from planc.graph.sharding import (R, IllegalRedistribution, Layout, P, S, gradient_layout,
                                 redistribute)
from planc.estimate.model import Shapes, forward_flops, split_flops
from planc.plan.layout import Layout as RankLayout
from planc.models import family_of
from planc.models.family import OpRule
from planc.models.family import shares_heads as family_shares_heads
from planc.plan.plan import Plan

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
    # A replicated parameter each rank applies through its slice ``(dim, axis)`` of it,
    # a slice that other ranks share (k and v with fewer kv heads than tp ranks).
    shared_slice: tuple[str, int] | None = None
    # A replicated parameter applied to replicated data whose use feeds only this rank's
    # share of the operator's outputs (a latent that the rank's heads read): partial.
    partial: bool = False

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
        if self.shared_slice is not None or self.partial:
            return P  # every rank's slice gradient, zero elsewhere: summed over tp
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


def shares_heads(plan: Plan, dim: str) -> bool:
    return family_shares_heads(family_of(plan), plan.model, plan.mesh.tp, dim)


def _linear(rule: OpRule, placement: str, plan: Plan) -> list[Choice]:
    """The ways to run a linear operator: its weights' outputs side by side along
    ``rule.output_dim``, plus the optional bias, then its ``params`` that the model has
    (a norm of each head's features, Qwen3's q/k norms), whole on every rank: applied to
    a column shard's heads, each rank's gradient of them is a partial sum."""
    out, fan = rule.output_dim, rule.input_dim
    whole = _rule_params(rule, plan)

    def norms(data: Layout, partial: bool = False):
        return tuple(ParamUse(name, R, data, d, partial=partial) for name, d in whole)

    def weights(storage_of, data: Layout, axis: int | None):
        return tuple(ParamUse(w.name, storage_of(w), data, (w.fan_in, w.fan_out), axis)
                     for w in rule.weights)

    def bias(storage: Layout, data: Layout):
        if rule.bias is None:
            return ()
        return (ParamUse(rule.bias, storage, data, (out,), 0 if storage.is_sharded else None),)

    # The weight is (in, out): column-parallel shards axis 1, row-parallel axis 0 (the
    # names alone cannot say which: proj's weight is hidden x hidden).
    if placement in ("column", "vocab"):
        uses = []
        for w in rule.weights:
            if shares_heads(plan, w.fan_out):
                uses.append(ParamUse(w.name, R, R, (w.fan_in, w.fan_out),
                                     shared_slice=(w.fan_out, 1)))
            else:
                uses.append(ParamUse(w.name, S(w.fan_out), R, (w.fan_in, w.fan_out), 1))
        return [Choice(R, S(out), P, True, tuple(uses) + bias(S(out), R) + norms(R, True))]
    if placement == "row":
        # The bias is added after the partial sum is reduced, by the consumer.
        return [Choice(S(fan), P, S(fan), True, weights(lambda w: S(w.fan_in), S(fan), 0))]
    return [Choice(R, R, R, False, weights(lambda w: R, R, None) + bias(R, R) + norms(R)),
            Choice(S("seq"), S("seq"), S("seq"), True,
                   weights(lambda w: R, S("seq"), None) + bias(R, S("seq"))
                   + norms(S("seq")))]


def _pointwise(rule: OpRule) -> list[Choice]:
    return [Choice(R, R, R, False),
            Choice(S(rule.input_dim), S(rule.output_dim), S(rule.input_dim), True),
            Choice(S("seq"), S("seq"), S("seq"), True)]


def _norm(rule: OpRule, stream: Layout) -> list[Choice]:
    params = tuple(ParamUse(p, R, stream, ("hidden",)) for p in rule.params)
    return [Choice(stream, stream, stream, stream.is_sharded, params)]


def choices(op: str, plan: Plan, stream: Layout) -> list[Choice]:
    """Every way to run ``op`` over tp given the plan's placements."""
    t = plan.shard.tp
    rule = family_of(plan).rules[op]
    if op == "head":
        if plan.model.tie_embeddings:  # the head is the transposed embedding table
            return [Choice(c.input, c.output, c.grad_input, c.sharded,
                           tuple(ParamUse("embedding.weight", u.storage, u.data,
                                          ("vocab", "hidden"),
                                          0 if u.storage.is_sharded else None)
                                 for u in c.params))
                    for c in _linear(rule, t.head, plan)]
        return _linear(rule, t.head, plan)
    if rule.kind == "linear":
        return _linear(rule, getattr(t, rule.placement), plan)
    if rule.kind == "attention":
        # Whole heads per rank, or every head everywhere; never split along tokens over
        # tp, since every query needs every key. Shared kv heads are never gathered back
        # (their copies' gradients are partial): attention takes the heads qkv made.
        if shares_heads(plan, "kv"):
            return [Choice(S("qkv"), S("hidden"), S("qkv"), True)] if t.qkv == "column" \
                else [Choice(R, R, R, False)]
        return [Choice(S("qkv"), S("hidden"), S("qkv"), True), Choice(R, R, R, False)]
    if rule.kind == "pointwise":
        return _pointwise(rule)
    if rule.kind == "norm":
        return _norm(rule, stream)
    if rule.kind == "tokenwise":
        # Each token by itself through replicated weights (a mixture of experts with its
        # experts whole on every tp rank): on every token, or on this rank's share of
        # them, as Megatron-Core splits the tokens over tp before routing; a weight's
        # gradient is then a partial sum over tp.
        uses = _rule_params(rule, plan)
        if rule.column_weights and getattr(t, rule.placement) == "column":
            return [_column_tokenwise(rule, uses)]
        whole = Choice(R, R, R, False, tuple(ParamUse(n, R, R, d) for n, d in uses))
        share = Choice(S("seq"), S("seq"), S("seq"), True,
                       tuple(ParamUse(n, R, S("seq"), d) for n, d in uses))
        # Each tp rank dispatches its own tokens (Megatron-Core); a statistic of each
        # sequence sums its counts over the tp x cp ranks holding the sequence's tokens,
        # so that no tp rank repeats another's share.
        if rule.expert_parallel and plan.mesh.ep > 1 or rule.sums_over_sequences(plan.model):
            return [share]
        return [whole, share]
    if rule.kind == "residual":
        return [Choice(stream, stream, stream, stream.is_sharded)]
    if rule.kind == "position":
        return [Choice(stream, stream, stream, stream.is_sharded,
                       (ParamUse(rule.params[0], R, stream, ("seq", "hidden")),))]
    if rule.kind == "embedding":
        table = "embedding.weight"
        dims = ("vocab", "hidden")
        if t.embedding == "vocab":  # each rank looks up its rows; others give zeros
            return [Choice(R, P, R, True, (ParamUse(table, S("vocab"), R, dims),))]
        if t.embedding == "hidden":
            return [Choice(R, S("hidden"), R, True, (ParamUse(table, S("hidden"), R, dims),))]
        return [Choice(R, R, R, False, (ParamUse(table, R, R, dims),)),
                Choice(S("seq"), S("seq"), S("seq"), True, (ParamUse(table, R, S("seq"), dims),))]
    if rule.kind == "loss":
        return [Choice(S("vocab"), P, S("vocab"), True), Choice(R, R, R, False),
                Choice(S("seq"), P, S("seq"), True)]
    raise KeyError(op)


def _column_tokenwise(rule: OpRule, uses: list[tuple[str, tuple[str, ...]]]) -> Choice:
    """A tokenwise operator whose column weights are split along their outputs (its
    heads), every token on every rank: its input replicated, its output the rank's
    share of ``rule.output_dim``, its input's gradient and its other parameters' partial
    sums over tp (Megatron-Core's multi-latent attention: each rank reads the whole
    latents through its own heads' up-projections)."""
    column = {w.name: w for w in rule.column_weights}
    params = tuple(
        ParamUse(name, S(column[name].fan_out), R, dims, 1) if name in column
        else ParamUse(name, R, R, dims, partial=True) for name, dims in uses)
    return Choice(R, S(rule.output_dim), P, True, params)


def features_split_flops(op: str, shapes: Shapes, tp: int, way: "Choice | OpLayout"
                         ) -> float | None:
    """The forward FLOPs of one tp rank of ``op`` run ``way`` where its split over the
    features leaves part of the work whole on every rank (multi-head latent attention's
    latents: planc.estimate.model.split_flops); None where ``way`` divides the work evenly
    over tp (its tokens, or a linear's features) or runs it whole."""
    if not way.sharded or way.input == S("seq"):
        return None
    return split_flops(op, shapes, tp)


def _replicated(op: str, plan: Plan, stream: Layout) -> Choice:
    """With tp = 1 every operator runs whole, as if every placement were replicate (a
    row-parallel bias is then the linear's own again)."""
    rule = family_of(plan).rules[op]
    if rule.kind == "linear":
        first = _linear(rule, "replicate", plan)[0]
        if op == "head" and plan.model.tie_embeddings:
            first = Choice(R, R, R, False, (ParamUse("embedding.weight", R, R,
                                                     ("vocab", "hidden")),))
    else:
        first = choices(op, plan, stream)[0]
    return Choice(R, R, R, False, tuple(ParamUse(u.name, R, R, u.dims)
                                        for u in first.params))


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
        self.elements = _param_elements(plan)

    def transfer(self, redistribution, nbytes: float) -> float:
        if redistribution is None or not redistribution.is_transfer:
            return 0.0
        size = nbytes * redistribution.buffer_fraction(self.tp)
        # A tiny constant per transfer breaks ties towards fewer transfers.
        return self.cost.transfer_seconds(redistribution.kind, size, self.tp,
                                          self.crosses_nodes) + 1e-12

    def parameter(self, use: ParamUse, elements: int) -> float:
        return self.transfer(use.gradient_transfer(), elements * self.shapes.dtype_bytes)

    def compute(self, op: str, choice: Choice) -> float:
        own = features_split_flops(op, self.shapes, self.tp, choice)
        if own is not None:
            return self.cost.compute_seconds(3 * own)
        flops = 3 * forward_flops(op, self.shapes)  # forward and backward
        return self.cost.compute_seconds(flops / (self.tp if choice.sharded else 1))


def _param_elements(plan: Plan) -> dict[str, int]:
    """Elements of every parameter, by its name within a block (or its global name)."""
    sizes = {}
    family = family_of(plan)
    for layer in _layer_kinds(plan):
        for param in family.layer_parameters(plan.model, layer):
            sizes[param.name.removeprefix(f"layers.{layer}.")] = param.numel
    for param in family.embedding_parameters(plan.model) + family.head_parameters(plan.model):
        sizes[param.name] = param.numel
    return sizes


def _rule_params(rule: OpRule, plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    """(name, dimensions) of the operator's ``params`` that the plan's model has (an
    optional one, as Qwen3's q/k norms, only where a key asks for it)."""
    if not rule.params:
        return []
    dims = _param_dims(plan)
    return [(name, dims[name]) for name in rule.params if name in dims]


def _param_dims(plan: Plan) -> dict[str, tuple[str, ...]]:
    """The dimension names of every block parameter, by its name within a block."""
    family = family_of(plan)
    return {p.name.removeprefix(f"layers.{layer}."): p.dims for layer in _layer_kinds(plan)
            for p in family.layer_parameters(plan.model, layer)}


def _layer_kinds(plan: Plan) -> list[int]:
    """One layer of each kind of block the model has (all alike but a mixture of experts'
    dense first layers)."""
    family = family_of(plan)
    if family.layer_block is None:
        return [0]
    first: dict[tuple[str, ...], int] = {}
    for layer in range(plan.model.layers):
        first.setdefault(family.block(plan.model, layer)[0], layer)
    return sorted(first.values())


def _used_chains(plan: Plan) -> list[str]:
    """The layout-search chains whose operators some block of this model has."""
    family = family_of(plan)
    used = set(family.embedding_ops) | set(family.head_ops)
    for layer in _layer_kinds(plan):
        used.update(family.block(plan.model, layer)[0])
    return [name for name, ops in family.chains.items() if set(ops) <= used]


def _evaluate(ops: tuple[str, ...], picks: tuple[Choice, ...], source: Layout,
              coster: _Coster, shapes: Shapes, plan: Plan, tied_gradient: Layout | None,
              stream: Layout):
    """(seconds per step, OpLayouts) of one combination, or None if it is illegal.

    ``tied_gradient``: with tied embeddings, the layout of the embedding's own gradient;
    the head's use of the same table must produce its gradient in the same layout, so
    that the two can be summed before any fix-up.
    """
    total = 0.0
    family = family_of(plan)
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
                                        + coster.compute(op, pick))
        params, bias_from = pick.params, None
        rule = family.linear_rule(producer) if producer else None
        if layout.is_partial and rule is not None and rule.bias is not None:
            # The producer's bias, deferred past the reduction of its partial sum.
            params = params + (ParamUse(rule.bias, R, pick.input, (rule.output_dim,)),)
            bias_from = producer
        for use in params:
            total += coster.parameter(use, coster.elements[use.name])
        if op == "loss" and pick.input == S("vocab"):
            total += coster.microbatches * len(LOSS_REDUCTIONS) * coster.transfer(
                redistribute(P, R), shapes.elements("tokens") * FP32_BYTES)
        chosen.append(OpLayout(op, pick.input, pick.output, pick.grad_input, pick.sharded,
                               params, bias_from))
        layout, tensor, producer = pick.output, family.output_tensor[op], op
    if ops == family.embedding_ops and layout != stream:
        # The blocks read the residual stream: the embedding's output is moved there.
        try:
            forward = redistribute(layout, stream)
            backward = redistribute(gradient_layout(stream), gradient_layout(layout))
        except IllegalRedistribution:
            return None
        total += coster.microbatches * (coster.transfer(forward, shapes.bytes("stream"))
                                        + coster.transfer(backward, shapes.bytes("stream")))
    return total, chosen


def _choose_chain(name: str, plan: Plan, stream: Layout, coster: _Coster, shapes: Shapes,
                  tied_gradient: Layout | None = None):
    ops = family_of(plan).chains[name]
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
                           tied_gradient if name == "head" else None, stream)
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
    for name in _used_chains(plan):
        seconds[name], chosen = _choose_chain(name, plan, stream, coster, shapes, tied)
        ops.update((item.op, item) for item in chosen)
        if name == "embedding" and plan.model.tie_embeddings:
            tied = ops["embedding"].params[0].local_gradient()
    return TensorParallelPlan(stream, ops, seconds)
