"""The published runs that bench/validation.py and the tests hold the simulator to: each
table's figures as its source printed them. The layouts are the plans' (plans/, each
header names its source and what it assumes); docs/simulate.md lists the sources.
"""

# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
# (arXiv 2205.05198), Table 5, A100s, Megatron-LM. model: (full recomputation, sequence
# parallel + selective), seconds per step.
KORTHIKANTI_TABLE_5 = {"22b": (1.42, 1.10), "175b": (18.13, 13.75),
                       "530b": (49.05, 37.83), "1t": (94.42, 71.49)}
# the paper's sequence parallelism keeps each GEMM input's shard and gathers it again in
# the backward (section 4.2.2)
SEQUENCE_SELECTIVE = ("shard.tp.sequence_parallel=on", "optimize.recompute=selective",
                      "shard.tp.gathered_inputs=regather")


# The Megatron-LM README's weak-scaling table on H100s: model -> TFLOP/s per GPU.
MEGATRON_H100 = {"1_7b": 408.8, "7_1b": 465.9, "16b": 489.1, "32b": 459.6, "70b": 419.7,
                 "119b": 420.5, "177b": 432.8, "314b": 474.4, "462b": 459.9}


# Held out (not looked at while the kernel model was built): Narayanan et al., "Efficient
# Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), Table 1,
# A100s: model -> published TFLOP/s per GPU, counted by their eq. 3, which includes the
# recomputed forward: 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step.
NARAYANAN_TABLE_1 = {"1_7b": 137, "3_6b": 138, "7_5b": 142, "18b": 135, "39b": 138,
                     "76b": 140, "145b": 148, "310b": 155, "530b": 163, "1t": 163}


def narayanan_step_flops(m) -> float:
    """FLOPs of a step as Narayanan et al. (SC'21, eq. 3) count them, recomputation in."""
    return 96 * m.batch * m.seq * m.layers * m.hidden ** 2 * (
        1 + m.seq / (6 * m.hidden) + m.vocab / (16 * m.layers * m.hidden))


# How each source measured its peak memory.
NVIDIA_SMI = "nvidia-smi on the first node (the allocator's cache and the CUDA context in)"
# torchtitan 9dec370, train.py's log line: memory_stats' reserved_bytes.all.peak.
TORCHTITAN_PEAK = "max reserved (the caching allocator's peak), the largest over the GPUs"

# plans/bloom/: (step s, peak GB); sources in each plan's header.
BLOOM = {"bloom-176b": (104.70, 59), "bloom-176b-tp8": (121.63, 40),
         "bloom-176b-heads64": (102.03, 59), "bloom-176b-heads128": (105.89, 60),
         "bloom-176b-mbs4": (102.27, 73), "bloom-181b-pp6": (111.71, 57),
         "bloom-181b-tp2": (112.50, 63), "bloom-181b-pp24": (119.53, 44)}
# Held out: readings of the same days' layout search that the table above leaves out,
# from BigScience, train/tr11-176B-ml/chronicles-prequel.md. Each is (layers, hidden,
# heads), (dp, tp, pp, micro-batch size, global batch) -> seconds per iteration and
# nvidia-smi GB on the first node (None where the page leaves it blank; None and "OOM"
# for a layout the page reads as out of the 80 GB). Iteration 2's snapshot each, which
# the page says "can fluctuate a bit".
#
# "GBS Variations" (2022-02-25, the day bloom-181b-* come from): fp16, ZeRO-1, 48 nodes,
# plans/bloom/bloom-181b-tp2.plan at each reading's shape and layout. Its 181B shape is
# NLAYERS 72, NHIDDEN 14336, NHEADS 64; dp 8, tp 4, pp 12, MBS 2 was read twice. Its one
# 177B reading (NHIDDEN 12288, NLAYERS 96) states no NHEADS: 64 taken, the section's
# and the best of the 177B's 02-24 NHEADS table (64, 96, 128).
BLOOM_181B = (72, 14336, 64)
BLOOM_SEARCH = (
    (BLOOM_181B, (8, 8, 6, 4, 1568), 113.01, 56), (BLOOM_181B, (8, 8, 6, 4, 2048), 114.11, 55),
    (BLOOM_181B, (8, 8, 6, 6, 2016), 123.57, 66), (BLOOM_181B, (4, 8, 12, 4, 1568), 92.75, None),
    (BLOOM_181B, (4, 8, 12, 4, 2048), 117.07, 49), (BLOOM_181B, (4, 8, 12, 2, 1568), 99.93, None),
    (BLOOM_181B, (4, 8, 12, 2, 2048), 128.82, None), (BLOOM_181B, (6, 8, 8, 4, 2016), 113.16, 52),
    (BLOOM_181B, (12, 8, 4, 2, 2016), 125.52, 53), (BLOOM_181B, (12, 8, 4, 4, 2016), 114.81, 59),
    (BLOOM_181B, (24, 8, 2, 1, 2016), 145.45, 65), (BLOOM_181B, (24, 8, 2, 2, 2016), 136.13, 76),
    (BLOOM_181B, (48, 8, 1, 1, 2016), None, "OOM"),
    (BLOOM_181B, (8, 4, 12, 4, 2048), 111.89, 60), (BLOOM_181B, (8, 4, 12, 2, 2048), 110.48, 44),
    (BLOOM_181B, (8, 4, 12, 2, 2048), 113.54, 38), (BLOOM_181B, (16, 4, 6, 4, 2048), 117.11, 75),
    (BLOOM_181B, (32, 2, 6, 2, 2048), None, "OOM"), (BLOOM_181B, (32, 2, 6, 1, 2048), None, "OOM"),
    (BLOOM_181B, (8, 2, 24, 2, 2048), 122.75, 53), (BLOOM_181B, (4, 4, 24, 1, 2048), 130.60, None),
    ((96, 12288, 64), (8, 1, 48, 1, 2048), 142.17, 58))
# "Rebalancing layers" (2022-02-28, the day of bloom-176b-tp8, -heads64, -heads128 and
# -mbs4): the BF16 optimizer and the embedding-aware partition of
# plans/bloom/bloom-176b.plan at the other shapes it tried, global batch 2048. The 176B
# readings are the bloom table's; its 112-head one is the README's 104.70 s there, and
# the page's 104.50 s for the same plan and layout is not counted a second time.
BLOOM_SEARCH_BF16 = (
    ((106, 12288, 64), (8, 4, 12, 2, 2048), 116.54, 67),
    ((106, 12288, 96), (8, 4, 12, 2, 2048), 118.79, 65),
    ((106, 12288, 128), (8, 4, 12, 2, 2048), 121.42, 67),
    ((106, 12288, 96), (8, 4, 12, 4, 2048), 120.34, 79),
    ((100, 12288, 64), (16, 4, 6, 2, 2048), None, "OOM"),
    ((100, 12288, 64), (16, 4, 6, 1, 2048), None, "OOM"),
    ((100, 12288, 64), (8, 8, 6, 2, 2048), 139.72, 61),
    ((100, 12288, 64), (8, 8, 6, 4, 2048), 120.96, 72),
    ((82, 13312, 64), (4, 8, 12, 4, 2048), 111.79, 52),
    ((82, 13312, 64), (8, 4, 12, 2, 2048), 104.45, 63),
    ((82, 13312, 104), (8, 4, 12, 2, 2048), 123.71, 62),
    ((82, 13312, 128), (8, 4, 12, 2, 2048), 108.78, 60),
    ((82, 13312, 64), (8, 4, 12, 4, 2048), 104.82, 74),
    ((94, 13312, 128), (8, 4, 12, 2, 2048), 124.10, 67),
    ((82, 14336, 128), (8, 4, 12, 2, 2048), None, "OOM"))
# (date, the plan of that day, readings): a reading of another shape than the plan's own
# (bench/validation.py reads it from the plan) sets the plan's layers, hidden and heads
BLOOM_SEARCH_DAYS = (("02-25", "bloom/bloom-181b-tp2.plan", BLOOM_SEARCH),
                     ("02-28", "bloom/bloom-176b.plan", BLOOM_SEARCH_BF16))
MTNLG = {"mtnlg-530b-280": 60.1, "mtnlg-530b-350": 50.2, "mtnlg-530b-420": 44.4}
# plans/torchtitan/: (tokens/s per GPU, peak GiB or None).
TORCHTITAN = {"torchtitan-8b-fsdp8": (5762, 82.4), "torchtitan-8b-fsdp128": (5605, 67.0),
              "torchtitan-8b-tp8": (4378, None), "torchtitan-8b-async-tp8": (4809.4, None),
              "torchtitan-70b-tp8": (597.3, None),
              "torchtitan-70b-async-tp8": (652.4, None)}
# The same file's FSDP rows with torch.compile (benchmarks/llama3_h100_202412_torchtitan.md,
# Tables 1 and 3, "FSDP + torch.compile"; its Float8 rows planc cannot express): the
# plans above with the elementwise kernels fused (optimize { kernels = fused }).
TORCHTITAN_COMPILED = {"torchtitan-8b-fsdp8": (6667, 77.0), "torchtitan-8b-fsdp128": (6514, 62.0)}

# planc's own runs on one NVIDIA H200 (plans/planc-h200/, docs/performance.md): bench/
# gpu_step.py and bench/gpu_moe.py, (step s, peak MiB). The dense row on 2026-12-04 (the
# first H200 session); the mixtures from the last H200 session of 2026-12-04, after a
# rank's experts were quantised at once and their FP8 weight gradients ran as split bf16
# GEMMs (`PARTS="tests gpu_moe" bench/gpu.sh`; performance.md, "Mixtures of experts on
# one GPU"). The peak is planc run's peak_memory_mb there: torch.cuda.max_memory_allocated.
PLANC_H200 = {"llama-1b-fp32": (1.1946, 39386), "moe-bf16": (0.1078, 23983),
              "moe-fp8": (0.3347, 23125), "deepseek-bf16": (0.1374, 31813),
              "deepseek-fp8": (0.3900, 31684)}
CUDA_ALLOCATED = "torch.cuda.max_memory_allocated (tensors only: no cache, no context)"
