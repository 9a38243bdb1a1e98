"""Benchmark: planc's evaluation (``train { eval_every }``) against the same forwards in
plain PyTorch.

bench/peers.py's gpt (4 layers, hidden 256, 8 heads, vocabulary 2,048, sequence 128,
batch 16) on one rank, two ways, interleaved in rounds that alternate which side goes
first:

- ``planc``: ``planc run`` of a 1-rank plan that evaluates ``--batches`` batches after
  every step; its figure is the median of the records' ``eval_s`` after the warm-up
  steps (the evaluation alone, outside the step);
- ``torch``: bench/peers_torch.py's module with planc's initial weights, the same
  batches (planc's synthetic evaluation batches, of seed + 1) under ``torch.no_grad()``
  and the mean cross-entropy, timed the same number of times.

Both sides compute on ``--threads`` intra-op threads (the machine's cores by default, as
``planc run`` gives a 1-rank run). The plan trains with SGD at an lr of 1e-12, so its
evaluations see the initial weights to about 1e-12, and the benchmark stops unless
planc's first evaluation loss equals the module's to 1e-5.

    .venv/bin/python bench/evaluation.py [--rounds 3] [--steps 6] [--batches 8]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rounds import check_rounds_and_steps, rounds_and_threads  # noqa: E402

WARMUP = 2
PLAN = """plan evaluation {{
  model gpt {{ layers = 4; hidden = 256; heads = 8; vocab = 2048; seq = 128; batch = 16 }}
  mesh {{ }}
  train {{ steps = {steps}; optimizer = sgd(lr = 1e-12); seed = {seed}; eval_every = 1
          eval_batches = {batches} }}
}}
"""


def run_planc(steps: int, batches: int, seed: int) -> tuple[float, float]:
    """(median eval_s after the warm-up, the first evaluation's loss)."""
    from planc_metrics import run_for_metrics

    with tempfile.TemporaryDirectory() as directory:
        records, printed = run_for_metrics(PLAN.format(steps=steps, batches=batches,
                                                       seed=seed), Path(directory))
    if records is None:
        raise SystemExit(f"evaluation: planc run failed:\n{printed}")
    return (statistics.median(r["eval_s"] for r in records[WARMUP:]),
            records[0]["eval_loss"])


def run_torch(steps: int, batches: int, seed: int) -> tuple[float, float]:
    """(median time of ``batches`` forwards, the first evaluation's loss)."""
    import torch

    import peers_torch

    config = peers_torch.Config(**{**peers_torch.DEFAULTS, "seed": seed})
    model = peers_torch.GPT(config)  # planc's initial weights of the seed
    held_out = dataclasses.replace(config, seed=seed + 1)  # planc's evaluation batches
    tokens = [peers_torch.batch(held_out, j) for j in range(batches)]
    times, first = [], None
    with torch.no_grad():
        for _ in range(steps):
            start = time.perf_counter()
            losses = [peers_torch.loss_fn(model(t[:, :-1]), t[:, 1:]) for t in tokens]
            loss = float(sum(losses) / len(losses))
            times.append(time.perf_counter() - start)
            first = loss if first is None else first
    return statistics.median(times[WARMUP:]), first


def main() -> int:
    parser = rounds_and_threads(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    check_rounds_and_steps(parser, args, WARMUP)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # planc run's rank and this process
    import torch

    torch.set_num_threads(args.threads)
    seed = peers_torch_seed()
    ratios, figures = [], {"planc": [], "torch": []}
    for k in range(args.rounds):
        order = ("planc", "torch") if k % 2 == 0 else ("torch", "planc")
        losses = {}
        for side in order:
            run = run_planc if side == "planc" else run_torch
            seconds, losses[side] = run(args.steps, args.batches, seed)
            figures[side].append(seconds)
        if abs(losses["planc"] - losses["torch"]) > 1e-5 * abs(losses["torch"]):
            raise SystemExit(f"evaluation: the first evaluation losses differ: planc "
                             f"{losses['planc']:.8f}, torch {losses['torch']:.8f}")
        ratios.append(figures["planc"][-1] / figures["torch"][-1])
        print(f"round {k + 1}: planc {figures['planc'][-1] * 1e3:.1f} ms, torch "
              f"{figures['torch'][-1] * 1e3:.1f} ms, planc / torch {ratios[-1]:.3f} "
              f"(first evaluation loss {losses['planc']:.6f} and {losses['torch']:.6f})",
              flush=True)
    print(f"{args.batches} evaluation batches on {args.threads} threads, median of "
          f"{args.rounds} rounds: planc {statistics.median(figures['planc']) * 1e3:.1f} ms, "
          f"torch {statistics.median(figures['torch']) * 1e3:.1f} ms, planc / torch "
          f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    return 0


def peers_torch_seed() -> int:
    import peers_torch

    return peers_torch.DEFAULTS["seed"]


if __name__ == "__main__":
    sys.exit(main())
