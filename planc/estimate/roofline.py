"""What a compute instruction's arithmetic and memory traffic take on a device without a
kernel model (a CPU, or any device planc.estimate.kernel_cost does not know): the longer
of its FLOPs at the achievable rate and the bytes it moves at the memory bandwidth (the
roofline of Williams, Waterman and Patterson, CACM 2009). Matrix multiplies are bound by
the first, layer norms, activations and residual adds by the second.

The simulator adds the device's fixed cost per instruction to this
(planc.estimate.instruction_cost); ``planc calibrate`` measures that fixed cost as what
the runtime's own instructions take beyond this (planc.runtime.instruction_overheads).
"""

from __future__ import annotations

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
    """Seconds of ``flops`` at ``rate`` FLOP/s, and of ``exponentials`` at ``exp_rate`` a
    second where the device measured one, or of ``moved_bytes`` at ``bandwidth``
    bytes/s, whichever is longer: an exponential runs on the same cores as the FLOPs."""
    arithmetic = flops / rate + (exponentials / exp_rate if exp_rate else 0.0)
    return max(arithmetic, moved_bytes / bandwidth)
