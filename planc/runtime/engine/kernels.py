"""The compute steps every model family shares on one rank's shards, forward and backward.

Every compute instruction runs here on the local tensors its operands say it holds
(planc.program.operands; the compiler derived them from the node's tp layouts): a
column-parallel linear multiplies by its
columns, a vocabulary-parallel embedding looks up its rows and zeroes the rest,
attention runs on its heads and, under context parallelism, on the keys and values the
transfers brought. Dispatch goes through :data:`FORWARD`, keyed by the node's operator.

A forward step keeps what its backward needs; the backward step asks autograd for the
gradients of that one step (the inputs and the parameters it used). Attention is
``scaled_dot_product_attention``, PyTorch's fused kernel; the cross-entropy loss
(planc.runtime.families.loss) writes its gradient, softmax minus one-hot, out by hand.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from planc.graph.vocabulary import Op
from planc.program.operands import Operands, token_ranges
from planc.runtime.backward_passes import WeightRoots, input_half, weight_half
from planc.runtime.engine import fp8
from planc.runtime.engine.context import RankContext
from planc.runtime.families.compiled import compiled_formulas
from planc.runtime.families import family_kernels, loss
from planc.runtime.families.recomputed_output import (MADE_AGAIN, READS_MADE, Recipes,
                                                      taking_anew)
from planc.runtime.engine.model import split_feature
from planc.runtime.engine.ring_attention import Ring, ring_attention, step_masks

# The vocabulary-parallel loss's per-token statistics: no autograd, nothing kept.
LOSS_STATISTICS = (Op.LOSS_MAX, Op.LOSS_SUM_EXP)
RESIDUALS = (Op.ATTN_RESIDUAL, Op.MLP_RESIDUAL)
SUMMED = "summed"  # Saved.extra of a residual sum: its input ports' dtypes


@dataclass
class Saved:
    """What a forward step keeps for its backward."""

    inputs: dict[str, torch.Tensor]  # leaves, by input port
    params: dict[str, torch.Tensor]  # leaves, by global parameter name
    # where the output's gradient enters autograd's graph (None if run without one)
    output: "Output | torch.Tensor | None"
    extra: dict = field(default_factory=dict)
    # ZeRO-3: the whole buckets ``params`` are views of, by bucket; let go after the
    # forward and refilled before the backward (planc.runtime.engine.store)
    gathered: dict = field(default_factory=dict)
    # a split backward's input half: where its weight half starts (backward_passes)
    weight_roots: WeightRoots | None = None


@dataclass(frozen=True)
class Output:
    """What a backward needs of its forward's output: the edge its gradient enters
    autograd's graph by, and its dtype; not its values, which so are freed once the
    steps reading them have run unless autograd keeps them itself (the logits, a
    vocabulary wide, which the loss reads once and keeps as log-probabilities)."""

    edge: torch.autograd.graph.GradientEdge
    dtype: torch.dtype


def _kept(out):
    """The output as a forward step keeps it for its backward: its :class:`Output`
    where autograd made it, else itself (a leaf, a mixture's rows)."""
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        return Output(torch.autograd.graph.get_gradient_edge(out), out.dtype)
    return out


@dataclass(frozen=True)
class Peers:
    """A process group a compute step communicates over itself (a mixture of experts'
    all-to-alls over its ep group, its balance loss's counts over the ranks holding each
    sequence): the handle, the members, this rank's index."""

    group: object  # a process group
    members: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Spec:
    """A compute instruction as the kernels need it, read once from its operands."""

    op: Op
    layer: int | None
    seq_sharded: bool  # the input holds this tp rank's slice of the tokens
    replicated: bool  # every tp rank holds the whole input
    params: tuple[str, ...]
    param_slices: dict[str, tuple[str, int]]
    bias: str | None
    vocab_parallel: bool
    tokens: tuple[int, int, int] | None = None  # tp_overlap: the piece of tokens it runs
    ring: Ring | None = None  # ring attention: its cp ring (planc.runtime.engine.ring_attention)
    peers: Peers | None = None  # a mixture of experts: its ep group
    counts: Peers | None = None  # its balance loss: the ranks holding parts of a sequence
    # the program frees the step's input ``x`` after it: the step may write over it (the
    # loss over the logits)
    frees_input: bool = False
    # a recomputed forward: the input ports its recomputation takes from it (None: all)
    keeps_inputs: tuple[str, ...] | None = None
    # a cut mixture's FP8 experts: the received rows' bytes go after them (the compiler's
    # decision: planc.passes.split_dispatch)
    drops_rows: bool = False

    @staticmethod
    def of(operands: Operands, ring: Ring | None = None, peers: Peers | None = None,
           counts: Peers | None = None) -> "Spec":
        return Spec(Op(operands.kernel), operands.layer, operands.seq_sharded,
                    operands.replicated, operands.params, dict(operands.param_slices),
                    operands.bias, operands.vocab_parallel, operands.tokens, ring, peers,
                    counts, keeps_inputs=operands.keeps_inputs,
                    drops_rows=operands.drops_rows)


def _autograd_grad(outputs, grads, targets, retain_graph):
    return torch.autograd.grad(list(outputs), targets, list(grads), allow_unused=True,
                               retain_graph=retain_graph)


def _engine_grad(outputs, grads, targets, retain_graph):
    """``torch.autograd.grad`` without its argument handling: the engine call it ends in.
    A backward step asks for the vector-Jacobian product of its output (or, in a weight
    half, of the edges its input half kept) with gradients whose shapes the compiler or
    autograd made (planc.program.operands), so ``_make_grads``' normalisation and shape
    checks, a third of the call's CPU on a small layer's step (a profile of a 1-rank
    run, yappi), are redone work; the engine still checks the shapes itself."""
    return torch.autograd.graph._engine_run_backward(
        tuple(outputs), tuple(grads), retain_graph, False, tuple(targets), True,
        accumulate_grad=False)


# torch 2.13's internal entry point (the Makefile pins torch); any other torch: its API.
_vector_jacobian = _engine_grad if hasattr(torch.autograd.graph, "_engine_run_backward") \
    else _autograd_grad


def taken(table: dict[tuple, object], step: int) -> dict[tuple, object]:
    """The entries of ``table`` (keyed by step first: what the mixtures record of each
    step for the metrics and the balancing bias) of ``step``, removed from it."""
    return {key: table.pop(key) for key in [key for key in table if key[0] == step]}


def _leaf(port: str, value, keep_graph: bool):
    """An input as a forward step differentiates it: a tensor, detached; a cut mixture's
    rows between its instructions (planc.runtime.families.moe_dispatch.Routed), their
    tensor detached, differentiated where they are the step's data (port ``x``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(keep_graph and value.is_floating_point())
    return value.leaf(keep_graph and port == "x")


def _differentiated(value) -> torch.Tensor:
    """The tensor :func:`_leaf` made of an input: itself, or a Routed's rows."""
    return value if isinstance(value, torch.Tensor) else value.rows


class Kernels:
    def __init__(self, ctx: RankContext, buffers: dict[str, torch.Tensor] | None = None):
        self.ctx = ctx
        # the rank's state that is not trained, read by kernels (a mixture's balancing
        # bias: planc.runtime.engine.store.ParamStore.buffers)
        self.buffers = {} if buffers is None else buffers
        # (step, microbatch, layer) -> how many (token, slot) pairs chose each expert, what
        # the balancing bias's update sums (planc.runtime.engine.router_bias); None: the
        # program does not update a bias (an evaluation's), so nothing is counted
        self.chosen: dict[tuple, torch.Tensor] | None = None
        self.recipes = Recipes()  # optimize { recompute_activation }: outputs made again
        model = ctx.model
        self.hidden = model.hidden
        self.fp8 = fp8.recipe_of(model)  # None: GEMMs in the model's dtype
        self.head_dim = model.head_dim
        # The operators every family shares, then the family's own (its runtime module,
        # planc.runtime.families.NAME, as planc.models.NAME describes them).
        self.forward_table: dict[Op, Callable] = {
            Op.EMBEDDING: self._embedding, Op.POSITION: self._position,
            Op.QKV: self._linear, Op.PROJ: self._linear, Op.FC1: self._linear,
            Op.FC2: self._linear, Op.HEAD: self._head, Op.ATTN_RESIDUAL: self._residual,
            Op.MLP_RESIDUAL: self._residual,
            # the loss's kernels take the rank's context, not the kernels (loss.py)
            Op.LOSS: functools.partial(loss.loss_forward, ctx),
            Op.LOSS_MAX: functools.partial(loss.loss_max, ctx),
            Op.LOSS_SUM_EXP: functools.partial(loss.loss_sum_exp, ctx),
        }
        for op, kernel in family_kernels(model.family).items():
            self.forward_table[op] = functools.partial(kernel, self)
        # optimize { compile = on }: what the family's kernels run in place of their
        # eager formulas (planc.runtime.families.compiled); empty: eager
        self.compiled = compiled_formulas(model.family, ctx.device) \
            if model.compile_kernels else {}
        self._ring_masks: dict[Ring, list] = {}
        # id of a step's Spec -> whether its input half found where a weight half can
        # start (backward_passes.weight_splits): asked again only while it does
        self._splits: dict[int, bool] = {}
        # (step, microbatch, router) -> (rows this rank's experts ran, its ep group): what
        # the metrics report of the routing's balance (planc.runtime.step_records)
        self.routed: dict[tuple, tuple[int, tuple[int, ...]]] = {}
        # (step, microbatch, layer) -> (pairs dropped, pairs chosen) under capacity, for
        # the metrics; a recomputed forward drops the same and overwrites its own
        self.dropped: dict[tuple, tuple[int, int]] = {}

    def take_dropped(self, step: int) -> tuple[int, int] | None:
        """(pairs dropped, pairs chosen) by ``model { capacity }`` over this rank's
        mixtures in ``step``, or None (no capacity); forgets them."""
        values = list(taken(self.dropped, step).values())
        if not values:
            return None
        return sum(d for d, _ in values), sum(n for _, n in values)

    def take_routed(self, step: int) -> tuple[int, tuple[int, ...]] | None:
        """The rows this rank's experts ran in ``step`` and its ep group, or None (no
        experts split over ep here); forgets them."""
        values = list(taken(self.routed, step).values())
        if not values:
            return None
        return sum(rows for rows, _ in values), values[0][1]

    def ring_attention(self, spec: Spec, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over every cp rank's K/V block, run as
        the ring steps the instruction lists; which keys each step's queries see follows
        the token positions of the model table."""
        ring = spec.ring
        masks = self._ring_masks.get(ring)
        if masks is None:
            masks = self._ring_masks[ring] = step_masks(
                ring, self.ctx.positions(seq_sharded=False), self.ctx.block_positions,
                self.ctx.dtype)
        return ring_attention(q, k, v, ring, masks)

    def positions(self, spec: Spec) -> torch.Tensor:
        """Positions of the tokens a step's input holds (RoPE): its tp slice, or under
        tp_overlap its piece of the tokens (planc.program.operands.token_ranges)."""
        positions = self.ctx.positions(spec.seq_sharded)
        if spec.tokens is None:
            return positions
        return torch.cat([positions[a:b] for a, b in
                          token_ranges(positions.shape[0], *spec.tokens)])

    # --- forward -----------------------------------------------------------------------

    def forward(self, spec: Spec, inputs: dict[str, torch.Tensor],
                params: dict[str, torch.Tensor], step: int, microbatch: int,
                keep_graph: bool, piece_of=None) -> tuple[torch.Tensor, Saved]:
        """One forward compute node. ``params``: global name -> tensor as stored."""
        if spec.op in LOSS_STATISTICS:
            return self.forward_table[spec.op](spec, inputs, None, step, microbatch, {}), \
                Saved({}, {}, None)
        if spec.op is Op.LOSS:  # differentiated by hand: keeps only what its extra holds
            extra = {}
            with torch.no_grad():
                value = self.forward_table[spec.op](spec, inputs, None, step, microbatch,
                                                    extra)
            return extra.pop("report"), Saved({}, {}, value, extra)
        if spec.op in RESIDUALS and spec.bias is None and keep_graph:
            # the gradient of a sum is its output's, to each input: nothing to keep (the
            # inputs, which autograd would keep as leaves, are the two outputs of the
            # block's row-parallel linears, hidden wide, whose backward reads neither)
            with torch.no_grad():
                out = self.forward_table[spec.op](spec, inputs, None, step, microbatch, {})
            return out, Saved({}, {}, None, {SUMMED: {p: t.dtype for p, t in inputs.items()}})
        leaves = {port: _leaf(port, t, keep_graph) for port, t in inputs.items()}
        param_leaves = {n: t.detach().requires_grad_(keep_graph) for n, t in params.items()}
        dtype = self.ctx.dtype

        def p(name: str) -> torch.Tensor:
            value = param_leaves[name].to(dtype)
            sliced = spec.param_slices.get(name)
            if sliced is not None:
                dim, axis = sliced
                value = split_feature(value, dim, self.ctx.tp, self.ctx.tp_rank,
                                      self.ctx.model, axis)
            return value

        extra: dict = {}
        with torch.enable_grad() if keep_graph else torch.no_grad(), \
                taking_anew(leaves.get("x"), piece_of, keep_graph):  # tp_overlap's proj
            out = self.forward_table[spec.op](spec, leaves, p, step, microbatch, extra)
        kept = leaves if keep_graph or spec.keeps_inputs is None else \
            {port: t for port, t in leaves.items() if port in spec.keeps_inputs}
        saved = Saved(kept, param_leaves, _kept(out) if keep_graph else None, extra)
        # The loss's value for the report differs from the tensor to differentiate.
        return extra.pop("report", out), saved

    def _bias(self, spec: Spec, p) -> torch.Tensor | None:
        """A row-parallel producer's bias, added once its partial sum has been reduced."""
        return p(spec.bias) if spec.bias else None

    def _embedding(self, spec: Spec, x, p, step, mb, extra):
        ctx = self.ctx
        ids, _ = ctx.microbatch(step, mb, spec.seq_sharded)
        table = p(spec.params[0])
        if spec.vocab_parallel:
            rows = table.shape[0]
            local = ids - ctx.tp_rank * rows
            owned = (local >= 0) & (local < rows)
            return table[local.clamp(0, rows - 1)] * owned.unsqueeze(-1)
        return table[ids]

    def _position(self, spec: Spec, x, p, step, mb, extra):
        return x["x"] + p(spec.params[0])[self.ctx.positions(spec.seq_sharded)]

    def _linear(self, spec: Spec, x, p, step, mb, extra):
        """``x @ W`` (+ b); several weights (llama's q, k, v; gate, up) side by side in one
        GEMM."""
        data = x["x"]
        if self.reads_recipe(spec):
            return self.through_recipe(spec, data, extra, lambda: self._gemm(spec, data, p))
        return self._gemm(spec, data, p)

    def reads_recipe(self, spec: Spec) -> bool:
        """Whether the GEMM of ``spec`` keeps how to make its input again, as the model
        table says: down, the activation's output (optimize { recompute_activation }); q/k/v
        and the MLP's first, a norm's (optimize { recompute_norms })."""
        m = self.ctx.model
        return spec.op is Op.FC2 and m.recompute_activation or \
            spec.op in (Op.QKV, Op.FC1) and m.recompute_norms

    def through_recipe(self, spec: Spec, data: torch.Tensor, extra: dict, gemm):
        """``gemm()`` of ``data``, keeping how to make it again (Recipes.through); the
        GEMM's last piece lets the input go, and its backward's halves hold and release
        what they make (``extra``)."""
        last = spec.tokens is None or spec.tokens[0] + 1 == spec.tokens[1]
        made = self.recipes.pending()
        if made is not None:
            extra[READS_MADE] = made
        return self.recipes.through(data, gemm, spec.tokens, last)

    def _gemm(self, spec: Spec, data: torch.Tensor, p):
        weights = [name for name in spec.params if not name.endswith(".bias")]
        own_bias = [name for name in spec.params if name.endswith(".bias") and
                    name != spec.bias]
        if not own_bias:  # in FP8 with model { fp8 } (planc.runtime.engine.fp8)
            return fp8.matmul(data, [p(name) for name in weights], self.fp8)
        weight = p(weights[0]) if len(weights) == 1 else torch.cat(
            [p(name) for name in weights], dim=1)
        # One fused kernel, as nn.Linear's addmm: the bias is the GEMM's beta term.
        flat = torch.addmm(p(own_bias[0]), data.reshape(-1, data.shape[-1]), weight)
        return flat.view(*data.shape[:-1], flat.shape[-1])

    def _head(self, spec: Spec, x, p, step, mb, extra):
        (table,) = spec.params
        value = p(table)
        # A tied head is the transposed embedding table (vocab x hidden).
        return x["x"] @ (value.t() if table == "embedding.weight" else value)

    def _residual(self, spec: Spec, x, p, step, mb, extra):
        out = x["skip"] + x["x"]
        bias = self._bias(spec, p)
        return out if bias is None else out + bias

    # --- backward ----------------------------------------------------------------------

    def backward(self, spec: Spec, saved: Saved, grad: torch.Tensor | None,
                 inputs: bool = True, params: bool = True, kept: int | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Gradients of one compute node: (by input port, by parameter name). A split
        backward asks for the inputs' first (keeping autograd's graph), then the
        parameters'; ``kept``: the bytes its weight half would keep of ``grad`` (as it
        came: FP8 rows stay FP8), its own size if not given."""
        if spec.op == Op.LOSS:  # no parameters: a weight step has nothing to do
            return (loss.loss_backward(self.ctx, saved.extra) if inputs else {}), {}
        if SUMMED in saved.extra:  # a residual sum without a bias
            return ({port: grad.to(dtype) for port, dtype in saved.extra[SUMMED].items()}
                    if inputs else {}), {}
        wanted_inputs = [(port, t) for port, t in
                         ((port, _differentiated(v)) for port, v in saved.inputs.items())
                         if t.requires_grad] if inputs else []
        wanted_params = list(saved.params.items()) if params else []
        reads = saved.extra.get(READS_MADE)
        if reads is not None and inputs != params:  # one half of a split backward
            if inputs:
                reads.hold()
            else:
                reads.release()
        if saved.weight_roots is not None and not inputs:
            found = weight_half(saved.weight_roots, [t for _, t in wanted_params],
                                _vector_jacobian)
            return {}, {name: g for (name, _), g in zip(wanted_params, found)
                        if g is not None}
        targets = [t for _, t in wanted_inputs] + [t for _, t in wanted_params]
        output = saved.output
        if output is None or not targets:
            return {}, {}
        edge = output.edge if isinstance(output, Output) else output
        run = functools.partial(_vector_jacobian, (edge,), (grad.to(output.dtype),),
                                targets, retain_graph=not params)
        if not params and saved.params and self._splits.get(id(spec), True):
            # the weight half may start where the paths to the weights part
            # (backward_passes), not from the output gradient
            grads, saved.weight_roots = input_half(
                run, edge.node, targets, list(saved.params.values()),
                grad.nbytes if kept is None else kept)
            self._splits[id(spec)] = saved.weight_roots is not None
            if saved.weight_roots is not None:
                saved.output = None  # what the input half alone read goes now
        else:
            grads = run()
        made = saved.extra.pop(MADE_AGAIN, None)
        if made is not None:  # an activation's outputs a deferred weight half will read
            made.settle()
        count = len(wanted_inputs)
        ports = {port: torch.zeros_like(tensor) if g is None else g
                 for (port, tensor), g in zip(wanted_inputs, grads[:count])}
        named = {name: g for (name, _), g in zip(wanted_params, grads[count:])
                 if g is not None}
        return ports, named
