"""Measurement: what a lost rank costs a run today (issue 39), from the kill to the first
step trained after it, with a person's restart in between done at once by this script.

A 2-rank dp run checkpoints after every step. Once ``--warm`` steps are recorded, rank 1
is killed with SIGKILL. The script times how long ``planc run`` takes to notice, stop the
other rank and exit (naming the rank), then restarts it with ``--resume`` on the same
checkpoint directory and times how long until the first resumed step's metrics record is
written. Each of ``--rounds`` rounds does it once; the figures are medians.

With ``--replan`` nobody restarts anything: plans/gpt-tiny.plan's 8 ranks (tp 2 x pp 2 x
dp 2 on two "nodes" of 4) run with ``--on-failure replan``, a checkpoint every 2 steps,
and rank 5 is killed after ``--warm`` steps; the figures are planc run's own, from the
first record after the switch (``recovery``: the seconds from the failure to the end of
that step, the steps redone) and from its output (how long the search, compile and
verification took).

    .venv/bin/python bench/recovery.py [--rounds 3] [--warm 5] [--replan]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def replan_round(work: Path, warm: int) -> dict:
    """The recovery record of a run that lost rank 5, with the search's seconds added."""
    metrics = work / "m.jsonl"
    run = subprocess.Popen(
        [sys.executable, "-m", "planc", "run", str(ROOT / "plans" / "gpt-tiny.plan"), "-o",
         str(work / "build"), "--set", "train.optimizer=sgd(lr = 0.3, momentum = 0.9)",
         "--steps", str(warm + 8), "--metrics", str(metrics), "--checkpoint-dir",
         str(work / "ckpt"), "--checkpoint-every", "2", "--on-failure", "replan"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while count(metrics) < warm and run.poll() is None:
            time.sleep(0.02)
        os.kill(rank_pids(run.pid)[5], signal.SIGKILL)
        _, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    if run.returncode != 0:
        raise SystemExit(f"the run did not go on:\n{err}")
    record = next(json.loads(line)["recovery"] for line in metrics.read_text().splitlines()
                  if "recovery" in line)
    record["search_s"] = float(re.search(r"planc: replanned in ([0-9.]+) s", err).group(1))
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--replan", action="store_true",
                        help="planc run --on-failure replan on 8 ranks, no restart by hand")
    args = parser.parse_args()
    if args.rounds < 1 or args.warm < 2:
        parser.error("--rounds must be at least 1 and --warm at least 2")
    if args.replan:
        lost, searched = [], []
        for round_ in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="planc-bench-replan-") as work:
                record = replan_round(Path(work), args.warm)
            lost.append(record["seconds_lost"])
            searched.append(record["search_s"])
            print(f"round {round_ + 1}: {record['from']} -> {record['to']} on "
                  f"{record['ranks']} ranks, resumed at step {record['resumed_step']}, "
                  f"{record['steps_redone']} steps redone; {record['seconds_lost']:.2f} s from "
                  f"the kill to the end of the first step after it, {record['search_s']:.1f} s "
                  f"of it the search, compile and verification", flush=True)
        print(f"median: {statistics.median(lost):.2f} s from the kill to the first step "
              f"after it, {statistics.median(searched):.1f} s of it choosing the layout")
        return 0
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
