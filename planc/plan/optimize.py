"""The optimize block of a plan: the compiler's passes and the runtime's and simulator's
kernel choices it turns on (:class:`Optimize`), with the values its choice keys take."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Optimize:
    fuse: bool = True
    bucket: float = 25e6  # bytes
    route: str = "auto"
    overlap: bool = True
    # With overlap: a backward whose input gradient feeds a tp or cp collective computes
    # its weight gradient while that collective is in flight (planc.passes.overlap).
    weight_grad_overlap: bool = True
    recompute: str = "none"
    # Collective matmul over tp (planc.passes.tp_overlap): True lets the cost model
    # choose the chunk count, False is off, an integer forces that many chunks.
    tp_overlap: bool | int = True
    # Each tp rank sends 1/tp of the activation between stages, all-gathered over tp on
    # the receiving stage (Narayanan et al. SC'21, 4.1); it acts where tp > 1, pp > 1 and
    # the activation is not already split over tp (sequence parallelism).
    pp_scatter_gather: bool = True
    # How the weight gradients of the microbatches of a step add up, for the simulator's
    # price (planc.estimate.instruction_cost.accumulation_seconds; the runtime always adds them
    # separately): GRAD_ACCUMULATIONS.
    grad_accumulation: str = field(default="fused", metadata={"omitted_when_default": True})
    # How the elementwise operators' kernels run, for the simulator's price
    # (planc.estimate.kernel_cost; the runtime's own kernels do not change): KERNEL_MODES.
    kernels: str = field(default="fused", metadata={"omitted_when_default": True})
    # How a mixture's dispatch and combine travel: MOE_DISPATCHERS.
    moe_dispatcher: str = field(default="all_to_all", metadata={"omitted_when_default": True})
    # The runtime compiles the family's elementwise formulas with torch.compile
    # (planc.runtime.engine.kernels; the llama, moe and deepseek families).
    compile: bool = field(default=False, metadata={"omitted_when_default": True})
    # A mixture's experts keep gate and up but not their SwiGLU's product, which the
    # backward computes again for the down projection's weight gradient (Megatron-Core's
    # recompute_modules "moe_act"; planc.runtime.families.moe_dispatch).
    recompute_moe_activation: bool = field(default=False,
                                           metadata={"omitted_when_default": True})
    # A dense block's MLP keeps its activation's input but not its output, which the
    # backward computes again for the down projection's weight gradient (torchtitan's
    # per-op selective checkpointing recomputes it; planc.runtime.families.
    # recomputed_product).
    recompute_activation: bool = field(default=False, metadata={"omitted_when_default": True})
    # A block's two norms keep their input but not their output, which the backward of
    # the GEMM reading it computes again (Megatron-Core's recompute_modules "layernorm",
    # torchtitan's per-op selective checkpointing; planc.runtime.families.recomputed_output).
    recompute_norms: bool = field(default=False, metadata={"omitted_when_default": True})


# optimize { grad_accumulation }: "fused", the weight-gradient GEMM adds into the
# gradient buffer (Megatron-LM's gradient_accumulation_fusion, from February 2022);
# "buffer", a kernel adds each microbatch's gradient into a buffer zeroed each step
# (Megatron-LM's main_grad hook, DeepSpeed's BF16_Optimizer); "autograd", autograd adds
# into param.grad from the second microbatch on (the first's gradient becomes it).
GRAD_ACCUMULATIONS = ("fused", "buffer", "autograd")

# optimize { kernels }: "fused", each norm, activation and loss one kernel (Megatron-LM's
# fused kernels, or torch.compile); "eager", the PyTorch module's own operations, each a
# kernel with its upcasts, as a model runs without torch.compile (torchtitan's Llama).
KERNEL_MODES = ("fused", "eager")

# optimize { moe_dispatcher }: "all_to_all", one row per (token, expert) to the expert's
# rank; "two_hop", one row per (token, node) over the network to the rank at the sender's
# place on that node, which forwards one row per (token, rank) inside the node, each
# pair's expert and weight beside it (DeepSeek-V3's dispatch, section 3.2.2; DeepEP).
MOE_DISPATCHERS = ("all_to_all", "two_hop")
