"""Benchmark: what a checkpoint after every step costs the step, written synchronously
and with ``planc run --checkpoint-async``, against no checkpoint.

One model (gpt, 8 layers, hidden 512: 26 million parameters, 0.3 GB of fp32 parameters
and AdamW state a checkpoint) trains ``--steps`` steps on ``--ranks`` gloo ranks (dp) in
three ways, interleaved over ``--rounds`` rounds: no checkpoint, ``--checkpoint-every 1``,
and ``--checkpoint-every 1 --checkpoint-async``. A step's cost is its ``time_s`` plus
what the next step's record says the step boundary waited (``checkpoint_wait_s``: all
of the checkpoint when synchronous, copying the state out and waiting for the previous
checkpoint's writer when asynchronous; ``peer_memory_wait_s``: the copy in peer memory);
the figure is the median over the steps after the first two, then over the rounds.

    .venv/bin/python bench/checkpoint_async.py [--steps 12] [--rounds 3] [--ranks 2]
        [--threads N] [--peer-memory]

``--threads N`` gives each rank N compute threads (OMP_NUM_THREADS) instead of its share of
the cores: ``--ranks 1 --threads 1`` leaves one of this machine's two cores to the
writer, as a GPU node leaves its host CPUs to it while the GPUs compute.
``--peer-memory`` adds ``--checkpoint-peer-memory`` alone (a copy in the next node's
memory after every step, the files only after the last), synchronous and with
``--checkpoint-async``, each rank a node of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = """plan ckpt {{
  model gpt {{ layers = 8; hidden = 512; heads = 8; vocab = 1024; seq = 128; batch = 16 }}
  mesh {{ dp = {ranks} }}
  {topology}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-4); seed = 1 }}
}}
"""
WAYS = {"no checkpoint": [], "synchronous": ["--checkpoint-every", "1"],
        "asynchronous": ["--checkpoint-every", "1", "--checkpoint-async"]}


def step_costs(directory: Path, ranks: int, steps: int, flags: list[str],
               topology: str = "") -> list[float]:
    from planc.cli import main

    plan = directory / "ckpt.plan"
    plan.write_text(PLAN.format(ranks=ranks, steps=steps, topology=topology))
    metrics = directory / "m.jsonl"
    argv = ["run", str(plan), "-o", str(directory / "build"), "--metrics", str(metrics),
            "--force", *flags]
    if flags:
        argv += ["--checkpoint-dir", str(directory / "ckpt")]
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        status = main(argv)
    if status != 0:
        raise SystemExit(f"planc run failed:\n{captured.getvalue()}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    waits = [r.get("checkpoint_wait_s", 0.0) + r.get("peer_memory_wait_s", 0.0)
             for r in records[1:]] + [0.0]
    return [r["time_s"] + wait for r, wait in zip(records, waits)][2:-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, help="compute threads a rank [its share]")
    parser.add_argument("--peer-memory", action="store_true",
                        help="also --checkpoint-peer-memory (a copy in the next node's memory "
                        "after every step), each rank a node of its own")
    args = parser.parse_args()
    ways = dict(WAYS)
    topology = ""
    if args.peer_memory:
        if args.ranks < 2:
            parser.error("--peer-memory needs at least 2 ranks, each a node")
        ways["peer memory"] = ["--checkpoint-peer-memory"]  # the files after the last step
        ways["peer memory, asynchronous"] = ["--checkpoint-peer-memory", "--checkpoint-async"]
        topology = f"topology {{ nodes = {args.ranks}; devices_per_node = 1 }}"
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # planc run keeps a user's
    if args.steps < 5 or args.rounds < 1 or args.ranks < 1:
        parser.error("--steps must be at least 5, --rounds and --ranks at least 1")
    medians: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="planc-bench-ckpt-") as work:
        for round_ in range(args.rounds):
            for way, flags in ways.items():
                directory = Path(work) / way.replace(" ", "-")
                directory.mkdir(exist_ok=True)
                medians[way].append(statistics.median(
                    step_costs(directory, args.ranks, args.steps, flags, topology)))
            print(f"round {round_ + 1}: " + ", ".join(
                f"{way} {medians[way][-1] * 1e3:.0f} ms" for way in ways), flush=True)
    base = statistics.median(medians["no checkpoint"])
    for way in ways:
        value = statistics.median(medians[way])
        print(f"{way}: {value * 1e3:.0f} ms a step ({value / base:.2f}x no checkpoint)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
