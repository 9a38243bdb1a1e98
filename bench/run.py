"""Benchmark: ``planc run`` step time of one model under several plans, on gloo.

Every variant trains the same model (4 layers, hidden 256, seq 128, batch 16) for
``--steps`` steps through ``planc run``; the time of a step is the median of the steps
after the first two (the first builds groups and warms the allocator). Ratios are
against the single-rank plan measured in the same run, so they compare what the plan's
communication and scheduling cost on this machine, not the machine. With two cores,
two ranks cannot be faster than one rank by more than 2x, and four ranks share two cores.

    .venv/bin/python bench/run.py [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEMPLATE = """plan bench {{
  model gpt {{ layers = 4; hidden = 256; heads = 8; vocab = 1024; seq = 128; batch = 16 }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m}{schedule} }}
  optimize {{ overlap = {overlap} }}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-3); seed = 1 }}
}}
"""

VARIANTS = {
    "1 rank (baseline)": dict(mesh=""),
    "dp 2": dict(mesh="dp = 2"),
    "dp 2, overlap off": dict(mesh="dp = 2", overlap="off"),
    "dp 2, zero 3": dict(mesh="dp = 2", shard="dp { zero = 3 }"),
    "tp 2": dict(mesh="tp = 2"),
    "tp 2, sequence parallel": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
    "cp 2, ring": dict(mesh="cp = 2", shard="cp { attention = ring }"),
    "pp 2, 1f1b, 4 microbatches": dict(mesh="pp = 2", m=4),
    "pp 2, 1f1b, 4 microbatches, overlap off": dict(mesh="pp = 2", m=4, overlap="off"),
    "tp 2 x dp 2 (4 ranks)": dict(mesh="tp = 2; dp = 2"),
}


def step_seconds(text: str, directory: Path) -> float:
    from planc.cli import main

    plan = directory / "bench.plan"
    plan.write_text(text)
    metrics = directory / "metrics.jsonl"
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        status = main(["run", str(plan), "-o", str(directory / "build"), "--metrics",
                       str(metrics), "--force"])  # the last round's metrics: replaced
    if status != 0:
        raise SystemExit(f"planc run failed:\n{captured.getvalue()[-3000:]}")
    times = [json.loads(line)["time_s"] for line in metrics.read_text().splitlines()]
    return statistics.median(times[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two are not timed)")
    results = {}
    for name, case in VARIANTS.items():
        values = dict(mesh="", shard="", m=1, schedule="", overlap="on", steps=args.steps)
        values.update(case)
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = step_seconds(TEMPLATE.format(**values), Path(tmp))
        print(f"  {name}: {results[name] * 1000:.0f} ms", file=sys.stderr, flush=True)
    baseline = results["1 rank (baseline)"]
    width = max(map(len, results))
    print(f"{'plan':<{width}}  {'ms/step':>8}  {'vs 1 rank':>9}")
    for name, seconds in results.items():
        print(f"{name:<{width}}  {seconds * 1000:>8.1f}  {seconds / baseline:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
