"""What each instruction of a rank's program is bound to when the run starts
(planc.runtime.engine.interpreter): a compute step's kernel and what it keeps, or a
transfer's handler and its call, read once from the operands the compiler wrote on it
(planc.program.operands), so that running it later is a lookup and a call."""

from __future__ import annotations

import dataclasses
import enum

from planc.graph.vocabulary import Op
from planc.program.operands import Input, StepKind
from planc.program.program import Instruction, saved_for_weights
from planc.runtime.engine.kernels import Peers, Spec
from planc.runtime.engine.ring_attention import Ring
from planc.runtime.engine.transfers import Call


class UnboundInstruction(ValueError):
    """An instruction whose operands name nothing the runtime has: a program that planc
    verify refuses (a damaged build), run with ``planc run --no-verify``."""


def unbound(instruction: Instruction, exc: Exception) -> UnboundInstruction:
    """The one line for ``instruction`` of an unverified program, which binding it
    raised ``exc`` on: a failed lookup names its key as the build's files write it."""
    detail = str(exc) if isinstance(exc, ValueError) else \
        f"it names {_named(exc.args[0])}, which its program does not hold" \
        if isinstance(exc, KeyError) and exc.args else f"{type(exc).__name__} {exc}"
    return UnboundInstruction(f"its program's {instruction.op.value} {instruction.node} on "
                              f"stream {instruction.stream} cannot be run: {detail}")


def _named(key) -> str:
    """A lookup's key as the build's files write it: ``send grad_norm`` where Python
    shows ``(<Opcode.SEND: 'send'>, 'grad_norm')``."""
    if isinstance(key, tuple):
        return " ".join(_named(part) for part in key)
    return str(key.value) if isinstance(key, enum.Enum) else str(key)


class BoundCompute:
    """A compute instruction: its kernel (Spec), its inputs, and what it keeps for a
    later step."""

    def __init__(self, node: str, instruction: Instruction, ring: Ring | None = None,
                 peers: Peers | None = None, counts: Peers | None = None):
        operands = instruction.operands
        self.kind = operands.step  # which handler of Interpreter._steps runs it
        # planc.runtime.engine.grad_norm
        self.clip = operands if operands.step is StepKind.CLIP else None
        # planc.runtime.engine.router_bias
        self.router = operands if operands.step is StepKind.ROUTER else None
        self.node, self.inputs = node, operands.inputs
        self.spec = None if self.clip or self.router else \
            Spec.of(operands, ring, peers, counts)
        if self.spec is not None and any(i.port == "x" and i.buffer in instruction.frees
                                         for i in operands.inputs):
            self.spec = dataclasses.replace(self.spec, frees_input=True)
        self.gathered = dict(operands.gathered)  # bucket -> the ZeRO-3 gather that filled it
        self.per_microbatch = instruction.per_microbatch
        self.forward_of = operands.forward_of
        self.saved_from = operands.saved_from
        self.keep_graph = operands.keeps_graph
        # whether a later step (its backward, its recomputation) takes what it kept: the
        # program says so by the buffer NODE:saved among its writes
        self.keeps = saved_for_weights(node) in instruction.writes
        self.bucket = operands.bucket
        self.weight_grad = operands.weight_step  # B: its W step computes param grads
        self.whole_input = whole_input(self.spec, operands.inputs)


def whole_input(spec: Spec | None, inputs: tuple[Input, ...]) -> tuple[Input, tuple] | None:
    """tp_overlap: for a piece of proj, its input ``x`` read whole, and which piece of the
    tokens the step takes of it. proj keeps how to take the piece again, not its copy,
    since the attention's backward keeps the whole; elsewhere nothing else keeps the
    whole, and the copies are its bytes."""
    if spec is None or spec.op is not Op.PROJ or spec.tokens is None:
        return None
    for item in inputs:
        if item.port == "x" and item.tokens is not None and item.piece is None:
            return dataclasses.replace(item, tokens=None), item.tokens
    return None


class BoundTransfer:
    """A transfer instruction: its handler (planc.runtime.engine.transfers) and the
    group call it makes."""

    def __init__(self, node: str, instruction: Instruction, handler, call: Call):
        operands = instruction.operands
        self.node, self.inputs, self.handler, self.call = node, operands.inputs, handler, \
            call
        self.per_microbatch = instruction.per_microbatch
        self.sums_microbatches = operands.payload == "loss"
        self.reads_values = operands.payload not in ("grad", "param")
        self.reports_loss = operands.payload == "loss"
        # a cut mixture's all-to-all: its rows, and the dispatch that routed them
        self.routed = operands.payload in ("counts", "dispatch", "combine")
