"""Benchmark, on a GPU: what the GEMMs and attention of the validation plans achieve, to
check planc simulate's kernel model (planc/estimate/kernel_cost.py) against a real device.

For every plan of the Megatron-LM H100 table and Llama 3 405B (the shapes one
tensor-parallel rank multiplies for one microbatch: forward, input gradient, weight
gradient) it times ``torch.matmul`` in bf16, and causal FlashAttention (PyTorch's SDPA
flash backend) forward and forward+backward at head dim 128. Prints one JSON object per
line: shape, seconds (median of timed runs after warm-up), TFLOP/s.

``--fp32`` measures instead what an fp32 plan runs (planc run keeps PyTorch's default of
no TF32): square fp32 GEMMs, and causal SDPA in fp32 (its memory-efficient backend:
FlashAttention takes no fp32) at the head widths of bench/gpu_step.py's llama and of
the 2,048-wide plans: the simulator's fp32 rates (the datasheet's FP32 peak for the
GEMMs; planc/estimate/gpus.py's ``attention_fp32``, which its H200 run of 2026-12-04
set) against a device. ``both`` is a forward and a backward, 3.5 forwards' FLOPs.

``--fp8`` times planc's FP8 GEMMs (``model { fp8 = blockwise }``, DeepSeek-V3's 1 x 128
and 128 x 128 scales) at a mixture's shapes against the same product in bf16: the product
alone, tile by tile (planc.runtime.engine.fp8.tiled_product) and in one block-scaled call
where the device has it (blockwise_product), and the whole GEMM as a forward runs it, the
quantisation of the rows and the weight included (scaled_product's choice).

    python3 bench/kernels_gpu.py > kernels.jsonl     (on a machine with a CUDA GPU)
    python3 bench/kernels_gpu.py --fp32 > kernels-fp32.jsonl
    python3 bench/kernels_gpu.py --fp8 > kernels-fp8.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

# name: (tokens per microbatch, hidden, heads, kv heads, ffn, gated ffn, tp)
MODELS = {
    "megatron-h100-1_7b": (4096, 2048, 16, 16, 8192, False, 1),
    "megatron-h100-7_1b": (4096, 4096, 32, 32, 16384, False, 2),
    "megatron-h100-16b": (4096, 6144, 48, 48, 24576, False, 4),
    "megatron-h100-32b": (4096, 7168, 56, 56, 28672, False, 8),
    "megatron-h100-70b": (4096, 8192, 64, 64, 32768, False, 8),
    "megatron-h100-119b": (4096, 10240, 80, 80, 40960, False, 8),
    "megatron-h100-177b": (4096, 12288, 96, 96, 49152, False, 8),
    "megatron-h100-314b": (4096, 16384, 128, 128, 65536, False, 8),
    "megatron-h100-462b": (4096, 18432, 144, 144, 73728, False, 8),
    "llama3-405b": (8192, 16384, 128, 8, 53248, True, 8),
}


def timed(fn, repeat: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm(m: int, n: int, k: int, dtype=torch.bfloat16) -> float:
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    return timed(lambda: torch.matmul(a, b))


def attention(tokens: int, heads: int, head_dim: int = 128, dtype=torch.bfloat16,
              batch: int = 1) -> tuple[float, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, device="cuda", dtype=dtype,
                           requires_grad=True) for _ in range(3))
    backend = SDPBackend.FLASH_ATTENTION if dtype != torch.float32 else \
        SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel(backend):
        forward = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True))

        def both():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
        return forward, timed(both)


def fp32() -> int:
    """What an fp32 plan's kernels reach, TF32 off as planc run leaves it."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for size in (2048, 4096, 8192):
        seconds = gemm(size, size, size, torch.float32)
        print(json.dumps({"op": "square", "dtype": "fp32", "mnk": (size, size, size),
                          "seconds": seconds, "tflops": 2 * size ** 3 / seconds / 1e12}),
              flush=True)
    # bench/gpu_step.py's 1b llama (batch 4, 32 heads of 64) and a head width of 128
    for batch, tokens, heads, head_dim in ((4, 2048, 32, 64), (1, 4096, 16, 128)):
        forward, both = attention(tokens, heads, head_dim, torch.float32, batch)
        flops = 4 * tokens * tokens * head_dim * heads * batch / 2
        print(json.dumps({"op": "attention", "dtype": "fp32", "batch": batch,
                          "tokens": tokens, "heads": heads, "head_dim": head_dim,
                          "forward_seconds": forward, "forward_tflops": flops / forward / 1e12,
                          "both_seconds": both, "both_tflops": 3.5 * flops / both / 1e12}),
              flush=True)
    return 0


def fp8() -> int:
    """planc's FP8 GEMMs against bf16's (module docstring), at bench/gpu_moe.py's widths:
    16,384 tokens (a batch of 8 x 2,048) through hidden 2,048 to an expert's 1,408 and
    back, and a dense ffn of 10,944."""
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from planc.runtime.engine import fp8 as kernels

    device = torch.device("cuda", 0)
    output = kernels.blockwise_kernel(device, 128)
    print(json.dumps({"blockwise_products": str(output)}), flush=True)
    for m, n, k in ((16384, 1408, 2048), (16384, 2048, 1408), (16384, 10944, 2048),
                    (16384, 2048, 10944)):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        rows, blocks = kernels.encoded_rows(x, 128), kernels.encoded_blocks(w, 128)
        flops = 2 * m * n * k
        times = {"bf16": timed(lambda: x @ w),
                 "tiles": timed(lambda: kernels.tiled_product(*rows, *blocks)),
                 "whole": timed(lambda: kernels.scaled_product(
                     *kernels.encoded_rows(x, 128), *kernels.encoded_blocks(w, 128)))}
        if output is not None:
            times["blockwise"] = timed(lambda: kernels.blockwise_product(*rows, *blocks,
                                                                         output))
        print(json.dumps({"op": "fp8", "mnk": (m, n, k), **{
            f"{name}_tflops": flops / seconds / 1e12 for name, seconds in times.items()}}),
            flush=True)
        torch.cuda.empty_cache()
    return 0


def main() -> int:
    print(json.dumps({"device": torch.cuda.get_device_name(),
                      "sms": torch.cuda.get_device_properties(0).multi_processor_count}))
    if sys.argv[1:] == ["--fp32"]:
        return fp32()
    if sys.argv[1:] == ["--fp8"]:
        return fp8()
    if sys.argv[1:]:
        print(f"usage: {sys.argv[0]} [--fp32 | --fp8]", file=sys.stderr)
        return 2
    seen = set()
    for name, (tokens, h, heads, kv, ffn, gated, tp) in MODELS.items():
        head_dim = h // heads
        qkv = (heads + 2 * kv) * head_dim // tp
        up = (2 if gated else 1) * ffn // tp
        for op, n, k in (("qkv", qkv, h), ("proj", h, h // tp), ("fc1", up, h),
                         ("fc2", h, ffn // tp)):
            for step, shape in (("forward", (tokens, n, k)), ("input_grad", (tokens, k, n)),
                                ("weight_grad", (k, n, tokens))):
                if shape in seen:
                    continue
                seen.add(shape)
                seconds = gemm(*shape)
                print(json.dumps({"plan": name, "op": op, "step": step, "mnk": shape,
                                  "seconds": seconds,
                                  "tflops": 2 * shape[0] * shape[1] * shape[2] / seconds / 1e12}),
                      flush=True)
        local = heads // tp
        forward, both = attention(tokens, local, head_dim)
        # causal: half of 4 s^2 d heads (forward), FlashAttention's own convention
        flops = 4 * tokens * tokens * head_dim * local / 2
        print(json.dumps({"plan": name, "op": "attention", "tokens": tokens, "heads": local,
                          "forward_seconds": forward, "forward_tflops": flops / forward / 1e12,
                          "both_seconds": both, "both_tflops": 3.5 * flops / both / 1e12}),
              flush=True)
        torch.cuda.empty_cache()
    for size in (1024, 2048, 4096, 8192, 16384):
        seconds = gemm(size, size, size)
        print(json.dumps({"op": "square", "mnk": (size, size, size), "seconds": seconds,
                          "tflops": 2 * size ** 3 / seconds / 1e12}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
