"""What a plan's settings make of its device's rates, for the kernel model and for an
MFU: the FP8 speed-up of its GEMMs, the peak an MFU is of, and the share of its
attention's work the busiest cp rank does under the causal mask."""

from __future__ import annotations

from planc.plan.plan import Plan
from planc.plan.presets import PRESETS

CAUSAL = 0.5  # the share of an attention's FLOPs (every key counted) a causal mask leaves


def fp8_speedup(plan: Plan) -> float | None:
    """With ``model { fp8 }``, how many times its dtype's rate the device multiplies FP8
    at, as its datasheet says (H100: 1,979 over 989 TFLOP/s); None without FP8 or on a
    device with no FP8 rate (the GEMMs are then priced at the dtype's)."""
    preset = PRESETS.get(plan.topology.preset or "")
    if plan.model.options.get("fp8") is None or preset is None or "fp8" not in preset.flops:
        return None
    return preset.flops["fp8"] / preset.flops[plan.model.dtype]


def mfu_peak(plan: Plan) -> float:
    """The peak an MFU is of, per device: its dtype's, or the FP8 rate where the plan's
    GEMMs run in FP8 (the fastest arithmetic the step uses, so that an MFU never passes
    100 %; PaLM's definition, Chowdhery et al. 2022, appendix B: of the system's peak)."""
    return plan.topology.device.flops * (fp8_speedup(plan) or 1.0)


def causal_share(plan: Plan) -> float:
    """The share of its attention's FLOPs (every key counted) that the busiest cp rank
    computes under the causal mask: half, where the tokens are dealt in 2 cp chunks so
    that each rank holds an early and a late one (``shard { cp { load_balance = on } }``,
    Megatron-LM's and Llama 3's split); without it, cp rank r holds the r-th of cp
    contiguous chunks, whose queries see (r + 1/2) / cp of the keys on average, and the
    last rank, which every cp collective waits for, (2 cp - 1) / (2 cp)."""
    cp = plan.mesh.cp
    if cp == 1 or plan.shard.cp.load_balance:
        return CAUSAL
    return (2 * cp - 1) / (2 * cp)
