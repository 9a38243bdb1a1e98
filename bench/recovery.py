"""Measurement: what a lost rank costs a run today (issue 39), from the kill to the first
step trained after it, with a person's restart in between done at once by this script.

A 2-rank dp run checkpoints after every step. Once ``--warm`` steps are recorded, rank 1
is killed with SIGKILL. The script times how long ``planc run`` takes to notice, stop the
other rank and exit (naming the rank), then restarts it with ``--resume`` on the same
checkpoint directory and times how long until the first resumed step's metrics record is
written. Each of ``--rounds`` rounds does it once; the figures are medians.

    .venv/bin/python bench/recovery.py [--rounds 3] [--warm 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.straggler import rank_pids  # noqa: E402

PLAN = """plan recovery {
  model gpt { layers = 4; hidden = 256; heads = 8; vocab = 1024; seq = 128; batch = 16 }
  mesh { dp = 2 }
  train { steps = 400; optimizer = adamw(lr = 1e-4) }
}
"""


def count(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.endswith("}"))


def one_round(work: Path, warm: int) -> tuple[float, float, int, int]:
    """(seconds from the kill to planc run's exit, seconds from the restart to its first
    step's record, the step killed in, the step resumed from)."""
    plan, metrics, resumed = work / "r.plan", work / "m.jsonl", work / "m2.jsonl"
    plan.write_text(PLAN)
    ckpt = work / "ckpt"
    run = subprocess.Popen(
        [sys.executable, "-m", "planc", "run", str(plan), "-o", str(work / "build"),
         "--metrics", str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
         "--force"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while count(metrics) < warm and run.poll() is None:
            time.sleep(0.02)
        ranks = rank_pids(run.pid)
        killed_in = count(metrics)
        killed = time.perf_counter()
        os.kill(ranks[1], signal.SIGKILL)
        _, err = run.communicate(timeout=120)
        stopped = time.perf_counter()
    finally:
        if run.poll() is None:
            run.kill()
    if "rank 1" not in err:
        raise SystemExit(f"planc run did not name rank 1:\n{err}")
    restart = subprocess.Popen(
        [sys.executable, "-m", "planc", "run", str(work / "build"), "--resume", str(ckpt),
         "--metrics", str(resumed), "--checkpoint-dir", str(ckpt), "--force",
         "--steps", str(killed_in + 3)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started = time.perf_counter()
    try:
        while count(resumed) < 1 and restart.poll() is None:
            time.sleep(0.02)
        first = time.perf_counter()
        restart.communicate(timeout=120)
    finally:
        if restart.poll() is None:
            restart.kill()
    if restart.returncode != 0:
        raise SystemExit("the resumed run failed")
    step = json.loads(resumed.read_text().splitlines()[0])["step"]
    return stopped - killed, first - started, killed_in, step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1 or args.warm < 2:
        parser.error("--rounds must be at least 1 and --warm at least 2")
    stops, restarts = [], []
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="planc-bench-recovery-") as work:
            stop, restart, killed_in, step = one_round(Path(work), args.warm)
        stops.append(stop)
        restarts.append(restart)
        print(f"round {round_ + 1}: killed after {killed_in} steps; planc run stopped "
              f"{stop:.2f} s after the kill; resumed at step {step + 1}, its first step "
              f"recorded {restart:.2f} s after the restart", flush=True)
    print(f"median: stopped in {statistics.median(stops):.2f} s, first step after the "
          f"restart in {statistics.median(restarts):.2f} s: "
          f"{statistics.median(stops) + statistics.median(restarts):.2f} s from the kill to "
          f"training again, with the restart itself at once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
