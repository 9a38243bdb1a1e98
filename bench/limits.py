"""Benchmark: every command on the plans at planc's limits (docs/language.md, section 5,
Limits): a plan at every limit at once, the most model chunks, and the heaviest layout
(llama; tp, cp and sequence parallelism; ZeRO-3; full recomputation; 1,024 stages).

Goal: each command (``compile`` and the read-only commands tests/test_limits_compiled.py
runs on the build) under 20 s and 1 GiB resident on a 2-core machine; docs/language.md
quotes these figures. The tests check the counts and the memory; only here is time
measured. Each command runs in a fresh process, as the ``planc`` script does; the time is
its wall-clock time, the memory its peak resident set (wait4).

    .venv/bin/python bench/limits.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.limit_plans import AT_THE_LIMITS  # noqa: E402

GOAL_S, GOAL_BYTES = 20.0, 1 << 30


def command(argv: tuple[str, ...], cwd: Path) -> tuple[float, int]:
    """Seconds and peak resident bytes of ``planc ARGV`` in a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "planc", *argv], cwd=cwd,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    error = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    if process.returncode != 0:
        raise SystemExit(f"planc {' '.join(argv)} failed ({process.returncode}):\n{error}")
    return seconds, usage.ru_maxrss * 1024


def main() -> int:
    met = True
    print(f"{'plan':20s} {'command':10s} {'seconds':>8s} {'MiB':>6s}")
    for name, plan in AT_THE_LIMITS.items():
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "limits.plan").write_text(plan.text)
            for argv in (("compile", "limits.plan", "-o", "build"), *plan.commands):
                seconds, peak = command(argv, Path(tmp))
                met &= seconds < GOAL_S and peak < GOAL_BYTES
                print(f"{name:20s} {argv[0]:10s} {seconds:8.1f} {peak / 2**20:6.0f}",
                      flush=True)
    print(f"goal (every command < {GOAL_S:g} s and < 1 GiB):", "met" if met else "NOT met")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
