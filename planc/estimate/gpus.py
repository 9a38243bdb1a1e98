"""The GPUs whose kernels :mod:`planc.estimate.kernel_cost` prices by shape, and where each
of their figures comes from.

- **A100 SXM4** (``dgx-a100``): 108 SMs; ``large = 0.80``: optimized GEMMs "reach up to
  80-90% of the theoretical maximum" (Dao, "FlashAttention-2", 2023, section 1), the low
  end: a statement, not a measurement of the CUDA 11 cuBLAS that the A100 runs of
  2021-22 used (none was found; docs/simulate.md, "What the A100 tables still miss");
  FlashAttention rates of 187 TFLOP/s forward (60 % of peak) and 142 backward (45 %),
  inside the ranges FlashAttention-2 reports on A100 (Dao 2023: 50-73 % forward, up to
  63 % backward), kept for completeness: the published A100 runs used unfused attention
  (below), and so does the model.
- **H100 SXM5** (``dgx-h100``): 132 SMs; ``large = 0.79``: cuBLAS bf16 8192^3 on an
  H100 80GB HBM3 at 783 TFLOP/s (``bench/kernels_gpu.py``, docs/simulate.md; the
  workplace's device notes saw 769-798); attention 164 TFLOP/s forward and 168 backward:
  FlashAttention-2 through PyTorch's SDPA, causal, head dimension 128, the median over
  the shapes of the Megatron-LM H100 plans and Llama 3 405B on that H100 (134-214 forward,
  151-264 backward; Dao 2023, figure 7, reports FlashAttention-2 on H100 at up to
  335 TFLOP/s with more heads and sequences per call).
- ``k_overhead = 256``: on the H100 above, GEMMs with ``K`` of 896 to 2,304 ran at
  0.70-0.86 of the 8192^3 rate (``bench/kernels_gpu.py``), which ``K / (K + 256)``
  (0.78-0.90) follows; the A100 is taken to be alike (no A100 measurement was found).
  Over the 93 GEMMs of those plans the model's time is within 5.5 % of the measured one
  at the median, 20 % at most.
- The A100's attention is unfused (``flash = False``): the Korthikanti and Narayanan runs
  used Megatron-LM's batched GEMMs with a fused scale-mask-softmax and a dropout between
  them (Korthikanti et al. 2022, section 4.2), not FlashAttention.
- A plan that declares its own peak (``device { flops }`` over one of these presets: a
  part at another power limit or clock, such as torchtitan's 500 W H100s) scales the
  attention rates by its peak over the preset's, as ``peak`` scales the GEMMs.
- ``launch = 4 us`` per kernel: the launch overhead of a CUDA kernel on these GPUs (NVIDIA,
  "Getting Started with CUDA Graphs", 2019: a few microseconds per kernel).
- **fp32 attention** on the H100 (``attention_fp32``): 39.1 TFLOP/s forward and 32.4
  backward (2.5 forwards' FLOPs over the time of a forward and backward, 7.05 ms, less
  the forward's, 1.76 ms), SDPA's memory-efficient kernel (FlashAttention takes no
  fp32), causal, head dimension 128, batch 1 of 4,096 tokens and 16 heads:
  ``bench/kernels_gpu.py --fp32`` on an H200 (2026-12-04), whose compute is the H100
  SXM's (the same GH100 die, 132 SMs, 67 TFLOP/s FP32 on both datasheets). Its head
  dimension 64 at bench/gpu_step.py's shape ran at 31.2 and 30.9. The A100 has none
  measured: its fp32 attention scales the bf16 rates to the FP32 peak, as any declared
  peak scales them. The same run's fp32 GEMMs, 48.6-51.0 TFLOP/s on squares of 2,048 to
  8,192 (0.73-0.76 of the FP32 peak), agree with ``large = 0.79`` within 9 %, so the
  GEMMs keep it.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.plan.plan import Plan
from planc.plan.presets import PRESETS


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    large: float  # fraction of peak a large GEMM reaches
    k_overhead: int  # inner-dimension elements a tile's fill and drain cost
    attention_forward: float  # FLOP/s, causal, head dimension 128
    attention_backward: float
    launch: float = 4e-6  # seconds per kernel
    flash: bool = True  # the published runs on it used FlashAttention (else unfused)
    # (forward, backward) FLOP/s of fp32 attention, measured at the FP32 cores' peak
    attention_fp32: tuple[float, float] | None = None


GPUS = {
    "dgx-a100": GPU("A100 SXM4", 108, 0.80, 256, 187e12, 142e12, flash=False),
    "dgx-h100": GPU("H100 SXM5", 132, 0.79, 256, 164e12, 168e12,
                    attention_fp32=(39.1e12, 32.4e12)),
}


def attention_rates(plan: Plan, gpu: GPU) -> tuple[float, float, float]:
    """The attention rates (forward, backward FLOP/s) of ``plan``'s dtype on ``gpu``, and
    the peak FLOP/s they were measured against: the preset's own device's bf16 tensor-core
    peak (its datasheet figure; bench/kernels_gpu.py measures FlashAttention in bf16), or
    for an fp32 model its FP32 cores' peak where ``gpu`` has fp32 rates measured. A plan's
    own peak (``device { flops }``: a declared lower clock, or the FP32 cores' for an fp32
    model without measured rates) scales them by itself over that reference. A topology
    of no named preset has only its declared peak."""
    preset = PRESETS.get(plan.topology.preset or "")
    if preset is None:
        return gpu.attention_forward, gpu.attention_backward, plan.topology.device.flops
    if plan.model.dtype == "fp32" and gpu.attention_fp32 is not None:
        return (*gpu.attention_fp32, preset.flops["fp32"])
    return gpu.attention_forward, gpu.attention_backward, preset.flops["bf16"]
