"""bench/validation.py's tables of published runs (plans/bloom/, plans/mtnlg/,
plans/torchtitan/ and the tables in tests/test_simulate.py): every run's plan parses as its
source states it, one run of each new table simulates, the published figure becomes a step
as its unit says, and the leave-one-table-out machinery simulates what it claims to.

The sources and what each plan assumes are in the plans' header comments; the error tables
are bench/validation.py's output (docs/simulate.md, "Validation"). Nothing here bounds an
error: the simulator's accuracy is what bench/validation.py reports, not a test.
"""

from __future__ import annotations

import dataclasses

import pytest

from bench import deepspeed_schedule, validation
from planc.compile import compile_plan
from planc.estimate.kernel_cost import GPUS
from planc.lang import load_file
from planc.simulate import simulate
from tests.conftest import PLANS

RUNS = validation.runs()
NEW_TABLES = ("bloom", "mtnlg", "torchtitan")


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r.table}:{r.label}")
def test_every_published_run_parses(run):
    plan = validation.loaded(run)
    assert plan.world > 0 and validation.published_step(run, plan) > 0


def test_the_layouts_are_the_sources():
    """The fields each source states (the plans' header comments cite them)."""
    bloom = validation.loaded(next(r for r in RUNS if r.label == "bloom-176b"))
    assert (bloom.mesh.tp, bloom.mesh.pp, bloom.mesh.dp, bloom.world) == (4, 12, 8, 384)
    assert bloom.model.batch // bloom.mesh.dp // bloom.schedule.microbatches == 2
    assert (bloom.model.layers, bloom.model.hidden, bloom.model.heads) == (70, 14336, 112)
    # --pp-partition-method 'type:transformer|embedding': 5 layers beside each end's
    # embedding, 6 on every other rank
    sizes = [last - first + 1 for first, last in bloom.shard.pp.chunks]
    assert sizes == [5] + [6] * 10 + [5]
    assert bloom.topology.inter.bandwidth == 6.25e9  # 4 x 100 Gb/s Omni-Path per 8 GPUs
    assert bloom.train.grad_clip == 1.0  # tr11-176B-ml.slurm: --clip-grad 1.0
    # BF16_Optimizer adds every microbatch's gradient into its fp32 buffer
    assert (bloom.optimize.grad_accumulation, bloom.shard.dp.fp32_grads) == ("buffer", True)
    # ... and its pipeline engine all-reduces that fp32 buffer over dp (_bf16_reduce_grads),
    # cast to the engine's communication_data_type, bf16
    assert bloom.shard.dp.reduce_dtype == "model" and bloom.reduce_dtype_bytes == 2
    for nodes, dp in ((280, 8), (350, 10), (420, 12)):
        mtnlg = load_file(PLANS / "mtnlg" / f"mtnlg-530b-{nodes}.plan").plan
        assert (mtnlg.mesh.tp, mtnlg.mesh.pp, mtnlg.mesh.dp) == (8, 35, dp)
        assert mtnlg.world == 8 * nodes and mtnlg.model.batch == 1920
        assert mtnlg.optimize.grad_accumulation == "autograd"  # 2021: no fusion yet
    # Megatron-LM of 2022 with fp16: no fusion, the main_grad hook; Megatron-Core r0.8 fuses
    for name in ("22b", "175b", "530b", "1t"):
        plan = load_file(PLANS / f"korthikanti-{name}.plan").plan
        assert plan.optimize.grad_accumulation == "buffer", name
    for path in PLANS.glob("megatron-h100-*.plan"):
        assert load_file(path).plan.optimize.grad_accumulation == "fused", path.name
    titan = load_file(PLANS / "torchtitan" / "torchtitan-70b-tp8.plan").plan
    assert (titan.mesh.tp, titan.mesh.dp, titan.model.batch, titan.model.seq) == \
        (8, 32, 512, 8192)
    # torchtitan's files: local batch x FSDP degree, full AC for 70B and per-op selective
    # for 8B (planc's selective stands for it), max_norm 1.0 in the tomls, the 500 W part
    # halfway between H100 NVL's and SXM's datasheet peaks
    layouts = {"8b-fsdp8": (1, 8, 16, "selective"), "8b-fsdp128": (1, 128, 256, "selective"),
               "8b-tp8": (8, 8, 96, "selective"), "8b-async-tp8": (8, 8, 96, "selective"),
               "70b-tp8": (8, 32, 512, "full"), "70b-async-tp8": (8, 32, 512, "full")}
    for name, (tp, dp, batch, recompute) in layouts.items():
        titan = load_file(PLANS / "torchtitan" / f"torchtitan-{name}.plan").plan
        assert (titan.mesh.tp, titan.mesh.dp, titan.model.batch, titan.model.seq,
                titan.schedule.microbatches) == (tp, dp, batch, 8192, 1), name
        assert titan.optimize.recompute == recompute, name
        assert titan.optimize.tp_overlap is ("async" in name) or tp == 1, name
        assert titan.train.grad_clip == 1.0, name
        assert titan.topology.device.flops == 912.25e12, name


def test_narayanan_plans_are_the_run_scripts():
    """run_table_1.sh: --micro-batch-size and --num-layers-per-virtual-pipeline-stage,
    --DDP-impl torch (overlap) up to 18B; CONFIG.sh: --clip-grad 1.0. The Megatron-LM of
    the paper had no asynchronous tensor-parallel all-reduce (weight_grad_overlap)."""
    script = {"1_7b": (16, 1), "3_6b": (16, 1), "7_5b": (16, 1), "18b": (8, 1),
              "39b": (4, 1), "76b": (2, 3), "145b": (2, 2), "310b": (1, 2), "530b": (1, 3),
              "1t": (1, 1)}
    for name, (micro_size, chunks) in script.items():
        plan = load_file(PLANS / f"narayanan-{name}.plan").plan
        m = plan.model
        assert m.batch // plan.mesh.dp // plan.schedule.microbatches == micro_size, name
        assert plan.shard.pp.virtual == chunks, name
        assert (plan.schedule.pipeline == "interleaved") == (chunks > 1), name
        assert plan.train.grad_clip == 1.0, name
        assert plan.optimize.overlap == (name in ("1_7b", "3_6b", "7_5b", "18b")), name
        assert not (plan.optimize.overlap and plan.optimize.weight_grad_overlap), name
        # 6985e58 had no gradient-accumulation fusion: autograd adds into param.grad
        assert plan.optimize.grad_accumulation == "autograd", name


@pytest.mark.parametrize("plan", ["torchtitan/torchtitan-8b-fsdp8.plan",
                                  "bloom/bloom-176b.plan"])
def test_a_run_of_each_new_table_simulates(plan):
    run = next(r for r in RUNS if r.plan == plan)
    row = validation.simulated(run)
    assert row["table"] in NEW_TABLES and row["step"] > 0 and row["memory"] > 0
    assert row["error"] == row["step"] / row["published_step"] - 1
    # these tables fed no constant of the model: the held-out prediction is the shipped one
    assert row["loo_error"] == row["error"]


def test_planc_h200_plans_are_the_benchmarks_own():
    """plans/planc-h200/ holds the plans bench/gpu_step.py and bench/gpu_moe.py trained on
    the H200, key for key, with only the machine added; and their rows are step times
    in seconds and peaks in MiB as those benchmarks printed them."""
    from bench import gpu_moe, gpu_step
    from bench.published_runs import PLANC_H200
    from planc.lang import load_text

    def ran(text):
        return load_text(text, "ran.plan").plan

    sources = {"llama-1b-fp32": ran(gpu_step.PLAN.format(steps=6, compile="off",
                                                         **gpu_step.SIZES["1b"])),
               "moe-bf16": ran(gpu_moe.plan_text("moe", False, "gpu", 6)),
               "moe-fp8": ran(gpu_moe.plan_text("moe", True, "gpu", 6)),
               "deepseek-bf16": ran(gpu_moe.plan_text("deepseek", False, "gpu", 6)),
               "deepseek-fp8": ran(gpu_moe.plan_text("deepseek", True, "gpu", 6))}
    assert sorted(sources) == sorted(PLANC_H200)
    for name, source in sources.items():
        plan = load_file(PLANS / "planc-h200" / f"{name}.plan").plan
        assert (plan.model, plan.mesh, plan.shard, plan.schedule, plan.optimize,
                plan.train) == (source.model, source.mesh, source.shard, source.schedule,
                                source.optimize, source.train), name
        device = plan.topology.device
        # the H200's datasheet memory and bandwidth over the H100's compute, one GPU
        assert (plan.topology.preset, plan.world, device.memory, device.bandwidth) == \
            ("dgx-h100", 1, 141e9, 4.8e12), name
        assert device.flops == (67e12 if plan.model.dtype == "fp32" else 989e12), name
    rows = {r.label: r for r in RUNS if r.table == "planc_h200"}
    assert (rows["llama-1b-fp32"].published, rows["llama-1b-fp32"].memory) == \
        (1.1946, 39386 * 2 ** 20)
    assert all(r.measure == validation.STEP for r in rows.values())


def test_published_dense_runs_leave_out_planc_own():
    """The expected error planc simulate states is over published runs: planc's own
    (planc_h200) and the mixtures are summed apart."""
    assert validation.OWN_OR_MIXTURES == ("moe", "planc_h200")
    published = [r for r in RUNS if r.table not in validation.OWN_OR_MIXTURES]
    from planc.simulate.accuracy import DENSE
    assert len(published) == DENSE.runs == 78


def test_published_figures_become_steps():
    by_plan = {r.plan: r for r in RUNS}
    by_label = {r.label: r for r in RUNS if r.table == "torchtitan"}
    titan = by_label["torchtitan-8b-fsdp8"]
    plan = validation.loaded(titan)
    # 16 sequences of 8,192 tokens over 8 GPUs at 5,762 tokens/s each
    assert validation.published_step(titan, plan) == 16 * 8192 / (5762 * 8)
    # the same plan with torch.compile's fused kernels, at the file's 6,667 tokens/s
    compiled = by_label["torchtitan-8b-fsdp8 + torch.compile"]
    plan = validation.loaded(compiled)
    assert (compiled.plan, plan.optimize.kernels) == (titan.plan, "fused")
    assert validation.published_step(compiled, plan) == 16 * 8192 / (6667 * 8)
    assert validation.loaded(titan).optimize.kernels == "eager"
    narayanan = by_plan["narayanan-1_7b.plan"]
    plan = validation.loaded(narayanan)
    eq3 = 96 * 512 * 2048 * 24 * 2304 ** 2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert validation.published_step(narayanan, plan) == pytest.approx(eq3 / (137e12 * 32),
                                                                       rel=1e-12)


def test_simulate_prices_with_the_gpu_it_is_given():
    """planc.simulate.simulate(build, gpu=...) prices the kernels with another GPU's
    figures (what leave-one-table-out needs): the shipped GPU gives the shipped step,
    stage by stage; a slower large-GEMM rate a slower one."""
    plan = load_file(PLANS / "korthikanti-22b.plan").plan
    build = compile_plan(plan)
    shipped, same = simulate(build), simulate(build, gpu=GPUS["dgx-a100"])
    assert same.stages == shipped.stages and same.step_seconds == shipped.step_seconds
    slower = simulate(build, gpu=dataclasses.replace(GPUS["dgx-a100"], large=0.4))
    assert slower.step_seconds > 1.5 * shipped.step_seconds


def test_the_a100_efficiency_is_derived_not_fitted_to_korthikanti():
    """The A100 preset's one efficiency (compile's estimates, the tensor-parallel chooser,
    tune's bound) is the kernel model's large-GEMM rate, not a figure chosen against
    Korthikanti Table 5: no constant of the model comes from that table."""
    from planc.plan.presets import PRESETS

    assert PRESETS["dgx-a100"].efficiency == GPUS["dgx-a100"].large
    assert PRESETS["dgx-h100"].efficiency == GPUS["dgx-h100"].large
    assert validation.loo_variant("korthikanti", None) == ((), None,
                                                           "no constant derived from it")


def test_h100_held_out_says_what_it_needs():
    with pytest.raises(ValueError, match="kernels_gpu.py"):
        validation.loo_variant("h100", None)
    assert validation.loo_variant("bloom", None) == ((), None, "no constant derived from it")


def test_summary_keeps_the_sign():
    s = validation.summary([-0.1, 0.02, -0.05])
    assert (s["median"], s["largest"], s["both_signs"], s["direction"]) == \
        (0.05, 0.1, True, "mixed")
    assert validation.summary([-0.1, -0.2])["direction"] == "every row too fast"


def test_bad_arguments_are_refused_without_a_traceback(tmp_path, capsys):
    for argv in (["--only", "nonsense"], ["--kernels", str(tmp_path / "absent.jsonl")],
                 ["--write"]):
        with pytest.raises(SystemExit) as exit_:
            validation.main(argv)
        assert exit_.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


def test_deepspeed_train_schedule_takes_1f1b_time():
    """BLOOM's and MT-NLG's DeepSpeed TrainSchedule, replayed with blocking sends: 1F1B's
    (m + p - 1) (F + B) with free transfers; each exchange's receive and send in series
    add their transfers beyond it."""
    for microbatches, stages in ((240, 35), (128, 12), (3, 4)):
        assert deepspeed_schedule.replay(microbatches, stages, 1.0, 3.0) == \
            (microbatches + stages - 1) * 4.0
    # one stage: no exchanges, the microbatches one after another
    assert deepspeed_schedule.replay(5, 1, 1.0, 3.0) == 20.0
    assert deepspeed_schedule.replay(128, 12, 1.0, 3.0, transfer=0.02) > 556.0
    # the last stage's program: forward then backward of each microbatch, its exchanges
    # with stage 2 before each forward
    last = deepspeed_schedule.step_commands(2, 4, 3)
    assert last == [("recv", "activation", 0, 2), ("forward", 0), ("backward", 0),
                    ("send", "grad", 0, 2), ("recv", "activation", 1, 2), ("forward", 1),
                    ("backward", 1), ("send", "grad", 1, 2)]


def test_the_plans_reduce_gradients_in_the_dtype_their_sources_say():
    # fp32: Megatron-Core r0.8 with bf16, FSDP2's mixed_precision_reduce in torchtitan,
    # Llama 3's "FP32 reduce-scatter". The model's dtype: DeepSpeed's engine casts a
    # bucket to its communication_data_type before the all-reduce, bf16 for BLOOM's
    # BF16_Optimizer (02-28 on), whose fp32 gradients it hands over, and fp16 for the
    # 02-25 rows' fp16 engine.
    fp32 = sorted(PLANS.glob("megatron-h100-*.plan")) + sorted(PLANS.glob("torchtitan/*.plan")) \
        + [PLANS / "llama3-405b.plan"]
    assert len(fp32) == 9 + 6 + 1
    for path in fp32:
        assert load_file(path).plan.reduce_dtype == "fp32", path
    deepspeed = [(p, "bf16") for p in sorted(PLANS.glob("bloom/bloom-176b*.plan"))] + \
        [(p, "fp16") for p in sorted(PLANS.glob("bloom/bloom-181b*.plan"))]
    assert len(deepspeed) == 5 + 3
    for path, dtype in deepspeed:
        plan = load_file(path).plan
        assert (plan.shard.dp.reduce_dtype, plan.reduce_dtype) == ("model", dtype), path


def test_the_held_out_bloom_readings_are_the_pages_and_not_the_tables():
    """bloom_search: the 19 timed readings of chronicles-prequel.md's 2022-02-25 tables
    that the bloom table leaves out, each bloom-181b-tp2.plan at the reading's layout (18
    of its 181B shape, one of a 177B shape), and the 12 of its 2022-02-28 tables at the
    shapes other than the 176B's, bloom-176b.plan at the reading's shape and layout; 27
    give nvidia-smi's memory; the layout read twice is labelled apart; the six layouts the
    page read as out of memory are not timed."""
    from bench.published_runs import BLOOM_SEARCH, BLOOM_SEARCH_BF16

    held = [r for r in RUNS if r.table == "bloom_search"]
    assert len(held) == 31 and sum(r.memory is not None for r in held) == 27
    assert len({r.label for r in held}) == 31
    assert [r.label for r in held if "again" in r.label] == \
        ["dp 8, tp 4, pp 12, mbs 2, batch 2048 (read again)"]
    in_table = set()
    for name in ("181b-tp2", "181b-pp6", "181b-pp24", "176b", "176b-tp8", "176b-heads64",
                 "176b-heads128", "176b-mbs4"):
        plan = load_file(PLANS / "bloom" / f"bloom-{name}.plan").plan
        m = plan.model
        in_table.add((m.layers, m.hidden, m.heads, plan.mesh.dp, plan.mesh.tp, plan.mesh.pp,
                      plan.microbatch_size, m.batch))
    layouts = set()
    for run in held:
        plan = validation.loaded(run)
        m = plan.model
        layout = (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp, plan.microbatch_size, m.batch)
        shape_label = "{}, {} x {}, {} heads: dp {}, tp {}, pp {}, mbs {}".format(
            run.label[:5], m.layers, m.hidden, m.heads, *layout[:4])
        if run.label.startswith("02-28"):
            assert (m.dtype, m.batch, plan.world, plan.shard.dp.fp32_grads) == \
                ("bf16", 2048, 384, True), run.label
            assert run.label == shape_label
        elif run.label.startswith("02-25"):
            assert (m.layers, m.hidden, m.heads, m.dtype, plan.world, run.plan) == \
                (96, 12288, 64, "fp16", 384, "bloom/bloom-181b-tp2.plan"), run.label
            assert (run.label, run.published, run.memory) == (shape_label, 142.17, 58e9)
        else:
            assert (m.layers, m.hidden, m.heads, m.dtype, plan.world) == \
                (72, 14336, 64, "fp16", 384), run.label
            assert run.label.startswith("dp {}, tp {}, pp {}, mbs {}, batch {}".format(*layout))
        layouts.add((m.layers, m.hidden, m.heads) + layout)
    assert not layouts & in_table and len(layouts) == 30
    # the page's figures for the two readings of one layout: 110.48 s at 44 GB and
    # 113.54 s at 38 GB
    twice = sorted((r.published, r.memory) for r in held if "tp 4, pp 12, mbs 2, b" in r.label)
    assert twice == [(110.48, 44e9), (113.54, 38e9)]
    # what ran out of memory is priced for memory only, against the 80 GB
    oom = validation.out_of_memory()
    assert [r["label"] for r in oom] == [
        "dp 48, tp 8, pp 1, mbs 1, batch 2016",
        "dp 32, tp 2, pp 6, mbs 2, batch 2048",
        "dp 32, tp 2, pp 6, mbs 1, batch 2048",
        "02-28, 100 x 12288, 64 heads: dp 16, tp 4, pp 6, mbs 2",
        "02-28, 100 x 12288, 64 heads: dp 16, tp 4, pp 6, mbs 1",
        "02-28, 82 x 14336, 128 heads: dp 8, tp 4, pp 12, mbs 2"]
    assert [sum(seconds is None for _, _, seconds, _ in day)
            for day in (BLOOM_SEARCH, BLOOM_SEARCH_BF16)] == [3, 3]
    # docs/simulate.md, Memory: planc check warns of four; the other two it lets through
    assert [(round(r["memory"] / 1e9, 1), r["over"]) for r in oom] == [
        (103.5, True), (91.0, True), (85.5, True), (84.6, True), (79.0, False),
        (58.3, False)]
    assert all(r["capacity"] == 80e9 for r in oom)
