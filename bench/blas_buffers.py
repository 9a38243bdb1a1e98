"""Benchmark: what a CPU rank holds that no tensor of its plan does, part by part.

bench/memory_live.py counts the bytes a rank of ``planc run`` has allocated through glibc
(``mallinfo2``) and finds each tiny plan of plans/ holding tens of MiB more than its
tensors. This measures, each in a fresh process, the two parts that were guessed at:

- a matrix multiply on a thread that has run none before: the bytes in use while that
  thread lives, once with MKL's memory manager as torch's CPU build leaves it and once
  with ``MKL_DISABLE_FAST_MM=1`` (MKL then frees its buffers at the end of each call).
  MKL keeps a buffer for packing the GEMM's panels per thread that ran one;
- gloo: a process group of one rank and a second group, each after its first all-reduce.

    .venv/bin/python bench/blas_buffers.py [--shapes 64x64x64,512x64x256,2048x2048x2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_live import IN_USE, MIB, free_port  # noqa: E402

TORCH = IN_USE + r"""
import torch
torch.set_num_threads(1)
"""
GEMM = TORCH + r"""
m, k, n = map(int, sys.argv[1].split("x"))
a, b = torch.randn(m, k), torch.randn(k, n)
before, done, measured = in_use(), threading.Event(), []

def multiply():
    a @ b
    measured.append(in_use() - before)  # the product freed, the thread still alive
    done.wait()

thread = threading.Thread(target=multiply)
thread.start()
while not measured:
    time.sleep(0.01)
done.set()
thread.join()
print(json.dumps({"kept": measured[0], "after_exit": in_use() - before}))
"""
GLOO = TORCH + r"""
import os
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
before = in_use()
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
world = in_use() - before
group = dist.new_group([0])
dist.all_reduce(torch.ones(4), group=group)
print(json.dumps({"world": world, "group": in_use() - before - world}))
dist.destroy_process_group()
"""


def probe(code: str, argument: str, fast_mm: bool = True) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "MKL_DISABLE_FAST_MM"}
    if not fast_mm:
        env["MKL_DISABLE_FAST_MM"] = "1"  # MKL reads its presence, whatever the value
    done = subprocess.run([sys.executable, "-c", code, argument], capture_output=True,
                          text=True, env=env, timeout=300)
    if done.returncode:
        raise SystemExit(f"blas_buffers: the probe failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8x8x8,64x64x64,512x64x256,2048x2048x2048",
                        help="M x K x N of each product, comma-separated")
    args = parser.parse_args()
    print("| product (M x K x N, fp32) | kept by its thread | after the thread ended "
          "| kept, MKL_DISABLE_FAST_MM=1 |\n|---|---|---|---|")
    for shape in args.shapes.split(","):
        fast, plain = probe(GEMM, shape), probe(GEMM, shape, fast_mm=False)
        print(f"| {shape} | {fast['kept'] / MIB:.2f} MiB | {fast['after_exit'] / MIB:.2f} MiB "
              f"| {plain['kept'] / MIB:.2f} MiB |")
    gloo = probe(GLOO, str(free_port()))
    print(f"\ngloo: {gloo['world'] / 1024:.0f} KiB for the world's process group, "
          f"{gloo['group'] / 1024:.0f} KiB for one more group (one rank each, after an "
          f"all-reduce)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
