"""Train plans/llama-small.plan in bf16, with DeepSeek-V3's FP8 recipe
(``model { fp8 = blockwise }``, emulated), with it and E5M2 output gradients
(``fp8_gradients = e5m2``), and in fp32, and plot the losses (docs/fp8-loss.png): issue
40's bar is the FP8 loss within 1% of bf16's. fp32 is the yardstick: how far a run that
differs from bf16 only in precision (more of it) ends from bf16's.

    .venv/bin/python bench/fp8_loss.py [--steps 200] [--tiny] [--plot docs/fp8-loss.png]

On a corpus of 2,000,000 generated characters (python -m planc.data.corpus --chars
2000000, data/stories-2m.tokens, made if missing: 528K tokens, which 200 steps of 16
sequences of 129 tokens read 0.78 times), so that the loss measures learning rather than
memorisation; ``--tiny``: the project's 53K-token corpus, which 200 steps read 8 times.
Every run on dp 2 (tp would split k and v into shards of 32 features, less than the
128-feature tile), the same seed, data and schedule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.corpus import TOKENS, loss_axes, loss_bench_arguments, save_curves  # noqa: E402 (the repository's root first)
PLANC = [os.path.join(os.path.dirname(sys.executable), "planc")]
RECIPES = {"bf16": [],
           "fp8 blockwise, E4M3 gradients (DeepSeek-V3)": ["--set", "model.fp8=blockwise"],
           "fp8 blockwise, E5M2 gradients (TE's HYBRID)": [
               "--set", "model.fp8=blockwise", "--set", "model.fp8_gradients=e5m2"],
           "fp32 (more precision than bf16)": ["--set", "model.dtype=fp32"]}
LARGE = "data/stories-2m.tokens"
E4M3 = "fp8 blockwise, E4M3 gradients (DeepSeek-V3)"


def compare_seeds(work: str, args, corpus: str, tail, seed0: dict[str, float]) -> None:
    """bf16's and E4M3's end losses on seeds 0 .. N-1: each seed's gap, and the means'
    with their standard error."""
    import statistics

    ends = {name: [end] for name, end in seed0.items()}
    for seed in range(1, args.seeds):
        for name in ends:
            ends[name].append(tail(train(work, name, RECIPES[name] + [
                "--set", f"train.seed={seed}"], args.steps, corpus)))
    (base, b), (name, f) = ends.items()
    print(f"{args.seeds} seeds, the mean of the last steps: {base} "
          + ", ".join(f"{x:.4f}" for x in b) + f"; {name} " + ", ".join(f"{x:.4f}" for x in f))
    print("each seed's gap: " + ", ".join(f"{100 * (y - x) / x:+.2f}%" for x, y in zip(b, f)))
    error = (statistics.variance(b) / len(b) + statistics.variance(f) / len(f)) ** 0.5
    mean = statistics.mean(b)
    print(f"the means' gap: {100 * (statistics.mean(f) - mean) / mean:+.2f}%, its standard "
          f"error {100 * error / mean:.2f} points")


def ensure_large_corpus() -> None:
    if not os.path.exists(LARGE):
        subprocess.run([sys.executable, "-m", "planc.data.corpus", "-o", LARGE,
                        "--chars", "2000000"], check=True)


def train(work: str, name: str, extra: list[str], steps: int, corpus: str) -> list[float]:
    metrics = os.path.join(work, f"{len(os.listdir(work))}.jsonl")
    subprocess.run(PLANC + ["run", "plans/llama-small.plan", "-o", os.path.join(work, "b"),
                            "--force", "--set", f'train.data="../{corpus}"',
                            "--set", f"train.steps={steps}", "--set", "model.dtype=bf16",
                            "--set", "mesh.tp=1", "--set", "mesh.dp=2",
                            "--set", "shard.tp.sequence_parallel=off",
                            "--metrics", metrics, *extra], check=True)
    return [json.loads(line)["loss"] for line in open(metrics)]


def main() -> int:
    args = loss_bench_arguments(__doc__.splitlines()[0], 200, "fp8-loss.png", ROOT,
                                flags={"--tiny": "the 53K-token corpus, read 8 times"},
                                options={"--seeds": (int, 1, "bf16 and E4M3 also on seeds "
                                                     "1 .. N-1: one run's end loss swings "
                                                     "by several % with any change")})
    corpus = TOKENS if args.tiny else LARGE
    if not args.tiny:
        ensure_large_corpus()
    work = tempfile.mkdtemp(prefix="planc-fp8-")
    losses = {name: train(work, name, extra, args.steps, corpus)
              for name, extra in RECIPES.items()}
    (base, base_losses), *others = losses.items()
    window = max(1, args.steps // 10)  # the last tenth: the loss as training ends

    def tail(values):
        return sum(values[-window:]) / window

    if args.seeds > 1:
        compare_seeds(work, args, corpus, tail, {
            base: tail(base_losses), E4M3: tail(losses[E4M3])})

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
    save_curves(figure, axes, f"llama-small, {args.steps} steps, "
                f"{'tiny corpus' if args.tiny else '2M characters'}; last {window} steps "
                f"against bf16: " + ", ".join(f"{100 * g:+.1f}%" for g in gaps.values()),
                args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
