"""planc simulate: the replay's semantics on programs whose answer is worked out by hand,
the model FLOPs, the command line, and the validation against published Megatron-LM runs.

Published step times: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), Table 5, A100s, Megatron-LM: full recomputation,
and sequence parallelism with selective recomputation.
"""

from __future__ import annotations

import json
import statistics

import pytest

from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.program.operands import Operands
from planc.program.program import Instruction, Program
from planc.simulate import Simulation, model_flops, simulate, stage_results
from planc.estimate.block_replay import replay
from planc.estimate.instruction_cost import InstructionCosts, ring_seconds
from planc.estimate.kernel_cost import GPUS, KernelModel, wave_efficiency
from planc.simulate.pipeline import step
from bench.published_runs import (KORTHIKANTI_TABLE_5, MEGATRON_H100, NARAYANAN_TABLE_1,
                                  SEQUENCE_SELECTIVE, narayanan_step_flops)
from tests.conftest import PLANS
from tests.test_passes import validated_example

# Regression guards, not evidence of accuracy (that is bench/validation.py's, table by
# table): the errors reached, rounded up. With the kernel model of planc.estimate.kernel_cost on
# A100s (GEMMs by shape, Megatron-LM's unfused attention of 2022) and NCCL's achieved
# bandwidths (planc.plan.presets): median 3.1 %, max 11.3 % (the 22B model's second
# column), of both signs. With the links' line rates they were 7.0 % and 16.7 %, every
# row too fast.
MEDIAN_ERROR, MAX_ERROR = 0.035, 0.12


# Guards as above. Reached with the kernel model on H100s (GEMMs by shape,
# FlashAttention-2's measured rates), NCCL's achieved bandwidths, the ZeRO-1 parameter
# gathers overlapped with the first forward and the gradients reduce-scattered in fp32
# (accumulate_allreduce_grads_in_fp32 for bf16): median 3.7 %, max 31.3 % (the 32B plan,
# too slow: its gathers and fp32 reductions over 48 nodes stay exposed); with each
# column-parallel GEMM's input gathered again in the backward, as TransformerEngine's
# linears do under sequence parallelism (gathered_inputs = regather), the same once
# those gathers start a step early under tp_overlap too (5.9 % and 32.3 % before).
H100_MEDIAN_ERROR, H100_MAX_ERROR = 0.04, 0.32


# The plans have the layouts of the paper's run script (run_table_1.sh: microbatch size,
# interleaved chunks; no tp overlap, and --DDP-impl local overlaps nothing; CONFIG.sh's
# --clip-grad 1.0; up to 18B no asynchronous tp all-reduce). Reached: median 8.1 %, max
# 11.6 % (1.7B), every model predicted faster than published. This bound, like the two
# above, is a regression guard set just above what the model reaches, not evidence of
# accuracy: bench/validation.py reports the errors (docs/simulate.md).
HELD_OUT_MEDIAN_ERROR, HELD_OUT_MAX_ERROR = 0.085, 0.12


def _compute(stream: str, node: str) -> Instruction:
    return Instruction("compute", stream, node)


def test_a_block_replays_streams_events_and_waits():
    seconds = {"a": 1.0, "ar": 3.0, "b": 2.0, "c": 0.5}
    block = [_compute("compute", "a"), Instruction("record", "compute", event="done:a"),
             Instruction("wait", "comm", event="done:a"),
             Instruction("all_reduce", "comm", "ar",
                         operands=Operands(payload="activation", group="tp")),
             Instruction("record", "comm", event="done:ar"),
             _compute("compute", "b"),
             Instruction("wait", "compute", event="done:ar"),
             _compute("compute", "c"),
             Instruction("wait", "compute", event="done:recv")]  # recorded elsewhere
    timed = replay(block, lambda instruction: seconds[instruction.node])
    # a 0-1; ar 1-4 on comm; b 1-3; compute waits for ar until 4 (1 s exposed); c 4-4.5.
    assert timed.compute_end == 4.5 and timed.stream_ends == {"compute": 4.5, "comm": 4.0}
    assert timed.compute_busy == 3.5 and timed.exposed == {"tp": 1.0}
    assert timed.external == ("done:recv",)


class _SharedSMs:
    """Seconds by node; a transfer on the ep stream holds 20 SMs, and a compute step
    beside 20 held takes twice its time, beside 40 four times."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    def __call__(self, instruction: Instruction) -> float:
        return self.seconds[instruction.node]

    def held_sms(self, instruction: Instruction) -> int:
        return 20 if instruction.stream == "ep" else 0

    def contended(self, instruction: Instruction, held: int) -> float:
        return self.seconds[instruction.node] * {20: 2.0, 40: 4.0}[held]


def test_a_compute_step_beside_an_all_to_all_works_on_the_sms_it_leaves():
    """y (3 s) holds SMs from 0; a0 (2 s alone) does 3/4 of its work by 3 s and the rest
    alone: it ends at 3.5. x (4 s) waits for a0: 3.5-7.5. b (10 s alone) does a fifth of
    its work beside x, then 8 s alone: 3.5-15.5. The first replay (nothing held) put x
    at 2-6; the replays stop when x no longer moves."""
    def a2a(node: str) -> Instruction:
        return Instruction("all_to_all", "ep", node,
                           operands=Operands(payload="dispatch", group="ep"))
    block = [a2a("y"), _compute("compute", "a0"),
             Instruction("record", "compute", event="done:a0"),
             Instruction("wait", "ep", event="done:a0"), a2a("x"),
             _compute("compute", "b")]
    timed = replay(block, _SharedSMs({"y": 3.0, "a0": 2.0, "x": 4.0, "b": 10.0}),
                   keep_spans=True)
    assert [(span.node, span.start, span.end) for span in timed.spans] == [
        ("y", 0.0, 3.0), ("a0", 0.0, 3.5), ("x", 3.5, 7.5), ("b", 3.5, 15.5)]
    assert timed.compute_end == 15.5 and timed.compute_busy == 15.5
    # two transfers at once hold 40 SMs: c (1 s alone) works at a quarter of its rate
    # while both run (0-2: half its work), then at half while v runs on (2-3: the rest)
    block = [a2a("u"), Instruction("all_to_all", "ep2", "v", operands=Operands(
        payload="dispatch", group="ep")), _compute("compute", "c")]

    class TwoStreams(_SharedSMs):
        def held_sms(self, instruction: Instruction) -> int:
            return 20 if instruction.stream in ("ep", "ep2") else 0
    timed = replay(block, TwoStreams({"u": 2.0, "v": 4.0, "c": 1.0}))
    assert timed.compute_end == 3.0


def test_two_stages_of_gpipe_by_hand():
    seconds = {"a": 1.0, "sa": 0.5, "b": 2.0, "c": 1.0, "d": 2.0, "sd": 0.5}
    first = Program(0, ("compute", "send_next"), {
        "F0": (_compute("compute", "a"), Instruction("record", "compute", event="done:a"),
               Instruction("wait", "send_next", event="done:a"),
               Instruction("send", "send_next", "sa")),
        "B0": (_compute("compute", "b"),)},
        (("F0", 0), ("F0", 1), ("B0", 0), ("B0", 1)), {}, (), 2)
    last = Program(1, ("compute", "send_prev"), {
        "F1": (_compute("compute", "c"),),
        "B1": (_compute("compute", "d"), Instruction("record", "compute", event="done:d"),
               Instruction("wait", "send_prev", event="done:d"),
               Instruction("send", "send_prev", "sd"))},
        (("F1", 0), ("F1", 1), ("B1", 0), ("B1", 1)), {}, (), 2)
    first_time, last_time = step({0: first, 1: last},
                                 lambda stage: lambda instruction: seconds[instruction.node])
    # Stage 0: F 0-1 (sent at 1.5), F 1-2 (2.5); stage 1: F 1.5-2.5, F 2.5-3.5, B 3.5-5.5
    # (sent back at 6), B 5.5-7.5 (sent at 8: stage 1's step ends there); stage 0: B 6-8,
    # B 8-10.
    assert (first_time.end, last_time.end) == (10.0, 8.0)
    assert (first_time.busy, first_time.waiting) == (6.0, 4.0)
    assert (last_time.busy, last_time.waiting) == (6.0, 1.5)
    assert last_time.exposed == {"pp": 0.5}
    # the bubble: stage 0 waited 4 s and ends the step; stage 1 waited 1.5 s and then 2 s
    # for stage 0 to end it. The headline is stage 0's: 40 % of the 10 s step.
    first, last = stage_results((first_time, last_time), [1.0, 2.0])
    assert (first.bubble_seconds, last.bubble_seconds) == (4.0, 3.5)
    assert (first.step_seconds, last.step_seconds, last.memory_bytes) == (10.0, 8.0, 2.0)
    assert (first.exposed_seconds, last.exposed_seconds) == ({}, {"pp": 0.5})
    run = Simulation("p", 2, (first, last), 10.0, 1.0, 1.0, None)
    assert run.bubble == 0.4 and run.to_json()["stages"][1]["bubble_seconds"] == 3.5


def test_without_overlap_a_collective_on_the_compute_stream_is_exposed_on_its_axis():
    """With overlap off every collective runs on the compute stream, so all of its time
    is the stage's exposed communication, on its axis: computing, the bubble and the
    exposed communication then add up to the step (the tp all-reduces were once in none
    of them, and planc simulate reported no tp exposure for such plans)."""
    loaded = load_file(PLANS / "korthikanti-22b.plan", ("optimize.overlap=off",))
    assert loaded.ok, loaded.diagnostics
    run = simulate(compile_plan(loaded.plan))
    (stage,) = run.stages
    assert set(stage.exposed_seconds) == {"stage", "tp"} and stage.exposed_seconds["tp"] > 0
    assert stage.busy_seconds + stage.bubble_seconds + sum(stage.exposed_seconds.values()) \
        == pytest.approx(run.step_seconds, rel=1e-12)


def test_without_load_balance_the_last_cp_rank_s_causal_attention_is_priced():
    """cp 4 without load_balance: cp rank 3 holds the last quarter of the tokens, whose
    queries see 7/8 of the keys on average, against half on every rank when the chunks
    are dealt early and late; every cp collective waits for it, so its attention is the
    stage's (the key once changed no figure of planc simulate)."""
    from planc.estimate.kernel_cost import KernelModel
    from planc.estimate.plan_rates import causal_share

    seconds = {}
    for balance in ("on", "off"):
        plan = load_file(PLANS / "cp-ring-attention.plan",
                         (f"shard.cp.load_balance={balance}",)).plan
        kernels = KernelModel.of(plan)
        build = compile_plan(plan)
        attention = next(i.operands for p in build.programs.values() for i in p.written()
                         if i.operands is not None and i.operands.kernel == "attention"
                         and i.operands.step == "forward")
        seconds[balance] = kernels.graph_seconds(attention, 0.0) - kernels.gpu.launch
        assert causal_share(plan) == {"on": 0.5, "off": 7 / 8}[balance]
        seconds[balance, "step"] = simulate(build).step_seconds
    assert seconds["off"] / seconds["on"] == pytest.approx(1.75, rel=1e-12)
    assert seconds["off", "step"] > seconds["on", "step"]


def test_model_flops_are_narayanan_et_al():
    loaded = load_text("plan p { model gpt { layers = 2; hidden = 32; heads = 4; vocab = 128; "
                       "seq = 16; batch = 8 } }")
    # 3 x 128 tokens x (2 layers x (2 (4 h^2 + 2 h 4h) + 4 s h) + 2 h V)
    assert model_flops(loaded.plan) == 3 * 128 * (2 * (2 * (4 * 1024 + 2 * 32 * 128)
                                                       + 4 * 16 * 32) + 2 * 32 * 128)
    assert model_flops(loaded.plan) == 23_592_960


def test_waves_of_output_tiles_by_hand():
    # 2048 x 2304 on 108 SMs: 256x128 and 128x256 tiles make 144 tiles, two waves of 108
    # (144 / 216 used); 128x128 tiles make 288, three waves (288 / 324): the best.
    assert wave_efficiency(2048, 2304, 108) == pytest.approx(288 / 324)
    assert wave_efficiency(4096, 4096, 128) == 1.0  # whole waves of every tile


def test_a_gemm_is_priced_by_its_shape_on_the_gpu_of_its_preset():
    """korthikanti-22b: tp 8, one microbatch of 4 sequences of 2,048 tokens, hidden 6,144.
    Its qkv forward multiplies 8192 x 6144 by 6144 x 2304 (3 x 6144 / 8 features); its
    backward is the input gradient (8192 x 2304 by 2304 x 6144) and the weight gradient
    (6144 x 8192 by 8192 x 2304); proj is row-parallel, K = 6144 / 8."""
    # the GEMMs alone: without the separate gradient accumulation the plan says its run did
    build = compile_plan(load_file(PLANS / "korthikanti-22b.plan",
                                   ("optimize.grad_accumulation=fused",)).plan)
    kernels = KernelModel.of(build.plan)
    assert kernels is not None and kernels.gpu == GPUS["dgx-a100"]
    costs = InstructionCosts(build.plan, build.groups)
    program = next(p for p in build.programs.values() if p.stage == 0)
    found = {i.node: i for block in program.blocks.values() for i in block}
    assert costs(found["F/L0/qkv"], 0) == kernels.gemm_seconds(8192, 2304, 6144)
    assert costs(found["F/L0/proj"], 0) == kernels.gemm_seconds(8192, 6144, 768)
    # The overlap pass split qkv's backward (its weight gradient overlaps the all-reduce
    # of its input gradient): B is the input gradient's GEMM, W the weight gradient's.
    backward = found["B/L0/qkv"]
    assert backward.operands.weight_step == "W/L0/qkv"
    assert costs(backward, 0) == kernels.gemm_seconds(8192, 6144, 2304)
    assert costs(found["W/L0/qkv"], 0) == kernels.gemm_seconds(6144, 2304, 8192)
    # An unsplit backward runs both: fc2's (row-parallel, K = 4 x 6144 / 8).
    assert found["B/L0/fc2"].operands.weight_step is None
    assert costs(found["B/L0/fc2"], 0) == pytest.approx(
        kernels.gemm_seconds(8192, 3072, 6144) + kernels.gemm_seconds(3072, 6144, 8192))
    # A device with no published kernel figures keeps the one-efficiency roofline.
    cpu = load_file(PLANS / "korthikanti-22b.plan", ("topology.preset=cpu",)).plan
    assert KernelModel.of(cpu) is None


def _fc2_backward_seconds(*overrides: str) -> float:
    """korthikanti-22b's first fc2 backward (unsplit: both GEMMs) on stage 0."""
    build = compile_plan(load_file(PLANS / "korthikanti-22b.plan", overrides).plan)
    program = next(p for p in build.programs.values() if p.stage == 0)
    found = {i.node: i for block in program.blocks.values() for i in block}
    assert found["B/L0/fc2"].operands.params == ("layers.0.fc2.weight",)
    return InstructionCosts(build.plan, build.groups)(found["B/L0/fc2"], 0)


def test_a_separate_gradient_accumulation_is_priced_as_its_memory_traffic():
    """fc2's weight on a tp rank of korthikanti-22b: 4 x 6144 x 6144 / 8 elements. Added
    into a 16-bit buffer (Megatron-LM's main_grad hook), each microbatch reads both
    gradients and writes one (6 bytes an element) in one kernel, at the A100's 2,039 GB/s
    and 4 us a launch; into an fp32 buffer beside bf16 gradients (BF16_Optimizer) a cast
    and an add move 18 bytes in two kernels; autograd adds from the second microbatch on,
    (m - 1) / m of one a microbatch, none with one microbatch."""
    elements, bandwidth, launch = 4 * 6144 * 6144 // 8, 2039e9, 4e-6
    fused = _fc2_backward_seconds("optimize.grad_accumulation=fused")
    buffer = _fc2_backward_seconds("optimize.grad_accumulation=buffer")
    assert buffer - fused == pytest.approx(6 * elements / bandwidth + launch, rel=1e-9)
    # with one microbatch autograd never adds
    assert _fc2_backward_seconds("optimize.grad_accumulation=autograd") == fused
    four = ("schedule.microbatches=4",)  # of one sequence each
    assert _fc2_backward_seconds(*four, "optimize.grad_accumulation=autograd") - \
        _fc2_backward_seconds(*four, "optimize.grad_accumulation=fused") == pytest.approx(
            3 / 4 * (6 * elements / bandwidth + launch), rel=1e-9)
    bf16 = ("model.dtype=bf16", "shard.dp.fp32_grads=on")
    assert _fc2_backward_seconds(*bf16, "optimize.grad_accumulation=buffer") - \
        _fc2_backward_seconds(*bf16, "optimize.grad_accumulation=fused") == pytest.approx(
            18 * elements / bandwidth + 2 * launch, rel=1e-9)


def test_a_declared_peak_scales_attention_as_it_scales_the_gemms():
    """torchtitan's 500 W H100s declare 912.25 TFLOP/s (between H100 NVL and SXM) over
    the dgx-h100 preset: FlashAttention's rates (measured on the 989 TFLOP/s part) scale by
    912.25 / 989, as the GEMMs' peak does; a plan that declares nothing keeps them."""
    # attention's kernel alone: without the eager run's repeat_kv copies
    fused = ("optimize.kernels=fused",)
    titan = load_file(PLANS / "torchtitan" / "torchtitan-8b-fsdp8.plan", fused).plan
    sxm = load_file(PLANS / "torchtitan" / "torchtitan-8b-fsdp8.plan",
                    (*fused, "topology.device.flops=989TFLOP/s")).plan
    assert titan.topology.device.flops == 912.25e12
    slow, fast = KernelModel.of(titan), KernelModel.of(sxm)
    assert (slow.attention_scale, fast.attention_scale) == (912.25 / 989, 1.0)
    # one layer's causal forward: 2 sequences x 8,192 tokens, 4 s h FLOPs per token
    flops = 4.0 * 2 * 8192 * 8192 * 4096
    operands = Operands(flops=flops, kernel="attention", step="forward")
    assert slow.seconds(operands, 0.0) == flops * 0.5 / (164e12 * 912.25 / 989) + 4e-6
    assert fast.seconds(operands, 0.0) == flops * 0.5 / 164e12 + 4e-6
    assert slow.gemm_seconds(16384, 4096, 4096) > fast.gemm_seconds(16384, 4096, 4096)


# what torchtitan-8b-fsdp8 computes again in the backward, off: the modules' own passes
KEPT = ("optimize.recompute_norms=off", "optimize.recompute_activation=off")


def _torchtitan_8b_costs(kernels: str, settings: tuple[str, ...] = KEPT
                         ) -> tuple[InstructionCosts, dict[str, Instruction]]:
    """torchtitan-8b-fsdp8 (FSDP 8, no tp: 2 sequences of 8,192 tokens a rank, hidden
    4,096, ffn 14,336, 32 heads sharing 8 k/v heads of 128, vocabulary 128,256) under
    ``optimize { kernels }`` and ``settings``."""
    build = compile_plan(load_file(PLANS / "torchtitan" / "torchtitan-8b-fsdp8.plan",
                                   (f"optimize.kernels={kernels}", *settings)).plan)
    program = next(iter(build.programs.values()))
    found = {i.node: i for block in program.blocks.values() for i in block if i.node}
    return InstructionCosts(build.plan, build.groups), found


@pytest.mark.parametrize("kernels", ["eager", "fused"])
def test_what_a_backward_makes_again_is_priced_as_the_module_s_forward(kernels):
    """torchtitan-8b-fsdp8 as published computes both norms' outputs again in the backward
    of q/k/v and of gate/up, and the SwiGLU's product in down's: each the module's forward
    over its output, eager (RMSNorm 28 + 4 x 2 bytes an element in 8 kernels, SwiGLU 5 x
    2 in 2) or fused (one kernel reading and writing: 2 x 2, and 3 x 2 for SwiGLU, which
    reads gate and up); nothing more in any forward."""
    bandwidth, launch, tokens = 2.4e12, 4e-6, 2 * 8192
    again, found = _torchtitan_8b_costs(kernels, ())
    kept, same = _torchtitan_8b_costs(kernels)
    stream, ffn = tokens * 4096, tokens * 14336
    def norm(elements: float) -> float:
        return 36 * elements / bandwidth + 8 * launch if kernels == "eager" else \
            4 * elements / bandwidth + launch
    product = 10 * ffn / bandwidth + 2 * launch if kernels == "eager" else \
        6 * ffn / bandwidth + launch
    # q/k/v's tokens follow from its FLOPs, which count RoPE's (the next test)
    qkv_tokens = 1 + 3 * 5120 / (2 * 4096 * 6144)
    for node, more in (("B/L0/qkv", norm(stream * qkv_tokens)), ("B/L0/fc1", norm(stream)),
                       ("B/L0/fc2", product)):
        assert again(found[node], 0) - kept(same[node], 0) == pytest.approx(more), node
    for node in ("F/L0/qkv", "F/L0/fc1", "F/L0/fc2", "B/L0/proj", "B/L0/ln1"):
        assert again(found[node], 0) == kept(same[node], 0), node


def test_eager_modules_are_priced_as_the_kernels_torchtitans_llama_runs():
    """At 2.4 TB/s and 4 us a launch, in bf16 (2 bytes), per element: RMSNorm forward
    28 + 4 x 2 bytes in 8 kernels, backward 76 + 8 x 2 in 16 (against one kernel reading
    and writing 2 bytes each, fused); SwiGLU 5 x 2 in 2 and 9 x 2 in 3; RoPE after the
    qkv GEMM 16 + 2 x 2 in 6 over q's and k's 40 heads of 128 (fused: one kernel of 2 x 2);
    repeat_kv's copies before attention 2 x 2 x (1 + 8 / 32) in 2 over q's 32 heads; the
    loss in fp32 22 bytes a logit in 3 kernels, its backward 26 in 4."""
    bandwidth, launch, tokens = 2.4e12, 4e-6, 2 * 8192
    eager, found = _torchtitan_8b_costs("eager")
    fused, same = _torchtitan_8b_costs("fused")
    stream = tokens * 4096
    assert eager(found["F/L0/ln1"], 0) == pytest.approx(36 * stream / bandwidth + 8 * launch)
    assert fused(same["F/L0/ln1"], 0) == pytest.approx(4 * stream / bandwidth + launch)
    assert eager(found["B/L0/ln1"], 0) == pytest.approx(92 * stream / bandwidth + 16 * launch)
    ffn = tokens * 14336
    assert eager(found["F/L0/swiglu"], 0) == pytest.approx(10 * ffn / bandwidth + 2 * launch)
    assert eager(found["B/L0/swiglu"], 0) == pytest.approx(18 * ffn / bandwidth + 3 * launch)
    # the tokens follow from qkv's FLOPs, which count RoPE's 3 a rotated element beside
    # the GEMM's 2 x 4,096 x 6,144 a token
    rotated = tokens * (1 + 3 * 5120 / (2 * 4096 * 6144)) * 40 * 128
    assert eager(found["F/L0/qkv"], 0) - fused(same["F/L0/qkv"], 0) == pytest.approx(
        16 * rotated / bandwidth + 5 * launch)
    assert eager(found["B/L0/qkv"], 0) - fused(same["B/L0/qkv"], 0) == pytest.approx(
        16 * rotated / bandwidth + 5 * launch)
    queries = tokens * 32 * 128
    for node in ("F/L0/attention", "R/L0/attention", "B/L0/attention"):
        assert eager(found[node], 0) - fused(same[node], 0) == pytest.approx(
            5 * queries / bandwidth + 2 * launch)
    logits = tokens * 128256
    assert eager(found["F/loss"], 0) == pytest.approx(22 * logits / bandwidth + 3 * launch)
    assert eager(found["B/loss"], 0) == pytest.approx(26 * logits / bandwidth + 4 * launch)
    # what the modules do not touch is the same kernel either way
    for node in ("F/L0/proj", "B/L0/fc2", "F/L0/attn_residual", "F/head"):
        assert eager(found[node], 0) == fused(same[node], 0), node
    # RoPE is priced under fused as one pass over q and k (none before this model)
    kernels = KernelModel.of(compile_plan(load_file(
        PLANS / "torchtitan" / "torchtitan-8b-fsdp8.plan",
        ("optimize.kernels=fused",)).plan).plan)
    assert fused(same["F/L0/qkv"], 0) == pytest.approx(
        kernels.gemm_seconds(rotated / (40 * 128), 6144, 4096) + 4 * rotated / bandwidth
        + launch)


def test_qk_norms_are_priced_beside_rope_in_the_qkv_operator():
    """model { qk_norm } on torchtitan-8b-fsdp8: each head's q and k normalised before
    RoPE, over the same 40 heads of 128 RoPE turns. Fused, one more kernel reading and
    writing 2 bytes an element (3 in the backward: its gradient, its input, the input's
    gradient); eager, the RMSNorm module's 28 + 4 x 2 bytes in 8 kernels (76 + 8 x 2 in
    16 backward). The tokens follow from the FLOPs, which count the norms' 4 and RoPE's
    3 a rotated element beside the GEMM's 2 x 4,096 x 6,144 a token."""
    bandwidth, launch, tokens = 2.4e12, 4e-6, 2 * 8192
    rotated = tokens * (1 + 7 * 5120 / (2 * 4096 * 6144)) * 40 * 128
    for kernels, forward, backward in (("fused", (4 + 4, 2), (4 + 6, 2)),
                                       ("eager", (20 + 36, 14), (20 + 92, 22))):
        build = compile_plan(load_file(PLANS / "torchtitan" / "torchtitan-8b-fsdp8.plan",
                                       (f"optimize.kernels={kernels}",
                                        "model.qk_norm=on")).plan)
        program = next(iter(build.programs.values()))
        found = {i.node: i for block in program.blocks.values() for i in block if i.node}
        costs, model = InstructionCosts(build.plan, build.groups), KernelModel.of(build.plan)
        for node, (moved, launches) in (("F/L0/qkv", forward), ("B/L0/qkv", backward)):
            gemms = costs(found[node], 0) - moved * rotated / bandwidth - launches * launch
            assert gemms == pytest.approx(model.linear_seconds(
                "qkv", found[node].operands.step, found[node].operands.flops,
                found[node].operands.weight_step is not None)), (kernels, node)


def test_a_gpt_has_no_eager_modules_to_price():
    """GPT's LayerNorm and GELU are one kernel each in eager PyTorch too, and it has no
    RoPE: kernels = eager changes nothing."""
    plan = load_file(PLANS / "korthikanti-22b.plan").plan
    eager = load_file(PLANS / "korthikanti-22b.plan", ("optimize.kernels=eager",)).plan
    assert simulate(compile_plan(eager)).step_seconds == \
        simulate(compile_plan(plan)).step_seconds


def test_a_cpu_prices_forward_and_backward_overheads_apart_and_a_hand_off_per_transfer():
    """On a calibrated CPU a forward instruction pays the forward overhead, a backward
    or weight one the backward overhead, and a transfer the hand-off between the
    runtime's stream threads, each on top of its arithmetic or its backend time."""
    import dataclasses

    plan = load_file(PLANS / "demo.plan").plan
    # the device's own figures, for every operator (the operators' own: tests/test_routes.py)
    device = dataclasses.replace(plan.topology.device, overhead=1e-3,
                                 backward_overhead=3e-3, handoff=5e-4, overheads=())
    plan = dataclasses.replace(plan, topology=dataclasses.replace(plan.topology,
                                                                  device=device))
    build = compile_plan(plan)
    costs = InstructionCosts(build.plan, build.groups)
    program = next(p for p in build.programs.values() if p.stage == 0)
    found = {i.node: i for block in program.blocks.values() for i in block}

    def roofline(node: str) -> float:
        operands = found[node].operands
        return max(costs.cost.compute_seconds(operands.flops),
                   2.0 * operands.output_bytes / device.bandwidth)

    assert costs(found["F/L0/fc1"], 0) == roofline("F/L0/fc1") + 1e-3
    assert costs(found["B/L0/fc1"], 0) == roofline("B/L0/fc1") + 3e-3
    assert costs(found["W/L0/fc1"], 0) == roofline("W/L0/fc1") + 3e-3
    transfer = next(i for i in found.values()
                    if i.op == "all_reduce" and i.operands.group == "tp")
    operands = transfer.operands
    placements = build.groups.placements(operands.group, 0)
    backend = max(costs.cost.route_time(operands.route, transfer.op, operands.bytes, p)
                  for p in placements)
    assert costs(transfer, 0) == backend + 5e-4
    # a topology calibrated before the backward was measured apart: one overhead for all
    old = dataclasses.replace(device, backward_overhead=None)
    build = compile_plan(dataclasses.replace(plan, topology=dataclasses.replace(
        plan.topology, device=old)))
    old_costs = InstructionCosts(build.plan, build.groups)
    assert old_costs(found["B/L0/fc1"], 0) == roofline("B/L0/fc1") + 1e-3


def _simulated(name: str, overrides=()) -> float:
    """The plan as written is an example too: validated and its programs' shape checked
    (tests/test_lower.py leaves the tables' plans to this file)."""
    loaded = load_file(PLANS / f"korthikanti-{name}.plan", overrides)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    build = compile_plan(loaded.plan) if overrides else validated_example(loaded.plan)
    return simulate(build).step_seconds


def test_step_times_of_korthikanti_et_al_table_5():
    errors = {}
    for name, (full, selective) in KORTHIKANTI_TABLE_5.items():
        errors[(name, "full")] = _simulated(name) / full - 1
        errors[(name, "seq+sel")] = _simulated(name, SEQUENCE_SELECTIVE) / selective - 1
    sizes = [abs(e) for e in errors.values()]
    assert statistics.median(sizes) <= MEDIAN_ERROR, errors
    assert max(sizes) <= MAX_ERROR, errors
    # Sequence parallelism with selective recomputation is faster on every model, as
    # published (by 22-30 %).
    for name in KORTHIKANTI_TABLE_5:
        full, selective = KORTHIKANTI_TABLE_5[name]
        assert (1 + errors[(name, "seq+sel")]) * selective < (1 + errors[(name, "full")]) * full


def test_throughput_of_the_megatron_lm_h100_weak_scaling_table():
    errors = {}
    for name, published in MEGATRON_H100.items():
        loaded = load_file(PLANS / f"megatron-h100-{name}.plan")
        assert loaded.ok, [d.message for d in loaded.diagnostics]
        build = validated_example(loaded.plan)  # an example: tests/test_lower.py leaves it
        errors[name] = simulate(build).tflops_per_gpu / published - 1
    sizes = [abs(e) for e in errors.values()]
    assert statistics.median(sizes) <= H100_MEDIAN_ERROR, errors
    assert max(sizes) <= H100_MAX_ERROR, errors


def test_step_times_of_narayanan_et_al_table_1_held_out():
    errors = {}
    for name, published in NARAYANAN_TABLE_1.items():
        loaded = load_file(PLANS / f"narayanan-{name}.plan")
        assert loaded.ok, [d.message for d in loaded.diagnostics]
        plan = loaded.plan
        step = narayanan_step_flops(plan.model) / (published * 1e12 * plan.world)
        build = validated_example(loaded.plan)  # an example: tests/test_lower.py leaves it
        errors[name] = simulate(build).step_seconds / step - 1
    sizes = [abs(e) for e in errors.values()]
    assert statistics.median(sizes) <= HELD_OUT_MEDIAN_ERROR, errors
    assert max(sizes) <= HELD_OUT_MAX_ERROR, errors


def test_simulate_prints_the_step_and_writes_json_and_a_trace(tmp_path, run_planc):
    done = run_planc("simulate", PLANS / "gpt-tiny.plan", "--trace", tmp_path / "t.json")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    data = json.loads(run_planc("simulate", PLANS / "gpt-tiny.plan", "--json").stdout)
    step = data["step_seconds"]
    # the figures printed are the JSON's: the step, stage 0's bubble, the worst stage's
    # exposure on each axis (dp_cp's worst on stage 0, tp's on stage 1)
    worst = {a: max(s["exposed_seconds"].get(a, 0.0) for s in data["stages"])
             for a in ("dp_cp", "tp")}
    assert lines[0] == f"gpt_tiny: 8 ranks, 2 pipeline stages: one step takes {step * 1e6:.3g} us"
    # gpt-tiny's topology is no preset whose published runs the simulator was held to
    assert lines[1] == ("  expected error: not measured on this device (the simulator is held "
                        "to published runs on the dgx-a100 and dgx-h100 presets)")
    assert lines[2].startswith("  throughput: ") and " MFU " in lines[2]
    assert lines[3] == (f"  pipeline bubble: {data['stages'][0]['bubble_seconds'] / step:.1%} "
                        f"of the step (stage 0)")
    assert lines[4] == ("  exposed communication (worst stage, per axis): "
                        f"dp_cp {worst['dp_cp'] * 1e6:.3g} us, tp {worst['tp'] * 1e6:.3g} us")
    assert lines[5].startswith("  memory: ")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # The first rank of each stage: tp 2 makes stage 1 start at rank 2.
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {0, 2}
    names = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert {"compute", "comm", "send_next", "recv_prev"} <= names
    starts = {e["id"] for e in trace if e["ph"] == "s"}
    finishes = {e["id"] for e in trace if e["ph"] == "f"}
    assert starts and starts == finishes  # every pipeline send flows to its receive
    done = run_planc("simulate", PLANS / "gpt-tiny.plan", "--json")
    data = json.loads(done.stdout)
    assert data["format"] == "planc-simulation" and len(data["stages"]) == 2
    assert data["step_seconds"] == max(s["step_seconds"] for s in data["stages"])
    assert data["peak_flops"] == 989e12  # gpt-tiny.plan: device { flops = 989TFLOP/s }
    assert data["mfu"] == pytest.approx(data["model_flops"] / data["step_seconds"] / 8
                                        / 989e12)


# A topology as planc calibrate writes it for a 2-core CPU running gloo: 40 GFLOP/s.
CPU_TOPOLOGY = {
    "format": "planc-topology", "version": 1, "name": "a 2-core CPU", "devices_per_node": 2,
    "device": {"flops": 4e10, "memory": None, "efficiency": 1.0, "bandwidth": 6e9},
    "intra": {"bandwidth": 2e9, "latency": 4e-5,
              "collectives": {"all_reduce": {"bandwidth": 1e9, "latency": 1e-4}}},
    "inter": {"bandwidth": 2e9, "latency": 4e-5, "collectives": {}},
    "measured": {}}
CPU_PLAN = """plan cpu {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 64; seq = 16; batch = 4 }
  mesh { dp = 2 }
  topology { preset = "machine.json" }
}
"""


def test_a_calibrated_cpu_prices_the_logits_a_loss_reads_and_a_backwards_three_tensors(
        tmp_path):
    """On the roofline of a calibrated CPU a vocabulary-parallel loss reads the rank's
    slice of the logits, once in its max, once in its sum of exponentials and twice in
    its backward (its output is one figure per token: priced by that alone, the sum of
    exponentials of plans/llama-small.plan cost 0.8 ms of the 45 ms planc run
    measured), and a backward moves three tensors of its output's size."""
    from planc.estimate.instruction_cost import InstructionCosts
    from planc.lang import load_file
    from planc.program.operands import GRADIENT_STEPS, StepKind

    (tmp_path / "machine.json").write_text(json.dumps(CPU_TOPOLOGY))
    (tmp_path / "cpu.plan").write_text(CPU_PLAN.replace("vocab = 64", "vocab = 4096")
                                       .replace("dp = 2", "tp = 2"))
    plan = load_file(tmp_path / "cpu.plan").plan
    build = compile_plan(plan)
    costs = InstructionCosts(plan, build.groups)
    logits_bytes = 4 * 16 * (4096 // 2) * 4  # batch x seq tokens, the rank's half, fp32
    device = plan.topology.device
    found = {}
    for instruction in build.programs[build.table.names[0]].written():
        operands = instruction.operands
        if operands is None or operands.kernel not in ("loss_max", "loss_sum_exp", "loss",
                                                       "gelu"):
            continue
        gradient = operands.step in GRADIENT_STEPS
        # the loss's backward reads the logits and writes their gradient; its max and
        # its sum of exponentials are one pass each; the loss after them reads a logit
        # a token (its output's traffic)
        moved = {"B/loss": 2 * logits_bytes, "F/loss": 2 * operands.output_bytes}.get(
            instruction.node, 3 * operands.output_bytes if operands.kernel == "gelu"
            else logits_bytes)
        if operands.kernel == "gelu" and operands.step != StepKind.BACKWARD:
            continue
        expected = max(operands.flops / 4e10, moved / 6e9) + \
            device.instruction_overhead(operands.kernel, gradient)
        found[instruction.node] = (costs(instruction, 0), expected)
    assert {"F/loss_max", "F/loss_sum_exp", "B/loss", "B/L0/gelu"} <= set(found), found
    for node, (priced, expected) in found.items():
        assert priced == pytest.approx(expected, rel=1e-12), node


@pytest.mark.parametrize("mesh", ["dp", "tp"])
def test_a_calibrated_cpu_prices_a_losss_exponentials_at_its_measured_rate(tmp_path, mesh):
    """device.exp_rate (planc calibrate: exponentials a second): a loss pass that
    exponentiates each logit of its slice costs them at that rate on top of its FLOPs
    (plans/llama-small.plan on a 2-rank calibration: its sum of exponentials measured
    23.9 ms, priced 4.8 without the rate and 21.0 with it; its backward 20.9, priced 9.8
    and 23.3). The whole loss exponentiates in its log-softmax and its backward; a
    vocabulary-parallel one in its sum of exponentials and its backward, and its loss
    after them reads no logit of fp32 (measured 0.41 ms, priced 9.7 as two passes
    over them). GELU's tanhs are priced alike. A topology without the rate prices the
    FLOPs alone."""
    from planc.estimate.instruction_cost import InstructionCosts
    from planc.lang import load_file
    from planc.program.operands import StepKind

    text = CPU_PLAN.replace("vocab = 64", "vocab = 4096").replace("dp = 2", f"{mesh} = 2")
    (tmp_path / "cpu.plan").write_text(text)
    # the rank's tokens (batch x seq over dp) by its slice of the vocabulary (over tp)
    logits = {"dp": 2 * 16 * 4096, "tp": 4 * 16 * 2048}[mesh]
    passes = {"F/loss": 2 if mesh == "dp" else 0, "B/loss": 2, "F/loss_max": 1,
              "F/loss_sum_exp": 1}  # over the logits, in fp32
    exponentiating = {"dp": {"F/loss", "B/loss"}, "tp": {"F/loss_sum_exp", "B/loss"}}[mesh]
    for exp_rate in (None, 2e8):
        device = {**CPU_TOPOLOGY["device"], **({} if exp_rate is None else
                                                {"exp_rate": exp_rate})}
        (tmp_path / "machine.json").write_text(json.dumps({**CPU_TOPOLOGY, "device": device}))
        plan = load_file(tmp_path / "cpu.plan").plan
        assert plan.topology.device.exp_rate == exp_rate
        build = compile_plan(plan)
        costs = InstructionCosts(plan, build.groups)
        found = set()
        for instruction in build.programs[build.table.names[0]].written():
            operands = instruction.operands
            if operands is None or operands.kernel not in ("loss", "loss_max", "loss_sum_exp",
                                                           "gelu"):
                continue
            node = instruction.node
            if operands.kernel == "gelu":  # a tanh an element of its output, both ways
                backward = operands.step == StepKind.BACKWARD
                arithmetic = operands.flops / 4e10 + (
                    operands.output_bytes / 4 / exp_rate if exp_rate else 0.0)
                moved = (3 if backward else 2) * operands.output_bytes
                found.add(f"{'B' if backward else 'F'}/gelu")
            else:
                arithmetic = operands.flops / 4e10 + (
                    logits / exp_rate if exp_rate and node in exponentiating else 0.0)
                moved = max(passes[node] * logits * 4, 2 * operands.output_bytes)
            expected = max(arithmetic, moved / 6e9) + plan.topology.device.instruction_overhead(
                operands.kernel, operands.step != StepKind.FORWARD)
            assert costs(instruction, 0) == pytest.approx(expected, rel=1e-9), node
            found.add(node)
        assert {n for n in found if "/L" not in n} == {"F/gelu", "B/gelu"} | set(passes) - (
            {"F/loss_max", "F/loss_sum_exp"} if mesh == "dp" else set())


def test_an_activations_tanhs_and_sigmoids_count_as_exponentials():
    """GPT's tanh GELU: a tanh an element of its output forward and backward; llama's
    SwiGLU: a sigmoid forward, two backward (its silu made again and silu_backward's);
    the other operators none (plans/llama-small.plan's SwiGLU backward measured 14.7 ms
    a step, priced 4.0 by its FLOPs and bytes and 9.0 with its sigmoids)."""
    from planc.estimate.roofline import transcendentals
    from planc.lang import load_text

    llama = CPU_PLAN.replace(
        "model gpt { layers = 2; hidden = 32; heads = 4;",
        "model llama { layers = 2; hidden = 32; heads = 4; kv_heads = 2; ffn = 48;").replace(
        '  topology { preset = "machine.json" }\n', "")
    counts = {}
    for text in (CPU_PLAN.replace('  topology { preset = "machine.json" }\n', ""), llama):
        plan = load_text(text, "p.plan").plan
        build = compile_plan(plan)
        for instruction in build.programs[build.table.names[0]].written():
            operands = instruction.operands
            if operands is None or operands.kernel is None or "/L0/" not in instruction.node:
                continue
            elements = (operands.output_bytes or 0) / 4
            counts[instruction.node] = transcendentals(operands, 4) / elements \
                if elements else 0.0
    # transcendentals per element of each operator's output
    assert {node: count for node, count in counts.items() if count} == {
        "F/L0/gelu": 1.0, "B/L0/gelu": 1.0, "F/L0/swiglu": 1.0, "B/L0/swiglu": 2.0}


def test_a_calibrated_cpu_prints_its_flop_rate_in_a_unit_that_shows_it(tmp_path, run_planc):
    """11.1 GFLOP/s once printed as '0.0 TFLOP/s per GPU'; an MFU under 1% keeps two
    significant digits."""
    (tmp_path / "machine.json").write_text(json.dumps(CPU_TOPOLOGY))
    (tmp_path / "cpu.plan").write_text(CPU_PLAN)
    done = run_planc("simulate", tmp_path / "cpu.plan")
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if "expected error" not in line][:2] == [
        "cpu: 2 ranks, 1 pipeline stage: one step takes 513 us",
        "  throughput: 10.7 GFLOP/s per device, MFU 26.8% (model FLOPs of Narayanan et al. 2021, "
        "recomputation not counted)"]
    big_device = run_planc("simulate", tmp_path / "cpu.plan", "--set",
                           "topology.device.flops=400TFLOP/s", "--set", "mesh.dp=1", "--set",
                           "topology.devices_per_node=1")
    assert big_device.returncode == 0, big_device.stderr
    assert [line for line in big_device.stdout.splitlines()
            if "expected error" not in line][:2] == [
        "cpu: 1 rank, 1 pipeline stage: one step takes 397 us",
        "  throughput: 27.8 GFLOP/s per device, MFU 0.0069% (model FLOPs of Narayanan et al. "
        "2021, recomputation not counted)"]
    # diff and report print the same figures the same way
    compared = run_planc("diff", tmp_path / "cpu.plan", tmp_path / "cpu.plan")
    assert compared.returncode == 0, compared.stderr
    assert [line.split()[3:6] for line in compared.stdout.splitlines()
            if line.startswith("FLOP/s per device")] == [["10.7", "GFLOP/s", "10.7"]]
    page = run_planc("report", tmp_path / "cpu.plan", "-o", tmp_path / "r.html")
    assert page.returncode == 0, page.stderr
    text = (tmp_path / "r.html").read_text()
    assert "FLOP/s per device<b>10.7 GFLOP/s</b>" in text and "MFU<b>26.8%</b>" in text


def test_diff_puts_two_layouts_side_by_side(run_planc):
    done = run_planc("diff", PLANS / "korthikanti-22b.plan", PLANS / "korthikanti-22b.plan",
                     "--set-b", "shard.tp.sequence_parallel=on",
                     "--set-b", "optimize.recompute=selective")
    assert done.returncode == 0, done.stderr
    rows = {line[:26].strip(): line[26:].split() for line in done.stdout.splitlines()[2:]
            if line.strip() and not line.startswith("per device")}
    assert rows["overrides"] == ["shard.tp.sequence_parallel=on,",
                                 "optimize.recompute=selective"]
    assert rows["world"] == ["8", "8", "1.00x"]
    assert rows["mesh"] == ["tp", "8", "tp", "8"]
    step_ratio = float(rows["step (simulated)"][-1].rstrip("x"))
    assert step_ratio < 0.8  # selective recomputation skips most of the recomputed forward
    # Sequence parallelism turns each all-reduce into a reduce-scatter and an all-gather.
    count_a, count_b = (int(rows["transfers over tp"][i].rstrip(",")) for i in (0, 3))
    assert count_b > count_a
    done = run_planc("diff", PLANS / "korthikanti-22b.plan", "missing.plan")
    assert done.returncode == 1 and "missing.plan" in done.stderr
    done = run_planc("diff", PLANS / "gpt-tiny.plan", PLANS, "--set-b", "mesh.tp=4")
    assert (done.returncode, done.stderr) == (2, f"planc: error: --set-b needs B to be a .plan "
                                                 f"file, but {PLANS} is a directory; name "
                                                 f"the plan file instead\n")


def test_a_diagnostic_of_an_override_names_the_option_that_gave_it(run_planc, tmp_path):
    """diff's --set-b and simulate's --imbalance-from give overrides; their diagnostics
    said --set, which the user never typed."""
    plan = PLANS / "llama-tiny.plan"
    done = run_planc("diff", plan, plan, "--set-b", "mesh.tpp=2")
    assert (done.returncode, done.stderr) == (1, (
        "--set-b mesh.tpp=2:1:6: error: unknown key 'tpp' in mesh { }\n"
        "   1 | mesh.tpp=2\n     |      ^~~\n  hint: did you mean 'tp'?\n1 error generated.\n"))
    done = run_planc("diff", plan, plan, "--set-b", "mesh.tp")
    assert done.returncode == 2 and done.stderr.endswith(
        "planc diff: error: argument --set-b: 'mesh.tp' has no '='; write KEY=VALUE, such "
        "as mesh.tp=2\n")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 4.0, "time_s": 0.5, "ep_imbalance": 99}\n')
    done = run_planc("simulate", PLANS / "moe-tiny.plan", "--imbalance-from", metrics)
    assert done.returncode == 1
    assert done.stderr.splitlines()[1] == (
        f"--imbalance-from {metrics}: model.imbalance=99:1:17: error: imbalance (99) must be "
        f"at most experts / top_k (4): the busiest expert takes each token at most once")
    # a plan without experts: refused before anything is read or printed (it printed
    # "model.imbalance = 1.3", then "unknown key 'imbalance' in model llama { }")
    metrics.write_text('{"step": 0, "loss": 4.0, "time_s": 0.5, "ep_imbalance": 1.3}\n')
    done = run_planc("simulate", plan, "--imbalance-from", metrics)
    assert (done.returncode, done.stderr) == (1, (
        "planc: error: --imbalance-from sets model.imbalance, the routing's imbalance of a "
        "mixture of experts, and plan llama_tiny is model llama, which has no experts\n"))


def test_report_is_one_offline_page(tmp_path, run_planc):
    metrics = tmp_path / "m.jsonl"
    # Step times of a run: two warm-up steps, then 30, 10 and 20 ms (median 20 ms).
    metrics.write_text("".join(json.dumps({"step": i, "time_s": t, "exposed_comm_s": 0.001})
                               + "\n" for i, t in enumerate([0.5, 0.4, 0.03, 0.01, 0.02])))
    page = tmp_path / "report.html"
    done = run_planc("report", PLANS / "gpt-tiny.plan", "-o", page, "--metrics", metrics)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    for heading in ("Layout", "Memory per stage", "Transfers per axis and kind",
                    "Timeline of one step (simulated)", "Predicted and measured", "The plan"):
        assert f"<h2>{heading}</h2>" in text
    assert text.count("<svg") == 3
    assert "<td>step time</td>" in text and "<td>20 ms</td>" in text
    assert "median over 3 steps" in text
    assert "http" not in text.replace("http://www.w3.org", "")  # nothing fetched
    assert "<script" not in text


def test_report_refuses_bad_input_and_writes_nothing(tmp_path, run_planc):
    bad = tmp_path / "m.jsonl"
    bad.write_text("not json\n")
    page = tmp_path / "report.html"
    done = run_planc("report", PLANS / "gpt-tiny.plan", "-o", page, "--metrics", bad)
    assert (done.returncode, done.stderr) == (1, f"planc: error: {bad} is not a planc run "
                                                 f"metrics file (one JSON object per line)\n")
    done = run_planc("report", PLANS / "gpt-tiny.plan", "-o", tmp_path)
    assert done.returncode == 2 and "is a directory" in done.stderr
    assert not page.exists()


def test_report_looks_right_in_a_browser(tmp_path, run_planc):
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    page = tmp_path / "report.html"
    assert run_planc("report", PLANS / "gpt-tiny.plan", "-o", page).returncode == 0
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--screenshot={shot}", "--window-size=1100,2400", page.as_uri()],
                   capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a rendered page, not a blank one


def test_the_simulator_and_the_chakra_export_replay_the_programs_alone(tmp_path):
    """Costs, peers and representative ranks come from the instructions' operands, the
    rank table and the group table: a build without its graph simulates, traces and
    exports the same step (ring shifts, pipeline transfers and a tree route included)."""
    from dataclasses import replace

    from planc.export.chakra import export
    from planc.simulate.trace import write

    loaded = load_file(PLANS / "cp-ring-attention.plan",
                       ("mesh.pp=2", "model.layers=4", "model.seq=4096"))
    build = compile_plan(loaded.plan)
    ops = {(i.op, i.operands.route) for p in build.programs.values()
           for part in (p.prologue, *p.blocks.values(), p.epilogue) for i in part
           if i.operands is not None}
    assert {("send", None), ("all_reduce", "tree")} <= ops
    assert any(i.op == "compute" and i.operands.ring_steps == 4
               for p in build.programs.values() for part in p.blocks.values() for i in part)
    # A routed collective costs what the route pass predicted for it.
    costs = InstructionCosts(build.plan, build.groups)
    routed = [(i, p.stage) for p in build.programs.values()
              for part in (p.prologue, *p.blocks.values(), p.epilogue) for i in part
              if i.operands is not None and i.operands.route is not None]
    assert routed and all(costs(i, stage) == build.graph.nodes[i.node]["route_seconds"]
                          for i, stage in routed)
    without_graph = replace(build, graph=None, summary=None)
    seen = simulate(build, keep_timeline=True)
    blind = simulate(without_graph, keep_timeline=True)
    assert blind.to_json() == seen.to_json()
    write(tmp_path / "seen.json", build, seen)
    write(tmp_path / "blind.json", without_graph, blind)
    assert (tmp_path / "seen.json").read_bytes() == (tmp_path / "blind.json").read_bytes()
    seen_files = export(build, tmp_path / "seen")
    blind_files = export(without_graph, tmp_path / "blind")
    assert [p.read_bytes() for p in seen_files] == [p.read_bytes() for p in blind_files]


def test_ring_attention_hides_each_shift_behind_its_block():
    """Per ring step the longer of the block's compute and the shifts in flight: the
    forward shifts at every step but the last, the backward also moves a dK/dV block."""
    assert ring_seconds(4.0, 0.5, 4, backward=False) == 4.0  # every shift hidden
    assert ring_seconds(4.0, 2.0, 4, backward=False) == 3 * 2.0 + 1.0  # shifts exposed
    assert ring_seconds(4.0, 0.75, 4, backward=True) == 3 * 1.5 + 1.0
    assert ring_seconds(4.0, 0.25, 4, backward=True) == 4.0


def test_a_ring_attention_step_is_priced_by_its_ring_steps():
    """At seq 2,048 the shifts, not the blocks, set a ring step's time (at the plan's
    32,768 every shift hides behind its block, and a step priced without its ring, or a
    backward priced as a forward, passed): each direction is priced exactly."""
    loaded = load_file(PLANS / "cp-ring-attention.plan", ("model.layers=2", "model.seq=2048"))
    build = compile_plan(loaded.plan)
    costs = InstructionCosts(build.plan, build.groups)
    (program,) = build.programs.values()
    ring = {i.node: i for part in program.blocks.values() for i in part
            if i.operands is not None and i.operands.ring_steps}
    for node, backward in (("F/L0/attention", False), ("B/L0/attention", True)):
        operands = ring[node].operands
        compute = costs.kernels.seconds(operands, 2.0 * operands.output_bytes)
        shift = costs.cost.transfer_seconds("recv", operands.bytes, 4,
                                            build.groups.crosses_nodes("cp"))
        assert costs(ring[node], 0) == ring_seconds(compute, shift, 4, backward=backward)
        assert costs(ring[node], 0) > compute  # the shifts decide it


def test_fp32_runs_on_the_fp32_cores():
    """PyTorch's fp32 matmuls do not use TF32 unless told (allow_tf32 is False) and planc
    run does not tell them: an fp32 plan on a DGX preset is priced at the datasheet's FP32
    peak, and its attention at the fp32 rates measured on the H100's compute (an H200's),
    or on the A100, which has none measured, at its bf16 rates scaled down as its GEMMs
    are. Before, TF32's 494 TFLOP/s priced planc's own 1.1B llama on an H200 at 0.19 s a
    step, and the scaled-down attention at 1.42 s; it took 1.19 s
    (plans/planc-h200/llama-1b-fp32.plan)."""
    from planc.estimate.kernel_cost import KernelModel
    from planc.simulate.accuracy import FP32_MEASURED, FP32_SCALED, expected

    fp32 = load_file(PLANS / "planc-h200" / "llama-1b-fp32.plan").plan
    bf16 = load_file(PLANS / "planc-h200" / "llama-1b-fp32.plan",
                     ("model.dtype=bf16",)).plan
    assert (fp32.topology.device.flops, bf16.topology.device.flops) == (67e12, 989e12)
    measured, scaled = KernelModel.of(fp32), KernelModel.of(bf16)
    assert (measured.attention, measured.attention_scale) == ((39.1e12, 32.4e12), 1.0)
    assert (scaled.attention, scaled.attention_scale) == ((164e12, 168e12), 1.0)
    a100 = load_file(PLANS / "korthikanti-22b.plan", ("model.dtype=fp32",)).plan
    assert a100.topology.device.flops == 19.5e12
    assert KernelModel.of(a100).attention_scale == 19.5e12 / 312e12
    assert round(simulate(compile_plan(fp32)).step_seconds, 2) == 1.19
    # the whole step: GEMM-bound, so about the ratio of the peaks (989 / 67 = 14.8)
    fp32_step = simulate(compile_plan(fp32)).step_seconds
    bf16_step = simulate(compile_plan(bf16)).step_seconds
    assert 8 < fp32_step / bf16_step < 14.8
    # one run within 0.5 % promises nothing of other fp32 plans: on the H100 they are
    # given the dense published runs' error; on the A100, whose fp32 attention still
    # scales its bf16 rates, that run's error under that scaling
    assert expected(fp32) is FP32_MEASURED and FP32_MEASURED.text() == (
        "± 10.5% (the median error over 78 published runs of dense models, in 16 bits; "
        "planc's own fp32 run on one H200 came within 0.5 %; the largest 46%)")
    assert expected(a100) is FP32_SCALED and FP32_SCALED.text() == (
        "± 16.7% (the error of the one fp32 run it was held to with its attention priced as "
        "this GPU's is, at the bf16 rates scaled down: planc's own on one H200; no published "
        "run is fp32)")
    # tune's bound: fp32 attention counts twice its causal FLOPs at 1.17 of the FP32 peak,
    # above the GEMMs' 0.79, and is not cut to 1 (the bound would then exceed its price)
    assert KernelModel.fastest_fraction(fp32) == 2 * 39.1e12 / 67e12


def test_simulate_states_the_error_of_its_validation_on_the_gpus_it_was_held_to():
    from planc.simulate.accuracy import CALIBRATED, DENSE, MIXTURES, expected
    from planc.views.simulate_text import render

    dense = load_file(PLANS / "korthikanti-22b.plan").plan
    mixture = load_file(PLANS / "moe-published" / "mcore-mixtral-8x7b.plan").plan
    assert expected(dense) is DENSE and expected(mixture) is MIXTURES
    assert expected(load_file(PLANS / "gpt-tiny.plan").plan) is None
    # the demo's topology is this machine as planc calibrate measured it
    assert expected(load_file(PLANS / "demo.plan").plan) is CALIBRATED
    lines = render(simulate(compile_plan(dense)), expected(dense)).splitlines()
    assert lines[1] == ("  expected error: ± 10.5% (the median error over 78 published runs "
                        "of dense models; the largest 46%)")


def test_an_fp8_plan_is_stated_the_error_of_the_published_fp8_run_and_plancs_own():
    """model { fp8 } is priced as DeepSeek-V3's fused kernels: its expected error is the
    one published FP8 run's (+13.2 % on the step), and the statement names planc run's
    own FP8 steps on the H200, several times the prediction, rather than the mixtures'
    published bf16 runs."""
    from planc.simulate.accuracy import FP8, MIXTURES, expected
    from bench import validation

    h800 = load_file(PLANS / "moe-published" / "deepseek-v3-h800.plan").plan
    own = load_file(PLANS / "planc-h200" / "moe-fp8.plan").plan
    bf16 = load_file(PLANS / "planc-h200" / "moe-bf16.plan").plan
    assert expected(h800) is FP8 and expected(own) is FP8 and expected(bf16) is MIXTURES
    from tests.test_simulate_moe import MOE_PUBLISHED

    published = next(p for p in MOE_PUBLISHED if p.plan == "deepseek-v3-h800")
    tokens = h800.model.batch * h800.model.seq / h800.world / simulate(
        compile_plan(h800)).step_seconds
    # the step's error, as the moe table's median counts it
    assert round(published.tokens_per_gpu(h800) / tokens - 1, 3) == FP8.median == FP8.largest
    measured = {r.label: r for r in validation.runs() if r.table == "planc_h200"}
    times = sorted(round(1 / (1 + validation.simulated(measured[name])["error"]), 1)
                   for name in ("moe-fp8", "deepseek-fp8"))
    assert times == [6.7, 7.2]
    assert FP8.text() == (
        "± 13.2% (the error of the one published FP8 run, DeepSeek-V3 on 2,048 H800s with "
        "its quantisation fused into its kernels; planc run's own FP8 steps, which quantise "
        "apart, took 6.7 and 7.2 times the predicted step on one H200)")


def test_tune_claims_no_speed_up_inside_the_simulators_expected_error():
    from planc.simulate.accuracy import DENSE
    from planc.views.tune_text import _within

    assert _within(1.05, DENSE) == ("; within the simulator's expected error of ± 10.5%, so "
                                    "not a difference it can tell apart")
    assert _within(1.2, DENSE) == ""
    assert _within(1.2, None) == ", by a model not measured on this device"


def test_a_streams_tail_is_charged_to_the_axis_of_its_last_transfer():
    """The comm stream carries tp's collectives and the loss's all-reduce over its stage's
    group: a wait for what it ran last is that transfer's axis, not tp's by the stream."""
    plan = load_file(PLANS / "gpt-tiny.plan",
                     ("mesh.tp=1", "mesh.pp=2", "mesh.dp=4")).plan
    stages = simulate(compile_plan(plan)).stages
    assert [sorted(k for k, v in s.exposed_seconds.items() if v > 0) for s in stages] == \
        [["dp_cp"], ["stage"]]
