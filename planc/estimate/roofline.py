"""What a compute instruction's arithmetic and memory traffic take on a device without a
kernel model (a CPU, or any device planc.estimate.kernel_cost does not know): the longer
of its FLOPs at the achievable rate and the bytes it moves at the memory bandwidth (the
roofline of Williams, Waterman and Patterson, CACM 2009). Matrix multiplies are bound by
the first, layer norms, activations and residual adds by the second.

What a loss reads, what a loss or an activation exponentiates, and what a backward moves,
beyond its output and its FLOPs (:func:`memory_bound_bytes`, :func:`transcendentals`)
is here too: the GPU kernel model (planc.estimate.kernel_cost) prices the same bytes.

The simulator adds the device's fixed cost per instruction to this
(planc.estimate.instruction_cost); ``planc calibrate`` measures that fixed cost as what
the runtime's own instructions take beyond this (planc.runtime.instruction_overheads).
"""

from __future__ import annotations

from planc.models.family import LOSS_PART_FLOPS_PER_LOGIT
from planc.program.operands import FORWARD_STEPS, Operands, StepKind

# Bytes an operator moves per byte of its output: read the input and write the output;
# a residual add reads two inputs; AdamW reads a parameter, its gradient and two moments
# and writes three of them back (SGD with momentum: three reads, two writes).
TRAFFIC = {"attn_residual": 3.0, "mlp_residual": 3.0}
OPTIMIZER_TRAFFIC = {"adamw": 7.0, "sgd": 5.0}
DEFAULT_TRAFFIC = 2.0
OPTIMIZER_KERNEL = "optimizer"


def traffic(kernel: str, optimizer: str) -> float:
    """Bytes moved per byte of output by ``kernel``; ``optimizer``: the plan's optimizer's
    name, for the optimizer step's own kernel."""
    if kernel == OPTIMIZER_KERNEL:
        return OPTIMIZER_TRAFFIC.get(optimizer, OPTIMIZER_TRAFFIC["adamw"])
    return TRAFFIC.get(kernel, DEFAULT_TRAFFIC)


def roofline_seconds(flops: float, moved_bytes: float, rate: float,
                     bandwidth: float, exponentials: float = 0.0,
                     exp_rate: float | None = None) -> float:
    """Seconds of ``flops`` at ``rate`` FLOP/s, and of ``exponentials`` (transcendental
    functions: :func:`transcendentals`) at ``exp_rate`` a second where the device
    measured one, or of ``moved_bytes`` at ``bandwidth`` bytes/s, whichever is longer:
    an exponential runs on the same cores as the FLOPs."""
    arithmetic = flops / rate + (exponentials / exp_rate if exp_rate else 0.0)
    return max(arithmetic, moved_bytes / bandwidth)


# What an instruction moves and computes beyond its output and its FLOPs, which the GPU
# kernel model (planc.estimate.kernel_cost) and this roofline both price.
BACKWARD_TRAFFIC = 3.0
# The cross-entropy's operators, each as (FLOPs it counts per logit, its passes over the
# logits). The loss (planc.models: 5 FLOPs a logit forward, twice that backward): a pass
# reads the logits to find the largest, a second sums their exponentials; the backward
# reads them and writes their gradient. A vocabulary-parallel loss runs the first two
# passes as operators of their own, one pass each (planc.graph.derive).
LOSS_READS = {"loss": (5.0, 2.0), "loss_max": (LOSS_PART_FLOPS_PER_LOGIT, 1.0),
              "loss_sum_exp": (LOSS_PART_FLOPS_PER_LOGIT, 1.0)}
# The activations' transcendental functions per element of their output, (forward,
# backward), as planc.runtime.families computes them: GPT's tanh GELU one tanh, and its
# backward (PyTorch's gelu_backward) the tanh again; llama's SwiGLU one sigmoid in its
# silu, and its backward the silu again (made again, as Megatron-LM's fused bias-SwiGLU
# does) and silu_backward's sigmoid.
ACTIVATION_TRANSCENDENTALS = {"gelu": (1, 1), "swiglu": (1, 2)}


def loss_logits(operands: Operands, flops: float) -> float:
    """The logits a loss instruction of ``flops`` reads (:data:`LOSS_READS`; a backward
    counts twice its forward's FLOPs)."""
    per_logit = LOSS_READS[operands.kernel][0]
    return flops / per_logit / (2.0 if operands.step == StepKind.BACKWARD else 1.0)


def _loss_pass(operands: Operands, dtype_bytes: int) -> tuple[float, float]:
    """A loss instruction's passes over its logits and exponentials per logit: its
    :data:`LOSS_READS` passes, exponentiating in each but the max's; the
    vocabulary-parallel loss after its max and sum reads each token's target logit and
    normalisers alone, after a 16-bit model's logits are widened to fp32 (one pass;
    planc.runtime.families.loss.loss_forward), and exponentiates none."""
    kernel = operands.kernel
    if kernel == "loss" and operands.vocab_parallel and operands.step != StepKind.BACKWARD:
        return (0.0 if dtype_bytes >= 4 else 1.0), 0.0
    return LOSS_READS[kernel][1], (0.0 if kernel == "loss_max" else 1.0)


def memory_bound_bytes(operands: Operands, traffic: float, dtype_bytes: int) -> float:
    """The bytes a memory-bound kernel moves, at least ``traffic`` (the roofline's bytes
    per byte of output times its output): a loss reads the logits, its output being one
    figure per token (the whole loss in two passes, a vocabulary-parallel loss's max or
    sum of exponentials in one, the loss after them none of fp32 logits); a backward
    reads three tensors of its output's size.
    The GPU's kernel model and the roofline of a CPU or a calibrated device both price
    these."""
    kernel = operands.kernel
    if kernel in LOSS_READS:
        # the vocabulary slice of every token, once per pass over them
        passes, _ = _loss_pass(operands, dtype_bytes)
        logits = loss_logits(operands, operands.flops or 0.0)
        return max(traffic, passes * logits * dtype_bytes)
    if operands.step == StepKind.BACKWARD and kernel != OPTIMIZER_KERNEL:
        # the forward's input and the output's gradient read, the input's gradient written
        return max(traffic, BACKWARD_TRAFFIC * (operands.output_bytes or 0))
    return traffic


def transcendentals(operands: Operands, dtype_bytes: int) -> float:
    """The exponentials (and tanhs and sigmoids, each an exponential's work) an
    instruction computes: a loss one per logit of its slice where it exponentiates them
    (planc.runtime.families.loss: the whole loss's log-softmax and its backward's
    softmax, a vocabulary-parallel loss's sum of exponentials and its backward's
    softmax; none in its max nor in the vocabulary-parallel loss itself, which reads the
    target's logit and the reduced normaliser); an activation its
    :data:`ACTIVATION_TRANSCENDENTALS` per element of its output. 0 for any other
    kernel."""
    kernel = operands.kernel
    per_element = ACTIVATION_TRANSCENDENTALS.get(kernel)
    if per_element is not None:
        elements = (operands.output_bytes or 0) / dtype_bytes
        if operands.step == StepKind.BACKWARD:
            return per_element[1] * elements
        return per_element[0] * elements if operands.step in FORWARD_STEPS else 0.0
    if kernel not in LOSS_READS:
        return 0.0
    _, per_logit = _loss_pass(operands, dtype_bytes)
    return per_logit * loss_logits(operands, operands.flops or 0.0)
