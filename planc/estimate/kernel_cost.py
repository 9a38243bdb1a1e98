"""What the kernels of a compute instruction achieve on a known GPU: matrix multiplies by
their shape, attention at FlashAttention's published rates, and a fixed cost per kernel.

Beside :mod:`planc.estimate.cost` (which prices transfers and, with one efficiency, compute) so
that a pass can price a GEMM the way the simulator does (``linear_seconds``: tp_overlap's
choice of a chunk count, where smaller pieces run less efficiently). The simulator uses
this model for a topology whose preset names a GPU below; any other device (a CPU
measured by ``planc calibrate``, a hand-written one) keeps the roofline of one
efficiency (:mod:`planc.estimate.instruction_cost`).

**Matrix multiplies.** A GEMM of an ``M x K`` by a ``K x N`` matrix is computed tile by
tile, one output tile per thread block, in waves of as many blocks as the GPU has SMs
(NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, 2023: tile and
wave quantization; typical cuBLAS tiles 256x128, 128x256 and 128x128, of which cuBLAS's
heuristics pick one). Its time is the longer of

- its FLOPs at ``peak x large x waves x K / (K + k_overhead)``: ``large`` is what cuBLAS
  reaches on large well-shaped GEMMs; ``waves`` the useful share of the last wave, for the
  best of the typical tiles; ``K / (K + k_overhead)`` the cost of filling and draining each
  tile's main loop, which a short inner dimension (the row-parallel GEMMs' ``K = h / tp``)
  cannot amortise;
- the bytes it reads and writes (``M K + K N + M N`` elements) at the memory bandwidth
  (the guide's math and memory bounds),

plus the fixed cost of its launch. A forward runs one GEMM (``M x K`` by ``K x N``), a
backward two: the input gradient (``M x N`` by ``N x K``) and the weight gradient
(``K x M`` by ``M x N``); a split backward's B and W steps one each. ``N`` and ``K`` are the
operator's features on its tensor-parallel rank (column-parallel operators split ``N``,
row-parallel ones ``K``); ``M``, the tokens, follows from the instruction's FLOPs, so that a
GEMM that a program splits into chunks is priced at its chunk's size.

**Attention** runs at FlashAttention's rates for a causal mask, head dimension 128: the
forward at ``attention_forward`` FLOP/s, the backward (2.5 times the forward's FLOPs,
FlashAttention's count) at ``attention_backward``, both counting the FLOPs a causal mask
leaves (half of the instruction's, which counts every key); an fp32 model at its GPU's
``attention_fp32`` rates where they were measured (:func:`planc.estimate.gpus.attention_rates`).

**A mixture of experts** (the ``moe`` operator) is priced by its kernels on the busiest
rank of its ep group, as Megatron-Core's grouped-GEMM MoE layer runs them: the router's
GEMM (tokens x experts, inner ``hidden``); the experts' gate-and-up and down GEMMs as one
grouped GEMM each over the rank's ``experts / ep`` experts, each expert getting ``ep x
tokens x top_k / experts`` rows times the routing's imbalance (model moe's
``imbalance``, with ep > 1) (the tiles of every expert fill the waves together, as a
grouped kernel schedules them; a backward runs the input- and the weight-gradient
grouped GEMMs, whose inner dimension is an expert's rows); the shared experts as one
dense SwiGLU on the tokens; and the memory traffic of what lies between them: the
router's fp32 probabilities, the permutation of the tokens into the dispatch buffer
and back (with the weighted sum), the SwiGLU activation on every row; a launch per
kernel. The all-to-alls are the simulator's (:mod:`planc.estimate.instruction_cost`).

**Every other operator** (norms, activations, residual adds, the loss, the optimizer) is
bound by its memory traffic, as in the roofline, plus its launch; a backward moves three
tensors of its output's size (the forward's input and the output's gradient read, the
input's gradient written), and the cross-entropy reads the logits twice (their largest,
then the sum of their exponentials) though it writes one figure per token.

The figures per GPU, and where they come from, are :mod:`planc.estimate.gpus`'s.

What a module runs beside its GEMMs (RoPE, an eager norm) is
:mod:`planc.estimate.module_kernels`'s.
"""

from __future__ import annotations

from copy import copy
from dataclasses import replace
from math import ceil

from planc.estimate.gpus import GPU, GPUS, attention_rates
from planc.estimate.mixture import Mixture
from planc.estimate.model import Shapes
from planc.estimate.plan_rates import causal_share, fp8_speedup
from planc.estimate.module_kernels import (ADDED_TO_THE_GRAPH, Passes, made_again_passes,
                                           module_passes)
from planc.program.operands import Operands, StepKind
from planc.models import family_of
from planc.plan.plan import Plan
from planc.estimate.roofline import loss_logits, memory_bound_bytes

# The typical cuBLAS tiles of the NVIDIA guide (rows x columns of the output).
TILES = ((256, 128), (128, 256), (128, 128))
# The operators that are one GEMM per step, and the tensor each multiplies (its K); proj
# multiplies what attention produced (heads x head_dim features).
GEMM_INPUT = {"qkv": "stream", "proj": None, "fc1": "stream", "fc2": "ffn",
              "head": "stream"}
SPLIT_N = ("column", "vocab")  # tensor-parallel layouts that split a GEMM's output features
ATTENTION = "attention"
MIXTURE = "moe"
# A mixture's parts, each a compute piece when cut at its all-to-alls
# (planc.models.moe.part_flops). Its kernels besides its GEMMs, forward, are five: the
# router's softmax and top-k, the permutation into the dispatch buffer, the experts'
# activation, the shared experts', the unpermutation with its weighted sum; the backward
# runs the gradient of each.
MIXTURE_PARTS = ("moe_route", "moe_shared", "moe_experts", "moe_combine")
FLASH_BACKWARD = 2.5  # FlashAttention counts a backward as 2.5 forwards
# Bytes per score of unfused attention in 16-bit: the softmax reads and writes each (4),
# the dropout reads it and writes it and its one-byte mask (5); the backward reads the
# mask and the gradient and writes it (5), then the softmax's gradient reads the
# probabilities and the gradient and writes one (6).
UNFUSED_FORWARD_BYTES = 9
UNFUSED_BACKWARD_BYTES = 11

# The SMs an expert all-to-all's kernel holds while it runs: a CTA of NCCL's never shares
# its SM with a compute kernel (NVIDIA/nccl issue 689), and one of DeepSeek's
# communication kernels is alike. Two-hop dispatch and combine as DeepSeek-V3 runs them:
# 20 SMs (its report, arXiv 2412.19437, section 3.2.2; DeepEP's default since). NCCL's
# all-to-all on a node of 8 GPUs and 8 NICs: 16 (NVIDIA/nccl issue 689, "on DGX with 8
# NICs ... it would use 16 SMs"; issue 1598: all_to_all_single launched 16 CTAs).
TWO_HOP_SMS = 20
ALL_TO_ALL_SMS = 16

FP8_LINEARS = ("qkv", "proj", "fc1", "fc2")  # the GEMMs model { fp8 } runs in FP8


def wave_efficiency(m: int, n: int, sms: int, groups: int = 1) -> float:
    """The useful share of the waves of output tiles, for the best typical tile; a
    grouped GEMM's ``groups`` GEMMs of one shape fill the waves together."""
    best = 0.0
    for rows, columns in TILES:
        tiles = groups * ceil(m / rows) * ceil(n / columns)
        waves = ceil(tiles / sms)
        best = max(best, groups * m * n / (waves * sms * rows * columns))
    return best


class KernelModel:
    """Seconds of a compute instruction on a known GPU: ``seconds(operands, traffic)``."""

    def __init__(self, plan: Plan, gpu: GPU):
        self.gpu = gpu
        self.peak = plan.topology.device.flops
        # The attention rates are the preset's own device's (in bf16, or measured in
        # fp32); a plan that declares another peak (device { flops }: a part at a lower
        # power limit or clock), or whose dtype runs on other cores without rates of its
        # own (fp32 on the A100), scales them as its GEMMs scale.
        forward, backward, reference = attention_rates(plan, gpu)
        self.attention = (forward, backward)
        self.attention_scale = self.peak / reference
        self.causal = causal_share(plan)
        # model { fp8 }: the linear layers' and the experts' GEMMs at the device's FP8
        # peak, as many times its dtype's as the datasheets say (H100: 1,979 over 989
        # TFLOP/s), scaled like the rest by a declared peak; None: at the dtype's
        self.fp8_speedup = fp8_speedup(plan)
        self.bandwidth = plan.topology.device.bandwidth
        shapes = Shapes.of(plan)
        self.dtype_bytes = shapes.dtype_bytes
        tp = plan.mesh.tp
        family = family_of(plan)
        output = family.output_tensor
        # op -> (N, K) of each of its GEMMs on one tp rank: one, or the family's several
        several = family.linear_gemms(plan.model, 1) if family.linear_gemms else {}
        self.features: dict[str, tuple[tuple[int, int], ...]] = {}
        for op, source in GEMM_INPUT.items():
            if op in several:  # on its share of the heads where its placement splits them
                split = tp if getattr(plan.shard.tp, op, None) in SPLIT_N else 1
                self.features[op] = tuple(family.linear_gemms(plan.model, split)[op])
                continue
            n, k = shapes.widths[output[op]], shapes.widths[source or output["attention"]]
            layout = getattr(plan.shard.tp, op, None)
            if tp > 1 and layout in SPLIT_N:
                n //= tp
            elif tp > 1 and layout == "row":
                k //= tp
            self.features[op] = ((max(n, 1), max(k, 1)),)
        # Unfused attention: per head, scores = Q K^T (s x s_full, inner head_dim), then
        # scores V (s x head_dim, inner s_full); heads of all microbatch rows stacked.
        self.mixture = Mixture.of(plan)
        self.module_passes = module_passes(plan, shapes)
        # GEMM -> the passes its backward runs to make its input again (recompute_activation,
        # recompute_norms)
        self.made_again = made_again_passes(plan, self.module_passes)
        # q's and k's features on one tp rank: what RoPE rotates
        heads, kv = shapes.heads, getattr(shapes.model, "key_value_heads", shapes.heads)
        self.rope_features = (max(heads // tp, 1) + max(kv // tp, 1)) * shapes.model.head_dim
        # a head's q and k features (the scores' inner dimension) and its v features (the
        # output's): head_dim both, or multi-head latent attention's own
        heads_all = max(shapes.heads, 1)
        self.score_width = max((shapes.widths["qkv"] - shapes.widths["kv"]) // heads_all, 1)
        self.value_width = max(shapes.widths[output["attention"]] // heads_all, 1)
        self.seq_full = shapes.seq_full
        self.score_rows = shapes.batch * shapes.seq * max(shapes.heads // tp, 1)

    @staticmethod
    def fastest_fraction(plan: Plan) -> float:
        """The largest fraction of the device's peak that any compute instruction of
        ``plan`` reaches, counting its FLOPs as the instruction does: a large GEMM's
        ``large`` (tiles, waves and a short inner dimension only lower it), fused
        attention's rates doubled (a causal mask leaves half of the FLOPs counted;
        unfused attention is GEMMs), or, off the known GPUs, the roofline's one
        efficiency. planc tune bounds step times with it."""
        gpu = GPUS.get(plan.topology.preset or "")
        device = plan.topology.device
        if gpu is None:
            return device.efficiency
        forward, backward, reference = attention_rates(plan, gpu)
        attention = max(forward, backward) if gpu.flash else 0.0
        # not capped at 1: fp32 attention, priced at rates measured against the FP32
        # cores' peak, counts twice its causal FLOPs at 1.17 of it on the H100
        return max(gpu.large, 2 * attention / reference)

    @staticmethod
    def of(plan: Plan) -> "KernelModel | None":
        gpu = GPUS.get(plan.topology.preset or "")
        return KernelModel(plan, gpu) if gpu is not None else None

    def sharing(self, held: int) -> "KernelModel":
        """This model while communication kernels hold ``held`` of the GPU's SMs: the
        GEMMs' tiles in waves over the SMs left, the GEMM and attention rates in
        proportion to them; memory bandwidth and launches unchanged."""
        left = max(self.gpu.sms - held, 1)
        model = copy(self)
        model.gpu = replace(self.gpu, sms=left)
        model.peak = self.peak * left / self.gpu.sms
        model.attention_scale = self.attention_scale * left / self.gpu.sms
        return model

    def gemm_seconds(self, m: float, n: int, k: int, fp8: bool = False) -> float:
        """One GEMM of an ``m x k`` by a ``k x n`` matrix (``fp8``: one of the plan's FP8
        GEMMs, :meth:`grouped_gemm_seconds`)."""
        return self.grouped_gemm_seconds(1, m, n, k, fp8)

    def grouped_gemm_seconds(self, groups: int, m: float, n: int, k: float,
                             fp8: bool = False) -> float:
        """One grouped GEMM: ``groups`` GEMMs of ``m x k`` by ``k x n`` in one launch,
        whose output tiles fill the SMs' waves together. ``fp8`` on a device with FP8
        (``fp8_speedup``): at its FP8 rate, the inputs one byte an element, and each
        input read in the dtype and written in FP8 by its quantisation (a bound:
        DeepSeek-V3 fuses an activation's into the kernel before, and a weight's blocks
        serve every microbatch)."""
        gpu, rows = self.gpu, ceil(m)
        waves = wave_efficiency(rows, n, gpu.sms, groups)
        rate = self.peak * gpu.large * waves * k / (k + gpu.k_overhead)
        traffic = self.dtype_bytes * groups * (m * k + k * n + m * n) / self.bandwidth
        if fp8 and self.fp8_speedup:
            rate *= self.fp8_speedup
            inputs = groups * (m * k + k * n)  # read as one byte, and quantised: 1 + d + 1
            traffic = (self.dtype_bytes * groups * m * n
                       + (self.dtype_bytes + 2) * inputs) / self.bandwidth
        return max(2.0 * groups * m * n * k / rate, traffic) + gpu.launch

    def mixture_seconds(self, step: str | None, flops: float, split: bool = False) -> float:
        """A mixture's ``step`` (forward, recompute, backward or weight) of ``flops``: its
        parts' (:meth:`mixture_part_seconds`) added up. ``split``: a backward whose weight
        gradients are a step of their own; it and that step each hold half the whole
        backward's flops (planc.passes.split_backward)."""
        whole_backward = step == "backward" and not split
        tokens = flops / (2.0 if whole_backward else 1.0) / self.mixture.flops_per_token
        return sum(self.mixture_part_seconds(part, step, tokens, split)
                   for part in MIXTURE_PARTS)

    def mixture_part_seconds(self, part: str, step: str | None, tokens: float,
                             split: bool = False) -> float:
        """One part of a mixture's ``step`` on ``tokens`` (planc.models.moe.part_flops; a
        piece of a mixture cut at its all-to-alls, planc.passes.split_dispatch): its GEMMs,
        and the memory traffic and launches of its kernels between them. A backward with
        ``split`` runs the input gradients' GEMMs only, and its ``weight`` step the
        weight gradients' (Qi et al. 2024), which read what the backward saved and launch
        nothing between them."""
        x = self.mixture
        backward, weight = step == "backward", step == "weight"
        # received by the busiest rank of the ep group, over its local experts: the step
        # waits for it
        rows = tokens * x.top_k * x.imbalance
        per_expert = rows / x.local
        h, e, shared = x.hidden, x.expert_ffn, x.shared * x.expert_ffn
        f8 = self.fp8_speedup is not None  # the experts' GEMMs in FP8, not the router's

        def gemms(price, forward, inputs, weights) -> float:
            """The step's GEMMs, each (rows, columns, inner) priced by ``price``: the
            forward's, the input gradients', the weight gradients'."""
            shapes = weights if weight else (inputs if split else inputs + weights) \
                if backward else forward
            return sum(price(*shape) for shape in shapes)

        def dense(m, n, k):
            return self.gemm_seconds(m, n, k, f8)

        def grouped(m, n, k):
            return self.grouped_gemm_seconds(x.local, m, n, k, f8)

        seconds, elements, extra, passes = 0.0, 0.0, 0.0, 0
        # Between the GEMMs: the router's probabilities (fp32) written and read; the
        # tokens gathered into the dispatch buffer (read and written) and scattered back
        # with the weighted sum (the rows read, the tokens written); the activation
        # reading gate and up and writing their product. A backward moves each twice
        # (the forward's saved input and the gradient read, a gradient written).
        if part == "moe_route":  # in the activations' precision, never FP8
            seconds = gemms(self.gemm_seconds, [(tokens, x.experts, h)],
                            [(tokens, h, x.experts)], [(h, x.experts, tokens)])
            elements, extra, passes = rows * 2 * h, 2 * 4.0 * tokens * x.experts, 2
        elif part == "moe_experts":  # gate and up in one GEMM, then down
            seconds = gemms(grouped, [(per_expert, 2 * e, h), (per_expert, h, e)],
                            [(per_expert, h, 2 * e), (per_expert, e, h)],
                            [(h, 2 * e, per_expert), (e, h, per_expert)])
            elements, passes = rows * 3 * e, 1
        elif part == "moe_shared":
            passes = 1
            seconds = gemms(dense, [(tokens, 2 * shared, h), (tokens, h, shared)],
                            [(tokens, h, 2 * shared), (tokens, shared, h)],
                            [(h, 2 * shared, tokens), (shared, h, tokens)]) if shared else 0.0
            elements = shared * 3 * tokens
        elif part == "moe_combine":
            elements, passes = rows * h + tokens * h, 1
        # the SwiGLU's product again, for the down projection's backward: gate and up read,
        # the product written, whenever autograd unpacks it (both halves of a split
        # backward: planc.runtime.families.recomputed_product)
        again = {"moe_experts": e * rows, "moe_shared": shared * tokens}.get(part, 0.0)
        if x.product_recomputed and (backward or weight) and again:
            seconds += 3 * again * self.dtype_bytes / self.bandwidth + self.gpu.launch
        if weight:  # the GEMMs alone
            return seconds
        moved = elements * self.dtype_bytes + extra
        return seconds + (2.0 if backward else 1.0) * moved / self.bandwidth + \
            (2 if backward else 1) * passes * self.gpu.launch

    def _linear_gemms(self, op: str, step: str | None, split: bool
                      ) -> tuple[tuple[int, int, int], ...]:
        """(rows, columns, inner) of each GEMM of a linear's step, the tokens as 1."""
        shapes: list[tuple[int, int, int]] = []
        for n, k in self.features[op]:
            if step == "backward" and not split:
                shapes += [(1, k, n), (k, n, 1)]  # dX = dY W^T, dW = X^T dY
            elif step == "backward":
                shapes.append((1, k, n))  # a split backward's B step: dX only
            elif step == "weight":
                shapes.append((k, n, 1))  # and its W step
            else:
                shapes.append((1, n, k))
        return tuple(shapes)

    def linear_tokens(self, op: str, step: str | None, flops: float,
                      split: bool = False) -> float:
        """The tokens a linear's step of ``flops`` runs on, on one tp rank."""
        per_token = sum(2.0 * a * b * c for a, b, c in self._linear_gemms(op, step, split))
        return flops / per_token

    def linear_seconds(self, op: str, step: str | None, flops: float,
                       split: bool = False) -> float:
        """A linear's ``step`` (forward, recompute, backward, weight) of ``flops`` on one
        tp rank; ``split``: its backward is split into B (input gradient) and W (weight
        gradient) steps. The tokens follow from the FLOPs, so a pass that cuts a linear
        into pieces (tp_overlap) prices each piece at its size."""
        tokens = self.linear_tokens(op, step, flops, split)
        # the layers' linears in FP8 (model { fp8 }); the head in the dtype, as DeepSeek-V3
        # keeps it (section 3.3.1) and planc's runtime runs it
        fp8 = self.fp8_speedup is not None and op in FP8_LINEARS
        seconds = sum(self.gemm_seconds(*(tokens if d == 1 else d for d in gemm), fp8=fp8)
                      for gemm in self._linear_gemms(op, step, split))
        again = self.made_again.get(op)
        if again is not None and step == StepKind.BACKWARD:  # input made again where first
            # unpacked: a split's input half holds it for the weight half (recomputed_output)
            seconds += self.passes_seconds(again, tokens * self.features[op][0][1])
        return seconds

    def passes_seconds(self, passes: Passes, elements: float) -> float:
        """Elementwise kernels over ``elements`` at the memory bandwidth, a launch each."""
        return passes.bytes(self.dtype_bytes) * elements / self.bandwidth + \
            passes.kernels * self.gpu.launch

    def module_seconds(self, operands: Operands, flops: float) -> float | None:
        """What the operator's module runs beside what the graph prices (RoPE after the
        qkv GEMM, repeat_kv before attention), or instead of it (an eager norm,
        activation or loss); None where the plan's kernels add nothing."""
        found = self.module_passes.get(operands.kernel)
        if found is None or operands.step == StepKind.WEIGHT or operands.vocab_parallel:
            return None
        name, (forward, backward) = found
        passes = backward if operands.step == StepKind.BACKWARD else forward
        if name == "rope":
            elements = self.rope_features * self.linear_tokens(
                operands.kernel, operands.step, flops, operands.weight_step is not None)
        elif name == "fp32_cross_entropy":
            elements = loss_logits(operands, flops)
        else:  # per element of the operator's output
            elements = (operands.output_bytes or 0) / self.dtype_bytes
        return self.passes_seconds(passes, elements)

    def unfused_attention(self, backward: bool) -> float:
        """Megatron-LM's attention before FlashAttention (Korthikanti et al. 2022, section
        4.2): two batched GEMMs with the scale-mask-softmax and the dropout between them,
        which read and write every score; the backward runs four GEMMs and their
        gradients."""
        rows, keys = self.score_rows, self.seq_full
        scores = rows * keys  # elements
        gemms = self.gemm_seconds(rows, keys, self.score_width) + \
            self.gemm_seconds(rows, self.value_width, keys)
        moved = UNFUSED_BACKWARD_BYTES if backward else UNFUSED_FORWARD_BYTES
        # the backward's four GEMMs are two of each shape
        return (2 if backward else 1) * gemms + moved * scores / self.bandwidth + \
            2 * self.gpu.launch

    def seconds(self, operands: Operands, traffic: float) -> float:
        """``traffic``: the roofline's bytes moved, for an operator bound by memory."""
        flops, kernel = operands.flops or 0.0, operands.kernel
        module = self.module_seconds(operands, flops)
        if module is not None and kernel not in ADDED_TO_THE_GRAPH:
            return module  # an eager module in place of the fused kernel
        return self.graph_seconds(operands, traffic) + (module or 0.0)

    def graph_seconds(self, operands: Operands, traffic: float) -> float:
        """The instruction's own kernels: its GEMMs, attention, or one memory-bound
        kernel."""
        flops, kernel = operands.flops or 0.0, operands.kernel
        if kernel in self.features:
            return self.linear_seconds(kernel, operands.step, flops,
                                       operands.weight_step is not None)
        split = operands.weight_step is not None
        if kernel == MIXTURE and self.mixture is not None:
            return self.mixture_seconds(operands.step, flops, split)
        if kernel in MIXTURE_PARTS and self.mixture is not None:  # cut at its all-to-alls
            tokens = (operands.output_bytes or 0) / (self.mixture.hidden * self.dtype_bytes)
            return self.mixture_part_seconds(kernel, operands.step, tokens, split)
        if kernel == ATTENTION and not self.gpu.flash:
            return self.unfused_attention(operands.step == StepKind.BACKWARD)
        if kernel == ATTENTION:
            if operands.step == StepKind.BACKWARD:
                work = FLASH_BACKWARD * flops / 2.0 * self.causal
                return work / (self.attention[1] * self.attention_scale) + self.gpu.launch
            return flops * self.causal / (self.attention[0] * self.attention_scale) + \
                self.gpu.launch
        return memory_bound_bytes(operands, traffic, self.dtype_bytes) / self.bandwidth + \
            self.gpu.launch
