"""Benchmark: ``planc simulate`` of the 1T-parameter plan on 3,072 GPUs, and its SPMD twin
with 100x the data parallelism.

Goal (issue 9): the plan of Narayanan et al. (SC'21), tp 8, pp 64, dp 6, 512
microbatches, simulates in under 5 s and under 1 GB, end to end (parse, check, compile,
replay, print), and the time does not grow with dp: the replay runs one representative
rank per pipeline stage, block by block. Each run is a fresh process; the time is the
median of several runs, memory the peak resident set size.

    .venv/bin/python bench/simulate.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = (ROOT / "plans" / "gpt-1t.plan").read_text()
VARIANTS = {
    "gpt-1t (3,072 GPUs)": PLAN,
    "dp 600 (307,200 GPUs)": PLAN.replace("    dp = 6\n", "    dp = 600\n").replace(
        "batch  = 3072", "batch  = 307200"),
}


def run_once(path: Path) -> tuple[float, float]:
    """(seconds, peak MB) of one ``planc simulate`` in a fresh process."""
    done = subprocess.run(["/usr/bin/time", "-f", "%e %M", sys.executable, "-m", "planc",
                           "simulate", str(path)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr)
    seconds, kilobytes = done.stderr.strip().splitlines()[-1].split()
    return float(seconds), float(kilobytes) / 1024


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| plan | simulate s (median) | peak MB | ratio to gpt-1t |")
    print("|---|---|---|---|")
    base = None
    with tempfile.TemporaryDirectory() as scratch:
        for name, text in VARIANTS.items():
            path = Path(scratch) / "p.plan"
            path.write_text(text)
            runs = [run_once(path) for _ in range(args.repeat)]
            seconds = statistics.median(r[0] for r in runs)
            memory = max(r[1] for r in runs)
            base = base or seconds
            print(f"| {name} | {seconds:.2f} | {memory:.0f} | {seconds / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
