"""Benchmark: what a second team of OpenMP threads in the process costs a parallel operator.

A CPU rank of ``planc run`` computes on its compute stream's thread
(planc.runtime.engine.executor). Each thread that runs a parallel operator with more than
one intra-op thread keeps a team of OpenMP threads of its own; this measures one
elementwise multiply (2,048 x 256 fp32 values, a small model's activation) on a thread
that is not the main one, with the machine's cores as its intra-op threads, in three
cases, each in a fresh process:

- ``alone``: the thread's team is the process's only one;
- ``beside main's team``: the main thread ran one parallel operator first (its team then
  sits idle), as a rank's main thread did when it built the parameters before the
  streams started;
- ``main on one thread``: the main thread ran the same operator first, on one thread
  (no team), as a rank's main thread does now.

The median of 300 calls after 20 warm-up calls, per case and round; the rounds rotate
the cases' order.

    .venv/bin/python bench/omp_teams.py [--rounds 3] [--threads N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rounds import check_rounds, rounds_and_threads  # noqa: E402

CASES = ("alone", "beside main's team", "main on one thread")
PROBE = """
import statistics, sys, threading, time, torch
case, threads = sys.argv[1], int(sys.argv[2])
values = torch.randn(2048 * 256)
if case != "alone":  # the main thread's own parallel operator, with or without a team
    torch.set_num_threads(threads if case == "beside main's team" else 1)
    values * 2.0
seen = []
def measure():
    torch.get_num_threads()  # this thread's count from now on is its own
    torch.set_num_threads(threads)
    for _ in range(20):
        values * 2.0
    for _ in range(300):
        start = time.perf_counter()
        values * 2.0
        seen.append(time.perf_counter() - start)
worker = threading.Thread(target=measure)
worker.start()
worker.join()
print(statistics.median(seen) * 1e6)
"""


def measure(case: str, threads: int) -> float:
    """Microseconds of one multiply on a second thread, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", PROBE, case, str(threads)],
                          capture_output=True, text=True, env=env, timeout=300, check=True)
    return float(done.stdout.strip())


def main() -> int:
    parser = rounds_and_threads(__doc__.split("\n")[0])
    args = parser.parse_args()
    check_rounds(parser, args)
    if args.threads < 2:
        parser.error("--threads must be at least 2: with one there is no team")
    seen: dict[str, list[float]] = {case: [] for case in CASES}
    for round_ in range(args.rounds):
        for case in CASES[round_ % 3:] + CASES[:round_ % 3]:
            seen[case].append(measure(case, args.threads))
    print(f"a {2048 * 256:,}-value multiply on a second thread with {args.threads} "
          f"intra-op threads, median of 300 calls, {args.rounds} rounds\n")
    print("| case | us per call | rounds |\n|---|---|---|")
    for case in CASES:
        rounds = ", ".join(f"{v:.1f}" for v in seen[case])
        print(f"| {case} | {statistics.median(seen[case]):.1f} | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
