"""Train plans/llama-small.plan in bf16, with DeepSeek-V3's FP8 recipe
(``model { fp8 = blockwise }``, emulated) and with it and E5M2 output gradients
(``fp8_gradients = e5m2``) on the project's corpus, and plot the losses
(docs/fp8-loss.png): issue 40's bar is the FP8 loss within 1% of bf16's.

    .venv/bin/python bench/fp8_loss.py [--steps 200] [--plot docs/fp8-loss.png]

Both runs on dp 2 (tp would split k and v into shards of 32 features, less than the
128-feature tile), the same seed, data and schedule. Makes data/tiny-corpus.tokens first
if it is missing (python -m planc.data.corpus).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.corpus import loss_axes, loss_bench_arguments, save_curves  # noqa: E402 (the repository's root first)
PLANC = [os.path.join(os.path.dirname(sys.executable), "planc")]
RECIPES = {"bf16": [],
           "fp8 blockwise, E4M3 gradients (DeepSeek-V3)": ["--set", "model.fp8=blockwise"],
           "fp8 blockwise, E5M2 gradients (TE's HYBRID)": [
               "--set", "model.fp8=blockwise", "--set", "model.fp8_gradients=e5m2"]}


def train(work: str, name: str, extra: list[str], steps: int) -> list[float]:
    metrics = os.path.join(work, f"{len(os.listdir(work))}.jsonl")
    subprocess.run(PLANC + ["run", "plans/llama-small.plan", "-o", os.path.join(work, "b"),
                            "--force", "--set", 'train.data="../data/tiny-corpus.tokens"',
                            "--set", f"train.steps={steps}", "--set", "model.dtype=bf16",
                            "--set", "mesh.tp=1", "--set", "mesh.dp=2",
                            "--set", "shard.tp.sequence_parallel=off",
                            "--metrics", metrics, *extra], check=True)
    return [json.loads(line)["loss"] for line in open(metrics)]


def main() -> int:
    args = loss_bench_arguments(__doc__.splitlines()[0], 200, "fp8-loss.png", ROOT)
    work = tempfile.mkdtemp(prefix="planc-fp8-")
    losses = {name: train(work, name, extra, args.steps) for name, extra in RECIPES.items()}
    (base, base_losses), *others = losses.items()
    window = max(1, args.steps // 10)  # the last tenth: the loss as training ends

    def tail(values):
        return sum(values[-window:]) / window

    print(f"{base}: step 1 {base_losses[0]:.4f}, mean of the last {window} steps "
          f"{tail(base_losses):.4f}")
    gaps = {}
    for name, values in others:
        gaps[name] = (tail(values) - tail(base_losses)) / tail(base_losses)
        worst = max(abs(a - b) / b for a, b in zip(values[window:], base_losses[window:]))
        print(f"{name}: step 1 {values[0]:.4f}, mean of the last {window} steps "
              f"{tail(values):.4f}, {100 * gaps[name]:+.2f}% against bf16; the largest gap "
              f"of one step after step {window}: {100 * worst:.2f}%")
    drawn = loss_axes()
    if drawn is None:
        return 0
    figure, axes = drawn
    for name, values in losses.items():
        axes.plot(range(1, len(values) + 1), values, label=name, linewidth=1)
    save_curves(figure, axes, f"llama-small, {args.steps} steps: FP8 GEMMs against bf16 (the "
                f"last {window} steps: " + ", ".join(f"{100 * g:+.1f}%" for g in gaps.values())
                + ")", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
