"""Benchmark: what ``torch.compile`` would save on the elementwise kernels of a llama step.

Issue 37 asks for an optional ``optimize { compile = on }``, off by default until
measured. This measures the candidates on their own, forward and backward (autograd),
each as planc runs it and as inductor compiles the same formula (one fused C++ loop per
pass; it needs a C++ compiler):

- RMSNorm (planc.runtime.families.llama.rms_normed), 2,048 tokens x 256;
- SwiGLU: planc's ``SwiGLU`` against the compiled ``silu(gate) * up``, 2,048 x 2 x 704;
- the rotary embedding of q and k: planc's ``RotateQK`` against the compiled rotate-half
  formula, 2,048 tokens x (8 + 4 + 4) heads of 32;
- GELU (tanh) with the row-parallel bias added first (planc.runtime.families.gpt), 2,048 x
  1,024.

The shapes are bench/gpu_step.py's small llama (and bench/peers.py's gpt for GELU). For
each kernel, the median of 30 forward-and-backward calls after a warm-up, the rounds
rotating which side runs first; the compile time (first calls) is printed apart.

    .venv/bin/python bench/compile_kernels.py [--rounds 3] [--threads N]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rounds import check_rounds, rounds_and_threads  # noqa: E402

CALLS = 30


def kernels():
    """name -> (planc's function, the formula to compile, input shapes, output shape):
    llama's formulas are the family's ``FORMULAS``, what ``compile = on`` compiles."""
    import torch
    import torch.nn.functional as F

    from planc.runtime.families.llama import FORMULAS, RotateQK, SwiGLU, rotary_tables

    heads, kv, hd, b, s = 8, 4, 32, 16, 128
    cos, sin = rotary_tables(torch.arange(s), hd, 10000.0, torch.float32)
    eps, width = 1e-5, (heads + kv) * hd  # the llama presets' eps; the rotated features

    def rms(x, w):
        return FORMULAS["rms_norm"](x, w, eps)

    def rope(out):
        return FORMULAS["rotate_qk"](out, cos, sin, width, hd)

    def gelu(x, bias):  # the gpt family's GELU with a row-parallel producer's bias
        return F.gelu(x + bias, approximate="tanh")

    features = (heads + 2 * kv) * hd
    return {
        "RMSNorm": (rms, rms, [(b, s, 256), (256,)], (b, s, 256)),
        "SwiGLU": (SwiGLU.apply, FORMULAS["swiglu"], [(b, s, 2 * 704)], (b, s, 704)),
        "rotary q/k": (lambda out: RotateQK.apply(out, cos, sin, width, hd),
                       rope, [(b, s, features)], (b, s, features)),
        "GELU + bias": (gelu, gelu, [(b, s, 1024), (1024,)], (b, s, 1024)),
    }


def timed(function, shapes, out_shape) -> float:
    """Milliseconds of a forward and backward, the median of CALLS after one warm-up."""
    import torch

    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(shape, generator=generator).requires_grad_(True)
              for shape in shapes]
    grad = torch.randn(out_shape, generator=generator)

    def once():
        torch.autograd.grad(function(*leaves), leaves, grad)
    once()
    seen = []
    for _ in range(CALLS):
        start = time.perf_counter()
        once()
        seen.append(time.perf_counter() - start)
    return statistics.median(seen) * 1e3


def main() -> int:
    parser = rounds_and_threads(__doc__.split("\n")[0])
    args = parser.parse_args()
    check_rounds(parser, args)
    import torch

    torch.set_num_threads(args.threads)
    table = kernels()
    compiled, compile_s = {}, {}
    for name, (_, formula, shapes, out_shape) in table.items():
        compiled[name] = torch.compile(formula, dynamic=False)
        start = time.perf_counter()
        timed(compiled[name], shapes, out_shape)  # compiles forward and backward
        compile_s[name] = time.perf_counter() - start
    seen = {(name, side): [] for name in table for side in ("planc", "compiled")}
    for round_ in range(args.rounds):
        for name, (planc_fn, _, shapes, out_shape) in table.items():
            sides = [("planc", planc_fn), ("compiled", compiled[name])]
            for side, function in sides[round_ % 2:] + sides[:round_ % 2]:
                seen[(name, side)].append(timed(function, shapes, out_shape))
    print(f"forward and backward, {args.threads} intra-op threads, median of {CALLS} "
          f"calls, {args.rounds} rounds\n")
    print("| kernel | planc ms | compiled ms | compiled / planc | first compile s |")
    print("|---|---|---|---|---|")
    for name in table:
        mine = statistics.median(seen[(name, "planc")])
        theirs = statistics.median(seen[(name, "compiled")])
        print(f"| {name} | {mine:.2f} | {theirs:.2f} | {theirs / mine:.2f} | "
              f"{compile_s[name]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
