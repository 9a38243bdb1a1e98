"""Train plans/llama-small.plan in bf16 and with DeepSeek-V3's FP8 recipe
(``model { fp8 = blockwise }``, emulated) on several seeds, and compare their loss on
held-out text at the end: issue 40's bar is the FP8 loss within 1% of bf16's. Seed 0 also
trains with E5M2 output gradients (``fp8_gradients = e5m2``) and in fp32, the yardstick:
how far a run that differs from bf16 only in precision (more of it) ends from bf16's.
The curves of seed 0 are drawn (docs/fp8-loss.png).

    .venv/bin/python bench/fp8_loss.py [--steps 200] [--seeds 6] [--plot docs/fp8-loss.png]

Every run: dp 2 (tp would split k and v into shards of 32 features, less than the
128-feature tile), AdamW at lr 3e-3 held constant and then decayed linearly to 0 over
the last quarter of the steps (``lr_schedule = wsd(decay = steps / 4)``: DeepSeek-V3's
own schedule is constant and then decayed, report section 4.2; a loss read while the lr
is high swings by several % between runs that differ in anything), and the loss on 32
held-out batches every quarter of the steps (``eval_every``, ``eval_data``).

The corpus: 2,000,000 generated characters (python -m planc.data.corpus --chars
2000000, data/stories-2m.tokens, 527,708 tokens, made if missing), cut in two: the
first 440,000 tokens train (200 steps of 16 sequences of 129 tokens read 412,800 of
them, each once), the last 87,708 are held out (the 32 batches read 66,048).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.corpus import loss_axes, loss_bench_arguments, save_curves  # noqa: E402 (the repository's root first)
from planc.data.tokens import header, open_tokens  # noqa: E402
PLANC = [os.path.join(os.path.dirname(sys.executable), "planc")]
BF16, E4M3 = "bf16", "fp8 blockwise, E4M3 gradients (DeepSeek-V3)"
RECIPES = {BF16: [],
           E4M3: ["--set", "model.fp8=blockwise"],
           "fp8 blockwise, E5M2 gradients (TE's HYBRID)": [
               "--set", "model.fp8=blockwise", "--set", "model.fp8_gradients=e5m2"],
           "fp32 (more precision than bf16)": ["--set", "model.dtype=fp32"]}
CORPUS = "data/stories-2m.tokens"
TRAIN, HELD_OUT = "data/stories-2m-train.tokens", "data/stories-2m-heldout.tokens"
TRAIN_TOKENS = 440_000  # the rest of the corpus is held out
EVAL_BATCHES = 32


def split_corpus() -> None:
    """Make the corpus if missing, and its training and held-out files: each a token
    file's header (planc.data.tokens) and a run of the corpus's tokens."""
    if not os.path.exists(CORPUS):
        subprocess.run([sys.executable, "-m", "planc.data.corpus", "-o", CORPUS,
                        "--chars", "2000000"], check=True)
    descriptor, layout = open_tokens(CORPUS)
    with os.fdopen(descriptor, "rb") as source:
        source.seek(layout.offset)
        tokens = source.read()
    cut = TRAIN_TOKENS * layout.width
    for path, part in ((TRAIN, tokens[:cut]), (HELD_OUT, tokens[cut:])):
        temporary = path + ".partial"
        with open(temporary, "wb") as out:
            out.write(header(layout.width) + part)
        os.replace(temporary, path)


def train(work: str, extra: list[str], steps: int, seed: int) -> tuple[list, list]:
    """One run's training losses, a step each, and its held-out losses as (step, loss)."""
    metrics = os.path.join(work, f"{len(os.listdir(work))}.jsonl")
    quarter = max(1, steps // 4)
    subprocess.run(PLANC + ["run", "plans/llama-small.plan", "-o", os.path.join(work, "b"),
                            "--force", "--set", f'train.data="../{TRAIN}"',
                            "--set", f'train.eval_data="../{HELD_OUT}"',
                            "--set", f"train.eval_every={quarter}",
                            "--set", f"train.eval_batches={EVAL_BATCHES}",
                            "--set", f"train.lr_schedule=wsd(decay={quarter})",
                            "--set", f"train.steps={steps}", "--set", f"train.seed={seed}",
                            "--set", "model.dtype=bf16",
                            "--set", "mesh.tp=1", "--set", "mesh.dp=2",
                            "--set", "shard.tp.sequence_parallel=off",
                            "--metrics", metrics, *extra], check=True)
    lines = [json.loads(line) for line in open(metrics)]
    return ([line["loss"] for line in lines],
            [(line["step"] + 1, line["eval_loss"]) for line in lines if "eval_loss" in line])


def compare_seeds(ends: dict[str, list[float]]) -> None:
    """bf16's and E4M3's held-out losses at the end, seed by seed: each seed's gap, and
    their mean with its standard error (the runs of one seed share the initial weights
    and the data, so the gaps are paired)."""
    base, fp8 = ends[BF16], ends[E4M3]
    print(f"the held-out loss at the end, seeds 0 .. {len(base) - 1}: {BF16} "
          + ", ".join(f"{x:.4f}" for x in base) + f"; {E4M3} "
          + ", ".join(f"{x:.4f}" for x in fp8))
    gaps = [100 * (y - x) / x for x, y in zip(base, fp8)]
    print("each seed's gap: " + ", ".join(f"{gap:+.2f}%" for gap in gaps))
    spread = 100 * (max(base) - min(base)) / statistics.mean(base)
    if len(gaps) > 1:
        error = statistics.stdev(gaps) / len(gaps) ** 0.5
        print(f"the mean gap: {statistics.mean(gaps):+.2f}%, its standard error "
              f"{error:.2f} points; bf16's seeds lie {spread:.2f}% apart")


def main() -> int:
    args = loss_bench_arguments(__doc__.splitlines()[0], 200, "fp8-loss.png", ROOT,
                                options={"--seeds": (int, 6, "bf16 and E4M3 on seeds "
                                                     "0 .. N-1")})
    split_corpus()
    work = tempfile.mkdtemp(prefix="planc-fp8-")
    curves = {name: train(work, extra, args.steps, 0) for name, extra in RECIPES.items()}
    ends = {name: [curves[name][1][-1][1]] for name in (BF16, E4M3)}
    for seed in range(1, args.seeds):
        for name in ends:
            ends[name].append(train(work, RECIPES[name], args.steps, seed)[1][-1][1])

    base = curves[BF16][1]
    print(f"seed 0, the held-out loss at steps {', '.join(str(s) for s, _ in base)}:")
    for name, (_, held) in curves.items():
        print(f"  {name}: " + ", ".join(f"{loss:.4f}" for _, loss in held) + "; "
              + ", ".join(f"{100 * (loss - b) / b:+.2f}%" for (_, loss), (_, b)
                          in zip(held, base)) + " against bf16")
    compare_seeds(ends)
    plot(curves, args.steps, args.plot)
    return 0


def plot(curves: dict[str, tuple[list, list]], steps: int, path: str) -> None:
    """Seed 0's training losses, a line a recipe, and its held-out losses as dots."""
    drawn = loss_axes()
    if drawn is None:
        return
    figure, axes = drawn
    for name, (losses, held) in curves.items():
        line, = axes.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
        axes.plot([s for s, _ in held], [loss for _, loss in held], "o",
                  color=line.get_color(), markersize=3)
    axes.set_yscale("log")
    end = {name: held[-1][1] for name, (_, held) in curves.items()}
    save_curves(figure, axes, f"llama-small, {steps} steps, seed 0; the held-out loss (dots)"
                f"\nat the end against bf16's: " + ", ".join(
                    f"{100 * (loss - end[BF16]) / end[BF16]:+.1f}%"
                    for name, loss in end.items() if name != BF16), path)

if __name__ == "__main__":
    sys.exit(main())
