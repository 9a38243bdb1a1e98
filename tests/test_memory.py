"""Memory per device (planc/estimate/memory.py) against the papers' own numbers and formulas.

Model states: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC'20), Figure 1 / section 3. Activations: Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), Table 2.
In-flight microbatches: Megatron-LM's pipeline schedules. Every expected value is
computed here by hand or from the formula, never by calling planc.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from planc.estimate import in_flight, memory, parameter_counts
from planc.lang import load_file, load_text
from tests.conftest import PLANS

GB = 1e9


def gpt_parameters(layers, hidden, vocab, seq, tied=False):
    """12 L h^2 + 13 L h + (V + s) h + 2 h + h V (4h MLP, biases, untied head)."""
    return (12 * layers * hidden ** 2 + 13 * layers * hidden + (vocab + seq) * hidden
            + 2 * hidden + (0 if tied else hidden * vocab))


def plan_of(text: str):
    loaded = load_text(text)
    assert loaded.ok, loaded.diagnostics
    return loaded.plan


# --- ZeRO, Figure 1 ------------------------------------------------------------------

# Psi = 7.5B, N_d = 64, mixed-precision Adam: 2 bytes of parameters, 2 of gradients,
# K = 12 bytes of optimizer state per parameter. The paper's Figure 1 prints
# 120 GB, 31.4 GB, 16.6 GB and 1.9 GB for the baseline and P_os, P_os+g, P_os+g+p
# (value in GB, decimals printed).
ZERO_FIGURE_1 = {0: (120, 0), 1: (31.4, 1), 2: (16.6, 1), 3: (1.9, 1)}


def as_printed(total_bytes: float, zero: int) -> float:
    return round(total_bytes / GB, ZERO_FIGURE_1[zero][1])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_paper_example_through_model_state_bytes(zero):
    psi, nd = 7.5e9, 64
    params, grads, optim = memory.model_state_bytes(psi, 2, 12, zero, nd)
    expected = {0: (2 * psi, 2 * psi, 12 * psi),
                1: (2 * psi, 2 * psi, 12 * psi / nd),
                2: (2 * psi, 2 * psi / nd, 12 * psi / nd),
                3: (2 * psi / nd, 2 * psi / nd, 12 * psi / nd)}[zero]
    assert (params, grads, optim) == pytest.approx(expected, rel=1e-12)
    total = params + grads + optim
    assert as_printed(total, zero) == ZERO_FIGURE_1[zero][0]
    # The exact values behind the rounding: 120, 31.40625, 16.640625, 1.875 GB.
    assert total == pytest.approx({0: 120e9, 1: 31.40625e9, 2: 16.640625e9,
                                   3: 1.875e9}[zero], rel=1e-12)


# 35 layers of width 4096, vocabulary 53,248, 2048 positions: 7,492,898,816 parameters.
ZERO_LAYERS, ZERO_HIDDEN, ZERO_VOCAB, ZERO_SEQ = 35, 4096, 53248, 2048
ZERO_PSI = 7_492_898_816


def zero_plan(zero: int, dp: int = 64, cp: int = 1):
    return plan_of(f"""
plan zero_paper {{
  model gpt {{ layers = {ZERO_LAYERS}; hidden = {ZERO_HIDDEN}; heads = 32
              vocab = {ZERO_VOCAB}; seq = {ZERO_SEQ}; batch = 64; dtype = bf16 }}
  mesh {{ dp = {dp}; cp = {cp} }}
  shard {{ dp {{ zero = {zero} }} }}
  train {{ optimizer = adamw(lr = 1e-4) }}
}}""")


def test_zero_plan_has_about_7_5_billion_parameters():
    psi = gpt_parameters(ZERO_LAYERS, ZERO_HIDDEN, ZERO_VOCAB, ZERO_SEQ)
    assert psi == ZERO_PSI
    assert abs(psi - 7.5e9) / 7.5e9 < 0.002
    plan = zero_plan(0)
    assert memory.total_parameters(plan) == ZERO_PSI
    assert memory.stage_parameters(plan, 0) == ZERO_PSI
    assert memory.optimizer_state_bytes(plan) == 12  # fp32 master + two fp32 moments


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp, cp", [(64, 1), (32, 2)])  # replicas = dp x cp = 64 either way
def test_zero_paper_example_through_a_plan(zero, dp, cp):
    psi, nd = ZERO_PSI, 64
    expected = {0: (2 * psi, 2 * psi, 12 * psi),
                1: (2 * psi, 2 * psi, 12 * psi / nd),
                2: (2 * psi, 2 * psi / nd, 12 * psi / nd),
                3: (2 * psi / nd, 2 * psi / nd, 12 * psi / nd)}[zero]
    (stage,) = memory.estimate(zero_plan(zero, dp, cp)).stages
    assert stage.parameters == psi
    assert (stage.parameter_bytes, stage.gradient_bytes, stage.optimizer_bytes) == expected
    assert as_printed(sum(expected), zero) == ZERO_FIGURE_1[zero][0]


@pytest.mark.parametrize("zero, dp, units", [(3, 64, True), (2, 64, False), (3, 1, False)])
def test_zero3_counts_its_largest_unit_whole_beside_the_shards(zero, dp, units):
    """Twice in bf16 (the forward's, filled again, and the backward's gather) and its
    fp32 gradient: 8 bytes a parameter of the largest unit, here the embedding (token
    and position tables, 53,248 x 4096 + 2048 x 4096), larger than a block. The last
    block, kept whole from its forward to its backward beside the head's unit, is
    within it (one copy of each)."""
    (stage,) = memory.estimate(zero_plan(zero, dp)).stages
    embedding = (ZERO_VOCAB + ZERO_SEQ) * ZERO_HIDDEN
    block = memory.layer_parameters(zero_plan(zero, dp))
    assert embedding > block == 12 * ZERO_HIDDEN ** 2 + 13 * ZERO_HIDDEN
    assert memory.last_block_kept(zero_plan(zero, dp)) == units
    assert stage.unsharded_bytes == (8 * embedding if units else 0.0)
    assert stage.total_bytes == (stage.parameter_bytes + stage.gradient_bytes
                                 + stage.optimizer_bytes + stage.activation_bytes
                                 + stage.unsharded_bytes)
    from planc.views import memory_text

    header = memory_text.render(memory.estimate(zero_plan(zero, dp))).splitlines()[1].split()
    assert header == ["stage", "params", "weights", "grads", "optimizer", "activations",
                      "in", "flight", *(["unit", "whole"] if units else []), "total"]


def moe_zero3(dp: int):
    """A mixture of 8 experts over ep 2 and ``dp`` ranks under ZeRO-3."""
    return plan_of(f"""plan m {{
  model moe {{ layers = 2; hidden = 64; heads = 4; kv_heads = 4; experts = 8; top_k = 2
              expert_ffn = 256; vocab = 256; seq = 32; batch = 8; dtype = bf16 }}
  mesh {{ dp = {dp}; ep = 2 }}
  shard {{ dp {{ zero = 3 }} }}
}}""")


def test_zero3_s_largest_unit_may_be_a_blocks_experts_split_over_ep():
    """The routed experts of a block split over ep are a ZeRO-3 unit of their own (over
    edp): 8 experts of 3 x 64 x 256 over ep 2, 196,608 elements a rank (2 shards of
    98,304 over edp 2: planc explain --buckets), larger than the block's attention,
    router and norms or the embedding."""
    plan = moe_zero3(dp=4)
    experts = 4 * 3 * 64 * 256
    assert memory.stage_expert_parameters(plan, 0) == 2 * experts
    assert memory.unsharded_unit_bytes(plan, 0) == (2 * 2 + 4) * experts


def test_experts_with_no_replica_are_no_zero3_unit():
    """dp 2 x ep 2: edp = tp x cp x dp / ep = 1, so the experts' bucket has no replica to
    gather from and is never gathered; the largest unit is a block's attention, router and
    norms (17,024 elements), not its experts' 196,608 a rank."""
    plan = moe_zero3(dp=2)
    block = memory.layer_parameters(plan)
    assert block == 17_024
    assert memory.unsharded_unit_bytes(plan, 0) == (2 * 2 + 4) * block
    assert memory.stage_expert_parameters(plan, 0) == 2 * 196_608


def zb_plan(pipeline: str, zero: int = 0, dp: int = 1, recompute: str = "none"):
    """A 4-layer llama over 2 stages, 4 microbatches of one 32-token sequence."""
    return plan_of(f"""plan z {{
  model llama {{ layers = 4; hidden = 64; heads = 4; kv_heads = 2; ffn = 128; vocab = 256
                seq = 32; batch = {4 * dp} }}
  mesh {{ pp = 2; dp = {dp} }}
  shard {{ dp {{ zero = {zero} }} }}
  schedule {{ microbatches = 4; pipeline = {pipeline} }}
  optimize {{ recompute = {recompute} }}
}}""")


# One llama block's steps with parameters and the features of their outputs a token:
# ln1 64, qkv (4 + 2 x 2) x 16 = 128, proj 64, ln2 64, fc1 2 x 128 = 256, fc2 64
BLOCK_OUTPUTS = 64 + 128 + 64 + 64 + 256 + 64


@pytest.mark.parametrize("stage, outputs, held", [
    (0, 2 * BLOCK_OUTPUTS + 64, 1),  # F0 F1 I0 W0 ..: the embedding's output too
    (1, 2 * BLOCK_OUTPUTS + 64 + 256, 2),  # F0 I0 F1 I1 W0 ..: the final norm's, the logits'
])
def test_a_split_backward_keeps_the_output_gradients_its_weight_half_reads(
        stage, outputs, held):
    """zb1p: every step with parameters keeps the gradient of its output from its input
    half (I) to its weight half (W), which reads it; in fp32, 32 tokens a microbatch, for
    the most microbatches of the stage between their I and their W. 1F1B keeps none."""
    assert memory.weight_gradient_reads_bytes(zb_plan("1f1b"), stage) == 0.0
    split = zb_plan("zb1p")
    assert memory.weight_gradient_reads_bytes(split, stage) == held * outputs * 32 * 4


@pytest.mark.parametrize("stage, peak, freed", [
    # F0 F1 I0 W0 ..: the peak at I0, before it frees anything
    (0, 2 * BLOCK_OUTPUTS + 64, 0),
    # F0 I0 F1 I1 W0 ..: the peak at I1: two microbatches' reads (the final norm's output
    # too) and the first's logits gradient (the second's logits the head's terms count
    # while its loss runs), less what I0 freed of the first's activations
    (1, 2 * (2 * BLOCK_OUTPUTS + 64) + 256, 1),
])
def test_a_split_backwards_input_half_frees_what_the_steps_without_parameters_keep(
        stage, peak, freed):
    """zb1p: the steps without parameters run their whole backward in the input half (I),
    which frees what they keep: the attention core's rotated q, k and v ((4 + 2 x 2) x 16
    features a token) and its probabilities (4 heads x 32 positions), SwiGLU's gate and
    up (2 x 128), for each of a chunk's 2 layers, in fp32, 32 tokens a microbatch. The
    stage's peak of activations and what W reads is lower by what the Is done by then
    freed. 1F1B splits nothing."""
    assert memory.input_half_frees_bytes(zb_plan("1f1b"), stage) == 0.0
    split = zb_plan("zb1p")
    assert memory.layer_input_half_bytes(split) == (128 + 4 * 32 + 256) * 32 * 4
    assert memory.weight_gradient_reads_bytes(split, stage) - \
        memory.input_half_frees_bytes(split, stage) == \
        peak * 32 * 4 - freed * 2 * memory.layer_input_half_bytes(split)


MIXED = """plan mixed {
  model moe { layers = 4; hidden = 64; heads = 4; kv_heads = 2; ffn = 256; vocab = 128
              seq = 32; batch = 4; experts = 4; top_k = 2; expert_ffn = 128
              shared_experts = 1; first_dense = 1 FP8 }
  mesh { pp = 2 }
  schedule { microbatches = 4; pipeline = zb1p }
}
"""


@pytest.mark.parametrize("fp8", [False, True])
def test_a_stage_of_mixtures_alone_is_counted_as_mixtures(fp8):
    """Dense block 0 and mixtures 1 to 3 over 2 stages: stage 0 holds both kinds and
    counts each block as the larger, stage 1 holds mixtures alone and counts them as
    mixtures, activations and what an input half frees alike. With FP8 the dense block
    is the larger (its SwiGLU's gate and up stay in the dtype, the experts' go to FP8),
    and stage 1 was counted as freeing that SwiGLU in its input halves, which its
    mixtures do not keep: 2 x 256 features of 32 tokens in fp32, a layer."""
    from planc.models import moe_memory

    plan = load_text(MIXED.replace("FP8", "; fp8 = blockwise" if fp8 else "")).plan
    sizes = dict(seq=32, seq_full=32, batch=1, tp=1, sequence_parallel=False,
                 recompute="none")
    dense, mixture = (moe_memory.activation_bytes(plan.model, kinds=kinds, **sizes)
                      for kinds in (moe_memory.DENSE, moe_memory.MIXTURE))
    assert (dense > mixture) is fp8
    assert memory.layer_activation_bytes(plan, stage=0) == max(dense, mixture) == \
        memory.layer_activation_bytes(plan)
    assert memory.layer_activation_bytes(plan, stage=1) == mixture
    halves = [memory.layer_input_half_bytes(plan, stage) for stage in (0, 1)]
    assert halves[1] == moe_memory.input_half_bytes(plan.model, kinds=moe_memory.MIXTURE, **sizes)
    assert halves[0] - halves[1] == (2 * 256 * 32 * 4 if fp8 else 0)


@pytest.mark.parametrize("recompute, inputs", [
    ("selective", 0),  # the attention core alone, which has no parameters: no W of its
    # ln1 64, qkv 64 (ln1's output), proj 64 (the heads' context), ln2 64, fc1 64 and
    # fc2 128 (the SwiGLU's output): what the recomputed steps' W graphs keep
    ("full", 5 * 64 + 128)])
def test_a_split_backward_keeps_a_recomputed_steps_inputs_until_its_weight_half(
        recompute, inputs):
    """Recomputation under zb1p: a recomputed step with parameters keeps its inputs in
    the graph its I ran through until its W reads them (dW = x^T dy); steps without
    parameters run their whole backward in I. Stage 1, 2 microbatches between their I and
    W, each of 2 layers and the head's chunk (the final norm and the head are not
    recomputed), fp32, 32 tokens."""
    split = zb_plan("zb1p", recompute=recompute)
    reads = 2 * BLOCK_OUTPUTS + 64 + 256
    assert memory.weight_gradient_reads_bytes(split, 1) == \
        2 * (reads + 2 * inputs) * 32 * 4


@pytest.mark.parametrize("stage, held", [(0, 1), (1, 2)])
def test_zero3_under_a_split_backward_keeps_a_chunks_units_whole_until_its_w(stage, held):
    """ZeRO-3 over dp 2 under zb1p: autograd's W reads the graph its I ran through, whose
    views hold the units' parameters as the backward's gather filled them, so a chunk's
    units stay whole in fp32 from its I to its W: the blocks', with the embedding on the
    first stage and the final norm and head on the last, for each microbatch between."""
    plan, plain = zb_plan("zb1p", zero=3, dp=2), zb_plan("1f1b", zero=3, dp=2)
    block = memory.layer_parameters(plan)
    chunk = 2 * block + (256 * 64 if stage == 0 else 64 + 256 * 64)
    assert memory.unsharded_unit_bytes(plan, stage) == \
        memory.unsharded_unit_bytes(plain, stage) + held * chunk * 4
    assert memory.unsharded_unit_bytes(zb_plan("zb1p", zero=2, dp=2), stage) == 0.0


def test_fp32_grads_adds_four_unsharded_bytes_per_parameter():
    # DeepSpeed's BF16_Optimizer: "4 bytes * params of additional memory", not sharded
    # (BigScience tr11 README, "Deepspeed config"); ZeRO-1 shards the rest as before.
    psi, nd = ZERO_PSI, 64
    plan = plan_of(f"""
plan bf16_optimizer {{
  model gpt {{ layers = {ZERO_LAYERS}; hidden = {ZERO_HIDDEN}; heads = 32
              vocab = {ZERO_VOCAB}; seq = {ZERO_SEQ}; batch = 64; dtype = bf16 }}
  mesh {{ dp = 64 }}
  shard {{ dp {{ zero = 1; fp32_grads = on }} }}
  train {{ optimizer = adamw(lr = 1e-4) }}
}}""")
    (stage,) = memory.estimate(plan).stages
    assert (stage.parameter_bytes, stage.gradient_bytes, stage.optimizer_bytes) == \
        (2 * psi, 6 * psi, 12 * psi / nd)


@pytest.mark.parametrize("name, accumulation", [("bloom-176b", 4), ("bloom-181b-pp6", 0)])
def test_bloom_plans_count_the_bf16_optimizers_buffer_only_where_they_used_it(name,
                                                                               accumulation):
    # 02-28's rows ran DeepSpeed's BF16_Optimizer (fp32_grads); 02-25's are taken as fp16.
    plan = load_file(PLANS / "bloom" / f"{name}.plan").plan
    first = memory.estimate(plan).stages[0]
    psi, dtype_bytes = first.parameters, plan.model.dtype_bytes
    assert (first.parameter_bytes, first.gradient_bytes, first.optimizer_bytes) == \
        (dtype_bytes * psi, (dtype_bytes + accumulation) * psi, 12 * psi / plan.mesh.dp)


def test_fp32_grads_with_fp32_weights_warns_and_changes_nothing():
    text = """
plan fp32_model {
  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 256; seq = 32; batch = 8 }
  mesh { dp = 2 }
  shard { dp { fp32_grads = on } }
}"""
    loaded = load_text(text)
    assert loaded.ok
    assert [d.message for d in loaded.diagnostics] == [
        "fp32_grads = on has no effect with dtype = fp32: the gradients are fp32 already"]
    plain = plan_of(text.replace("shard { dp { fp32_grads = on } }", ""))
    assert memory.estimate(loaded.plan) == memory.estimate(plain)


# --- Korthikanti et al. 2022, Table 2 -----------------------------------------------------

def korthikanti_plan(sequence_parallel: bool, dtype: str = "bf16", recompute: str = "none"):
    # GPT-3 175B's layer: s = 2048, b = 1, h = 12288, a = 96, t = 8.
    return plan_of(f"""
plan korthikanti {{
  model gpt {{ layers = 8; hidden = 12288; heads = 96; vocab = 51200; seq = 2048
              batch = 1; dtype = {dtype} }}
  mesh {{ tp = 8 }}
  shard {{ tp {{ sequence_parallel = {"on" if sequence_parallel else "off"} }} }}
  optimize {{ recompute = {recompute} }}
  train {{ optimizer = adamw(lr = 1e-4) }}
}}""")


S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H  # 25,165,824
# By hand, bytes per layer and microbatch with 2-byte activations:
#   none:       sbh (10 + 24/t + 5as/(ht)) = sbh (10 + 3 + 10) = 23 sbh
#   none, SP:   sbh/t (34 + 5as/h)         = sbh/8 (34 + 80)  = 14.25 sbh
#   selective:  sbh (10 + 24/t)            = 13 sbh
#   sel., SP:   34 sbh / t                 = 4.25 sbh
#   full:       2 sbh;  full, SP: 2 sbh / t = 0.25 sbh
KORTHIKANTI = {
    ("none", False): 578_813_952,
    ("none", True): 358_612_992,
    ("selective", False): 327_155_712,
    ("selective", True): 106_954_752,
    ("full", False): 50_331_648,
    ("full", True): 6_291_456,
}


def test_korthikanti_numbers_are_the_formulas():
    formulas = {
        ("none", False): SBH * (10 + 24 / T + 5 * A * S / (H * T)),
        ("none", True): SBH / T * (34 + 5 * A * S / H),
        ("selective", False): SBH * (10 + 24 / T),
        ("selective", True): 34 * SBH / T,
        ("full", False): 2 * SBH,
        ("full", True): 2 * SBH / T,
    }
    assert formulas == KORTHIKANTI


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_layer_activations_match_table_2(recompute, sp):
    plan = korthikanti_plan(sp)
    assert plan.microbatch_size == 1
    assert memory.layer_activation_bytes(plan, recompute) == KORTHIKANTI[recompute, sp]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_layer_activations_follow_the_plans_recompute_and_fp32_doubles(recompute, sp):
    plan = korthikanti_plan(sp, recompute=recompute)
    assert memory.layer_activation_bytes(plan) == KORTHIKANTI[recompute, sp]
    fp32 = korthikanti_plan(sp, dtype="fp32", recompute=recompute)
    assert memory.layer_activation_bytes(fp32) == 2 * KORTHIKANTI[recompute, sp]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_flash_attention_keeps_no_probabilities(recompute, sp):
    """On the dgx-h100 preset, whose attention the kernel model prices as FlashAttention
    (Dao et al. 2022: no s x S probabilities kept), Table 2's 5as/h term is gone: none
    counts as selective; the A100's preset (Megatron before FlashAttention) keeps it."""
    plan = korthikanti_plan(sp, recompute=recompute)
    h100 = dataclasses.replace(plan, topology=dataclasses.replace(plan.topology,
                                                                  preset="dgx-h100"))
    expected = "selective" if recompute == "none" else recompute
    assert memory.layer_activation_bytes(h100) == KORTHIKANTI[expected, sp]
    a100 = dataclasses.replace(plan, topology=dataclasses.replace(plan.topology,
                                                                  preset="dgx-a100"))
    assert memory.layer_activation_bytes(a100) == KORTHIKANTI[recompute, sp]


def test_mixtral_and_qwen3s_published_layouts_fit_80_gb():
    """Their published runs (Megatron-Core, FlashAttention on H100s) fit 80 GB; with the
    probabilities counted they did not (85.3 GB, 104 to 198 GB)."""
    for name in ("mcore-mixtral-8x7b", "modelzoo-qwen3-235b-tp4", "modelzoo-qwen3-235b-ep32",
                 "modelzoo-qwen3-235b-ep32-overlap", "modelzoo-qwen3-235b-a2a"):
        peak = memory.estimate(load_file(PLANS / "moe-published" / f"{name}.plan").plan).peak
        assert 40 * GB < peak.total_bytes < 80 * GB, (name, peak.total_bytes / GB)


def test_an_experts_state_is_sharded_over_its_own_replicas():
    """MoE Parallel Folding: a dense weight has dp x cp replicas, an expert tp x dp x cp
    / ep. Mixtral 8x7B's published layout (tp 1, dp 16, ep 8, pp 4; ZeRO-1): stage 0's 8
    layers hold 8 experts of three 4,096 x 14,336 weights each, 1/8 of them per rank; the
    optimizer state of the dense weights is split 16 ways, the experts' 2 ways. With the
    experts' split as the dense weights', it was 6.3 times too small and every peak still
    fit the bounds above."""
    plan = load_file(PLANS / "moe-published" / "mcore-mixtral-8x7b.plan").plan
    first = memory.estimate(plan).stages[0]
    experts = 8 * 8 * 3 * 4096 * 14336 // 8
    dense = first.parameters - experts
    k = memory.optimizer_state_bytes(plan)
    assert first.optimizer_bytes == k * dense / 16 + k * experts / 2 == 2_935_308_288


# --- microbatches in flight -------------------------------------------------------------

def pipeline_plan(pp: int, microbatches: int, schedule: str, virtual: int = 1):
    layers = pp * virtual * 2
    pp_block = f"shard {{ pp {{ virtual = {virtual} }} }}" if virtual > 1 else ""
    return plan_of(f"""
plan pipe {{
  model gpt {{ layers = {layers}; hidden = 64; heads = 4; vocab = 256; seq = 32
              batch = {microbatches * 2} }}
  mesh {{ pp = {pp} }}
  {pp_block}
  schedule {{ microbatches = {microbatches}; pipeline = {schedule} }}
}}""")


@pytest.mark.parametrize("pp, m, schedule, virtual, expected", [
    # GPipe: every stage holds all m microbatches before the first backward.
    (4, 8, "gpipe", 1, [8, 8, 8, 8]),
    (4, 2, "gpipe", 1, [2, 2, 2, 2]),
    # 1F1B: stage i holds min(pp - i, m).
    (4, 8, "1f1b", 1, [4, 3, 2, 1]),
    (4, 2, "1f1b", 1, [2, 2, 2, 1]),
    (1, 5, "1f1b", 1, [1]),
    # Interleaved (Megatron): (pp - i - 1) * 2 + (v - 1) * pp warm-up forwards, plus
    # one, at most m * v microbatch-chunks.
    # pp 4, v 2, m 8: 6+4+1, 4+4+1, 2+4+1, 0+4+1 = 11, 9, 7, 5 (cap 16).
    (4, 8, "interleaved", 2, [11, 9, 7, 5]),
    # pp 4, v 2, m 4: 11 and 9 capped at 8.
    (4, 4, "interleaved", 2, [8, 8, 7, 5]),
    # pp 2, v 3, m 2: 2+4+1 = 7 capped at 6; 0+4+1 = 5.
    (2, 2, "interleaved", 3, [6, 5]),
    # pp 2, v 3, m 4: 7 and 5 (cap 12).
    (2, 4, "interleaved", 3, [7, 5]),
])
def test_microbatches_in_flight(pp, m, schedule, virtual, expected):
    plan = pipeline_plan(pp, m, schedule, virtual)
    assert [in_flight.microbatches_in_flight(plan, i) for i in range(pp)] == expected
    assert [s.microbatches_in_flight for s in memory.estimate(plan).stages] == expected


# --- parameter counts -------------------------------------------------------------------

# gpt-tiny: L 4, h 64, ffn 256, V 256, s 32, untied.
TINY_TOTAL = 234_880  # 196,608 + 3,328 + 18,432 + 128 + 16,384


def test_total_parameters_of_gpt_tiny():
    plan = load_file(PLANS / "gpt-tiny.plan").plan
    assert gpt_parameters(4, 64, 256, 32) == TINY_TOTAL
    assert memory.total_parameters(plan) == TINY_TOTAL


def tiny_plan(tp_block: str = "", pp: int = 2, tied: bool = False, tp: int = 2):
    stages = "pp { stages = [0..1, 2..3] }" if pp == 2 else ""
    return plan_of(f"""
plan tiny {{
  model gpt {{ layers = 4; hidden = 64; heads = 4; vocab = 256; seq = 32; batch = 16
              tie_embeddings = {"on" if tied else "off"} }}
  mesh {{ tp = {tp}; pp = {pp} }}
  shard {{
    tp {{ {tp_block} }}
    {stages}
  }}
}}""")


h, f, V, s = 64, 256, 256, 32
LN = 4 * h  # ln1 + ln2, weight and bias, replicated: 256


def linear(fan_in, fan_out, placement, tp=2):
    weight, bias = fan_in * fan_out, fan_out
    return {"column": weight // tp + bias // tp,   # weight and bias both split
            "row": weight // tp + bias,             # bias whole on every rank
            "replicate": weight + bias}[placement]


def test_linear_counts_by_hand():
    assert linear(h, 3 * h, "column") == 6_240     # (12,288 + 192) / 2
    assert linear(h, h, "row") == 2_112            # 4,096 / 2 + 64
    assert linear(h, f, "column") == 8_320         # (16,384 + 256) / 2
    assert linear(f, h, "row") == 8_256            # 16,384 / 2 + 64


def test_stage_parameters_with_megatron_placements():
    plan = tiny_plan()
    layer = LN + 6_240 + 2_112 + 8_320 + 8_256
    assert layer == 25_184
    # stage 0: two layers, vocab-sharded embedding (256 x 64 / 2), whole positions (32 x 64)
    assert memory.stage_parameters(plan, 0) == 2 * layer + 8_192 + 2_048 == 60_608
    # stage 1: two layers, final LayerNorm (2 x 64), vocab-sharded head (256 x 64 / 2)
    assert memory.stage_parameters(plan, 1) == 2 * layer + 128 + 8_192 == 58_688
    assert memory.layer_parameters(plan) == layer


def test_stage_parameters_with_unusual_placements():
    plan = tiny_plan("qkv = row; proj = column; fc1 = row; fc2 = column; embedding = hidden")
    layer = (LN + linear(h, 3 * h, "row") + linear(h, h, "column") + linear(h, f, "row")
             + linear(f, h, "column"))
    # 256 + (6,144 + 192) + (2,048 + 32) + (8,192 + 256) + (8,192 + 32)
    assert layer == 25_344
    assert memory.layer_parameters(plan) == layer
    assert memory.stage_parameters(plan, 0) == 2 * layer + 256 * 64 // 2 + 2_048
    assert memory.stage_parameters(plan, 1) == 2 * layer + 128 + 256 * 64 // 2


def test_stage_parameters_replicated_over_tp():
    plan = tiny_plan("embedding = replicate; qkv = replicate; proj = replicate; "
                     "fc1 = replicate; fc2 = replicate; head = replicate")
    layer = 12 * h * h + 13 * h  # 49,984: the whole layer on every tp rank
    assert memory.layer_parameters(plan) == layer == 49_984
    assert memory.stage_parameters(plan, 0) == 2 * layer + V * h + s * h == 118_400
    assert memory.stage_parameters(plan, 1) == 2 * layer + 2 * h + V * h == 116_480
    # With everything replicated and tp = 1 the stages add up to the whole model.
    whole = tiny_plan(tp=1)
    assert (memory.stage_parameters(whole, 0) + memory.stage_parameters(whole, 1)
            == TINY_TOTAL)


def test_tied_embeddings():
    layer = 25_184
    # pp > 1: the last stage keeps its own copy of the (vocab-sharded) embedding as head.
    tied = tiny_plan(tied=True)
    assert memory.stage_parameters(tied, 0) == 2 * layer + 8_192 + 2_048
    assert memory.stage_parameters(tied, 1) == 2 * layer + 128 + 8_192
    # pp = 1: the one stage holds the table once.
    single = tiny_plan(tied=True, pp=1)
    assert memory.stage_parameters(single, 0) == 4 * layer + 8_192 + 2_048 + 128 == 111_104
    untied = tiny_plan(pp=1)
    assert memory.stage_parameters(untied, 0) == 111_104 + 8_192
    # The tied model counts the table once.
    assert memory.total_parameters(single) == TINY_TOTAL - V * h == 218_496


# --- the memory warning -----------------------------------------------------------------

GPT3_ON_ONE_NODE = """\
plan too_big {
  model gpt { layers = 96; hidden = 12288; heads = 96; vocab = 51200; seq = 2048
              batch = 8; dtype = bf16 }
  mesh { tp = 8 }
  topology { preset = dgx-a100 }
  schedule { microbatches = 8 }
  train { optimizer = adamw(lr = 6e-5) }
}
"""

_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _amount(hint: str, name: str) -> float:
    match = re.search(rf"{name} ([0-9.]+) (B|KB|MB|GB|TB)\b", hint)
    assert match, (name, hint)
    return float(match.group(1)) * _UNITS[match.group(2)]


def test_a_175b_model_on_eight_devices_warns_once_with_the_breakdown():
    loaded = load_text(GPT3_ON_ONE_NODE)
    assert loaded.ok
    assert len(loaded.diagnostics) == 1
    (warning,) = loaded.diagnostics
    assert warning.severity == "warning"
    assert warning.message.startswith("estimated memory per device")
    assert "80 GB" in warning.message
    breakdown = next(hint for hint in warning.hints if "parameters" in hint)
    for name in ("parameters", "gradients", "optimizer state", "activations"):
        assert name in breakdown

    # One tp rank of 8 holds, by hand: per layer 4h + (3h^2 + 3h)/8 + h^2/8 + h
    # + (4h^2 + 4h)/8 + 4h^2/8 + h; plus V h / 8 embedding, s h positions, 2h, V h / 8 head.
    h_, v_, s_ = 12288, 51200, 2048
    layer = (4 * h_ + (3 * h_ * h_ + 3 * h_) // 8 + h_ * h_ // 8 + h_
             + (4 * h_ * h_ + 4 * h_) // 8 + 4 * h_ * h_ // 8 + h_)
    per_device = 96 * layer + v_ * h_ // 8 + s_ * h_ + 2 * h_ + v_ * h_ // 8
    assert per_device == 21_933_858_816
    for name, expected in (("parameters", 2 * per_device), ("gradients", 2 * per_device),
                           ("optimizer state", 12 * per_device)):
        assert _amount(breakdown, name) == pytest.approx(expected, rel=0.01), name
    # Activations: at least 96 layers x 23 sbh (Korthikanti, tp 8, one microbatch in
    # flight on a single stage), plus a little for the head and logits.
    korthikanti = 96 * 23 * s_ * h_
    assert korthikanti * 0.995 <= _amount(breakdown, "activations") <= korthikanti * 1.02


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.plan")), ids=lambda p: p.stem)
def test_no_example_plan_overflows_its_devices(path):
    loaded = load_file(path)
    assert loaded.ok
    assert not [d for d in loaded.diagnostics
                if d.message.startswith("estimated memory per device")]
    assert not memory.estimate(loaded.plan).overflows


HEAD_PLAN = """plan h {
  model llama {
    layers = 16; hidden = 64; heads = 4; kv_heads = 2; ffn = 128; vocab = VOCAB; seq = 32
    batch = 16
  }
  mesh { pp = 4 }
  shard { pp { virtual = VIRTUAL } }
  schedule { microbatches = 16; pipeline = PIPELINE }
}
"""


@pytest.mark.parametrize("pipeline, virtual, stage, logits, chunks, read_by_w", [
    ("1f1b", 1, 3, 1, 1, 0),
    ("interleaved", 2, 3, 1, 5, 0),
    # the loss's backward is the split backward's first; the head's W runs 4 I's later
    ("interleaved_zb", 2, 3, 1, 8, 4),
    # the V's last chunk is on stage 0, beside its first; DualPipeV's head runs its I and
    # W blocks one after the other, while the head's own terms count its gradient
    ("dualpipev", 2, 0, 1, 9, 0),
    ("zbv", 2, 0, 1, 8, 1),
    ("zb1p", 1, 3, 1, 4, 4),  # I0 .. I3, then W0
    ("gpipe", 1, 3, 16, 16, 0),  # every forward before the first backward
])
def test_the_head_stage_holds_the_logits_of_the_last_chunks_microbatches_only(
        pipeline, virtual, stage, logits, chunks, read_by_w):
    """The head's stage holds the logits (fp32) and the final norm's and the head's inputs
    of the microbatches its last chunk has run forward and not yet backward, not of every
    microbatch-chunk the stage holds: a vocabulary larger by 1,000 adds 4 bytes a token
    for each of them. Under a split backward the head's output gradient (the logits',
    a vocabulary wide) waits for its W: 4 bytes a token more for each microbatch whose
    I has run and W has not at the stage's peak (its order replayed), once that I is
    done (while it runs, the logits' own terms count it)."""
    def plan(vocab):
        return plan_of(HEAD_PLAN.replace("VOCAB", str(vocab)).replace(
            "VIRTUAL", str(virtual)).replace("PIPELINE", pipeline))

    small, large = plan(128), plan(1128)
    assert small.head_stage == stage
    assert in_flight.head_microbatches_in_flight(small) == logits
    assert in_flight.microbatches_in_flight(small, stage) == chunks
    grown = (memory.stage_activation_bytes(large, stage)[0]
             - memory.stage_activation_bytes(small, stage)[0])
    reads = (memory.weight_gradient_reads_bytes(large, stage)
             - memory.weight_gradient_reads_bytes(small, stage))
    # (the larger logits gradient can move the stage's peak to where the input halves
    # have freed more: memory.input_half_frees_bytes)
    freed = (memory.input_half_frees_bytes(large, stage)
             - memory.input_half_frees_bytes(small, stage))
    # and the largest gradient a backward step returns is the head's table (1,128 x 64
    # in fp32), where it was fc1's (64 x 2 x 128): memory.largest_step_gradient_bytes
    table = 1128 * 64 * 4 - 64 * 2 * 128 * 4
    assert memory.largest_step_gradient_bytes(large, stage) - \
        memory.largest_step_gradient_bytes(small, stage) == table
    # a microbatch of one 32-token sequence
    assert grown == logits * 1000 * 32 * 4 + reads - freed + table
    assert reads == read_by_w * 1000 * 32 * 4


def test_the_fp32_gradient_copy_covers_a_ranks_experts_too():
    """shard { dp { fp32_grads } } adds an fp32 copy of every gradient a rank holds
    (DeepSpeed's BF16_Optimizer): the dense ones, 2 x (qkv 2,048 + proj 1,024 + norms 64
    + router 128) + embedding 2,048 + head 2,048 + final norm 32 = 10,656, and its half of
    the experts over ep 2, 2 layers x 4 experts x 3 x 32 x 16 / 2 = 6,144."""
    from planc.lang import load_text

    text = """plan m {
  model moe { layers = 2; hidden = 32; heads = 4; kv_heads = 2; vocab = 64; seq = 8
              batch = 8; dtype = bf16; experts = 4; top_k = 2; expert_ffn = 16 }
  mesh { dp = 2; ep = 2 }
  shard { dp { zero = 1%s } }
}"""
    on, off = (memory.estimate(load_text(text % extra).plan).stages[0]
               for extra in ("; fp32_grads = on", ""))
    assert on.gradient_bytes - off.gradient_bytes == 4 * (10656 + 6144)


def test_sequence_parallelism_splits_the_heads_inputs_over_tp():
    """Guards the head's sequence-parallel term: the head's stage holds the final
    LayerNorm's and the head's inputs, split over tp under sequence parallelism and whole
    without it, and the fp32 logits split over the vocabulary (Korthikanti et al. 2022's
    output layer, 4sbh/t (1 + v/h) with sequence parallelism, for 16-bit inputs and fp32
    logits). gpt, s 32, b 1, h 64, a 4, t 2, bf16, V 128, 2 layers, one microbatch in
    flight. With sequence parallelism: 2 layers x sbh/t (34 + 5as/h) = 2 x 1,024 x 44 =
    90,112, inputs 2sbh x 2 / t = 4,096, logits 4sbV / t = 8,192. Without: 2 layers x
    sbh (10 + 24/t + 5as/(ht)) = 2 x 2,048 x 27 = 110,592, inputs 2sbh x 2 = 8,192,
    logits 8,192. Either way, the 16-bit logits beside their fp32 copy while the loss
    reads them, 2sbV / t = 4,096, and the largest gradient one backward step returns,
    fc1's weight and bias on a tp rank in fp32, (64 x 256 + 256) / 2 x 4 = 33,280."""
    text = """plan h {
  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 128; seq = 32; batch = 1
              dtype = bf16 }
  mesh { tp = 2 }
  shard { tp { sequence_parallel = %s } }
}"""
    on, off = (plan_of(text % sp) for sp in ("on", "off"))
    assert on.shard.tp.head == off.shard.tp.head == "vocab"
    assert memory.largest_step_gradient_bytes(on, 0) == 33_280
    assert memory.stage_activation_bytes(on, 0) == (
        90_112 + 4_096 + 8_192 + 4_096 + 33_280, 1)
    assert memory.stage_activation_bytes(off, 0) == (
        110_592 + 8_192 + 8_192 + 4_096 + 33_280, 1)


def test_a_mixtures_dispatch_buffers_hold_one_cp_ranks_tokens():
    """Guards cp in the transient term: a block's dispatch buffers hold the tokens of one
    cp rank, b s / cp, not the whole sequence's. moe, b 4 (batch 8 over dp 2), s 8, cp 2:
    16 tokens, top_k 2, imbalance 1.5, so the busiest rank's 1.5 x 16 x 2 = 48 rows of
    (2 h + 3 expert_ffn) x 2 = 224 bytes each, 10,752 bytes; ep 1 dispatches nothing. The
    worst routing, every row of the ep 2 group on one rank's 2 experts, 2 x 16 x 2 = 64
    rows, is 3,584 bytes more."""
    text = """plan m {
  model moe { layers = 2; hidden = 32; heads = 4; kv_heads = 2; vocab = 64; seq = 8
              batch = 8; dtype = bf16; experts = 4; top_k = 2; expert_ffn = 16
              imbalance = 1.5 }
  mesh { dp = 2; cp = 2; ep = %d }
}"""
    split, whole = plan_of(text % 2), plan_of(text % 1)
    assert split.microbatch_size == 4
    grown = (memory.stage_activation_bytes(split, 0)[0]
             - memory.stage_activation_bytes(whole, 0)[0])
    # (less the mixture's gradient a backward returns: its experts halved over ep)
    fewer = (memory.largest_step_gradient_bytes(whole, 0)
             - memory.largest_step_gradient_bytes(split, 0))
    assert grown + fewer == 48 * 224 == 10_752
    assert memory.estimate(split).stages[0].worst_routing_extra_bytes == 16 * 224 == 3_584


def test_a_routed_experts_elements_are_split_over_ep():
    """Guards experts per rank = experts / ep (Lepikhin et al. 2020's GShard, Megatron-Core's
    expert parallelism): each of the 4 experts' gate, up and down weights (4 x 32 x 16 =
    2,048 elements) sits on a rank as its experts / ep rows: 1,024 elements with ep 2,
    512 with ep 4; the dense weights stay whole. Stage 0 of ep 2 holds the 10,656 dense
    elements and 2 layers x 3 x 1,024 = 6,144 of the experts'."""
    text = """plan m {
  model moe { layers = 2; hidden = 32; heads = 4; kv_heads = 2; vocab = 64; seq = 8
              batch = 8; dtype = bf16; experts = 4; top_k = 2; expert_ffn = 16 }
  mesh { dp = 4; ep = %d }
}"""
    experts = [f"layers.{layer}.experts.{w}.weight" for layer in (0, 1)
               for w in ("gate", "up", "down")]
    for ep, rows in ((1, 2048), (2, 1024), (4, 512)):
        local = parameter_counts.local_parameter_elements(plan_of(text % ep))
        assert {name: local[name] for name in experts} == dict.fromkeys(experts, rows)
        assert local["layers.0.q.weight"] == 32 * 32 and local["head.weight"] == 32 * 64
    assert memory.stage_parameter_counts(plan_of(text % 2)) == ((10_656, 6_144),)


def test_the_last_block_is_kept_whole_only_beside_the_heads_unit_and_on_its_chunk():
    """ZeRO-3 keeps the last block's units from their forward to their backward where it
    keeps the head's (one microbatch's head at a time: 1F1B, not GPipe's every forward
    first) and the block is on the head's chunk, so that only the head and the loss run
    between; a last chunk of the head alone runs other microbatches' work between."""
    assert memory.last_block_kept(zb_plan("1f1b", zero=3, dp=2))
    assert memory.last_block_kept(zb_plan("zb1p", zero=3, dp=2))
    assert not memory.last_block_kept(zb_plan("gpipe", zero=3, dp=2))
    assert not memory.last_block_kept(zb_plan("1f1b", zero=2, dp=2))
    assert not memory.last_block_kept(zb_plan("1f1b", zero=3, dp=1))
    head_alone = plan_of("""plan z {
  model llama { layers = 4; hidden = 64; heads = 4; kv_heads = 2; ffn = 128; vocab = 256
                seq = 32; batch = 8 }
  mesh { pp = 2; dp = 2 }
  shard { dp { zero = 3 }; pp { virtual = 2; stages = [0..1, 2..2, 3..3, head] } }
  schedule { microbatches = 4; pipeline = interleaved }
}""")
    assert memory.head_unit_kept(head_alone) and not memory.last_block_kept(head_alone)


def test_what_a_weight_half_reads_is_as_wide_as_its_steps_outputs_on_one_device():
    """zb1p over 2 stages and tp 2, stage 1 (2 layers and the head's chunk, 2
    microbatches between their I and W, 32 fp32 tokens each). llama with sequence
    parallelism: the norms' outputs split over the sequence (64 / 2), a column-parallel
    linear's over its features (qkv 128 / 2, fc1 256 / 2, the vocabulary-parallel head
    256 / 2), a row-parallel one's whole (proj, fc2: 64). gpt without it: norms whole,
    qkv 192 / 2, fc1 256 / 2, and the residuals, which carry the row-parallel proj's and
    fc2's biases over tp (Megatron-LM), split too."""
    def plan(family, sequence_parallel):
        kv = "kv_heads = 2; ffn = 128;" if family == "llama" else "ffn = 256;"
        return plan_of(f"""plan z {{
  model {family} {{ layers = 4; hidden = 64; heads = 4; {kv} vocab = 256; seq = 32
                   batch = 4 }}
  mesh {{ pp = 2; tp = 2 }}
  shard {{ tp {{ sequence_parallel = {sequence_parallel} }} }}
  schedule {{ microbatches = 4; pipeline = zb1p }}
}}""")

    llama = 32 + 64 + 64 + 32 + 128 + 64
    assert memory.weight_gradient_reads_bytes(plan("llama", "on"), 1) == \
        2 * (2 * llama + 32 + 128) * 32 * 4
    gpt = 64 + 96 + 64 + 64 + 64 + 128 + 64 + 64
    assert memory.weight_gradient_reads_bytes(plan("gpt", "off"), 1) == \
        2 * (2 * gpt + 64 + 128) * 32 * 4


def test_a_weight_half_reads_kv_heads_shared_over_tp_whole_and_a_gathered_embedding_gradient():
    """llama, 4 heads of 8 and 2 k/v heads over tp 4, zb1p over 2 stages (stage 0, one
    microbatch between its I and W, 32 fp32 tokens): qkv's output on a rank is its query
    head and one k and one v head whole (Megatron-LM replicates k/v heads where there are
    fewer than ranks): 24 features, not (4 + 2 x 2) x 8 / 4 = 16. Under sequence
    parallelism a vocabulary-parallel embedding's gradient comes gathered over tp, the
    whole sequence: 32 features, where a hidden-split one's is 32 / 4."""
    def plan(embedding):
        return plan_of(f"""plan z {{
  model llama {{ layers = 4; hidden = 32; heads = 4; kv_heads = 2; ffn = 64; vocab = 256
                seq = 32; batch = 4 }}
  mesh {{ pp = 2; tp = 4 }}
  shard {{ tp {{ sequence_parallel = on; embedding = {embedding} }} }}
  schedule {{ microbatches = 4; pipeline = zb1p }}
}}""")
    # ln1 8, qkv 24, proj 32, ln2 8, fc1 128 / 4, fc2 32: sequence-split norms
    layer = 8 + 24 + 32 + 8 + 32 + 32
    for embedding, features in (("vocab", 32), ("hidden", 8)):
        assert memory.weight_gradient_reads_bytes(plan(embedding), 0) == \
            (2 * layer + features) * 32 * 4


SEQUENCE_PARALLEL = """plan sp {
  model FAMILY { layers = 4; hidden = 512; heads = 8; kv_heads = 2; ffn = 2048; vocab = 8000;
                 seq = 512; batch = 4; dtype = fp32 }
  mesh { tp = 2 }
  topology { preset = dgx-h100; devices_per_node = 2 }
  shard { tp { sequence_parallel = SP } }
  schedule { microbatches = 1 }
  optimize { recompute = RECOMPUTE }
}
"""


@pytest.mark.parametrize("family,sp,recompute,mib", [
    # each gathered input is 2 MiB more than its shard (2,048 tokens x 512 x 4 bytes, half)
    ("llama", "on", "none", 4 * 2 * 2 + 2),  # q/k/v's and gate/up's, in 4 blocks; the head's
    ("llama", "on", "selective", 4 * 2 * 2 + 2),
    ("llama", "on", "attention_inputs", 4 * 1 * 2 + 2),  # q/k/v's input is recomputed
    ("llama", "on", "full", 2),  # a block keeps its input alone
    ("llama", "off", "none", 0),
    ("gpt", "on", "none", 4 * 2 * 2 + 2),  # qkv's and fc1's
    ("moe", "on", "none", 0),  # not counted for the other families
])
def test_planc_run_keeps_the_inputs_sequence_parallelism_gathers_beyond_the_count(
        family, sp, recompute, mib):
    """Korthikanti et al.'s count keeps each rank's shard of a column-parallel GEMM's
    input and gathers it again in the backward; planc's runtime keeps the gathered input
    (docs/simulate.md: 41 MiB a llama block at tp 2 where the count says 37). The
    estimate stays the count; what planc run holds more is said beside it."""
    text = SEQUENCE_PARALLEL.replace("FAMILY", family).replace("SP", sp).replace(
        "RECOMPUTE", recompute)
    if family == "gpt":
        text = text.replace("kv_heads = 2; ", "")
    if family == "moe":
        text = text.replace("ffn = 2048;", "ffn = 2048; experts = 4; top_k = 2; expert_ffn = 512;")
    loaded = load_text(text)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    estimate = memory.estimate(loaded.plan)
    (stage,) = estimate.stages
    assert stage.gathered_inputs_bytes == mib * 2 ** 20
    if mib:
        assert estimate.planc_run_peak.planc_run_total_bytes == \
            stage.total_bytes + mib * 2 ** 20
    else:
        assert estimate.planc_run_peak is None


def test_the_keys_and_values_gathered_over_cp_are_counted_where_the_attention_keeps_them():
    """A llama under cp 2 with the keys and values all-gathered: per block and microbatch,
    every cp rank's keys and values (2 x 2 kv heads of 8 x 16 tokens x 4 sequences, fp32),
    the copies repeated per query head (2 x 4 heads), and the mask (8 x 16); none with
    the ring, none under full recomputation, the same count in a split backward's input
    half (the attention is a step without parameters)."""
    from planc.lang import load_text
    from tests.test_llama import plan_text

    def plan(shard: str = "", optimize: str = ""):
        return load_text(plan_text("p", mesh="cp = 2", m=2, shard=shard,
                                   optimize=optimize)).plan
    gathered, ring = plan(), plan(shard="cp { attention = ring }")
    keys = 2 * 8 * 16 * 4 * (2 + 4) * 4
    mask = 8 * 16 * 4
    assert memory.layer_activation_bytes(gathered) - memory.layer_activation_bytes(ring) == \
        keys + mask
    full = plan(optimize="recompute = full")
    assert memory.layer_activation_bytes(full) == memory.layer_activation_bytes(
        load_text(plan_text("p", mesh="cp = 2", m=2, shard="cp { attention = ring }",
                            optimize="recompute = full")).plan)
    def zb1p(shard: str = ""):
        return load_text(plan_text("p", mesh="cp = 2; pp = 2", m=2, shard=shard,
                                   schedule="; pipeline = zb1p")).plan
    zb, zb_ring = zb1p(), zb1p("cp { attention = ring }")
    assert memory.layer_input_half_bytes(zb) - memory.layer_input_half_bytes(zb_ring) == \
        keys + mask


def _cp_plan(family: str, shard: str, optimize: str, mesh: str = "cp = 2"):
    from planc.lang import load_text
    from tests.test_deepseek_mla import plan_text as deepseek_text
    from tests.test_llama import plan_text as llama_text
    from tests.test_recompute_activation import GPT
    if family == "gpt":
        source = GPT.format(mesh=mesh, topology=f"shard {{ {shard} }}", optimize=optimize)
    elif family == "llama":
        source = llama_text("p", mesh="cp = 2", m=2, shard=shard, optimize=optimize)
    else:
        source = deepseek_text(mesh="cp = 2").replace(
            "  schedule {", f"  shard {{ {shard} }}\n  optimize {{ {optimize} }}\n  schedule {{")
    loaded = load_text(source)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    return loaded.plan


@pytest.mark.parametrize("family,keys,mask", [
    # gpt: k and v of the 4 heads (hidden 32) over 8 tokens x 2 sequences; mask 4 x 8
    ("gpt", 2 * 32 * 8 * 2, 4 * 8),
    # deepseek: 4 heads of k (nope 16 + rope 8) and v (24) over 32 tokens x 4 sequences
    ("deepseek", 4 * (16 + 8 + 24) * 32 * 4, 16 * 32)])
def test_every_family_counts_the_keys_and_values_gathered_over_cp(family, keys, mask):
    """gpt's and MLA's attention keep every cp rank's k and v (one head of each per query
    head: no repeated copies) and the mask, fp32; none with the ring."""
    gathered = _cp_plan(family, "", "")
    ring = _cp_plan(family, "cp { attention = ring }", "")
    assert memory.layer_activation_bytes(gathered) - memory.layer_activation_bytes(ring) == \
        (keys + mask) * 4


@pytest.mark.parametrize("qkv,copies", [("column", 1), ("row", 2)])
def test_a_row_parallel_qkv_s_bias_makes_a_second_copy_of_the_gathered_keys(qkv, copies):
    """gpt under tp 2 x cp 2: a column-parallel qkv adds its bias itself, and the attention
    reads the gathered keys and values as they came; a row-parallel one's bias is added
    after the reduction, so the attention keeps the biased copy beside the gathered step
    input (k and v of 2 of the 4 heads, 8 tokens x 2 sequences; the mask 4 x 8)."""
    mesh, placement = "tp = 2; cp = 2", f"tp {{ qkv = {qkv} }}"
    gathered = _cp_plan("gpt", placement, "", mesh)
    ring = _cp_plan("gpt", f"{placement}; cp {{ attention = ring }}", "", mesh)
    assert memory.layer_activation_bytes(gathered) - memory.layer_activation_bytes(ring) == \
        (copies * 2 * 16 * 8 * 2 + 4 * 8) * 4


@pytest.mark.parametrize("family", ["gpt", "llama", "deepseek"])
def test_attention_inputs_gathers_the_keys_and_values_again_and_keeps_none(family):
    """recompute = attention_inputs runs the attention again from the block's input, its
    all-gather over cp included (planc.graph.derive): nothing gathered is kept."""
    again = "recompute = attention_inputs"
    assert memory.layer_activation_bytes(_cp_plan(family, "", again)) == \
        memory.layer_activation_bytes(_cp_plan(family, "cp { attention = ring }", again))


@pytest.mark.parametrize("mesh,gathered", [("", 0), ("cp = 2", 1)])
def test_attention_inputs_holds_one_layer_s_attention_inputs_while_it_makes_them(
        mesh, gathered):
    """Under recompute = attention_inputs a backward makes one layer's first norm's output
    and q, k and v again (and gathers its keys and values over cp again), held until
    that layer's attention has run its backward, with its softmax probabilities where
    the GPU has no FlashAttention (this plan's): the stage's count beyond its kept
    layers is selective's plus those (fp32; the llama's 4 query and 2 key/value heads of
    8, 16 tokens x 4 sequences, or 8 of them under cp 2 with the 16 gathered)."""
    from planc.lang import load_text
    from tests.test_llama import plan_text

    def beyond_layers(recompute):
        plan = load_text(plan_text("p", mesh=mesh, m=2, optimize=f"recompute = {recompute}")
                         ).plan
        held, _ = memory.stage_activation_bytes(plan, 0)
        return held - in_flight.layers_in_flight(plan, 0) * memory.layer_activation_bytes(plan)

    seq, m = 16 // (2 if gathered else 1), load_text(plan_text("p", m=2)).plan.model
    tokens = seq * 4
    inputs = tokens * m.hidden + tokens * (4 + 2 * 2) * 8
    probabilities = 4 * 16 * tokens
    kv = gathered * (2 * 8 * 16 * 4 * (2 + 4) + seq * 16)
    assert beyond_layers("attention_inputs") - beyond_layers("selective") == \
        (inputs + probabilities + kv) * 4
