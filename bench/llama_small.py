"""Train plans/llama-small.plan for 50 steps on the project's tokenised corpus and plot
its loss (docs/llama-small-loss.png); also time a checkpoint round trip.

    .venv/bin/python bench/llama_small.py [--steps 50] [--plot docs/llama-small-loss.png]

Makes data/tiny-corpus.tokens first if it is missing (python -m planc.data.corpus).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.corpus import loss_axes, loss_bench_arguments  # noqa: E402 (the repository's root first)
PLANC = [os.path.join(os.path.dirname(sys.executable), "planc")]


def main() -> int:
    args = loss_bench_arguments(__doc__.splitlines()[0], 50, "llama-small-loss.png", ROOT)
    work = tempfile.mkdtemp(prefix="planc-llama-small-")
    metrics = os.path.join(work, "metrics.jsonl")
    checkpoints = os.path.join(work, "checkpoints")
    data = ["--set", 'train.data="../data/tiny-corpus.tokens"']
    subprocess.run(PLANC + ["run", "plans/llama-small.plan", "-o", os.path.join(work, "b"),
                            *data, "--set", f"train.steps={args.steps}", "--metrics", metrics,
                            "--checkpoint-dir", checkpoints], check=True)
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    print(f"loss: step 1 {losses[0]:.3f}, step {len(losses)} {losses[-1]:.3f} "
          f"(lowest {min(losses):.3f})")
    start = time.perf_counter()
    subprocess.run(PLANC + ["run", "plans/llama-small.plan", "-o", os.path.join(work, "c"),
                            *data, "--set", f"train.steps={args.steps + 1}", "--set", "mesh.tp=1",
                            "--set", "mesh.dp=2", "--set", "shard.tp.sequence_parallel=off",
                            "--set", "shard.dp.zero=3", "--resume", checkpoints], check=True)
    print(f"resume on dp 2 with ZeRO-3 and one more step: {time.perf_counter() - start:.1f} s"
          f" in all (the run's own lines above give the write, verify and load times)")
    drawn = loss_axes()
    if drawn is None:
        return 0
    figure, axes = drawn
    axes.plot(range(1, len(losses) + 1), losses, marker=".")
    axes.set_title("llama-small (19.2M parameters, tp 2 + SP) on the tiny corpus")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
