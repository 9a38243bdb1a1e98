"""What a model's modules run beside its GEMMs and attention (the family's
``module_kernels``), by the plan's ``optimize { kernels }``.

``fused`` (the default): each norm, activation and loss is one kernel (priced by
:mod:`planc.estimate.kernel_cost` as its memory traffic), as Megatron-LM's fused
kernels and torch.compile run them, and RoPE one more kernel after the qkv GEMM, reading
and writing q and k (Megatron-LM's fused rotary kernel; a compiled graph cannot fold it
into cuBLAS's GEMM or FlashAttention). ``eager``: the operations of the PyTorch module as
written, each a kernel of its own, forward and, by the derivatives autograd takes of each
(PyTorch's ``derivatives.yaml``), backward; counted on torchtitan's Llama 3
(``9dec370``), which its published H100 runs without torch.compile executed
(``MODULE_PASSES`` below, bytes per element of the tensor each pass runs over;
reductions' per-token outputs left out).
Nothing here is fitted: it is the bytes those kernels move at the memory bandwidth, and
a launch each.

:mod:`planc.estimate.kernel_cost` prices these passes (``passes_seconds``) beside or in
place of an operator's own kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.estimate.model import Shapes
from planc.models import family_of, recomputes_norms
from planc.models.llama import qk_norm
from planc.plan.plan import Plan


@dataclass(frozen=True)
class Passes:
    """The elementwise kernels of one module's forward or backward: the bytes they move
    per element (``fixed`` plus ``per_dtype_byte`` times the model dtype's bytes; an fp32
    upcast moves 4 whatever the dtype) and how many kernels they launch."""

    fixed: float
    per_dtype_byte: float
    kernels: int

    def bytes(self, dtype_bytes: int) -> float:
        return self.fixed + self.per_dtype_byte * dtype_bytes


# (forward, backward) of each module under optimize { kernels = eager }, b the dtype's bytes.
MODULE_PASSES = {
    # RMSNorm.forward: x.float() (b + 4), pow(2) (8), mean(-1) (4), + eps and rsqrt (per
    # token), x * r (8), type_as(x) (4 + b), * weight (2b): 28 + 4b, 8 kernels. Backward:
    # * weight's two gradients and the sum over tokens for the weight (6b, 3 kernels),
    # type_as's upcast (b + 4), x * r's gradients and the sum over features (8 + 16, 3),
    # rsqrt's (3 per token), mean's expand (4), pow's: x.pow(1), * 2, * grad (8 + 8 + 12,
    # 3), the two paths into x added (12), float()'s downcast (4 + b): 76 + 8b, 16 kernels.
    "rmsnorm": (Passes(28, 4, 8), Passes(76, 8, 16)),
    # apply_rotary_emb, per element of q and k: .float() (b + 4), the complex product (8),
    # type_as (4 + b), for each of the two (views are free): 16 + 2b, 6 kernels; the
    # backward the same three in reverse (the product's gradient by conj(freqs)).
    "rope": (Passes(16, 2, 6), Passes(16, 2, 6)),
    # F.silu(w1(x)) * w3(x), per element of the output: silu (2b), the product (3b); the
    # backward: the product's two gradients (3b each), silu's (3b).
    "swiglu": (Passes(0, 5, 2), Passes(0, 9, 3)),
    # F.cross_entropy(pred.float(), labels), per logit: the upcast (b + 4), log_softmax in
    # fp32 (PyTorch's cunn_SoftMaxForward on a row too long for shared memory reads it for
    # the max, for the sum and to write: 16), nll_loss's gather (per token): 20 + b, 3
    # kernels. Backward: nll_loss's zero-filled gradient (4) and scatter, log_softmax's
    # (reads the gradient for its sum, then it and the output, writes: 16), the downcast
    # (4 + b): 24 + b, 4 kernels.
    "fp32_cross_entropy": (Passes(20, 1, 3), Passes(24, 1, 4)),
}
# Under optimize { kernels = fused }, of the same modules only RoPE is a kernel the graph
# does not price: one pass that reads q and k and writes them, forward and backward.
FUSED_PASSES = {"rope": (Passes(0, 2, 1), Passes(0, 2, 1))}
# model { qk_norm }: an RMSNorm of q and k before RoPE, inside the qkv operator. Fused (as
# Megatron-LM's --qk-layernorm runs Transformer Engine's RMSNorm), one kernel reading and
# writing each element, and in the backward reading its gradient and input and writing
# the input's (per-token statistics and the weight's sum left out, as above); eager, the
# RMSNorm module's passes.
FUSED_QK_NORM = (Passes(0, 2, 1), Passes(0, 3, 1))


def _joined(a: Passes, b: Passes) -> Passes:
    return Passes(a.fixed + b.fixed, a.per_dtype_byte + b.per_dtype_byte, a.kernels + b.kernels)


def repeat_kv_passes(heads: int, kv_heads: int) -> tuple[Passes, Passes] | None:
    """torchtitan's repeat_kv, per element of attention's output (q's size): k and v
    expanded to every query head and copied by ``reshape`` (each reads its kv elements,
    ``kv / heads`` of q's, and writes q's): 2b (1 + kv / heads), 2 kernels; the backward
    sums the copies back (the same bytes). Nothing when every head has its own k and v."""
    if kv_heads >= heads:
        return None
    copy = Passes(0, 2 * (1 + kv_heads / heads), 2)
    return copy, copy


# The operators whose module passes run beside the graph's kernels (RoPE after the qkv
# GEMM, repeat_kv before attention), not in place of them.
ADDED_TO_THE_GRAPH = ("qkv", "attention")


def module_passes(plan: Plan, shapes: Shapes) -> dict[str, tuple[str, tuple[Passes, Passes]]]:
    """operator -> (its module's name, its (forward, backward) passes) under the plan's
    ``optimize { kernels }``, for the operators whose module runs kernels the graph does
    not price."""
    eager = plan.optimize.kernels == "eager"
    found = {}
    for op, name in family_of(plan).module_kernels.items():
        if name == "repeat_kv":
            passes = repeat_kv_passes(shapes.heads, shapes.model.key_value_heads) \
                if eager else None
        else:
            passes = (MODULE_PASSES if eager else FUSED_PASSES).get(name)
        if name == "rope" and passes is not None and qk_norm(plan.model):
            norm = MODULE_PASSES["rmsnorm"] if eager else FUSED_QK_NORM
            passes = (_joined(passes[0], norm[0]), _joined(passes[1], norm[1]))
        if passes is not None:
            found[op] = (name, passes)
    return found


def made_again_passes(plan: Plan, passes: dict[str, tuple[str, tuple[Passes, Passes]]]
                      ) -> dict[str, Passes]:
    """GEMM -> the passes its backward runs to make its input again, per element of that
    input: down's, the dense MLP's activation (optimize { recompute_activation }: SwiGLU
    reads gate and up and writes the product, GeLU reads its input and writes it), and
    q/k/v's and the MLP's first GEMM's, the norm before it (optimize { recompute_norms }:
    its input read, its output written), each one kernel, or the eager module's forward
    passes (``passes``: :func:`module_passes`' of the plan)."""
    found = {}
    if plan.recomputes_activation:
        swiglu = "swiglu" in family_of(plan).rules
        eager = passes.get("swiglu") if swiglu else None
        found["fc2"] = eager[1][0] if eager else Passes(0, 2 + swiglu, 1)
    if recomputes_norms(plan):
        for gemm, norm in (("qkv", "ln1"), ("fc1", "ln2")):
            eager = passes.get(norm)
            found[gemm] = eager[1][0] if eager else Passes(0, 2, 1)
    return found
