"""Benchmark: does ``planc simulate`` predict this machine? Calibrate the links, compute
and memory of this machine (``planc calibrate``), then for each plan of bench/peers.py
compare the simulated step time, on the calibrated topology, with ``planc run``'s
measured one (median of the slowest rank's step after two warm-up steps).

Goal (issue 9): within 20 % of the measured median on every plan.

    .venv/bin/python bench/simulate_here.py [--steps 8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers import PAIRS, WARMUP, plan_text  # noqa: E402

CASES = ("1 rank", "dp 2", "zero 3", "tp 2", "tp 2, sequence parallel", "pp 2, 1F1B",
         "pp 2, GPipe")


def main() -> int:
    from planc.cli import main as planc
    from planc.compile import compile_plan
    from planc.lang import load_text
    from planc.simulate import simulate

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        machine = Path(scratch) / "machine.json"
        done = subprocess.run([sys.executable, "-m", "planc", "calibrate", "-o", str(machine),
                               "--ranks", "2"], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr)
        print(done.stdout, file=sys.stderr)
        rows, errors = [], []
        for name in CASES:
            case = PAIRS[name][0]
            text = plan_text(case, args.steps)
            world = 2 if case.get("mesh") else 1
            text = text.replace("  shard {", f'  topology {{ preset = "{machine}"; '
                                             f'devices_per_node = {world} }}\n  shard {{', 1)
            loaded = load_text(text)
            if not loaded.ok:
                raise SystemExit([d.message for d in loaded.diagnostics])
            predicted = simulate(compile_plan(loaded.plan)).step_seconds
            directory = Path(scratch) / name.replace(" ", "_").replace(",", "")
            directory.mkdir()
            (directory / "p.plan").write_text(text)
            metrics = directory / "m.jsonl"
            with contextlib.redirect_stderr(io.StringIO()), \
                    contextlib.redirect_stdout(io.StringIO()):
                status = planc(["run", str(directory / "p.plan"), "-o", str(directory / "b"),
                                "--metrics", str(metrics)])
            if status:
                raise SystemExit(f"planc run failed on {name}")
            times = [json.loads(line)["time_s"] for line in metrics.read_text().splitlines()]
            measured = statistics.median(times[WARMUP:])
            error = predicted / measured - 1
            errors.append(abs(error))
            rows.append(f"| {name} | {measured * 1e3:.0f} | {predicted * 1e3:.0f} | "
                        f"{error:+.0%} |")
    print("| plan | measured ms | simulated ms | error |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nmedian error {statistics.median(errors):.0%}, largest {max(errors):.0%} "
          f"(goal: 20 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
