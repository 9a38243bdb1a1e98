"""What each instruction does, whatever stream it runs on.

Every instruction a program names is bound once, when the run starts, to a compute
kernel (:mod:`planc.runtime.engine.kernels`) or a transfer (:mod:`planc.runtime.engine.transfers`),
from the operands the compiler wrote on it (:mod:`planc.program.operands`): which buffer
feeds which port, which gradient a backward step's output carries, where the consumer
takes its own slice of a replicated value, its group. Running an instruction is then a
table lookup and a call; nothing about the plan is decided here.

Buffers of a step are keyed by (node, microbatch), microbatch None for once-per-step
values. Parameter gradients do not go through buffers: backward steps add them into
their bucket's gradient buffer (planc.runtime.engine.store).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from planc.graph.vocabulary import Op
from planc.program.operands import Input, StepKind
from planc.program.program import Instruction, Opcode, Program
from planc.runtime.engine import fp8, grad_norm, router_bias
from planc.runtime.engine import store as buckets
from planc.runtime.engine.bound import BoundCompute, BoundTransfer, unbound
from planc.runtime.engine.context import RankContext, pp_group_key
from planc.runtime.engine.kernels import Kernels, Peers, Saved
from planc.runtime.engine.model import join_tokens, select_tokens, split_feature
from planc.runtime.engine.optim import BucketOptimizer
from planc.runtime.engine.ring_attention import Ring
from planc.runtime.engine.store import ParamStore
from planc.runtime.engine.routes import resolve
from planc.runtime.engine.transfers import Call, Transfers


# Steps that look a parameter up (a table's rows): their backward does not keep it.
LOOKUPS = (Op.EMBEDDING, Op.POSITION)


@dataclass
class StepState:
    step: int
    buffers: dict[tuple[str, int | None], object] = field(default_factory=dict)
    saved: dict[tuple[str, int | None], Saved] = field(default_factory=dict)
    # Held as tensors while the step runs and read once it has ended (settled): reading
    # a number off a CUDA tensor mid-step would stop the host thread that issues every
    # stream until the device caught up, and the backward would wait for it.
    loss: float | torch.Tensor | None = None
    grad_norm: float | torch.Tensor | None = None  # train { grad_clip }: before clipping
    # model moe { bias_update }: the busiest expert's load over the mean, the stage's
    # worst block, as the update read the step's loads
    expert_imbalance: float | torch.Tensor | None = None
    # the parameters in the model's dtype, cast once a step for every microbatch (by name
    # and CUDA stream): a cast for each forward was a copy of the weights that autograd
    # kept for every microbatch in flight
    casts: dict = field(default_factory=dict)
    # the forward's gathered storage let go, by (gather, microbatch), until the backward's
    # gather fills it: ZeRO-3's whole buckets, regathered GEMM inputs
    # (planc.runtime.engine.store)
    let_go: dict = field(default_factory=dict)

    def settle(self) -> "StepState":
        """The step's figures as numbers, once its work is done; the step's parameter
        copies let go (the state outlives the step in its result)."""
        self.casts.clear()
        self.let_go.clear()
        for name in ("loss", "grad_norm", "expert_imbalance"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, float(value))
        return self


def combine(values: list[torch.Tensor]) -> torch.Tensor:
    """Sum gradient contributions; a K/V gradient (narrower) adds to the k and v heads at
    the end of a [q | k | v] gradient. A single one as it is, FP8 rows still encoded
    (planc.runtime.engine.fp8.EncodedRows)."""
    if len(values) == 1:
        return values[0]
    values = [fp8.readable(v) for v in values]
    widest = max(values, key=lambda v: v.shape[-1])
    whole = [v for v in values if v.shape == widest.shape]
    # One new tensor: the first sum allocates it, the rest add in place (the inputs are
    # buffers other steps may still read).
    total = whole[0] + whole[1] if len(whole) > 1 else whole[0].clone()
    for value in whole[2:]:
        total += value
    for value in values:
        if value.shape != widest.shape:
            total[..., total.shape[-1] - value.shape[-1]:] += value
    return total


class Interpreter:
    def __init__(self, ctx: RankContext, program: Program, store: ParamStore,
                 unverified: bool = False):
        """``unverified``: nobody proved the program (planc run --no-verify), so an
        instruction that cannot be bound is the build's fault, said in one line
        (:func:`unbound`); on a verified program it is planc's, and raises as it is."""
        self.ctx, self.program, self.store = ctx, program, store
        self.unverified = unverified
        self.kernels = Kernels(ctx, store.buffers)
        self.transfers = Transfers(ctx, store)
        self.microbatches = program.microbatches
        self.optimizers = {}  # optimizer node -> its BucketOptimizer
        self.optimized: dict[str, str] = {}  # optimizer node -> its bucket
        self.bound: dict[tuple[str, str], BoundCompute | BoundTransfer] = {}
        # What each kind of compute step does; a step the program leaves unnamed runs
        # the forward, as the operator's plain step.
        self._steps = {StepKind.FORWARD: self._forward, StepKind.RECOMPUTE: self._recompute,
                       StepKind.BACKWARD: self._backward, StepKind.WEIGHT: self._weight,
                       StepKind.OPTIMIZER: self._optimizer, StepKind.CLIP: self._clip,
                       StepKind.ROUTER: self._router, None: self._forward}
        for instruction in program.written():
            if instruction.node is not None:
                self._bind_checked(instruction)
        for stream, items in program.receives.items():
            for node, _ in items:
                self._bind_checked(program.receive(stream, node))
        # ZeRO-3 gathers whose storage goes when freed, though autograd keeps views of it,
        # and the backward gathers that fill it again
        self.let_go = buckets.forward_gathers(self.bound.values())
        self.fills = buckets.pairs(self.bound.values(), self.let_go)
        # and the gathered inputs of GEMMs whose backward gathers them again
        self.regathers, self.refilled = buckets.regathered_inputs(self.bound.values())
        self.let_go |= {buffer for filled in self.refilled.values() for buffer in filled}

    # --- binding ---------------------------------------------------------------------------

    def _bind_checked(self, instruction: Instruction) -> None:
        if not self.unverified:
            return self._bind(instruction)
        try:
            self._bind(instruction)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise unbound(instruction, exc) from exc

    def _bind(self, instruction: Instruction) -> None:
        op, node = instruction.op, instruction.node
        if (op, node) in self.bound:
            return
        operands = instruction.operands
        if op is Opcode.COMPUTE:
            ring = peers = None
            if operands.ring_steps:  # ring attention: its steps over the cp group
                call = self._call(op, instruction)
                ring = Ring(operands.ring_steps, call.group, call.members, call.index)
            elif operands.group is not None:  # a mixture of experts: its ep group
                call = self._call(op, instruction)
                peers = Peers(call.group, call.members, call.index)
            counts = None if operands.counts_group is None else \
                self._peers(operands.counts_group)  # its balance loss's counts
            self.bound[(op, node)] = BoundCompute(node, instruction, ring, peers, counts)
            if operands.step is StepKind.ROUTER:  # the stage's balancing biases, counted
                router_bias.hold(self.store.buffers, operands.router_layers,
                                 self.ctx.model.experts, self.ctx.device)
                self.kernels.chosen = {}
            if operands.step is StepKind.OPTIMIZER:
                bucket = operands.bucket
                tensor = self.store.shard[bucket] if operands.sharded else \
                    self.store.full[bucket]
                self.optimizers[node] = BucketOptimizer(self.ctx.optimizer, tensor)
                self.optimized[node] = bucket
            return
        handler = self.transfers.table[(op, operands.payload)]
        self.bound[(op, node)] = BoundTransfer(node, instruction, handler,
                                           self._call(op, instruction))

    def _peers(self, ref: str) -> Peers:
        """This rank's group of ``ref``, for a kernel that communicates over it itself."""
        groups, rank = self.ctx.groups, self.ctx.rank
        members = groups.members.get(ref, (rank,))
        return Peers(groups.handles.get(ref), members, members.index(rank))

    def _call(self, op: str, instruction: Instruction) -> Call:
        groups, ctx, operands = self.ctx.groups, self.ctx, instruction.operands
        if operands.payload == "stream":  # pipeline: a group per pair and direction
            peer = ctx.peer(operands.peer_stage)
            pair = (ctx.rank, peer) if op is Opcode.SEND else (peer, ctx.rank)
            return Call(operands, instruction.per_microbatch,
                        groups.handles[pp_group_key(operands.direction, *pair)],
                        tuple(sorted(pair)), 0, peer=peer)
        ref = operands.group
        members = groups.members.get(ref, (ctx.rank,))
        route = resolve(ctx.routes, op, operands.route, ref, members, ctx.rank, groups,
                        ctx.devices_per_node)
        return Call(operands, instruction.per_microbatch, groups.handles.get(ref), members,
                    members.index(ctx.rank), route)

    # --- reading buffers ---------------------------------------------------------------

    def _value(self, state: StepState, item: Input, microbatch: int | None,
               all_microbatches: bool = False):
        if item.per_microbatch and (microbatch is None or all_microbatches):
            values = [self._pick(state.buffers[(item.buffer, k)], item)
                      for k in range(self.microbatches)]
            values = [v for v in values if v is not None]
            return sum(values[1:], values[0]) if values else None
        key = (item.buffer, microbatch if item.per_microbatch else None)
        return self._pick(state.buffers[key], item)

    def _pick(self, value, item: Input):
        if isinstance(value, dict):  # a backward step's gradients, by input port
            value = value.get(item.grad_of)
        if value is not None and item.local_slice is not None and self.ctx.tp > 1:
            dim, axis = item.local_slice
            value = split_feature(value, dim, self.ctx.tp, self.ctx.tp_rank, self.ctx.model,
                                  axis)
        if value is not None and item.tokens is not None:
            value = select_tokens(value, *item.tokens)
        return value

    def _ports(self, state: StepState, inputs: tuple[Input, ...], microbatch: int | None,
               all_microbatches: bool = False) -> dict[str, list]:
        out: dict[str, list] = {}
        pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for item in inputs:
            value = self._value(state, item, microbatch, all_microbatches)
            if value is None:
                continue
            if item.piece is not None:  # put back together once every piece is in
                got = pieces.setdefault((item.port, item.piece_of), {})
                got[item.piece[0]] = value
                if len(got) < item.piece[1]:
                    continue
                value = join_tokens([got[j] for j in range(item.piece[1])], item.piece[2])
            out.setdefault(item.port, []).append(value)
        return out

    # --- running an instruction ------------------------------------------------------------

    def _handler(self, bound: BoundCompute | BoundTransfer):
        """What runs a bound instruction: its step kind's handler, or the transfer's."""
        return self._steps[bound.kind] if isinstance(bound, BoundCompute) else self._transfer

    def run(self, state: StepState, op: str, node: str, microbatch: int | None) -> None:
        bound = self.bound[(op, node)]
        mb = microbatch if bound.per_microbatch else None
        result = self._handler(bound)(state, bound, microbatch)
        if result is not None:
            state.buffers[(node, mb)] = result

    def instruction(self, op: str, node: str, microbatch: int | None,
                    frees: tuple[str, ...]) -> Callable[[StepState], None]:
        """Instruction ``(op, node)`` of ``microbatch`` as one call, bound once per run
        (the generated step calls it, planc.program.step_code): :meth:`run`, then the
        buffers no later instruction reads released."""
        bound = self.bound[(op, node)]
        handler = self._handler(bound)
        key = (node, microbatch if bound.per_microbatch else None)
        freed = tuple((buffer, microbatch) for buffer in frees if buffer not in self.let_go)
        let_go = tuple((buffer, microbatch) for buffer in frees if buffer in self.let_go)

        def run(state: StepState) -> None:
            result = handler(state, bound, microbatch)
            buffers = state.buffers
            if result is not None:
                buffers[key] = result
            for name in freed:
                buffers.pop(name, None)
            for name in let_go:
                state.let_go[name] = buckets.let_go(buffers.pop(name, None))

        return run

    def release(self, state: StepState, buffer: str, microbatch: int | None):
        """Free ``(buffer, microbatch)``, as :meth:`instruction`'s call does after its
        instruction, for an executor that issues them itself; returns the value (to
        record on the streams that read it) and a function letting its storage go."""
        value = state.buffers.pop((buffer, microbatch), None)
        if buffer in self.let_go:
            def let_go():
                state.let_go[(buffer, microbatch)] = buckets.let_go(value)
            return value, let_go
        return value, None

    def _params(self, state: StepState, step: BoundCompute, microbatch: int | None) -> dict:
        params = {}
        for name in step.spec.params:
            bucket = self.store.members[name].bucket
            gather = step.gathered.get(bucket)
            if gather is not None:  # a ZeRO-3 unit, gathered into a buffer of its own
                params[name] = self.store.view(state.buffers[(gather, microbatch)], name)
            else:
                params[name] = self._in_dtype(state, name, step.spec.op not in LOOKUPS)
        return params

    def _in_dtype(self, state: StepState, name: str, kept: bool = True) -> torch.Tensor:
        """Parameter ``name`` in the model's dtype: itself, or its copy of this step (the
        parameters change only at the step's end). A copy is made on the stream that
        reads it and read on that stream alone, so no later microbatch reads it early.
        ``kept``: whether the backward keeps it (a table only looked up is not kept, and
        its copy is freed with the forward)."""
        param = self.store.param(name)
        if param.dtype == self.ctx.dtype or not kept:
            return param
        key = (name, torch.cuda.current_stream() if param.is_cuda else None)
        cast = state.casts.get(key)
        if cast is None:
            cast = state.casts[key] = param.to(self.ctx.dtype)
        return cast

    def _clip(self, state: StepState, step: BoundCompute, mb: int | None):
        """The gradient norm's share, or the clip by the norm."""
        if step.clip.kernel == "grad_norm":
            return grad_norm.share(self.ctx, self.store, step.clip.norm_ranges)
        (summed,) = self._ports(state, step.inputs, None)["x"]
        state.grad_norm = grad_norm.clip(self.store, summed, step.clip.max_norm)
        return None

    def _router(self, state: StepState, step: BoundCompute, mb: int | None):
        """The step's expert loads, or the balancing bias's update by their sum."""
        layers = step.router.router_layers
        if step.router.bias_update is None:
            return router_bias.loads(self.kernels.chosen, state.step, layers,
                                     self.ctx.model.experts, self.ctx.device)
        (summed,) = self._ports(state, step.inputs, None)["x"]
        router_bias.update(self.store.buffers, summed, layers, step.router.bias_update)
        state.expert_imbalance = router_bias.imbalance(summed, layers)
        return None

    def _weight(self, state: StepState, step: BoundCompute, mb: int | None):
        """The parameter half of a split backward."""
        gathered = self._ports(state, step.inputs, mb).get(buckets.GATHERED_PORT)
        pieces = state.saved.pop((step.node, mb))  # one per piece, in order
        for j, (saved, grad) in enumerate(pieces):
            if gathered:  # its forward's input, gathered again (gathered_inputs = regather)
                whole = gathered[0]
                buckets.fill_input(saved.inputs["x"], whole if len(pieces) == 1 else
                                   select_tokens(whole, j, len(pieces), self.ctx.tp))
            _, named = self.kernels.backward(step.spec, saved, fp8.readable(grad),
                                             inputs=False)
            for name, value in named.items():
                self.store.grad_of(name).add_(value)
            if gathered:  # filled again for this weight gradient alone, which has run
                saved.inputs["x"].untyped_storage().resize_(0)
        self._drop_refilled(state, step, mb)
        return None

    def _drop_refilled(self, state: StepState, step: BoundCompute, mb: int | None) -> None:
        """The let-go inputs that ``step`` read whole again, no longer held for a fill:
        their bytes go with the step's saved tensors, not at the step's end."""
        for buffer in self.refilled.get(step.node, ()):
            state.let_go.pop((buffer, mb), None)

    def _backward(self, state: StepState, step: BoundCompute, mb: int | None):
        saved = state.saved.pop((step.saved_from, mb))
        if saved.gathered:  # ZeRO-3: the forward's parameters, back from this gather
            buckets.refill(saved.gathered, self._gathered(state, step, mb))
            # a gather that ran before the forward let go found nothing to fill: the
            # parked storage, refilled, is autograd's alone from now on
            for gather in step.gathered.values():
                state.let_go.pop((self.fills.get(gather), mb), None)
        if step.saved_from != step.forward_of:
            state.saved.pop((step.forward_of, mb), None)
        ports = self._ports(state, step.inputs, mb)
        grads = ports.get("grad", [])
        grad = combine(grads) if grads else None
        if buckets.GATHERED_PORT in ports:  # its forward's input, gathered again
            buckets.fill_input(saved.inputs["x"], ports[buckets.GATHERED_PORT][0])
            self._drop_refilled(state, step, mb)
        if step.weight_grad is not None:  # the input half: its W step comes later
            ports, _ = self.kernels.backward(step.spec, saved, fp8.readable(grad),
                                             params=False, kept=fp8.kept_bytes(grad))
            # kept as it came (FP8 rows stay FP8 until the W decodes them again), unless
            # the W starts from what the input half sent on (Saved.weight_roots)
            kept = None if saved.weight_roots is not None else grad
            state.saved.setdefault((step.weight_grad, mb), []).append((saved, kept))
            return ports
        ports, named = self.kernels.backward(step.spec, saved, fp8.readable(grad))
        for name, value in named.items():
            self.store.grad_of(name).add_(value)
        return ports

    def _forward(self, state: StepState, step: BoundCompute, mb: int | None):
        return self._run_forward(state, step, mb, self._inputs(state, step, mb))

    def _recompute(self, state: StepState, step: BoundCompute, mb: int | None):
        """The forward again, its inputs from outside the layer what the forward kept."""
        inputs = self._inputs(state, step, mb)
        kept = state.saved.get((step.forward_of, mb))
        if kept is not None:
            for port, tensor in kept.inputs.items():
                inputs.setdefault(port, tensor.detach())
        return self._run_forward(state, step, mb, inputs)

    def _inputs(self, state: StepState, step: BoundCompute, mb: int | None) -> dict:
        return {port: combine(values) for port, values in
                self._ports(state, step.inputs, mb).items()}

    def _run_forward(self, state: StepState, step: BoundCompute, mb: int | None, inputs: dict):
        piece_of = None
        if step.whole_input is not None:  # (kernels.Kernels.forward)
            whole, tokens = step.whole_input
            whole = self._value(state, whole, mb)
            piece_of = (whole, tokens) if isinstance(whole, torch.Tensor) else None
        output, saved = self.kernels.forward(step.spec, inputs, self._params(state, step, mb),
                                             state.step, mb, keep_graph=step.keep_graph,
                                             piece_of=piece_of)
        if step.keeps:
            state.saved[(step.node, mb)] = saved  # what this step's backward will need
            saved.gathered = self._gathered(state, step, mb)
        return output

    def _gathered(self, state: StepState, step: BoundCompute, mb: int | None) -> dict:
        """A ZeRO-3 step's whole buckets, by bucket (planc.runtime.engine.store)."""
        return {bucket: state.buffers[(gather, mb)] for bucket, gather in
                step.gathered.items()}

    def _optimizer(self, state: StepState, step: BoundCompute, mb: int | None) -> None:
        """One bucket's update, at the lr the build's schedule gives the training step
        (planc.plan.lr_schedule: the compiler's formula, as torch's schedulers would set it)."""
        optimizer = self.optimizers[step.node]  # bound to the bucket's flat tensor
        optimizer.lr = self.ctx.model.lr_at(state.step)
        bucket = step.bucket
        sharded = self.store.buckets[bucket]["sharded"]
        tensor = optimizer.tensor
        tensor.grad = self.store.grad_shard[bucket] if sharded else self.store.grad[bucket]
        optimizer.step()
        tensor.grad = None
        return None

    def _transfer(self, state: StepState, step: BoundTransfer, mb: int | None):
        value = None
        if step.routed:
            ports = self._ports(state, step.inputs, mb)
            (rows,) = ports.get("x", []) + ports.get("grad", [])
            value = (rows.detach(), (ports.get("routing") or [None])[0])
        elif step.reads_values:
            ports = self._ports(state, step.inputs, mb, step.sums_microbatches)
            values = [v.detach() for v in ports.get("x", []) + ports.get("grad", [])]
            value = combine(values) if values else None
            into = state.let_go.pop((self.regathers.get(step.node), mb), None)
            if into is not None:  # a GEMM's input again: into the forward's own bytes
                return self.transfers.all_gather_into(step.call, value, into)
        elif step.node in self.fills:  # a ZeRO-3 backward gather: into the forward's bytes
            value = state.let_go.pop((self.fills[step.node], mb), None)
        result = step.handler(step.call, value)
        if step.reports_loss:  # read at the step's end (StepState.settle)
            state.loss = result.detach() if isinstance(result, torch.Tensor) else result
        return result
