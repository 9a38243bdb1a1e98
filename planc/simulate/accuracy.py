"""How far ``planc simulate`` is from published runs: the error it states beside a step.

The figures are bench/validation.py's, over the published runs of docs/simulate.md's
tables, each run with the layout its source states (Korthikanti et al. 2022, Table 5;
the Megatron-LM README's H100 weak scaling; Narayanan et al. 2021, Table 1, with the
paper's run scripts; Llama 3 405B; BLOOM-176B and BigScience's layout search; MT-NLG
530B; torchtitan's H100 Llama 3 runs; the mixtures of experts of plans/moe-published/).
They hold for the GPUs those runs used (the dgx-a100 and dgx-h100 presets); on a
topology ``planc calibrate`` measured, the closed loop of bench/simulate_here.py (plans
trained here against their prediction) gives the figure; on any other device the
simulator has not been held to runs, and says so. Re-run bench/validation.py after a
change to the cost model and update them (tests/test_simulate.py checks them against the
tables).
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.estimate.gpus import GPUS
from planc.models import family_of
from planc.plan.plan import Plan
from planc.vocabulary.model_options import fp8_tile

VALIDATED_PRESETS = ("dgx-a100", "dgx-h100")


@dataclass(frozen=True)
class Accuracy:
    runs: int  # published runs compared
    median: float  # median absolute relative error of the step time
    largest: float
    what: str  # the runs, in words

    def tells_apart(self, ratio: float) -> bool:
        """Whether a simulated speed-up ``ratio`` (slower step over faster) is larger than
        the error to expect of either step: the median error, the typical one."""
        return ratio - 1 > self.median

    def text(self) -> str:
        if self.runs == 1:
            return f"± {self.median:.1%} (the error of the one {self.what})"
        return (f"± {self.median:.1%} (the median error over {self.runs} {self.what}; the "
                f"largest {self.largest:.0%})")


# bench/simulate_here.py on this project's 2-core machine, 2026-11-29 (quiet; after
# calibrate measured each operator's instructions and a pair's collectives reached from
# compute, docs/simulate.md "On this machine"): 7 plans of plans/ trained with gloo on a
# topology planc calibrate measured, step against simulate.
CALIBRATED = Accuracy(7, 0.18, 0.35,
                      "runs of plans/ trained on a calibrated 2-core CPU machine")
# bench/validation.py --json, 2026-12-02 ("all_dense" and the moe table's "shipped"; the
# dense figure after the Megatron-LM and Llama 3 plans gathered their GEMM inputs again in
# the backward, shard { tp { gathered_inputs = regather } }, and 2026-12-03 once those
# gathers started a step early under tp_overlap too, the whole bench rerun): 45
# dense runs of 7 tables. The moe table's 8
# runs, 2026-11-30, once optimize { moe_dispatcher = two_hop } wrote DeepEP's dispatch
# (6 of them had been refused before) and the experts' weight gradients were priced once
# (bench/validation.py --only moe); its DeepSeek-V3 rows with multi-head latent
# attention (model deepseek) since, the AutoModel rows with the full recomputation
# their benchmark configs set, two_hop forwarding a token once per rank, as DeepEP, and
# the Qwen3 rows with their q/k norms (qk_norm); 2026-12-03, the two Qwen3 rows that
# recomputed their experts' activation with it (optimize { recompute_moe_activation });
# 2026-12-04, the dense figure once torchtitan's FSDP rows made their norms' outputs
# again (optimize { recompute_norms }), as their per-op checkpointing does; the moe
# table's once NeMo AutoModel's three plans routed as their benchmark's gate does
# (model { routing = consecutive }) and reduced as their FSDP2 under pipelining does
# (zero = 1), and the ModelZoo's ep 32 rows (one added, with its all-to-all overlap)
# forced to balance, as its run script ran them. 2026-12-04, later: the dense figure over
# 77 runs, once the 30 readings of BigScience's layout search (2022-02-25 and 02-28) that
# the bloom table leaves out were held against the model (table bloom_search, every one
# too fast, median 13.5 %), BLOOM-176B's plans reduced in bf16, as DeepSpeed's engine casts
# BF16_Optimizer's fp32 gradients before its all-reduce, and torchtitan's two FSDP rows
# with torch.compile joined its table (45 runs, 7.6 %, before). 2026-12-05: 78 runs, once
# bloom_search held 02-25's one 177B reading (10.6 % over 77 before).
DENSE = Accuracy(78, 0.105, 0.455, "published runs of dense models")
MIXTURES = Accuracy(9, 0.136, 0.294, "published runs of mixtures of experts")
# No published run trains in fp32; the one fp32 run held to the simulator is planc's own
# llama of 1.1B on one H200 (bench/validation.py --only planc_h200). With fp32 attention
# at the rates a micro-benchmark measured on the H100's compute (planc/estimate/gpus.py)
# it came within 0.5 % (2026-12-04), which one dense run on one GPU cannot promise of
# other fp32 plans: they are stated the dense published runs' error, the run named. On a
# GPU whose fp32 attention is its bf16 rates scaled down to the FP32 peak (the A100), that
# run's error with the same scaling: +16.7 % (2026-12-01).
FP32_MEASURED = Accuracy(DENSE.runs, DENSE.median, DENSE.largest,
                         "published runs of dense models, in 16 bits; planc's own fp32 run "
                         "on one H200 came within 0.5 %")
FP32_SCALED = Accuracy(1, 0.167, 0.167, "fp32 run it was held to with its attention priced "
                       "as this GPU's is, at the bf16 rates scaled down: planc's own on one "
                       "H200; no published run is fp32")

# model { fp8 }: the simulator prices DeepSeek-V3's FP8 kernels, the quantisation fused
# into them, at the FP8 peak. One published run trains in FP8, DeepSeek-V3 on 2,048
# H800s (plans/moe-published/deepseek-v3-h800.plan): its step +13.2 % (bench/validation.py
# --only moe, 2026-12-04). planc run's own FP8 steps quantise in separate PyTorch
# operations: on one H200 they took 7.2 and 6.7 times the predicted step (moe-fp8 and
# deepseek-fp8, bench/validation.py --only planc_h200, 2026-12-04), which the statement
# names rather than averages in: it is planc's runtime against fused kernels, not the
# model against the hardware.
FP8 = Accuracy(1, 0.132, 0.132, "published FP8 run, DeepSeek-V3 on 2,048 H800s with its "
               "quantisation fused into its kernels; planc run's own FP8 steps, which "
               "quantise apart, took 6.7 and 7.2 times the predicted step on one H200")


def expected(plan: Plan) -> Accuracy | None:
    """The error to expect of a simulation of ``plan``; None where no published run
    of its device was compared."""
    preset = plan.topology.preset or ""
    if preset.endswith(".json"):  # a topology planc calibrate measured
        return CALIBRATED
    if preset not in VALIDATED_PRESETS:
        return None
    if fp8_tile(plan.model) is not None:
        return FP8
    if plan.model.dtype == "fp32":
        gpu = GPUS.get(preset)
        return FP32_MEASURED if gpu is not None and gpu.attention_fp32 else FP32_SCALED
    return MIXTURES if family_of(plan).has_mixture else DENSE
