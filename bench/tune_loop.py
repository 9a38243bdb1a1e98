"""Benchmark: does ``planc tune``'s order hold on this machine?

Closed loop (issue 25): calibrate a topology of this machine (``planc calibrate``), tune a
small llama over 4 ranks on it, then run (``planc run``, gloo) tune's top 3 and 5 other
valid layouts spread over the rest of its ranking, interleaved over ``--rounds`` rounds.
A layout's time is its step time (the slowest rank's, ``--metrics``' ``time_s``), the
median of the steps after the first two, then the median over the rounds. Prints each
layout's predicted and measured time, Spearman's rank correlation between the two
orders, and how far tune's best is from the measured best.

    .venv/bin/python bench/tune_loop.py [--rounds 3] [--steps 8]

With 4 ranks on a 2-core machine every figure includes CPU contention (the calibration
measures it too).
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

MODEL = """plan loop {{
  model llama {{ layers = 4; hidden = 256; heads = 8; kv_heads = 4; ffn = 512; vocab = 1024
                seq = 128; batch = 16 }}
  mesh {{ dp = 4 }}
  topology {{ preset = "{topology}" }}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-3); seed = 1 }}
}}
"""
SPREAD = 5  # layouts besides the top 3, spread over the rest of the ranking


def _quiet(argv: list[str]) -> tuple[int, str]:
    from planc.cli import main

    captured = io.StringIO()
    with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    return status, captured.getvalue()


def measured_seconds(text: str, directory: Path) -> float:
    plan = directory / "layout.plan"
    plan.write_text(text)
    metrics = directory / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    status, err = _quiet(["run", str(plan), "-o", str(directory / "build"), "--metrics",
                          str(metrics)])
    if status != 0:
        raise SystemExit(f"planc run failed:\n{err[-3000:]}")
    times = [json.loads(line)["time_s"] for line in metrics.read_text().splitlines()]
    return statistics.median(times[2:])


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    from planc.lang import load_text
    from planc.tune import tune

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="tl") as tmp:
        work = Path(tmp)
        topology = work / "here.json"
        status, err = _quiet(["calibrate", "-o", str(topology), "--ranks", "4"])
        if status != 0:
            raise SystemExit(f"planc calibrate failed:\n{err[-3000:]}")
        source = MODEL.format(topology=topology, steps=args.steps)
        plan = load_text(source).plan

        def check(text):
            loaded = load_text(text)
            return loaded.plan if loaded.ok else None

        search = tune(plan, source, 4, top=10_000, check=check, per_node=4)
        ranked = search.ranked
        rest = ranked[3:]
        picks = ranked[:3] + [rest[round(i * (len(rest) - 1) / (SPREAD - 1))]
                              for i in range(SPREAD)] if len(rest) >= SPREAD else ranked
        print(f"tune: {search.considered} layouts, {search.simulated} simulated in "
              f"{search.seconds:.1f} s; running {len(picks)}", file=sys.stderr)
        times: dict[int, list[float]] = {i: [] for i in range(len(picks))}
        for round_ in range(args.rounds):
            for i, pick in enumerate(picks):
                times[i].append(measured_seconds(pick.text, work))
            print(f"  round {round_ + 1} done", file=sys.stderr, flush=True)
    measured = [statistics.median(times[i]) for i in range(len(picks))]
    predicted = [p.step_seconds for p in picks]
    print(f"{'#':>3}  {'layout':<52} {'predicted':>10} {'measured':>10}  rounds")
    for i, pick in enumerate(picks):
        rank = ranked.index(pick) + 1
        print(f"{rank:>3}  {pick.candidate.text():<52} {predicted[i] * 1e3:>8.1f}ms "
              f"{measured[i] * 1e3:>8.1f}ms  " + ", ".join(f"{t * 1e3:.1f}" for t in times[i]))
    rho = spearman(predicted, measured)
    best = min(measured)
    print(f"Spearman's rank correlation, predicted vs measured: {rho:.2f}")
    print(f"tune's best measured {measured[0] * 1e3:.1f} ms, the measured best "
          f"{best * 1e3:.1f} ms: {measured[0] / best - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
