"""What a block of the moe family keeps for its backward, one microbatch on one device
(planc.estimate.memory's per-block counts): llama's dense block, a mixture, and the kinds
of blocks a stage holds, since the model's first ``first_dense`` blocks are dense and the
rest mixtures (planc.models.moe)."""

from __future__ import annotations

from planc.models import llama
from planc.models.family import Model
from planc.vocabulary.model_options import fp8_tile, gemm_input_bytes


# Which blocks a count is of: a stage holding dense blocks alone, mixtures alone, or both
# (the larger counted for every block: an estimate that errs high), as the model's first
# ``first_dense`` blocks are dense and the rest mixtures.
DENSE, MIXTURE, BOTH = "dense", "mixture", "both"
BLOCK_KINDS = (DENSE, MIXTURE, BOTH)


def _of_kinds(m: Model, kinds: str, dense: float, mixture: float) -> float:
    """The count of a block of ``kinds``: the larger of the two where there are both."""
    if not m.first_dense or kinds == MIXTURE:
        return mixture
    return dense if kinds == DENSE else max(dense, mixture)


def kinds_of_layers(m: Model, layers) -> str:
    """The kinds of blocks among ``layers`` (:data:`BLOCK_KINDS`); none: both."""
    dense = [layer < m.first_dense for layer in layers]
    return BOTH if not dense or any(dense) and not all(dense) else \
        DENSE if all(dense) else MIXTURE


def activation_bytes(m: Model, *, seq: int, seq_full: int, batch: int, tp: int,
                     sequence_parallel: bool, recompute: str,
                     attention=llama.attention_kept, rows_received_kept: bool = False,
                     kinds: str = BOTH, product_recomputed: bool = False,
                     activation_recomputed: bool = False) -> float:
    """One block of ``kinds`` (:data:`BLOCK_KINDS`: a stage's, or the model's), the larger
    where there are two: llama's dense block, and the mixture's, whose MLP part keeps
    instead the router's input and fp32 probabilities and, per routed and shared expert a
    token goes through, its input, gate and up outputs (a routed one's weight applied
    inside its SwiGLU, whose inputs its gradient reads: nothing more kept); the mixture
    runs whole on every tp rank, on a 1/tp share of the tokens. ``attention``: what a
    block's attention keeps (planc.models.llama.activation_bytes);
    ``rows_received_kept``: a mixture cut at its all-to-alls
    (planc.models.moe.cut_at_all_to_alls), whose experts piece keeps its input, the rows
    it received with their weights, in the dtype, for its backward
    (planc.runtime.engine.kernels: a step's inputs are what autograd differentiates to),
    beside its experts' own copies. ``product_recomputed``: the experts' SwiGLU product
    is computed again in the backward, not kept (optimize { recompute_moe_activation });
    ``activation_recomputed``: the dense blocks' (optimize { recompute_activation })."""
    dense = llama.activation_bytes(m, seq=seq, seq_full=seq_full, batch=batch, tp=tp,
                                   sequence_parallel=sequence_parallel, recompute=recompute,
                                   attention=attention,
                                   activation_recomputed=activation_recomputed)
    if recompute == "full":
        return dense
    sb = seq * batch
    active = m.top_k + m.shared_experts
    # llama's dense MLP out (gate and up in the dtype, down's input as a GEMM input), the
    # router's input and fp32 probabilities in, and per expert a token goes through its
    # rows (a GEMM input), its gate and up outputs and the product: in the dtype and a
    # GEMM input, or with fp8 gate and up in FP8 and the product recomputed from them
    # (DeepSeek-AI 2024, section 3.3.4; planc.runtime.engine.fp8.swiglu_down), or with
    # recompute_moe_activation gate and up alone (planc.runtime.families.recomputed_output)
    gemm = gemm_input_bytes(m)
    swiglu = 2 * m.expert_ffn * gemm if fp8_tile(m) else \
        2 * m.expert_ffn * m.dtype_bytes + m.expert_ffn * gemm * (not product_recomputed)
    received = m.top_k * sb * (m.hidden + 1) * m.dtype_bytes if rows_received_kept else 0.0
    down = gemm * (not activation_recomputed)  # the dense MLP's, which the mixture's replaces
    mixture = dense + (sb * m.hidden * m.dtype_bytes + sb * m.experts * 4
                       + active * sb * (m.hidden * gemm + swiglu) + received
                       - sb * m.ffn * (2 * m.dtype_bytes + down)) / tp
    return _of_kinds(m, kinds, dense, mixture)


def recomputed_product_bytes(m: Model, *, seq: int, batch: int, tp: int,
                             product_recomputed: bool = False, kinds: str = BOTH,
                             **_) -> float:
    """What a mixture's backward holds for a moment beyond its count under
    ``product_recomputed``: one block's experts' SwiGLU products of one microbatch,
    computed again (planc.runtime.families.recomputed_product): the bytes
    :func:`activation_bytes` does not count kept; none where nothing is computed again
    (planc.plan.plan.Plan.recomputes_moe_activation) or the blocks are dense."""
    if not product_recomputed or kinds == DENSE:
        return 0.0
    return (m.top_k + m.shared_experts) * seq * batch * m.expert_ffn * gemm_input_bytes(m) / tp


def input_half_bytes(m: Model, *, seq: int, seq_full: int, batch: int, tp: int,
                     sequence_parallel: bool, recompute: str,
                     attention=llama.attention_kept, core=llama.attention_core_kept,
                     rows_received_kept: bool = False, kinds: str = BOTH,
                     product_recomputed: bool = False,
                     activation_recomputed: bool = False) -> float:
    """Of :func:`activation_bytes`, what the steps without parameters keep, for the same
    kind of block (of ``kinds``): llama's (planc.models.llama.input_half_bytes) for a
    dense one; for a mixture, its attention core's alone, since its experts keep their
    rows, gate and up in their own step, which has parameters (counted as kept until the
    weight half even where a mixture over ep runs whole in the input half: an estimate
    that errs high)."""
    sizes = dict(seq=seq, seq_full=seq_full, batch=batch, tp=tp,
                 sequence_parallel=sequence_parallel, recompute=recompute)
    dense = llama.input_half_bytes(m, core=core, activation_recomputed=activation_recomputed,
                                   **sizes)
    if recompute == "full":
        return dense
    mixture = llama.input_half_bytes(m, core=core, **sizes) - \
        seq * batch * 2 * m.ffn / tp * m.dtype_bytes
    if not m.first_dense or kinds == MIXTURE:
        return mixture
    if kinds == DENSE:
        return dense
    dense_block = llama.activation_bytes(m, attention=attention,
                                         activation_recomputed=activation_recomputed, **sizes)
    return mixture if activation_bytes(m, attention=attention,
                                       rows_received_kept=rows_received_kept,
                                       product_recomputed=product_recomputed,
                                       activation_recomputed=activation_recomputed,
                                       **sizes) > dense_block else dense
