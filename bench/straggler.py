"""Demonstration: a rank slowed on purpose is named the straggler (issue 39).

A 2-rank dp run (one intra-op thread a rank) trains ``--steps`` steps with its metrics
written as it goes. Once ``--warm`` steps are recorded, each rank is pinned to a core of
its own (every thread of it, ``sched_setaffinity``) and a busy loop is started on rank 1's
core: rank 1 now gets about half a core, so its compute stream is busy about twice as
long as rank 0's. The script reports the step at which the slowdown began and the first
step whose metrics record names a straggler (the issue's bar: within 10 steps), and which
rank and stream it named. Linux only (``/proc``, ``sched_setaffinity``); 2 cores or more.

    .venv/bin/python bench/straggler.py [--steps 40] [--warm 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = """plan straggler {{
  model gpt {{ layers = 4; hidden = 256; heads = 8; vocab = 1024; seq = 128; batch = 16 }}
  mesh {{ dp = 2 }}
  train {{ steps = {steps}; optimizer = sgd(lr = 0.01) }}
}}
"""


def _parent(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def rank_pids(launcher: int) -> dict[int, int]:
    """The worker processes that descend from ``launcher`` (planc run), by rank: each holds
    its rank's log, ``logs/planc-*/RANK/stderr.log``, open."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid, ancestors, parent = int(entry.name), set(), int(entry.name)
            while parent > 1 and len(ancestors) < 64:
                parent = _parent(parent)
                ancestors.add(parent)
            if launcher not in ancestors:
                continue
            for fd in (entry / "fd").iterdir():
                match = re.search(r"/logs/planc-[^/]+/(\d+)/stderr\.log$", os.readlink(fd))
                if match:
                    found[int(match.group(1))] = pid
        except (OSError, ValueError, IndexError):
            continue
    return found


def pin(pid: int, core: int) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {core})
        except OSError:
            pass  # a thread that ended meanwhile


def spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm", type=int, default=5)
    args = parser.parse_args()
    if not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2:
        print("skipped: needs Linux and 2 cores")
        return 0
    with tempfile.TemporaryDirectory(prefix="planc-bench-straggler-") as work:
        work_path = Path(work)
        plan, metrics = work_path / "s.plan", work_path / "m.jsonl"
        plan.write_text(PLAN.format(steps=args.steps))
        run = subprocess.Popen(
            [sys.executable, "-m", "planc", "run", str(plan), "-o", str(work_path / "build"),
             "--metrics", str(metrics)], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        busy = None
        try:
            while len(records(metrics)) < args.warm and run.poll() is None:
                time.sleep(0.05)
            ranks = rank_pids(run.pid)
            if sorted(ranks) != [0, 1]:
                raise SystemExit(f"could not find the two ranks' processes: {ranks}")
            pin(ranks[0], 0)
            pin(ranks[1], 1)
            busy = multiprocessing.Process(target=spin, args=(1,), daemon=True)
            busy.start()
            slowed_at = len(records(metrics))
            _, err = run.communicate(timeout=600)
        finally:
            if busy is not None:
                busy.terminate()
            if run.poll() is None:
                run.kill()
        if run.returncode != 0:
            raise SystemExit(f"planc run failed:\n{err}")
        done = records(metrics)
        named = next((r for r in done if "straggler" in r), None)
        if named is None:
            print(f"slowed from step {slowed_at + 1}; no straggler named in {len(done)} steps")
            return 1
        lag = named["step"] + 1 - slowed_at
        s = named["straggler"]
        print(f"rank 1 slowed from step {slowed_at + 1} (busy loop on its core); named at "
              f"step {named['step'] + 1}, {lag} steps later: rank {s['rank']}'s {s['stream']} "
              f"stream {s['slower_by']:.0%} slower than its peers'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
