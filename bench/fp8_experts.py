"""Benchmark: a rank's routed experts in FP8 against bf16, forward and backward, alone.

The FP8 recipe's step on a GPU (bench/gpu_moe.py) is slower than bf16's; this times the
part that differs, one layer's routed experts (rows sorted by expert, the SwiGLU and its
three GEMMs, forward and backward) at bench/gpu_moe.py's ``moe`` widths, in bf16 (one
grouped GEMM each) and with ``fp8 = blockwise`` (planc.runtime.engine.fp8.experts_swiglu),
each as the median of CUDA-event timings after warm-up, and then profiles one FP8 pass
with torch.profiler: the kernels the GPU spent its time in, and how many were launched.

    python3 bench/fp8_experts.py                 # on a GPU
    python3 bench/fp8_experts.py --size tiny     # a CPU: that it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"gpu": dict(tokens=16384, hidden=2048, experts=32, ffn=768, top_k=8),
         "tiny": dict(tokens=256, hidden=256, experts=4, ffn=128, top_k=2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    import torch

    from planc.runtime.engine.fp8 import Recipe
    from planc.runtime.families.moe_dispatch import Experts, outputs_by_expert

    shape = SIZES[args.size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    rows_n = shape["tokens"] * shape["top_k"]
    choice = torch.randint(0, shape["experts"], (rows_n,), device=device, generator=generator)
    counts = torch.bincount(choice, minlength=shape["experts"]).tolist()
    h, f = shape["hidden"], shape["ffn"]

    def leaf(*dims, scale=0.02):
        return (torch.randn(*dims, device=device, generator=generator) * scale).to(
            torch.bfloat16).requires_grad_()

    rows, scales = leaf(rows_n, h, scale=1.0), leaf(rows_n, 1, scale=1.0)
    experts = Experts(leaf(shape["experts"], h, f), leaf(shape["experts"], h, f),
                      leaf(shape["experts"], f, h))
    grad = torch.randn(rows_n, h, device=device, generator=generator).to(torch.bfloat16)

    def once(recipe):
        out = outputs_by_expert(rows, scales, counts, experts, recipe)
        out.backward(grad)

    def timed(recipe) -> float:
        for _ in range(3):
            once(recipe)
        times = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                once(recipe)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                once(recipe)
                times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)

    flops = 3 * 2 * rows_n * h * f * 3  # three GEMMs, forward and two backward products
    print(f"{device}: {rows_n:,} rows over {shape['experts']} experts (hidden {h}, ffn {f}),"
          f" counts {min(counts)}-{max(counts)}", flush=True)
    for name, recipe in (("bf16", None), ("fp8", Recipe(128 if args.size == "gpu" else 16))):
        ms = timed(recipe)
        print(f"{name}: {ms:.2f} ms forward and backward, {flops / ms / 1e9:.1f} TFLOP/s",
              flush=True)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                          if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        once(Recipe(128 if args.size == "gpu" else 16))
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
