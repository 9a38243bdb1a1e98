#!/bin/bash
# Everything planc checks and measures on one GPU (about 10 minutes on an H200, more than
# one command of a 10-minute limit: take it in two with PARTS, below): the tests that need
# CUDA, bench/gpu_step.py (issue 37's one-GPU table), bench/gpu_moe.py (issue 40's MoE
# plans of one GPU), bench/fp8_experts.py (one layer's routed experts in FP8 against
# bf16, and the profile of an FP8 pass), bench/kernels_gpu.py --fp8 (planc's FP8 GEMMs)
# and --fp32 (the fp32 rates of the simulator). Each part has its own time limit
# (seconds: TESTS_S, STEP_S, MOE_S, EXPERTS_S, KERNELS_FP8_S, KERNELS_S), so that one
# part that runs long leaves the others their time; every line also goes to
# OUT/log.txt, and the tables to OUT/*.json(l).
# STEP_COMPILE_S (seconds, default 0: skipped) adds bench/gpu_step.py with planc's plan
# under optimize { compile = on } (torch.compile of the llama's elementwise formulas).
# PARTS (default: all of tests gpu_step gpu_moe fp8_experts kernels_fp8 kernels_fp32)
# runs those named alone, so that a lease too short for all of them can take them in two
# commands.
#
#   bench/gpu.sh [OUT]          OUT: where the log and the JSON go (default gpu-results)
#   PYTHON=.venv/bin/python bench/gpu.sh
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
part() { echo "=== $(date +%T) $*"; }
known="tests gpu_step gpu_moe fp8_experts kernels_fp8 kernels_fp32"
parts=" ${PARTS:-$known} "
for name in $parts; do  # a misspelt part would spend a GPU lease on nothing
    [[ " $known " == *" $name "* ]] ||
        { echo "bench/gpu.sh: no part '$name' (parts: $known)" >&2; exit 2; }
done
wanted() { [[ "$parts" == *" $1 "* ]]; }
{
    part machine
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
    wanted tests && part tests && \
    timeout "${TESTS_S:-90}" "$python" -m pytest -q -p no:cacheprovider -rs tests/test_fp8.py \
        tests/test_run_metrics.py tests/test_runtime_data_and_failures.py tests/test_moe.py \
        tests/test_llama.py tests/test_loss_kernel.py \
        -k "gpu or tensor_core or cuda or nccl or hopper"
    wanted gpu_step && part gpu_step && \
    timeout "${STEP_S:-330}" "$python" bench/gpu_step.py --steps 6 --rounds 3 \
        --json "$out/gpu_step.json"
    # planc with optimize { compile = on }
    if wanted gpu_step && [ "${STEP_COMPILE_S:-0}" -gt 0 ]; then
        part gpu_step_compile
        timeout "$STEP_COMPILE_S" "$python" bench/gpu_step.py --steps 6 --rounds 3 \
            --compile-kernels --json "$out/gpu_step_compile.json"
    fi
    wanted gpu_moe && part gpu_moe && \
    timeout "${MOE_S:-170}" "$python" bench/gpu_moe.py --steps 6 --json "$out/gpu_moe.json"
    wanted fp8_experts && part fp8_experts && \
    timeout "${EXPERTS_S:-60}" "$python" bench/fp8_experts.py > "$out/fp8_experts.txt"
    wanted kernels_fp8 && part kernels_fp8 && \
    timeout "${KERNELS_FP8_S:-60}" "$python" bench/kernels_gpu.py --fp8 > "$out/kernels_fp8.jsonl"
    # the fp32 rates planc simulate assumes (docs/simulate.md)
    wanted kernels_fp32 && part kernels_fp32 && \
    timeout "${KERNELS_S:-60}" "$python" bench/kernels_gpu.py --fp32 > "$out/kernels_fp32.jsonl"
    part done
} 2>&1 | tee "$out/log.txt"
